"""Inside the sandbox: listening sockets on the sandbox's loopback, and the thread that serves the
capture (intercept.py). The launcher binds every listener before the child starts (no race)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Awaitable


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


def start_thread(*coroutines: Awaitable[None]) -> threading.Thread:
    """Serve the coroutines (the capture) in a daemon thread: it ends with the launcher."""

    async def serve() -> None:
        await asyncio.gather(*coroutines)

    thread = threading.Thread(target=asyncio.run, args=(serve(),), name="egressd-bridge", daemon=True)
    thread.start()
    return thread
