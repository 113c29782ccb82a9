"""SOCKS5 on egressd's own front: real clients (pysocks, curl --socks5-hostname, raw sockets)
through a real `egressd run` to real servers on 127.0.0.1, names under .test from the test DNS server.

Why: SOCKS5 left mitmproxy for egressd's front. Every SOCKS5 CONNECT must be admitted by the same
steps as an HTTP CONNECT (credentials, limits, the decision, resolution, pinning, the SNI rule, the
audit) and answered with the reply code RFC 1928 has for the reason; a client that does not finish
its handshake is cut by header_timeout; a handshake in 1-byte writes is served like one in a write.
"""

from __future__ import annotations

import base64
import os
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.answers import parse_http
from tests.support.audit_log import audit_records
from tests.support.corpus import ProxyClient
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun, write_policy
from tests.support.tls_hello import client_hello
from tests.support.tunnel_clients import BANNER, RecordingServer, closed_by_proxy, recv_exact, wait_for
from tests.support.upstreams import EchoHTTPServer, TcpEchoServer, free_port

HEADER_TIMEOUT = 2
POLICY = f"""\
version: 1
allow: [up.test, echo.test, banner.test, quiet.test, gone.test, closed.test]
deny: [denied.test]
private: {{allow: true}}
limits: {{header_timeout: {HEADER_TIMEOUT}}}
"""


@dataclass
class Lab:
    run: EgressdRun
    client: ProxyClient
    audit: Path
    dns: DnsServer
    upstream: EchoHTTPServer
    echo: TcpEchoServer

    @property
    def socks(self) -> tuple[str, int]:
        assert self.client.socks_port is not None
        return self.client.host, self.client.socks_port

    def records(self) -> list[dict[str, object]]:
        if not self.audit.exists():
            return []
        return audit_records(self.audit)

    def wait_record(self, **fields: object) -> dict[str, object]:
        """The first audit record with these fields (written asynchronously: waited for)."""
        found: list[dict[str, object]] = []

        def check() -> bool:
            found[:] = [r for r in self.records() if all(r.get(k) == v for k, v in fields.items())]
            return bool(found)

        assert wait_for(check), (fields, self.records()[-5:])
        return found[0]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    tmp = tmp_path_factory.mktemp("socks")
    policy = write_policy(tmp, POLICY)
    audit = tmp / "audit.jsonl"
    with (
        DnsServer() as dns,
        EchoHTTPServer("127.0.0.1", name="up") as upstream,
        TcpEchoServer("127.0.0.1") as echo,
    ):
        for name in ("up.test", "echo.test", "banner.test", "quiet.test", "closed.test", "denied.test"):
            dns.add(name, "127.0.0.1")
        dns.nxdomain("gone.test")
        options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(audit)]
        with EgressdRun(options) as run:
            yield Lab(run, ProxyClient.from_env(run.env), audit, dns, upstream, echo)


def _greet_and_auth(sock: socket.socket, lab: Lab, password: str | None = None) -> None:
    sock.sendall(b"\x05\x01\x02")
    assert recv_exact(sock, 2) == b"\x05\x02"
    user, secret = lab.client.username.encode(), (password or lab.client.password).encode()
    sock.sendall(b"\x01" + bytes([len(user)]) + user + bytes([len(secret)]) + secret)
    assert recv_exact(sock, 2) == b"\x01\x00"


def _request(host: str, port: int, command: int = 1) -> bytes:
    name = host.encode()
    return bytes([5, command, 0, 3, len(name)]) + name + struct.pack("!H", port)


def _reply(sock: socket.socket) -> int:
    """The reply code (the bound address read and dropped); -1 when closed without a reply."""
    head = recv_exact(sock, 4)
    if len(head) < 4:
        return -1
    recv_exact(sock, {1: 4, 4: 16}[head[3]] + 2)
    return head[1]


@contextmanager
def socks_connect(lab: Lab, host: str, port: int, command: int = 1) -> Iterator[tuple[int, socket.socket]]:
    with socket.create_connection(lab.socks, timeout=10) as sock:
        _greet_and_auth(sock, lab)
        sock.sendall(_request(host, port, command))
        yield _reply(sock), sock


def _curl(lab: Lab, url: str, password: str | None = None) -> subprocess.CompletedProcess[bytes]:
    host, port = lab.socks
    user = f"{lab.client.username}:{password or lab.client.password}"
    command = ["curl", "-sS", "-i", "--max-time", "20", "--socks5-hostname", f"{host}:{port}"]
    return subprocess.run(
        [*command, "--proxy-user", user, url], env={}, capture_output=True, timeout=60, check=False
    )


def _pysocks(lab: Lab, password: str | None = None) -> socket.socket:
    import socks  # PySocks: a real SOCKS5 client library

    sock = socks.socksocket()
    host, port = lab.socks
    secret = password or lab.client.password
    sock.set_proxy(socks.SOCKS5, host, port, rdns=True, username=lab.client.username, password=secret)
    sock.settimeout(10)
    return sock


