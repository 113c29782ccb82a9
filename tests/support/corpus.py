"""Helpers for the bypass corpus: raw proxy clients and connection-counting "must not reach" servers.

Why: a bypass is proven absent only end to end. The corpus talks to the real `egressd run` over raw
sockets (HTTP absolute-form, CONNECT, SOCKS5), so the exact bytes of each trick reach the proxy, and
it puts real servers behind every address a trick might leak to (all on ONE port, so a leak to the
wrong address would land on a counting server instead of a closed port).
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import socket
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv6Address
from typing import Self
from urllib.parse import urlsplit

from tests.support.upstreams import EchoHTTPServer, TcpEchoServer, free_port

__all__ = [
    "ProxyClient",
    "Reader",
    "Response",
    "ServerSet",
    "read_head",
    "read_response",
]


@dataclass
class Response:
    """One HTTP response as read off the wire (headers lower-cased; repeated names keep the last)."""

    status: int
    headers: dict[str, str]
    body: bytes
    raw_head: bytes

    @property
    def reason(self) -> str | None:
        """egressd's reason code, if egressd (not an upstream) produced this response."""
        return self.headers.get("x-egressd-reason")

    @property
    def proxy_status(self) -> str:
        return self.headers.get("proxy-status", "")


class Reader:
    """Reads responses off one socket, keeping what arrived past the end of each (pipelining)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self, deadline: float) -> bool:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no complete response within the deadline; got {self.buf[:200]!r}")
        self.sock.settimeout(remaining)
        chunk = self.sock.recv(65536)
        self.buf += chunk
        return bool(chunk)

    def response(self, timeout: float = 10.0, *, head_only: bool = False) -> Response | None:
        """One response (head, then a Content-Length body). None when the peer closed silently."""
        deadline = time.monotonic() + timeout
        while b"\r\n\r\n" not in self.buf and len(self.buf) < (1 << 20):
            if not self._fill(deadline):
                break
        if not self.buf:
            return None
        head, sep, rest = self.buf.partition(b"\r\n\r\n")
        if not sep:
            raise AssertionError(f"incomplete response head: {self.buf[:300]!r}")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        self.buf = rest
        want = 0 if head_only else int(headers.get("content-length", "0") or 0)
        while len(self.buf) < want and time.monotonic() < deadline:
            if not self._fill(deadline):
                break
        body, self.buf = self.buf[:want], self.buf[want:]
        return Response(status=status, headers=headers, body=body, raw_head=head)


def read_head(sock: socket.socket) -> bytes:
    """What the peer sent up to the end of a head (the blank line), or until it closed: a raw read
    for the tests that look at the bytes themselves (a CONNECT's answer, a request to a test
    server). Anything read past the blank line stays at the end."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def read_response(sock: socket.socket, timeout: float = 10.0, *, head_only: bool = False) -> Response | None:
    """Read one response from a socket that carries only this one (see Reader for pipelining)."""
    return Reader(sock).response(timeout, head_only=head_only)


@dataclass
class ProxyClient:
    """Raw access to a running egressd: the listener address and the child's credentials."""

    host: str
    port: int
    username: str
    password: str
    socks_port: int | None = None

    @classmethod
    def from_env(cls, env: dict[str, str]) -> Self:
        """Build from the export lines of `egressd run` (HTTP_PROXY and EGRESSD_SOCKS_PROXY)."""
        url = urlsplit(env["HTTP_PROXY"])
        socks = urlsplit(env["EGRESSD_SOCKS_PROXY"]) if "EGRESSD_SOCKS_PROXY" in env else None
        assert url.hostname and url.port and url.username and url.password is not None
        return cls(
            host=url.hostname,
            port=url.port,
            username=url.username,
            password=url.password,
            socks_port=socks.port if socks is not None else None,
        )

    @property
    def auth_header(self) -> bytes:
        token = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
        return f"Proxy-Authorization: Basic {token}\r\n".encode()

    def open(self, timeout: float = 10.0) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def exchange(self, raw: bytes, timeout: float = 10.0) -> Response | None:
        """Send raw bytes on a fresh connection; read one response (None: closed without one)."""
        with self.open(timeout) as sock:
            sock.sendall(raw)
            try:
                return read_response(sock, timeout)
            except ConnectionResetError:
                return None

    def get(
        self,
        target: str,
        *,
        host: str | None = None,
        extra: Sequence[str] = (),
        method: str = "GET",
        timeout: float = 10.0,
    ) -> Response | None:
        """An absolute-form (or origin-form) request with the child's credentials."""
        lines = [f"{method} {target} HTTP/1.1"]
        if host is not None:
            lines.append(f"Host: {host}")
        lines.extend(extra)
        lines.append("Connection: close")
        raw = ("\r\n".join(lines) + "\r\n").encode("utf-8", "surrogateescape")
        return self.exchange(raw + self.auth_header + b"\r\n", timeout)

    @contextlib.contextmanager
    def connect(
        self, authority: str, *, host: str | None = None, timeout: float = 10.0
    ) -> Iterator[tuple[Response | None, socket.socket]]:
        """CONNECT; yields the proxy's answer and the socket (the tunnel when the answer is 200)."""
        sock = self.open(timeout)
        try:
            head = f"CONNECT {authority} HTTP/1.1\r\nHost: {host or authority}\r\n".encode(
                "utf-8", "surrogateescape"
            )
            sock.sendall(head + self.auth_header + b"\r\n")
            yield read_response(sock, timeout, head_only=True), sock
        finally:
            sock.close()

    @contextlib.contextmanager
    def socks5(
        self, host: str | bytes | IPv4Address | IPv6Address, port: int, *, timeout: float = 10.0
    ) -> Iterator[tuple[int, socket.socket]]:
        """SOCKS5 CONNECT with user/password auth, by name (ATYP 3) or, for an address object, by
        address (ATYP 1 or 4); yields (reply code, socket)."""
        assert self.socks_port is not None, "egressd run printed no EGRESSD_SOCKS_PROXY"
        sock = socket.create_connection((self.host, self.socks_port), timeout=timeout)
        try:
            sock.sendall(b"\x05\x01\x02")
            assert _recv_exact(sock, 2) == b"\x05\x02"
            user, password = self.username.encode(), self.password.encode()
            sock.sendall(b"\x01" + bytes([len(user)]) + user + bytes([len(password)]) + password)
            assert _recv_exact(sock, 2) == b"\x01\x00"
            if isinstance(host, IPv4Address | IPv6Address):
                address = bytes([1 if host.version == 4 else 4]) + host.packed
            else:
                name = host.encode("utf-8", "surrogateescape") if isinstance(host, str) else host
                address = b"\x03" + bytes([len(name)]) + name
            sock.sendall(b"\x05\x01\x00" + address + struct.pack("!H", port))
            reply = _recv_exact(sock, 4)
            if len(reply) < 2:
                yield -1, sock
                return
            code = reply[1]
            if len(reply) == 4:  # skip the bound address
                atyp = reply[3]
                rest = {1: 4 + 2, 4: 16 + 2}.get(atyp)
                if rest is None and atyp == 3:
                    rest = _recv_exact(sock, 1)[0] + 2
                if rest:
                    _recv_exact(sock, rest)
            yield code, sock
        finally:
            sock.close()

    def alive(self, server: EchoHTTPServer) -> bool:
        """The proxy still answers a normal, allowed request (after a malformed one)."""
        response = self.get(f"http://{server.host}:{server.port}/alive")
        return response is not None and response.status == 200


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        data += chunk
    return data


