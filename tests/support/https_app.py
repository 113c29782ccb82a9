"""A small HTTPS application server (trustme certificate) for the real-client inspection tests.

Why: the git, npm and pip tests each need a real HTTPS server that speaks the client's protocol (smart
HTTP, a registry, a simple index) under a test name such as ``git.test``. They share this base: TLS with
a certificate from the session CA, HTTP/1.1 with Content-Length or chunked request bodies, and counters
of accepted TCP connections, TLS handshakes and requests, so a test can prove that a refused client
never reached the server at all.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import socketserver
import ssl
import threading
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Any

import trustme

from tests.support.upstreams import BodyReadingHandler, CountingAccepts, ServedInThread

log = logging.getLogger(__name__)


@dataclass
class Request:
    """One request as the application sees it (headers with lower-case names)."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Reply:
    """What the application answers; Content-Length is added by the server."""

    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


class _Handler(BodyReadingHandler):
    server: _Server

    def _handle(self) -> None:
        owner = self.server.owner
        if self.headers.get("Expect", "").lower() == "100-continue":
            self.send_response_only(100)
            self.end_headers()
        request = Request(
            method=self.command,
            path=self.path,
            headers={k.lower(): v for k, v in self.headers.items()},
            body=self._read_body(),
        )
        with owner.lock:
            owner.requests.append(request)
        try:
            reply = owner.handle(request)
        except Exception:
            log.exception("%s: application error", owner.name)
            reply = Reply(500, b"application error\n")
        self.send_response(reply.status)
        headers = {"Content-Type": "text/plain", **reply.headers}
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(reply.body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(reply.body)

    do_GET = do_POST = do_PUT = do_HEAD = _handle


class _Server(CountingAccepts, ThreadingHTTPServer):
    def __init__(self, owner: AppHTTPSServer, addr: tuple[str, int]) -> None:
        self.owner = owner
        super().__init__(addr, _Handler)

    def server_bind(self) -> None:
        """No ``socket.getfqdn``: no reverse DNS through the system resolver."""
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    def finish_request(self, request: Any, client_address: Any) -> None:
        """TLS in the per-connection thread, so a silent client blocks nobody else."""
        raw = request
        try:
            try:
                request = self.owner.ssl_context.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError) as exc:
                with self.owner.lock:
                    self.owner.tls_failures.append(repr(exc))
                return
            with self.owner.lock:
                self.owner.tls_handshakes += 1
                self.owner.open_sockets.add(request)
            super().finish_request(request, client_address)
        finally:
            with self.owner.lock:
                self.owner.open_sockets.discard(raw)
                self.owner.open_sockets.discard(request)
            if request is not raw:
                with contextlib.suppress(OSError):
                    request.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("%s: error with %s", self.owner.name, client_address, exc_info=True)


class AppHTTPSServer(ServedInThread):
    """HTTPS server on ``host`` (IPv4) whose certificate names ``hostnames``; subclasses implement
    :meth:`handle`. ``connections`` counts TCP accepts, ``tls_handshakes`` completed handshakes,
    ``requests`` every request served."""

    def __init__(self, host: str, *, ca: trustme.CA, hostnames: list[str], name: str = "app") -> None:
        self.host = host
        self.port = 0
        self.hostname = hostnames[0]
        self.name = name
        self.connections = 0
        self.tls_handshakes = 0
        self.tls_failures: list[str] = []
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self.open_sockets: set[socket.socket] = set()
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert(*hostnames).configure_cert(ctx)
        ctx.set_alpn_protocols(["http/1.1"])
        self.ssl_context = ctx
        self._server: socketserver.BaseServer | None = None
        self._thread: threading.Thread | None = None

    def handle(self, request: Request) -> Reply:  # pragma: no cover - overridden
        raise NotImplementedError

    @property
    def base_url(self) -> str:
        """``https://<first hostname>:<port>`` (the name must resolve to ``host``)."""
        return f"https://{self.hostname}:{self.port}"

    @property
    def paths(self) -> list[str]:
        with self.lock:
            return [r.path for r in self.requests]

    def _make_server(self) -> socketserver.BaseServer:
        return _Server(self, (self.host, 0))
