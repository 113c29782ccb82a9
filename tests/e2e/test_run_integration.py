"""`egressd run` (long-running proxy, reload, drain), SOCKS5, audit, MCP stdio and pass-through."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.answers import parse_http
from tests.support.attempts import wait_until
from tests.support.audit_log import audit_records
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD, TEST_POLICY, EgressdRun, egressd_exec, write_policy
from tests.support.upstreams import EchoHTTPServer, EchoHTTPSServer, TcpEchoServer

HERE = Path(__file__).resolve().parents[1]


def curl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["curl", "-sS", "-i", "--max-time", "20", *args], env=env, capture_output=True, timeout=60
    )


def socks_url(run: EgressdRun) -> str:
    return run.env["EGRESSD_SOCKS_PROXY"]


def test_run_prints_exports_and_enforces(tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer) -> None:
    policy = write_policy(tmp_path)
    dns.add("up.test", upstream.host)
    with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]) as run:
        for key in (
            "HTTP_PROXY",
            "HTTPS_PROXY",
            "http_proxy",
            "https_proxy",
            "ALL_PROXY",
            "NODE_USE_ENV_PROXY",
        ):
            assert key in run.env, run.env
        assert run.proxy_url.startswith("http://") and "@127.0.0.1:" in run.proxy_url
        env = run.child_env()
        assert parse_http(curl(env, f"http://up.test:{upstream.port}/").stdout)[0] == 200
        assert parse_http(curl(env, "http://elsewhere.test/").stdout)[0] == 403


def test_reload_on_change_and_broken_file_keeps_last_good(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    policy = write_policy(tmp_path)
    dns.add("up.test", upstream.host)
    dns.add("other.test", upstream.host)
    url = f"http://up.test:{upstream.port}/"
    with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]) as run:
        env = run.child_env()
        assert parse_http(curl(env, url).stdout)[0] == 200
        # a broken file: refused on reload, the last good policy stays in force
        policy.write_text("version: 1\nallow: [up.test\n")
        assert run.wait_for_stderr("keeping the last good policy"), run.stderr
        assert parse_http(curl(env, url).stdout)[0] == 200
        # a good edit applies to the next request
        policy.write_text(TEST_POLICY.replace("  - up.test\n", ""))
        deadline = time.monotonic() + 10
        while parse_http(curl(env, url).stdout)[0] != 403:
            assert time.monotonic() < deadline, run.stderr
            time.sleep(0.2)
        # SIGHUP reloads too
        policy.write_text(TEST_POLICY)
        run.signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while parse_http(curl(env, url).stdout)[0] != 200:
            assert time.monotonic() < deadline, run.stderr
            time.sleep(0.2)


def test_sigterm_drains_in_flight_tunnel(tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer) -> None:
    policy = write_policy(tmp_path)
    dns.add("up.test", upstream.host)
    run = EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]).start()
    try:
        env = run.child_env()
        slow = subprocess.Popen(
            ["curl", "-sS", "-i", "--max-time", "20", f"http://up.test:{upstream.port}/slow?s=1.5"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        # the request is in flight (it reached the upstream) before egressd is told to stop
        wait_until(lambda: upstream.requests, "the slow request at the upstream")
        run.signal(signal.SIGTERM)
        out, _ = slow.communicate(timeout=30)
        assert parse_http(out)[0] == 200  # the in-flight request finished
        assert run.stop() == 0
    finally:
        run.stop()


@pytest.mark.parametrize("signals", [1, 2], ids=["drained", "second_signal"])
def test_a_stopped_run_removes_its_control_socket(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer, egressd_home: Path, signals: int
) -> None:
    """SIGTERM drains, then egressd exits; a second SIGTERM during the drain stops it at once. Either
    way its services stop before the proxy does, so the control API removes its socket."""
    policy = write_policy(tmp_path)
    dns.add("up.test", upstream.host)
    run = EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]).start()
    assert run.proc is not None
    control = egressd_home / "run" / f"{run.proc.pid}.sock"
    try:
        wait_until(control.exists, "egressd's control socket")
        slow = subprocess.Popen(
            ["curl", "-sS", "-i", "--max-time", "20", f"http://up.test:{upstream.port}/slow?s=2"],
            env=run.child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        wait_until(lambda: upstream.requests, "the slow request at the upstream")  # the drain waits
        run.signal(signal.SIGTERM)
        if signals == 2:
            assert run.wait_for_stderr("draining"), run.stderr
            run.signal(signal.SIGTERM)
            assert run.wait_for_stderr("second signal: stopping now"), run.stderr
        assert run.stop(timeout=30) == 0, run.stderr
        slow.communicate(timeout=30)
    finally:
        run.stop()
    assert "stopped" in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert not control.exists() and list(control.parent.glob("*.sock")) == []


def test_socks5_allowed_and_refused(tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer) -> None:
    policy = write_policy(tmp_path)
    dns.add("up.test", upstream.host)
    dns.nxdomain("other.test")
    with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]) as run:
        proxy = socks_url(run)
        assert proxy.startswith("socks5h://")
        ok = curl({}, "--proxy", proxy, f"http://up.test:{upstream.port}/socks")
        assert parse_http(ok.stdout)[0] == 200
        refused = curl({}, "--proxy", proxy, "http://elsewhere.test/")
        assert "not allowed by ruleset" in refused.stderr.decode() or "(2)" in refused.stderr.decode()
        unreachable = curl({}, "--proxy", proxy, "http://other.test/")
        assert "(4)" in unreachable.stderr.decode() or "unreachable" in unreachable.stderr.decode().lower()
        # same credentials as HTTP: none, or wrong ones, are refused
        bare = proxy.split("@", 1)[1]
        noauth = curl({}, "--proxy", f"socks5h://{bare}", f"http://up.test:{upstream.port}/")
        assert noauth.returncode != 0
        assert upstream.connections == 1


def test_socks5_tcp_payload(tmp_path: Path, dns: DnsServer, tcp_echo: TcpEchoServer) -> None:
    import socks  # PySocks: a real SOCKS5 client library

    policy = write_policy(tmp_path)
    dns.add("up.test", tcp_echo.address[0])
    with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]) as run:
        proxy = socks_url(run)
        creds, hostport = proxy[len("socks5h://") :].split("@")
        user, token = creds.split(":")
        host, port = hostport.rsplit(":", 1)
        sock = socks.socksocket()
        sock.set_proxy(socks.SOCKS5, host, int(port), rdns=True, username=user, password=token)
        sock.settimeout(10)
        sock.connect(("up.test", tcp_echo.address[1]))
        payload = os.urandom(100_000)
        sock.sendall(payload)
        received = b""
        while len(received) < len(payload):
            chunk = sock.recv(65536)
            assert chunk
            received += chunk
        assert received == payload
        sock.close()


def test_audit_file_and_trace(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer, upstream_tls: EchoHTTPSServer, ca_file: Path
) -> None:
    policy = write_policy(tmp_path)
    audit = tmp_path / "audit.jsonl"
    dns.add("up.test", upstream.host)
    dns.add("other.test", upstream_tls.host)
    result = egressd_exec(
        ["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(audit), "--trace"],
        [
            "sh",
            "-c",
            f"curl -sS http://up.test:{upstream.port}/a?token=secret >/dev/null; "
            f"curl -sS --cacert {ca_file} https://other.test:{upstream_tls.port}/b >/dev/null; "
            "curl -sS http://elsewhere.test/ >/dev/null",
        ],
    )
    assert result.returncode == 0, result.stderr.decode()
    records = audit_records(audit)
    decisions = [r for r in records if r["event"] == "decision"]
    closed = [r for r in records if r["event"] == "closed"]
    assert any(
        r["host"] == "up.test" and r["decision"] == "allow" and r.get("path") == "/a?<redacted>"
        for r in decisions
    )
    assert not any("secret" in json.dumps(r) for r in records)
    tls = [r for r in decisions if r["host"] == "other.test"]
    assert (
        tls
        and tls[0]["decision"] == "allow"
        and tls[0]["connected"] == f"{upstream_tls.host}:{upstream_tls.port}"
    )
    assert tls[0]["resolved"] == [upstream_tls.host]
    assert any(r["host"] == "elsewhere.test" and r["reason"] == "not_allowlisted" for r in decisions)
    tunnel = [r for r in closed if r["host"] == "other.test"]
    assert tunnel and tunnel[0]["bytes_up"] > 0 and tunnel[0]["bytes_down"] > 0
    for r in records:
        assert r["time"].endswith("Z")
    trace = result.stderr.decode()
    assert "elsewhere.test" in trace and "not_allowlisted" in trace
    assert result.stdout == b""  # egressd never writes on the child's stdout


def test_mcp_stdio_round_trip(tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer) -> None:
    policy = write_policy(tmp_path)
    dns.add("up.test", upstream.host)
    server = [sys.executable, str(HERE / "support" / "mcp_echo_server.py")]
    messages = [
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"},
            },
        },
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
        {
            "jsonrpc": "2.0",
            "id": 3,
            "method": "tools/call",
            "params": {"name": "fetch", "arguments": {"url": f"http://up.test:{upstream.port}/mcp"}},
        },
        {
            "jsonrpc": "2.0",
            "id": 4,
            "method": "tools/call",
            "params": {"name": "fetch", "arguments": {"url": "http://elsewhere.test/mcp"}},
        },
    ]
    stdin = "".join(json.dumps(m) + "\n" for m in messages).encode()
    wrapped = egressd_exec(["--policy", str(policy), "--nameserver", dns.nameserver], server, input=stdin)
    assert wrapped.returncode == 0, wrapped.stderr.decode()
    replies = [json.loads(line) for line in wrapped.stdout.decode().splitlines()]
    assert [r["id"] for r in replies] == [1, 2, 3, 4]  # nothing but JSON-RPC on stdout
    assert "200" in replies[2]["result"]["content"][0]["text"]
    assert "403" in replies[3]["result"]["content"][0]["text"]
    assert "not_allowlisted" in replies[3]["result"]["content"][0]["text"]
    # the first two answers are byte-identical to the unwrapped server's
    bare = subprocess.run(
        server,
        input=stdin[: stdin.index(b"\n", stdin.index(b"tools/list")) + 1],
        capture_output=True,
        timeout=30,
    )
    assert wrapped.stdout.splitlines()[:2] == bare.stdout.splitlines()[:2]


def test_exit_status_and_signal_pass_through(tmp_path: Path) -> None:
    assert egressd_exec([], ["sh", "-c", "exit 7"]).returncode == 7
    assert egressd_exec([], ["sh", "-c", "kill -TERM $$"]).returncode == -signal.SIGTERM
    # a signal sent to egressd reaches the child, and the exit status tells it
    proc = subprocess.Popen(
        [
            *EGRESSD,
            "exec",
            "--",
            sys.executable,
            "-c",
            # os.write: a handler that prints while "ready" is still being printed fails
            "import os,signal,sys,time\n"
            "signal.signal(signal.SIGINT, lambda *a: (os.write(1, b'got SIGINT\\n'), sys.exit(42)))\n"
            "os.write(1, b'ready\\n')\n"
            "time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=20)
    assert out == b"got SIGINT\n"
    assert proc.returncode == 42


def test_nothing_left_running_after_exec(tmp_path: Path) -> None:
    result = egressd_exec([], [sys.executable, "-c", "import os; print(os.environ['HTTP_PROXY'])"])
    url = result.stdout.decode().strip()
    port = int(url.rsplit(":", 1)[1])
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0  # the proxy is gone with the child


def test_idle_timeout_is_applied(tmp_path: Path, dns: DnsServer, tcp_echo: TcpEchoServer) -> None:
    policy = write_policy(tmp_path, TEST_POLICY + "limits: {idle_timeout: 2}\n")
    dns.add("up.test", tcp_echo.address[0])
    with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]) as run:
        proxy = run.proxy_url
        creds, hostport = proxy[len("http://") :].split("@")
        host, port = hostport.rsplit(":", 1)
        import base64

        auth = base64.b64encode(creds.encode()).decode()
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(
            f"CONNECT up.test:{tcp_echo.address[1]} HTTP/1.1\r\nHost: up.test\r\n"
            f"Proxy-Authorization: Basic {auth}\r\n\r\n".encode()
        )
        assert b" 200 " in sock.recv(4096)
        sock.sendall(b"ping")
        assert sock.recv(4096) == b"ping"
        start = time.monotonic()
        assert sock.recv(4096) == b""  # closed by egressd after the idle timeout
        assert 1.5 < time.monotonic() - start < 10
        sock.close()


def test_default_idle_timeout_is_an_hour() -> None:
    from egressd.policy import default_policy

    assert default_policy().limits.idle_timeout == 3600


def test_check_makes_no_network_request(tmp_path: Path, dns: DnsServer) -> None:
    policy = write_policy(tmp_path)
    for target, code in (("up.test", 0), ("https://elsewhere.test/x", 1), ("http://169.254.169.254/", 1)):
        result = subprocess.run(
            [*EGRESSD, "check", "--policy", str(policy), "--nameserver", dns.nameserver, target],
            capture_output=True,
            timeout=30,
        )
        assert result.returncode == code, result
    assert dns.queries == []
    dns.add("up.test", "169.254.169.254")
    resolved = subprocess.run(
        [*EGRESSD, "check", "--policy", str(policy), "--resolve", "--nameserver", dns.nameserver, "up.test"],
        capture_output=True,
        timeout=30,
    )
    assert resolved.returncode == 1
    assert b"resolved_forbidden" in resolved.stdout


@pytest.mark.parametrize(
    "bad", ["version: 2\n", "allow: [\n", "version: 1\nallow: ['exa mple.test']\n", "version: 1\nbogus: 1\n"]
)
def test_exec_refuses_bad_policy_without_running(tmp_path: Path, bad: str) -> None:
    policy = write_policy(tmp_path, bad)
    marker = tmp_path / "ran"
    result = egressd_exec(["--policy", str(policy)], ["touch", str(marker)])
    assert result.returncode == 2
    assert str(policy) in result.stderr.decode() or policy.name in result.stderr.decode()
    assert not marker.exists()
