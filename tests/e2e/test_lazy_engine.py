"""mitmproxy is imported and started only when a connection needs it (egressd's own front serves the rest)."""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import time

import pytest

from egressd.policy import parse_policy
from egressd.session.proxy import ProxyServer
from tests.support.egressd_cli import EGRESSD
from tests.support.upstreams import TcpEchoServer


def test_exec_true_never_imports_mitmproxy_core() -> None:
    env = dict(os.environ, PYTHONPROFILEIMPORTTIME="1")
    done = subprocess.run([*EGRESSD, "exec", "--", "true"], env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    imported = done.stderr.decode()
    assert "| egressd.cli" in imported  # the import log is really there
    for module in ("mitmproxy.proxy.server", "mitmproxy.master", "OpenSSL.SSL", "egressd.addons.policy_gate"):
        assert f"| {module}\n" not in imported and f" {module}\n" not in imported, module


def _master(proxy: ProxyServer) -> object:
    """The embedded mitmproxy's Master, None while it has not started."""
    return proxy.inspection.master if proxy.inspection is not None else None


def _auth(proxy: ProxyServer) -> str:
    creds = proxy.issue_credentials()
    return base64.b64encode(f"{creds.username}:{creds.token}".encode()).decode()


def _connect(proxy: ProxyServer, server: TcpEchoServer) -> socket.socket:
    """A CONNECT to server sent (its answer not read yet)."""
    host, port = server.address
    sock = socket.create_connection(proxy.http_address, timeout=10)
    sock.sendall(
        f"CONNECT {host}:{port} HTTP/1.1\r\nProxy-Authorization: Basic {_auth(proxy)}\r\n\r\n".encode()
    )
    return sock


def test_a_tunnel_or_socks5_does_not_start_mitmproxy_a_tunnel_to_inspect_does(
    inspecting_engine: ProxyServer, tcp_echo: TcpEchoServer, inspected_echo: TcpEchoServer
) -> None:
    engine = inspecting_engine
    with _connect(engine, tcp_echo) as sock:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.sendall(b"ping")
        assert sock.recv(4) == b"ping"
    assert _master(engine) is None, "a relayed tunnel started mitmproxy"

    assert engine.socks_address is not None
    with socket.create_connection(engine.socks_address, timeout=10) as sock:
        sock.sendall(b"\x05\x01\x02")  # SOCKS5 is the front's own
        assert sock.recv(2) == b"\x05\x02"
    assert _master(engine) is None, "a SOCKS5 client started mitmproxy"

    with _connect(engine, inspected_echo) as sock:  # sent before mitmproxy is up
        assert sock.recv(12) == b"HTTP/1.1 200"
    assert _master(engine) is not None
    # the second tunnel to inspect finds mitmproxy running
    with _connect(engine, inspected_echo) as sock:
        assert sock.recv(12) == b"HTTP/1.1 200"


def test_clients_that_leave_while_mitmproxy_starts_leave_nothing_open(
    inspecting_engine: ProxyServer, inspected_echo: TcpEchoServer
) -> None:
    for _ in range(5):
        _connect(inspecting_engine, inspected_echo).close()  # and gone before mitmproxy answers
    with _connect(inspecting_engine, inspected_echo) as sock:
        assert sock.recv(12) == b"HTTP/1.1 200"
    front = inspecting_engine._front
    assert front is not None
    deadline = time.monotonic() + 5
    while len(front.clients) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(front.clients) == 0


def test_a_failed_mitmproxy_start_is_tried_again(
    tcp_echo: TcpEchoServer, inspected_echo: TcpEchoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import egressd.inspect.engine as inspection

    real = inspection._import_mitmproxy
    calls: list[int] = []

    def fail_once() -> None:  # fault injection: the first start of mitmproxy fails
        calls.append(1)
        if len(calls) == 1:
            raise ImportError("injected: mitmproxy failed to import")
        real()

    monkeypatch.setattr(inspection, "_import_mitmproxy", fail_once)
    inspected = "{}:{}".format(*inspected_echo.address)
    policy = parse_policy(
        {"version": 1, "mode": "enforce", "allow": [inspected], "inspect": [inspected]}, "test"
    )
    engine = ProxyServer(policy)
    engine.start()
    try:
        with _connect(engine, inspected_echo) as sock:
            assert sock.recv(12) == b"HTTP/1.1 500"  # internal_error, closed: nothing let through
        with _connect(engine, inspected_echo) as sock:
            assert sock.recv(12) == b"HTTP/1.1 200"
        assert len(calls) == 2
    finally:
        engine.stop()