def tunnel_get(
    sock: socket.socket, host: str, timeout: float = 10.0, path: str = "/tunnel"
) -> Response | None:
    """A plain HTTP request inside an established (non-TLS) tunnel."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    try:
        return read_response(sock, timeout)
    except (ConnectionResetError, TimeoutError):
        return None


@dataclass
class ServerSet:
    """Counting servers that all listen on ONE port, on several addresses.

    A trick that makes egressd connect to another address than the one it decided about would land
    on one of these instead of a closed port, and be counted.
    """

    hosts: Sequence[str]
    tcp: bool = False
    port: int = 0
    servers: dict[str, EchoHTTPServer | TcpEchoServer] = field(default_factory=dict)

    def start(self) -> Self:
        for _attempt in range(50):
            port = free_port(self.hosts[0])
            started: dict[str, EchoHTTPServer | TcpEchoServer] = {}
            try:
                for host in self.hosts:
                    server: EchoHTTPServer | TcpEchoServer
                    if self.tcp:
                        server = TcpEchoServer(host, port, name=f"tcp-{host}")
                    else:
                        server = EchoHTTPServer(host, port, name=f"http-{host}")
                    started[host] = server.start()
            except OSError:
                for server in started.values():
                    server.stop()
                continue
            self.port, self.servers = port, started
            return self
        raise RuntimeError(f"no port free on all of {list(self.hosts)}")

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __getitem__(self, host: str) -> EchoHTTPServer | TcpEchoServer:
        return self.servers[host]

    def counts(self) -> dict[str, int]:
        """Accepted TCP connections per address."""
        return {host: server.connections for host, server in self.servers.items()}

    def reached(self, *except_hosts: str) -> dict[str, int]:
        """Addresses (other than ``except_hosts``) that accepted any connection: must stay empty."""
        return {h: n for h, n in self.counts().items() if n and h not in except_hosts}


# the ways a child names a target to egressd: absolute-form HTTP, CONNECT, SOCKS5 by name, SOCKS5
# by address (ATYP 1/4)
FRONTS = ("http", "connect", "socks-name", "socks-address")


def socks_address(written: str) -> IPv4Address | IPv6Address | None:
    """The SOCKS5 address form of a host as written in a URL; None for a name or a legacy IPv4
    spelling (`0x7f.1`), which have none."""
    try:
        address = ipaddress.ip_address(written.strip("[]"))
    except ValueError:
        return None
    return address


def attempt(
    client: ProxyClient, front: str, written: str, port: int, path: str = "/"
) -> tuple[int, str | None]:
    """(HTTP status or SOCKS5 reply code, X-Egressd-Reason) of one attempt at `written:port`
    through `front` (one of FRONTS; the reply code -1: closed without one)."""
    if front == "http":
        response = client.get(f"http://{written}:{port}{path}")
        return (-1, None) if response is None else (response.status, response.reason)
    if front == "connect":
        with client.connect(f"{written}:{port}") as (response, _):
            return (-1, None) if response is None else (response.status, response.reason)
    host: str | IPv4Address | IPv6Address | None = written.strip("[]")
    if front == "socks-address":
        host = socks_address(written)
        assert host is not None, f"{written} has no SOCKS5 address form"
    with client.socks5(host, port) as (code, _):
        return code, None
