"""Inside the sandbox: listen on the sandbox's loopback, forward each connection to a Unix socket.

The child's proxy variables point at this loopback port; the Unix socket (bind-mounted from the
host) leads to egressd's relay and on to the proxy. Like the relay, the bridge copies bytes and
decides nothing. The launcher binds the listening sockets before the child starts (no race) and
serves them in a thread; `python -m egressd.sandbox.bridge --unix PATH --listen HOST:PORT` runs
one bridge on its own, for debugging.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
from collections.abc import Awaitable, Sequence

from egressd.sandbox.splice import close_quietly, splice


def parse_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{text!r}: expected HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


def listen(address: tuple[str, int]) -> socket.socket:
    """A bound, listening TCP socket (bound now, so the child never races the bridge)."""
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(128)
    return sock


async def _forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, unix_path: str) -> None:
    try:
        upstream = await asyncio.open_unix_connection(unix_path)
    except OSError:
        await close_quietly(writer)
        return
    await splice((reader, writer), upstream)


async def serve(routes: Sequence[tuple[socket.socket, str]], *also: Awaitable[None]) -> None:
    """Serve every (listening socket, Unix socket path) pair forever, and `also` (the capture)."""
    servers = [
        await asyncio.start_server(lambda r, w, p=path: _forward(r, w, p), sock=sock) for sock, path in routes
    ]
    await asyncio.gather(*(server.serve_forever() for server in servers), *also)


def start_thread(routes: Sequence[tuple[socket.socket, str]], *also: Awaitable[None]) -> threading.Thread:
    """Serve in a daemon thread: it ends with the process that runs it."""
    thread = threading.Thread(
        target=asyncio.run, args=(serve(routes, *also),), name="egressd-bridge", daemon=True
    )
    thread.start()
    return thread


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m egressd.sandbox.bridge",
        description="Forward TCP connections on a loopback port to a Unix socket (egressd's relay).",
    )
    parser.add_argument("--unix", required=True, metavar="PATH", help="Unix socket to forward to")
    parser.add_argument("--listen", required=True, metavar="HOST:PORT", help="loopback address to listen on")
    args = parser.parse_args(argv)
    try:
        address = parse_hostport(args.listen)
    except ValueError as exc:
        parser.error(str(exc))
    asyncio.run(serve([(listen(address), args.unix)]))


if __name__ == "__main__":
    main()
