"""Inside the sandbox: listening sockets on the sandbox's loopback, and the thread that serves the
capture (intercept.py). The launcher binds every listener before the child starts (no race)."""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Awaitable, Callable, Sequence


def parse_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{text!r}: expected HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


def listen(address: tuple[str, int], backlog: int = 128) -> socket.socket:
    """A bound, listening TCP socket (bound now, so the child never races the listener)."""
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(backlog)
    return sock


def bind_udp(address: tuple[str, int]) -> socket.socket:
    """A bound UDP socket (bound before the child starts, like the TCP listeners)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    except OSError:
        pass
    sock.bind(address)
    return sock


def start_thread(
    serve: Callable[[], Awaitable[None]], wake: Sequence[socket.socket] = ()
) -> threading.Thread:
    """Run `serve()` on an event loop in a daemon thread, which ends with the launcher, from the
    moment one of `wake` has something to read: a child that never goes around the proxy never
    loads asyncio (what came waits in the socket meanwhile). asyncio is imported there, off the
    way to the child's start."""

    def run() -> None:
        if wake:
            ready = select.poll()
            for sock in wake:
                ready.register(sock, select.POLLIN)
            ready.poll()
        import asyncio

        asyncio.run(serve())  # type: ignore[arg-type]

    thread = threading.Thread(target=run, name="egressd-bridge", daemon=True)
    thread.start()
    return thread
