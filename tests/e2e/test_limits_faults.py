"""Limits, timeouts and faults: fail closed, lose nothing."""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.support.answers import assert_refusal, parse_http
from tests.support.attempts import gave_up_after, wait_until
from tests.support.audit_log import audit_records
from tests.support.corpus import read_head
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import TEST_POLICY, EgressdRun, egressd_exec, write_policy
from tests.support.upstreams import EchoHTTPServer, StallingPort, TcpEchoServer


def proxy_socket(run: EgressdRun) -> tuple[socket.socket, str]:
    url = urlsplit(run.proxy_url)
    auth = base64.b64encode(f"{url.username}:{url.password}".encode()).decode()
    assert url.hostname is not None and url.port is not None
    return socket.create_connection((url.hostname, url.port), timeout=10), auth


def _listening(run: EgressdRun) -> bool:
    """egressd still accepts connections on its proxy port (a bare connect, no request)."""
    url = urlsplit(run.proxy_url)
    assert url.hostname is not None and url.port is not None
    with socket.socket() as sock:
        return sock.connect_ex((url.hostname, url.port)) == 0


def open_tunnel(run: EgressdRun, target: str) -> tuple[socket.socket, bytes]:
    sock, auth = proxy_socket(run)
    sock.sendall(
        f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: Basic {auth}\r\n\r\n".encode()
    )
    return sock, read_head(sock)


def curl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["curl", "-sS", "-i", "--max-time", "20", *args], env=env, capture_output=True, timeout=60
    )


@pytest.fixture
def policy_with(tmp_path: Path) -> Iterator[object]:
    def make(extra: str) -> Path:
        return write_policy(tmp_path, TEST_POLICY + extra)

    yield make


# -- limits ------------------------------------------------------------------------------------
def test_max_connections_answers_429_then_recovers(
    policy_with: object, dns: DnsServer, tcp_echo: TcpEchoServer
) -> None:
    policy = policy_with("limits: {max_connections: 2}\n")  # type: ignore[operator]
    dns.add("up.test", tcp_echo.address[0])
    target = f"up.test:{tcp_echo.address[1]}"
    with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]) as run:
        first, head1 = open_tunnel(run, target)
        second, head2 = open_tunnel(run, target)
        assert b" 200 " in head1 and b" 200 " in head2
        third, head3 = open_tunnel(run, target)
        assert head3.startswith(b"HTTP/1.1 429"), head3
        assert b"X-Egressd-Reason: connection_limit" in head3 and b"Retry-After: " in head3
        third.close()
        first.close()
        deadline = time.monotonic() + 10
        while True:
            again, head = open_tunnel(run, target)
            again.close()
            if b" 200 " in head:
                break
            assert time.monotonic() < deadline, head
            time.sleep(0.1)
        second.close()
    assert tcp_echo.connections == 3


def test_requests_per_second_per_child(policy_with: object, dns: DnsServer, upstream: EchoHTTPServer) -> None:
    # one token every 5 s: the requests below come well within that even on a busy machine
    policy = policy_with("limits: {requests_per_second: 0.2, burst: 2}\n")  # type: ignore[operator]
    dns.add("up.test", upstream.host)
    url = f"http://up.test:{upstream.port}/"
    with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]) as run:
        env = run.child_env()
        statuses = [parse_http(curl(env, url).stdout)[0] for _ in range(4)]
        assert statuses[:2] == [200, 200] and 429 in statuses[2:], statuses
        limited = curl(env, url)
        headers = assert_refusal(limited, 429, "rate_limited", "connection_limit_reached")
        assert int(parse_http(limited.stdout)[1]["retry-after"]) >= 1
        assert "requests per second" in headers["proxy-status"]
        # a refused request takes no token: the bucket refills and the child is served again
        wait_until(lambda: parse_http(curl(env, url).stdout)[0] == 200, "a request after the refill", 30, 1)


