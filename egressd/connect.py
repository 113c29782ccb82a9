"""`python -m egressd.connect HOST PORT`: a tunnel through egressd's proxy on stdin/stdout.

An SSH `ProxyCommand` (git over SSH, `ssh`, `scp`): it reads the proxy URL and the child's
credentials from HTTPS_PROXY/ALL_PROXY/HTTP_PROXY, sends `CONNECT HOST:PORT`, and once the proxy
answers 200 copies stdin to the tunnel and the tunnel to stdout. So SSH needs no socat or nc, and
the proxy decides the connection like any other. A refusal is explained on stderr (the reason
egressd gave), never on stdout, which belongs to SSH. Standard library only: it starts fast.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy")
MAX_HEADER = 64 * 1024
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
        if self.username is None:
            return None
        raw = f"{self.username}:{self.password or ''}".encode()
        return "Basic " + base64.b64encode(raw).decode("ascii")


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


def connect_request(host: str, port: int, proxy: Proxy) -> bytes:
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
    auth = proxy.authorization()
    if auth:
        lines.append(f"Proxy-Authorization: {auth}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectError("the proxy closed the connection without answering")
        data += chunk
        if len(data) > MAX_HEADER:
            raise ConnectError("the proxy's answer is too long")
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def _refusal(head: bytes, sock: socket.socket, rest: bytes) -> str:
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    body = rest
    with contextlib.suppress(OSError):
        sock.settimeout(2.0)
        while len(body) < 16 * 1024 and (chunk := sock.recv(4096)):
            body += chunk
    reason = headers.get("x-egressd-reason")
    text = f"the proxy answered: {lines[0]}" + (f" (reason: {reason})" if reason else "")
    detail = body.decode("utf-8", "replace").strip()
    return text + (f"\n{detail}" if detail else "")


def open_tunnel(host: str, port: int, proxy: Proxy, timeout: float = 30.0) -> tuple[socket.socket, bytes]:
    """Connect to the proxy and CONNECT; return the socket and any tunnel bytes already read."""
    try:
        sock = socket.create_connection((proxy.host, proxy.port), timeout=timeout)
    except OSError as exc:
        raise ConnectError(f"cannot reach the proxy at {proxy.host}:{proxy.port}: {exc}") from exc
    try:
        sock.sendall(connect_request(host, port, proxy))
        head, rest = _read_head(sock)
        status = head.split(b"\r\n", 1)[0].split()
        if len(status) < 2 or status[1] != b"200":
            raise ConnectError(_refusal(head, sock, rest))
    except (OSError, ConnectError) as exc:
        sock.close()
        if isinstance(exc, ConnectError):
            raise
        raise ConnectError(f"talking to the proxy failed: {exc}") from exc
    sock.settimeout(None)
    return sock, rest


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
    """Copy both ways until the tunnel closes."""
    threading.Thread(target=_copy_in, args=(sock, stdin), daemon=True).start()
    with contextlib.suppress(OSError):
        if early:
            _write_all(stdout, early)
        while data := sock.recv(CHUNK):
            _write_all(stdout, data)
    sock.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m egressd.connect",
        description="Open a tunnel to HOST PORT through egressd's proxy and relay it on stdin/stdout "
        "(an SSH ProxyCommand).",
        epilog='example: ssh -o ProxyCommand="python -m egressd.connect %%h %%p" git@github.com',
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
