"""The two byte pipes of the sandbox, alone: the host's Unix relay and the in-sandbox bridge.

They copy bytes, keep half-closes and decide nothing (the proxy behind them decides). Here they are
chained to a TCP echo server without a proxy, so what is checked is the plumbing itself.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from egressd.sandbox import bridge
from egressd.sandbox.unix_relay import RelayError, UnixRelay
from tests.support.upstreams import TcpEchoServer, free_port


def _roundtrip(address: tuple[str, int], payload: bytes) -> bytes:
    with socket.create_connection(address, timeout=10) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)  # half-close: the answer must still come back
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


def test_relay_and_bridge_carry_bytes_and_half_close(tmp_path: Path, tcp_echo: TcpEchoServer) -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB, every byte value
    with UnixRelay({"echo": tcp_echo.address}, parent=str(tmp_path)) as relay:
        directory = relay.directory
        assert directory is not None
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        path = relay.paths["echo"]
        assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600
        listener = bridge.listen(("127.0.0.1", 0))
        bridge.start_thread([(listener, path)])
        assert _roundtrip(listener.getsockname(), payload) == payload
        assert _roundtrip(listener.getsockname(), b"second") == b"second"
    assert not directory.exists()  # sockets and directory removed on stop
    assert tcp_echo.connections == 2


def test_relay_to_a_closed_port_closes_the_client(tmp_path: Path) -> None:
    with (
        UnixRelay({"x": ("127.0.0.1", free_port())}, parent=str(tmp_path)) as relay,
        socket.socket(socket.AF_UNIX) as s,
    ):
        s.settimeout(10)
        s.connect(relay.paths["x"])
        assert s.recv(10) == b""


def test_relay_cannot_start_in_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(RelayError, match="cannot create the sandbox's socket directory"):
        UnixRelay({"x": ("127.0.0.1", 1)}, parent="/nonexistent-egressd-dir").start()


def test_relay_keeps_socket_paths_short(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    with UnixRelay({"socks": ("127.0.0.1", 1)}, parent=str(deep)) as relay:
        assert len(relay.paths["socks"]) < 108
        assert relay.paths["socks"].startswith(f"/tmp/egressd-{os.getuid()}/sandbox-")


def test_bridge_command_line(tmp_path: Path, tcp_echo: TcpEchoServer) -> None:
    """`python -m egressd.sandbox.bridge --unix PATH --listen HOST:PORT`, for debugging."""
    with UnixRelay({"echo": tcp_echo.address}, parent=str(tmp_path)) as relay:
        port = free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "egressd.sandbox.bridge",
                "--unix",
                relay.paths["echo"],
                "--listen",
                f"127.0.0.1:{port}",
            ]
        )
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    assert _roundtrip(("127.0.0.1", port), b"hello") == b"hello"
                    break
                except ConnectionRefusedError:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
        finally:
            proc.terminate()
            proc.wait(10)


def test_parse_hostport() -> None:
    assert bridge.parse_hostport("127.0.0.1:3128") == ("127.0.0.1", 3128)
    assert bridge.parse_hostport("[::1]:1080") == ("::1", 1080)
    with pytest.raises(ValueError, match="HOST:PORT"):
        bridge.parse_hostport("3128x")