# -- allowed ---------------------------------------------------------------------------------------
def test_curl_reaches_an_allowed_host(lab: Lab) -> None:
    done = _curl(lab, f"http://up.test:{lab.upstream.port}/through-socks")
    assert parse_http(done.stdout)[0] == 200, done.stderr
    assert b"/through-socks" in done.stdout
    record = lab.wait_record(host="up.test", port=lab.upstream.port, stage="connection", decision="allow")
    assert record["connected"] == f"127.0.0.1:{lab.upstream.port}"


def test_pysocks_tunnel_carries_every_byte(lab: Lab) -> None:
    payload = os.urandom(1 << 20)
    with _pysocks(lab) as sock:
        sock.connect(("ECHO.test.", lab.echo.port))  # any spelling: the canonical name is decided
        sock.sendall(payload)
        assert recv_exact(sock, len(payload)) == payload
    closed = lab.wait_record(event="closed", host="echo.test", port=lab.echo.port)
    assert closed["bytes_up"] == closed["bytes_down"] == len(payload)


# -- refused ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("host", "reason"), [("denied.test", "denylist"), ("elsewhere.test", "not_allowlisted")]
)
def test_a_policy_refusal_is_not_allowed_by_ruleset(lab: Lab, host: str, reason: str) -> None:
    before = lab.upstream.connections
    with socks_connect(lab, host, lab.upstream.port) as (code, sock):
        assert code == 0x02
        assert closed_by_proxy(sock)
    record = lab.wait_record(host=host, reason=reason)
    assert record["decision"] == "deny" and record["client"] == lab.client.username
    assert lab.upstream.connections == before
    done = _curl(lab, f"http://{host}:{lab.upstream.port}/")
    assert done.returncode == 97, done.stderr  # CURLE_PROXY: the SOCKS5 connect was refused


def test_a_dns_failure_is_host_unreachable(lab: Lab) -> None:
    with socks_connect(lab, "gone.test", 80) as (code, _sock):
        assert code == 0x04
    lab.wait_record(host="gone.test", reason="dns_error", decision="deny")


def test_a_refused_connect_is_connection_refused(lab: Lab) -> None:
    with socks_connect(lab, "closed.test", free_port("127.0.0.1")) as (code, _sock):
        assert code == 0x05
    lab.wait_record(host="closed.test", reason="connect_refused")


def test_bind_is_command_not_supported(lab: Lab) -> None:
    with socks_connect(lab, "up.test", lab.upstream.port, command=2) as (code, sock):
        assert code == 0x07
        assert closed_by_proxy(sock)


def test_a_wrong_password_gets_the_rfc1929_failure_then_close(lab: Lab) -> None:
    import socks

    before = lab.upstream.connections
    with socket.create_connection(lab.socks, timeout=10) as sock:
        sock.sendall(b"\x05\x01\x02")
        assert recv_exact(sock, 2) == b"\x05\x02"
        user, wrong = lab.client.username.encode(), b"not-the-token"
        sock.sendall(b"\x01" + bytes([len(user)]) + user + bytes([len(wrong)]) + wrong)
        sock.sendall(_request("up.test", lab.upstream.port))  # sent at once: never acted on
        assert recv_exact(sock, 2) == b"\x01\x01"
        assert closed_by_proxy(sock)
        assert recv_exact(sock, 1) == b""
    with pytest.raises(socks.ProxyError), _pysocks(lab, password="wrong") as client:
        client.connect(("up.test", lab.upstream.port))
    assert _curl(lab, f"http://up.test:{lab.upstream.port}/", password="wrong").returncode != 0
    assert lab.upstream.connections == before


def test_wrong_credentials_are_recorded_and_none_at_all_is_not(lab: Lab) -> None:
    """Wrong (or revoked) credentials are an attempt someone made, recorded on both ports; a request
    with none is the challenge a client that authenticates only when asked answers next."""
    port = lab.upstream.port
    target = f"wrong-{time.monotonic_ns()}.test"
    wrong = base64.b64encode(f"{lab.client.username}:not-the-token".encode()).decode()
    for credentials in (f"Proxy-Authorization: Basic {wrong}\r\n", ""):
        with lab.client.open() as sock:
            sock.sendall(
                f"CONNECT {target}:{port} HTTP/1.1\r\nHost: {target}:{port}\r\n{credentials}\r\n".encode()
            )
            assert parse_http(sock.recv(65536))[0] == 407
    record = lab.wait_record(host=target, reason="proxy_auth_required")
    assert record["decision"] == "deny" and record["stage"] == "connect", record
    with socket.create_connection(lab.socks, timeout=10) as sock:
        sock.sendall(b"\x05\x01\x02")
        assert recv_exact(sock, 2) == b"\x05\x02"
        user, password = lab.client.username.encode(), b"not-the-token"
        sock.sendall(b"\x01" + bytes([len(user)]) + user + bytes([len(password)]) + password)
        assert recv_exact(sock, 2) == b"\x01\x01"
    lab.wait_record(stage="socks", reason="proxy_auth_required", decision="deny")
    assert len([r for r in lab.records() if r.get("host") == target]) == 1, lab.records()[-5:]


