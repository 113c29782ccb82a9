"""`python -m egressd.child.connect HOST PORT`: a tunnel through egressd's proxy on stdin/stdout.

An SSH `ProxyCommand` (git over SSH, `ssh`, `scp`): it reads the proxy URL and the child's
credentials from HTTPS_PROXY/ALL_PROXY/HTTP_PROXY, sends `CONNECT HOST:PORT`, and once the proxy
answers 200 copies stdin to the tunnel and the tunnel to stdout. So SSH needs no socat or nc, and
the proxy decides the connection like any other. A refusal is explained on stderr (the reason
egressd gave), never on stdout, which belongs to SSH.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from egressd.wire.connect_client import AnswerError, ConnectClient, basic

PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy")
CHUNK = 64 * 1024
EXIT_REFUSED = 1
EXIT_USAGE = 2


class ConnectError(Exception):
    """The tunnel could not be opened; the message is for the user."""


@dataclass(frozen=True)
class Proxy:
    host: str
    port: int
    username: str | None = None
    password: str | None = None

    def authorization(self) -> str | None:
        return None if self.username is None else basic(self.username, self.password or "")


def proxy_from_url(url: str) -> Proxy:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme != "http":
        raise ConnectError(f"proxy {parts.scheme}://...: only an http:// proxy can tunnel with CONNECT")
    if not parts.hostname:
        raise ConnectError(f"proxy URL {url!r} has no host")
    return Proxy(
        host=parts.hostname,
        port=parts.port or 80,
        username=unquote(parts.username) if parts.username is not None else None,
        password=unquote(parts.password) if parts.password is not None else None,
    )


def proxy_from_env(env: Mapping[str, str]) -> Proxy:
    for name in PROXY_VARS:
        value = env.get(name, "").strip()
        if value and value.startswith("http://"):
            return proxy_from_url(value)
    raise ConnectError(
        f"no http:// proxy in {', '.join(PROXY_VARS[::2])} (run under `egressd exec` or `sandbox`)"
    )


def open_tunnel(host: str, port: int, proxy: Proxy, timeout: float = 30.0) -> tuple[socket.socket, bytes]:
    """Connect to the proxy and CONNECT; return the socket and any tunnel bytes already read."""
    try:
        sock = socket.create_connection((proxy.host, proxy.port), timeout=timeout)
    except OSError as exc:
        raise ConnectError(f"cannot reach the proxy at {proxy.host}:{proxy.port}: {exc}") from exc
    client = ConnectClient(host, port, proxy.authorization())
    try:
        sock.sendall(client.request)
        try:
            while not client.feed(sock.recv(4096)):
                if client.status:  # a refusal's text: what arrives within 2 s of its head
                    sock.settimeout(2.0)
        except OSError:
            if not client.status:
                raise
        if not client.admitted:
            raise ConnectError(client.refusal())
    except (OSError, AnswerError, ConnectError) as exc:
        sock.close()
        if isinstance(exc, ConnectError):
            raise
        if isinstance(exc, AnswerError):
            raise ConnectError(str(exc)) from exc
        raise ConnectError(f"talking to the proxy failed: {exc}") from exc
    sock.settimeout(None)
    return sock, client.tunnel


def _copy_in(sock: socket.socket, fd: int) -> None:
    """stdin -> tunnel; at EOF half-close the tunnel so the server sees it."""
    with contextlib.suppress(OSError):
        while data := os.read(fd, CHUNK):
            sock.sendall(data)
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def relay(sock: socket.socket, early: bytes, stdin: int = 0, stdout: int = 1) -> None:
    """Copy both ways until the socket closes; stdin's end half-closes it.

    The relay of egressd's small blocking processes (this ProxyCommand, the remote's policy
    channel feeder): a thread per direction, and a blocking write holds its reader back. The proxy's
    event loop relays with egressd.front.relay, which cannot serve here: it needs an event loop in a
    process that starts per SSH connection, and cannot read a stdin that is a plain file."""
    threading.Thread(target=_copy_in, args=(sock, stdin), daemon=True).start()
    with contextlib.suppress(OSError):
        if early:
            _write_all(stdout, early)
        while data := sock.recv(CHUNK):
            _write_all(stdout, data)
    sock.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m egressd.child.connect",
        description="Open a tunnel to HOST PORT through egressd's proxy and relay it on stdin/stdout "
        "(an SSH ProxyCommand).",
        epilog='example: ssh -o ProxyCommand="python -m egressd.child.connect %%h %%p" git@github.com',
    )
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--proxy", metavar="URL", help="proxy URL (default: from HTTPS_PROXY and friends)")
    args = parser.parse_args(argv)
    try:
        proxy = proxy_from_url(args.proxy) if args.proxy else proxy_from_env(os.environ)
        sock, early = open_tunnel(args.host, args.port, proxy)
    except ConnectError as exc:
        sys.stderr.write(f"egressd connect {args.host}:{args.port}: {exc}\n")
        sys.exit(EXIT_REFUSED)
    relay(sock, early)


if __name__ == "__main__":
    main()
