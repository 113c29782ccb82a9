"""mitmproxy is imported and started only when a connection needs it (the lean front serves the rest)."""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import time

import pytest

from egressd.policy import parse_policy
from egressd.proxy import EgressProxy
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


def _auth(proxy: EgressProxy) -> str:
    creds = proxy.issue_credentials()
    return base64.b64encode(f"{creds.username}:{creds.token}".encode()).decode()


def test_a_tunnel_does_not_start_mitmproxy_a_socks5_client_does(
    echo_engine: EgressProxy, tcp_echo: TcpEchoServer
) -> None:
    host, port = tcp_echo.address
    with socket.create_connection(echo_engine.http_address, timeout=10) as sock:
        head = f"CONNECT {host}:{port} HTTP/1.1\r\nProxy-Authorization: Basic {_auth(echo_engine)}\r\n\r\n"
        sock.sendall(head.encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.sendall(b"ping")
        assert sock.recv(4) == b"ping"
    assert echo_engine._master is None, "a lean-path tunnel started mitmproxy"

    assert echo_engine.socks_address is not None
    with socket.create_connection(echo_engine.socks_address, timeout=10) as sock:
        sock.sendall(b"\x05\x01\x02")  # offered: user/password; sent before mitmproxy is up
        assert sock.recv(2) == b"\x05\x02"
    assert echo_engine._master is not None
    # the second SOCKS5 client finds mitmproxy running
    with socket.create_connection(echo_engine.socks_address, timeout=10) as sock:
        sock.sendall(b"\x05\x01\x02")
        assert sock.recv(2) == b"\x05\x02"


def test_clients_that_leave_while_mitmproxy_starts_leave_nothing_open(echo_engine: EgressProxy) -> None:
    assert echo_engine.socks_address is not None
    for _ in range(5):
        with socket.create_connection(echo_engine.socks_address, timeout=10) as sock:
            sock.sendall(b"\x05\x01\x02")  # and gone before mitmproxy answers
    with socket.create_connection(echo_engine.socks_address, timeout=10) as sock:
        sock.sendall(b"\x05\x01\x02")
        assert sock.recv(2) == b"\x05\x02"
    front = echo_engine._front
    assert front is not None
    deadline = time.monotonic() + 5
    while len(front.clients) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(front.clients) == 0


def test_a_failed_mitmproxy_start_is_tried_again(
    tcp_echo: TcpEchoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import egressd.proxy as engine_proxy

    real = engine_proxy._import_mitmproxy
    calls: list[int] = []

    def fail_once() -> None:  # fault injection: the first start of mitmproxy fails
        calls.append(1)
        if len(calls) == 1:
            raise ImportError("injected: mitmproxy failed to import")
        real()

    monkeypatch.setattr(engine_proxy, "_import_mitmproxy", fail_once)
    policy = parse_policy({"version": 1, "mode": "enforce", "allow": []}, "test")
    engine = EgressProxy(policy)
    engine.start()
    try:
        assert engine.socks_address is not None
        with socket.create_connection(engine.socks_address, timeout=10) as sock:
            sock.sendall(b"\x05\x01\x02")
            assert sock.recv(2) == b""  # closed: nothing let through
        with socket.create_connection(engine.socks_address, timeout=10) as sock:
            sock.sendall(b"\x05\x01\x02")
            assert sock.recv(2) == b"\x05\x02"
        assert len(calls) == 2
    finally:
        engine.stop()