def test_a_client_offering_no_auth_only_is_refused(lab: Lab) -> None:
    with socket.create_connection(lab.socks, timeout=10) as sock:
        sock.sendall(b"\x05\x01\x00")
        assert recv_exact(sock, 2) == b"\x05\xff"
        assert closed_by_proxy(sock)


# -- the tunnel's first bytes ----------------------------------------------------------------------
def test_sni_of_another_host_closes_the_tunnel(lab: Lab) -> None:
    server = RecordingServer()
    try:
        with socks_connect(lab, "quiet.test", server.port) as (code, sock):
            assert code == 0
            sock.sendall(client_hello("elsewhere.test"))
            assert closed_by_proxy(sock)
        lab.wait_record(host="quiet.test", port=server.port, reason="sni_mismatch", stage="tls")
        assert b"elsewhere.test" not in server.got()
        # the tunnel's own name passes
        hello = client_hello("quiet.test")
        with socks_connect(lab, "quiet.test", server.port) as (code, sock):
            assert code == 0
            sock.sendall(hello)
            assert wait_for(lambda: hello in server.got())
    finally:
        server.close()


def test_a_server_that_speaks_first(lab: Lab) -> None:
    """Its banner follows the reply at once; the client's answer is relayed; a ClientHello for
    another host after the banner still closes the tunnel."""
    server = RecordingServer(BANNER)
    try:
        with socks_connect(lab, "banner.test", server.port) as (code, sock):
            assert code == 0
            assert recv_exact(sock, len(BANNER)) == BANNER
            sock.sendall(b"EHLO client.test\r\n")
            assert wait_for(lambda: server.got() == b"EHLO client.test\r\n")
        with socks_connect(lab, "banner.test", server.port) as (code, sock):
            assert code == 0
            assert recv_exact(sock, len(BANNER)) == BANNER
            sock.sendall(client_hello("elsewhere.test"))
            assert closed_by_proxy(sock)
        assert b"elsewhere.test" not in server.got()
    finally:
        server.close()


# -- slow and split handshakes -----------------------------------------------------------------------
def test_a_handshake_in_one_byte_writes(lab: Lab) -> None:
    user, secret = lab.client.username.encode(), lab.client.password.encode()
    handshake = (
        b"\x05\x01\x02"
        + b"\x01"
        + bytes([len(user)])
        + user
        + bytes([len(secret)])
        + secret
        + _request("echo.test", lab.echo.port)
    )
    with socket.create_connection(lab.socks, timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(len(handshake)):
            sock.sendall(handshake[i : i + 1])
            time.sleep(0.002)
        assert recv_exact(sock, 4) == b"\x05\x02\x01\x00"
        assert _reply(sock) == 0
        sock.sendall(b"ping")
        assert recv_exact(sock, 4) == b"ping"


@pytest.mark.parametrize(
    "sent", [b"", b"\x05\x01", b"\x05\x01\x02\x01\x05user"], ids=["silent", "greeting", "auth"]
)
def test_a_client_that_never_finishes_is_cut_by_header_timeout(lab: Lab, sent: bytes) -> None:
    with socket.create_connection(lab.socks, timeout=10) as sock:
        start = time.monotonic()
        sock.sendall(sent)
        assert closed_by_proxy(sock, timeout=HEADER_TIMEOUT + 8)
        assert time.monotonic() - start > HEADER_TIMEOUT - 0.5
    lab.wait_record(event="header_timeout")


# -- a listener that grants credentials (the sandbox's credential-free port) --------------------------
def test_an_implicit_listener_accepts_no_auth_and_still_checks_sent_credentials() -> None:
    from egressd.front.handed import Handed
    from egressd.policy import parse_policy
    from egressd.session.proxy import ProxyServer

    with TcpEchoServer("127.0.0.1") as echo:
        policy = parse_policy({"version": 1, "mode": "enforce", "allow": []}, "test")  # loopback: allowed
        engine = ProxyServer(policy, socks=False)
        engine.start()
        try:
            creds = engine.issue_credentials()
            listener = socket.create_server(("127.0.0.1", 0))
            engine.serve_socket(Handed(listener, "socks", creds))
            address = listener.getsockname()
            with socket.create_connection(address, timeout=10) as sock:
                sock.sendall(
                    b"\x05\x01\x00" + bytes([5, 1, 0, 1, 127, 0, 0, 1]) + struct.pack("!H", echo.port)
                )
                assert recv_exact(sock, 2) == b"\x05\x00"
                assert _reply(sock) == 0
                sock.sendall(b"ping")
                assert recv_exact(sock, 4) == b"ping"
            with socket.create_connection(address, timeout=10) as sock:
                sock.sendall(b"\x05\x02\x00\x02\x01\x01u\x01p")  # offers both, sends wrong ones
                assert recv_exact(sock, 4) == b"\x05\x02\x01\x01"
                assert closed_by_proxy(sock)
        finally:
            engine.stop()