# -- timeouts ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "head",
    [
        b"CONNECT up.test:443 HTTP/1.1\r\nHost: up.test\r\n",
        b"GET http://up.test/ HTTP/1.1\r\nHost: up.test\r\n",
    ],
    ids=["connect", "plain-http"],
)
def test_slow_request_head_is_cut(policy_with: object, dns: DnsServer, tmp_path: Path, head: bytes) -> None:
    policy = policy_with("limits: {header_timeout: 1}\n")  # type: ignore[operator]
    audit = tmp_path / "audit.jsonl"
    with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(audit)]) as run:
        sock, _ = proxy_socket(run)
        start = time.monotonic()
        closed = False
        for byte in head:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.2)
            sock.settimeout(0.01)
            try:
                if sock.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
        assert closed, "a Slowloris client was not cut"
        assert time.monotonic() - start < 5
    events = audit_records(audit)
    assert any(e["event"] == "header_timeout" for e in events)


def test_blackholed_address_then_next(tmp_path: Path, dns: DnsServer, stalling_port: StallingPort) -> None:
    host, port = stalling_port.address
    audit = tmp_path / "audit.jsonl"
    # A answers come before AAAA answers (a DNS server may shuffle records within one answer):
    # the black-holed IPv4 address is tried first, the IPv6 server second
    with EchoHTTPServer("2001:db8::7", port=port, name="second") as second:
        policy = write_policy(tmp_path, TEST_POLICY + "limits: {connect_timeout: 1}\n")
        dns.add("up.test", host, second.host)
        start = time.monotonic()
        result = egressd_exec(
            ["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(audit)],
            ["curl", "-sS", "-i", f"http://up.test:{port}/"],
        )
        elapsed = time.monotonic() - start
        assert parse_http(result.stdout)[0] == 200
        assert second.connections == 1
    records = audit_records(audit)
    connections = [r for r in records if r.get("stage") == "connection"]
    assert connections[-1]["connected"] == f"{second.host}:{port}"
    assert connections[-1]["resolved"] == [host, second.host]
    # the black-holed address was really tried first, and given up after connect_timeout
    (attempt,) = connections[-1]["attempts"]
    assert gave_up_after(attempt, f"{host}:{port}", 1), attempt
    assert elapsed < 2 * 1 + 5  # all attempts within 2x connect_timeout (+ egressd's start-up)


class _ResettingServer:
    """Sends part of a response, then resets the connection (RST)."""

    def __init__(self, host: str) -> None:
        self.sock = socket.create_server((host, 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n" + b"x" * 1000)
            time.sleep(0.2)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            conn.close()

    def close(self) -> None:
        self.sock.close()


def test_upstream_reset_mid_stream_is_reported(tmp_path: Path, dns: DnsServer) -> None:
    server = _ResettingServer("198.51.100.13")
    try:
        policy = write_policy(tmp_path)
        dns.add("up.test", "198.51.100.13")
        for args in ((), ("-p",)):  # plain HTTP through egressd, and a CONNECT tunnel
            start = time.monotonic()
            result = egressd_exec(
                ["--policy", str(policy), "--nameserver", dns.nameserver],
                ["curl", "-sS", "-o", "/dev/null", *args, f"http://up.test:{server.port}/"],
                timeout=60,
            )
            assert result.returncode != 0  # reported as an error, not a complete response
            assert time.monotonic() - start < 15  # and not hung
    finally:
        server.close()


def test_half_closed_tunnel_finishes(
    policy_with: object, dns: DnsServer, tcp_echo: TcpEchoServer, tmp_path: Path
) -> None:
    policy = policy_with("")  # type: ignore[operator]
    audit = tmp_path / "audit.jsonl"
    dns.add("up.test", tcp_echo.address[0])
    with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(audit)]) as run:
        sock, head = open_tunnel(run, f"up.test:{tcp_echo.address[1]}")
        assert b" 200 " in head
        sock.sendall(b"last words")
        assert sock.recv(4096) == b"last words"
        # half-close: egressd does not keep a half-open tunnel around, it closes both sides
        sock.shutdown(socket.SHUT_WR)
        start = time.monotonic()
        assert sock.recv(4096) == b""
        assert time.monotonic() - start < 5
        sock.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            events = audit_records(audit)
            if any(e["event"] == "closed" and e["host"] == "up.test" for e in events):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the half-closed tunnel was never closed")


# -- faults ------------------------------------------------------------------------------------
@pytest.mark.parametrize("point", ["decide", "hook"])
def test_internal_error_refuses_and_is_audited(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer, point: str
) -> None:
    policy = write_policy(tmp_path)
    audit = tmp_path / "audit.jsonl"
    dns.add("up.test", upstream.host)
    # the fault is put in from outside: tests/support/faults/sitecustomize.py, loaded by Python's site
    faults = str(Path(__file__).parents[1] / "support" / "faults")
    env = dict(os.environ, EGRESSD_TEST_FAULT=point, PYTHONPATH=faults)
    for url in (f"http://up.test:{upstream.port}/", f"https://up.test:{upstream.port}/"):
        result = egressd_exec(
            ["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(audit)],
            ["curl", "-sS", "-i", url],
            env=env,
        )
        assert_refusal(result, 500, "internal_error", "proxy_internal_error")
    assert upstream.connections == 0
    text = audit.read_text()
    assert '"internal_error"' in text and '"allow"' not in text


# -- reloads and signals under load ------------------------------------------------------------
def _load(env: dict[str, str], url: str, count: int, results: list[int]) -> None:
    for _ in range(count):
        results.append(parse_http(curl(env, url).stdout)[0])


@pytest.mark.parametrize("edit", ["sighup", "garbage"])
def test_reload_under_load_drops_nothing(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer, edit: str
) -> None:
    policy = write_policy(tmp_path)
    dns.add("up.test", upstream.host)
    url = f"http://up.test:{upstream.port}/slow?s=0.05"
    with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]) as run:
        env = run.child_env()
        results: list[int] = []
        workers = [threading.Thread(target=_load, args=(env, url, 15, results)) for _ in range(4)]
        for worker in workers:
            worker.start()
        for i in range(8):
            if edit == "sighup":
                policy.write_text(TEST_POLICY + f"# edit {i}\n")
                run.signal(signal.SIGHUP)
            else:
                policy.write_text("version: 1\nallow: [up.test\n" if i % 2 == 0 else "\x00\xff garbage")
            time.sleep(0.15)
        for worker in workers:
            worker.join(120)
        assert results == [200] * 60
        if edit == "garbage":
            # edits 0.15 s apart never hold still across a poll: the broken file that stays is
            # reported once it does
            assert run.wait_for_stderr("keeping the last good policy", timeout=20), run.stderr
            # the last good policy is still the one in force: a host it refuses stays refused
            assert parse_http(curl(env, "http://elsewhere.test/").stdout)[0] == 403


def test_sigterm_refuses_new_connections_while_draining(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    policy = write_policy(tmp_path)
    dns.add("up.test", upstream.host)
    run = EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]).start()
    try:
        env = run.child_env()
        slow = subprocess.Popen(
            ["curl", "-sS", "-i", f"http://up.test:{upstream.port}/slow?s=2"], env=env, stdout=subprocess.PIPE
        )
        # the slow request is in flight (it reached the upstream) before egressd is told to stop
        wait_until(lambda: upstream.requests, "the slow request at the upstream")
        run.signal(signal.SIGTERM)
        wait_until(lambda: not _listening(run), "egressd closing its listener on SIGTERM")
        late = curl(env, f"http://up.test:{upstream.port}/late")
        assert late.returncode != 0  # refused: the listener is gone
        out, _ = slow.communicate(timeout=30)
        assert parse_http(out)[0] == 200
        assert run.stop() == 0
    finally:
        run.stop()
    assert [r["path"] for r in upstream.requests] == ["/slow?s=2"]
