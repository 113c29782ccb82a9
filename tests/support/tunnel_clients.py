"""Helpers that several test modules use (so none imports another), from the tests of: The first client
bytes of a tunnel: the SNI rule holds whoever speaks first, and costs little."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

BANNER = b"220 banner.test ready\r\n"


@dataclass
class RecordingServer:
    """A TCP server on 127.0.0.1 that sends `greeting` on accept (if any) and records what it gets."""

    greeting: bytes = b""
    received: list[bytes] = field(default_factory=list)
    port: int = 0
    greeted: int = 0  # connections the greeting was sent on

    def __post_init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            if self.greeting:
                conn.sendall(self.greeting)
                with self._lock:
                    self.greeted += 1
            while chunk := conn.recv(65536):
                with self._lock:
                    self.received.append(chunk)

    def got(self) -> bytes:
        with self._lock:
            return b"".join(self.received)

    def close(self) -> None:
        self._sock.close()


def closed_by_proxy(sock: socket.socket, timeout: float = 10.0) -> bool:
    """The proxy closes the tunnel (EOF or reset) within `timeout`, whatever arrives before."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if not sock.recv(65536):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
    return False


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    sock.settimeout(10)
    while len(data) < n and (chunk := sock.recv(n - len(data))):
        data += chunk
    return data


