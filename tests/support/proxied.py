"""A raw HTTP/1.1 client through a running `egressd run`, on either front, read by h11.

Why: the attack tables send the same request through both of egressd's HTTP fronts — absolute-form
plain HTTP, and origin-form inside a CONNECT tunnel egressd inspects (TLS with egressd's CA) — and
need every byte of the answer as a client reads it: interim (1xx) heads, the final head, the body
de-chunked, the trailers, and where a 101 leaves the socket for whatever comes next.
"""

from __future__ import annotations

import base64
import socket
import ssl
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import h11

from tests.support.egressd_cli import EgressdRun

FRONTS = ("plain", "inspected")


@dataclass
class Answer:
    """Everything the child was sent for one request."""

    interim: list[h11.InformationalResponse] = field(default_factory=list)
    final: h11.Response | None = None
    body: bytes = b""
    trailers: list[tuple[bytes, bytes]] = field(default_factory=list)
    raw: bytes = b""
    switched: bool = False  # a 101 came: the socket now carries another protocol

    @property
    def status(self) -> int | None:
        if self.switched:
            return 101
        return self.final.status_code if self.final is not None else None

    def text(self) -> bytes:
        """Every byte of text the child got, de-chunked: reasons, fields, body, trailers."""
        heads = [*self.interim, *([self.final] if self.final is not None else [])]
        pieces = [
            h.reason + b"\n" + b"\n".join(n + b": " + v for n, v in h.headers.raw_items()) for h in heads
        ]
        pieces += [self.body, b"\n".join(n + b": " + v for n, v in self.trailers), self.raw]
        return b"\n".join(pieces)

    def field(self, name: bytes) -> bytes | None:
        """The final response's first field of this (lower-case) name."""
        assert self.final is not None
        found = [v for n, v in self.final.headers.raw_items() if n.lower() == name]
        return found[0] if found else None


def exchange(
    sock: socket.socket,
    method: str,
    target: str,
    host: str,
    headers: list[tuple[str, str]],
    timeout: float = 20,
) -> Answer:
    """One request on `sock`, read to the end of the final response, a 101, or the connection's end."""
    client = h11.Connection(h11.CLIENT)
    request = h11.Request(method=method, target=target, headers=[("Host", host), *headers])
    sock.sendall(client.send(request) + client.send(h11.EndOfMessage()))
    answer = Answer()
    deadline = time.monotonic() + timeout
    while True:
        try:
            event = client.next_event()
        except h11.RemoteProtocolError as exc:
            raise AssertionError(f"unreadable answer ({exc}): {answer.raw[:400]!r}") from None
        if event is h11.NEED_DATA:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                data = sock.recv(65536)
            except TimeoutError:
                raise AssertionError(
                    f"no complete answer within {timeout} s; got {answer.raw[:400]!r}"
                ) from None
            except ConnectionResetError:
                data = b""
            answer.raw += data
            client.receive_data(data)
        elif isinstance(event, h11.InformationalResponse):
            answer.interim.append(event)
            if event.status_code == 101:
                answer.switched = True
                return answer
        elif isinstance(event, h11.Response):
            answer.final = event
        elif isinstance(event, h11.Data):
            answer.body += bytes(event.data)
        elif isinstance(event, h11.EndOfMessage):
            answer.trailers = list(event.headers.raw_items())
            return answer
        else:  # ConnectionClosed, or PAUSED after a refusal's close
            return answer


@dataclass
class Proxied:
    """The child's side of a running egressd: `open` a connection to a target on a front, and send
    requests on it."""

    run: EgressdRun

    @property
    def auth(self) -> str:
        url = urlsplit(self.run.proxy_url)
        return "Basic " + base64.b64encode(f"{url.username}:{url.password}".encode()).decode()

    def open(self, front: str, authority: str) -> socket.socket:
        """A plain connection to egressd (front "plain"), or a TLS tunnel to `authority` through it
        that egressd inspects (front "inspected")."""
        url = urlsplit(self.run.proxy_url)
        assert url.hostname is not None and url.port is not None
        sock = socket.create_connection((url.hostname, url.port), timeout=10)
        if front == "plain":
            return sock
        connect = f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\nProxy-Authorization: {self.auth}\r\n"
        sock.sendall(connect.encode() + b"\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            data = sock.recv(1)
            assert data, f"CONNECT {authority}: closed after {head!r}"
            head += data
        assert head.startswith(b"HTTP/1.1 200 "), head
        context = ssl.create_default_context(cafile=self.run.env["SSL_CERT_FILE"])
        return context.wrap_socket(sock, server_hostname=authority.rpartition(":")[0])

    def send(
        self,
        sock: socket.socket,
        front: str,
        authority: str,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
    ) -> Answer:
        """One request for `path` on `authority`, in the form the front takes."""
        if front == "plain":
            proxied = [*headers, ("Proxy-Authorization", self.auth)]
            return exchange(sock, method, f"http://{authority}{path}", authority, proxied)
        return exchange(sock, method, path, authority, headers)

    def request(
        self, front: str, authority: str, method: str, path: str, headers: list[tuple[str, str]]
    ) -> Answer:
        """One request on a connection of its own (closed after it)."""
        with self.open(front, authority) as sock:
            return self.send(sock, front, authority, method, path, [*headers, ("Connection", "close")])
