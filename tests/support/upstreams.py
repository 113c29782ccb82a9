"""Real upstream servers (HTTP, HTTPS, TCP echo, refusing and stalling ports) for integration tests.

Why: egressd's decisions are only proven when real clients talk through it to real servers. Each
server counts the TCP connections it accepted, so a test can assert that a refused target was never
reached at all (not merely that the client got a 403).
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import socketserver
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self
from urllib.parse import parse_qs, urlsplit

import trustme

log = logging.getLogger(__name__)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (racy by nature; fine inside the netns)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def make_ca() -> trustme.CA:
    """A fresh throw-away certificate authority for the test upstreams."""
    return trustme.CA(organization_name="egressd tests")


def write_ca_file(ca: trustme.CA, path: str | Path) -> Path:
    """Write the CA certificate (PEM, no key) to ``path`` for CURL_CA_BUNDLE/SSL_CERT_FILE/etc."""
    p = Path(path)
    ca.cert_pem.write_to_path(str(p))
    return p


# ------------------------------------------------------------------------------------------------
# HTTP / HTTPS
# ------------------------------------------------------------------------------------------------
class CountingAccepts(socketserver.TCPServer):
    """A test server's accept: each connection counted in its owner's ``connections`` and kept in
    its ``open_sockets`` (so stop() can shut it); threads that never hold up the test's end."""

    owner: Any
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, peer = super().get_request()
        with self.owner.lock:
            self.owner.connections += 1
            self.owner.open_sockets.add(sock)
        return sock, peer


class ServedInThread:
    """The life cycle shared by the test servers: a socketserver in a daemon thread; stop() also
    shuts the client sockets still open, so a streaming handler cannot keep the test waiting.

    Subclasses set ``host``, ``port``, ``name``, ``lock``, ``open_sockets``, ``_server`` and
    ``_thread`` in ``__init__`` and build their server in :meth:`_make_server`.
    """

    host: str
    port: int
    name: str
    lock: threading.Lock
    open_sockets: set[socket.socket]
    _server: socketserver.BaseServer | None
    _thread: threading.Thread | None

    def _make_server(self) -> socketserver.BaseServer:
        raise NotImplementedError

    def start(self) -> Self:
        self._server = self._make_server()
        self.port = int(self._server.server_address[1])  # type: ignore[index]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"{self.name}-{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        with self.lock:
            socks = list(self.open_sockets)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None
        self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class BodyReadingHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 handler base of the test servers: logs under the server's name, reads any body."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s: " + format, self.server.owner.name, *args)  # type: ignore[attr-defined]

    def _read_body(self) -> bytes:
        """The whole body. A body cut short (the connection ended before its last chunk or its
        Content-Length) raises ConnectionError: the request is neither recorded nor answered, as a
        server that frames strictly would treat it."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self._line().split(b";")[0].strip(), 16)
                if size == 0:
                    while self._line() not in (b"\r\n", b"\n"):
                        pass
                    break
                chunks.append(self._exactly(size))
                self._line()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self._exactly(length) if length else b""

    def _line(self) -> bytes:
        line = self.rfile.readline()
        if not line.endswith(b"\n"):
            raise ConnectionError("the request body was cut short")
        return line

    def _exactly(self, size: int) -> bytes:
        data = self.rfile.read(size)
        if len(data) != size:
            raise ConnectionError("the request body was cut short")
        return data


class _Handler(BodyReadingHandler):
    """Echo handler; see :class:`EchoHTTPServer` for the special paths."""

    server: _HTTPServer

    def _handle(self) -> None:
        owner = self.server.owner
        body = self._read_body()
        headers = {k.lower(): v for k, v in self.headers.items()}
        owner.requests.append(
            {
                "method": self.command,
                "path": self.path,
                "headers": headers,
                "body": body,
                "peer": tuple(self.client_address[:2]),
            }
        )
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        path = url.path
        if path == "/redirect":
            self._send(302, b"", extra={"Location": query.get("to", ["/"])[0]})
        elif path == "/big":
            self._big(int(query.get("n", ["1048576"])[0]))
        elif path == "/chunked":
            self._chunked(int(query.get("n", ["1048576"])[0]))
        elif path == "/slow":
            time.sleep(float(query.get("s", ["1"])[0]))
            self._json(200, headers)
        elif path == "/silent":
            # accepts and reads the request, then never answers (until the server stops)
            owner.stopping.wait()
            self.close_connection = True
        elif path == "/half":
            # half a response head, then the connection closes
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nContent-Ty")
            self.wfile.flush()
            self.close_connection = True
        elif path == "/headers-forged":
            self._json(200, headers, extra={"X-Egressd-Reason": "forged", "Proxy-Status": "forged"})
        elif path == "/sse":
            self._sse(int(query["n"][0]) if "n" in query else None)
        elif path.startswith("/status/") and path[8:].isdigit():
            self._json(int(path[8:]), headers)
        else:
            self._json(200, headers)

    def _send(
        self,
        status: int,
        body: bytes,
        ctype: str = "text/plain",
        extra: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, headers: dict[str, str], extra: dict[str, str] | None = None) -> None:
        payload = {
            "server": self.server.owner.name,
            "method": self.command,
            "path": self.path,
            "headers": headers,
        }
        self._send(status, json.dumps(payload).encode(), "application/json", extra)

    def _big(self, n: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(n))
        self.end_headers()
        if self.command == "HEAD":
            return
        block = b"x" * 65536
        left = n
        while left > 0:
            chunk = block if left >= len(block) else block[:left]
            self.wfile.write(chunk)
            left -= len(chunk)

    def _chunked(self, n: int) -> None:
        """n bytes as one chunk and the body's end, in one write: a proxy gets it all at once."""
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.write(f"{n:x}\r\n".encode() + b"x" * n + b"\r\n0\r\n\r\n")

    def _sse(self, count: int | None) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        i = 0
        while count is None or i < count:
            if self.server.owner.stopping.is_set():
                return
            try:
                self.wfile.write(f'id: {i}\ndata: {{"n": {i}}}\n\n'.encode())
                self.wfile.flush()
            except OSError:
                return  # client went away
            i += 1
            time.sleep(0.2)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _handle


class _HTTPServer(CountingAccepts, ThreadingHTTPServer):
    request_queue_size = 1024

    def __init__(self, owner: EchoHTTPServer, addr: tuple[str, int]) -> None:
        self.owner = owner
        self.address_family = _family(addr[0])
        super().__init__(addr, _Handler)

    def server_bind(self) -> None:
        """Like HTTPServer.server_bind minus ``socket.getfqdn``: no reverse DNS via the system resolver."""
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    def finish_request(self, request: Any, client_address: Any) -> None:
        """Runs in the per-connection thread: do TLS here so a silent client blocks nobody else."""
        raw = request
        try:
            if self.owner.ssl_context is not None:
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
            if request is not raw:  # the TLS socket owns the fd now; the base class only closes `raw`
                with contextlib.suppress(OSError):
                    request.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("%s: error with %s", self.owner.name, client_address, exc_info=True)


class EchoHTTPServer(ServedInThread):
    """Plain HTTP/1.1 echo server in a background thread.

    ``GET /anything`` → 200 JSON ``{"server", "method", "path", "headers"}``. Special paths:
    ``/redirect?to=URL`` (302), ``/big?n=BYTES`` (streamed), ``/chunked?n=BYTES`` (one chunk and
    the body's end in one write), ``/slow?s=SECONDS``, ``/headers-forged`` (carries
    ``X-Egressd-Reason: forged`` and ``Proxy-Status: forged``), ``/sse[?n=COUNT]`` (event-stream,
    an event every 0.2 s until the client closes), ``/status/NNN``, ``/silent`` (reads the request
    and never answers until the server stops), ``/half`` (half a response head, then the
    connection closes).
    """

    scheme = "http"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, name: str = "upstream") -> None:
        self.host = host
        self.port = port
        self.name = name
        self.connections = 0
        self.tls_handshakes = 0
        self.tls_failures: list[str] = []
        self.sni: list[str | None] = []
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.open_sockets: set[socket.socket] = set()
        self.ssl_context: ssl.SSLContext | None = None
        self._server: socketserver.BaseServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL by address, e.g. ``http://198.51.100.1:PORT`` or ``http://[2001:db8::1]:PORT``."""
        return f"{self.scheme}://{_hostport(self.host, self.port)}"

    def url_for(self, hostname: str, path: str = "") -> str:
        """URL naming ``hostname`` instead of the address (the name must resolve to ``host``)."""
        return f"{self.scheme}://{_hostport(hostname, self.port)}{path}"

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    def _make_server(self) -> socketserver.BaseServer:
        return _HTTPServer(self, (self.host, self.port))

    def start(self) -> Self:
        self.stopping.clear()
        return super().start()

    def stop(self) -> None:
        self.stopping.set()  # ends SSE streams
        super().stop()


class EchoHTTPSServer(EchoHTTPServer):
    """The echo server over TLS with a certificate from ``ca`` for ``hostnames`` (names and IPs).

    Records the SNI of every handshake in ``sni`` and counts completed handshakes in ``tls_handshakes``
    (``connections`` counts TCP accepts, so a refused TLS client still shows up there).
    """

    scheme = "https"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        name: str = "upstream-tls",
        *,
        ca: trustme.CA,
        hostnames: list[str] | None = None,
    ) -> None:
        super().__init__(host, port, name)
        self.ca = ca
        self.hostnames = list(hostnames) if hostnames else [host]
        cert = ca.issue_cert(*self.hostnames)
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(ctx)
        ctx.set_alpn_protocols(["http/1.1"])

        def on_sni(
            _sock: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _ctx: ssl.SSLContext
        ) -> None:
            with self.lock:
                self.sni.append(server_name)

        ctx.sni_callback = on_sni
        self.ssl_context = ctx


class OneAnswerHTTPSServer:
    """HTTPS that answers one request per connection (`200`, its body the connection's number) and
    then closes it without saying so beforehand (no `Connection: close`), as a server whose
    keep-alive timer ran out does: the next request on the client's side needs a new connection.
    `stop_listening()` closes the listener: a new connection is then refused. Records each
    handshake's SNI in ``sni``."""

    def __init__(self, host: str, *, ca: trustme.CA, hostnames: list[str]) -> None:
        self.host = host
        self.connections = 0
        self.sni: list[str | None] = []
        self._listener = socket.create_server((host, 0))
        self.port = int(self._listener.getsockname()[1])
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert(*hostnames).configure_cert(self._context)
        self._context.sni_callback = self._on_sni
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _on_sni(self, _sock: ssl.SSLObject | ssl.SSLSocket, name: str | None, _ctx: ssl.SSLContext) -> None:
        self.sni.append(name)

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self._listener.accept()
                self.connections += 1
                threading.Thread(target=self._answer, args=(conn, self.connections), daemon=True).start()

    def _answer(self, conn: socket.socket, number: int) -> None:
        with contextlib.suppress(OSError, ssl.SSLError), conn:
            conn.settimeout(10)
            with self._context.wrap_socket(conn, server_side=True) as tls:
                head = b""
                while b"\r\n\r\n" not in head and (chunk := tls.recv(4096)):
                    head += chunk
                body = str(number).encode()
                tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    def stop_listening(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone does not)
        self._listener.close()
        self._thread.join(5)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_listening()


# ------------------------------------------------------------------------------------------------
# Raw TCP
# ------------------------------------------------------------------------------------------------
class _EchoTCPHandler(socketserver.BaseRequestHandler):
    server: _TCPServer

    def handle(self) -> None:
        owner = self.server.owner
        sock: socket.socket = self.request
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    return
                with owner.lock:
                    owner.received += len(data)
                sock.sendall(data)
        except OSError:
            return


class _TCPServer(socketserver.ThreadingTCPServer):
    request_queue_size = 1024  # load tests open 1,000 tunnels at once
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, owner: TcpEchoServer, addr: tuple[str, int]) -> None:
        self.owner = owner
        self.address_family = _family(addr[0])
        super().__init__(addr, _EchoTCPHandler)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, peer = super().get_request()
        with self.owner.lock:
            self.owner.connections += 1
            self.owner.peers.append(tuple(peer[:2]))
            self.owner.open_sockets.add(sock)
        return sock, peer

    def shutdown_request(self, request: Any) -> None:
        with self.owner.lock:
            self.owner.open_sockets.discard(request)
        super().shutdown_request(request)


class TcpEchoServer(ServedInThread):
    """Raw TCP echo server; counts accepted ``connections`` and ``received`` bytes, logs ``peers``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, name: str = "tcp-echo") -> None:
        self.host = host
        self.port = port
        self.name = name
        self.connections = 0
        self.received = 0
        self.peers: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        self.open_sockets: set[socket.socket] = set()
        self._server: socketserver.BaseServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    def _make_server(self) -> socketserver.BaseServer:
        return _TCPServer(self, (self.host, self.port))


class StallableEchoServer:
    """A TCP echo server that, once ``stall()`` is called (or from the start with ``stalled``), stops
    answering connects: later SYNs are dropped, so a client's connect times out.

    How: a listener with backlog 0 whose accept queue is filled by one connection of our own and never
    accepted; Linux then drops further SYNs silently. There is no other way inside a namespace without
    netfilter or a dummy device (neither is available here).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, stalled: bool = False) -> None:
        self.host = host
        self.connections = 0
        self._listener = socket.socket(_family(host), socket.SOCK_STREAM)
        self._listener.bind((host, port))
        self._listener.listen(0)
        self.port = int(self._listener.getsockname()[1])
        self._stalled = threading.Event()
        self._served: list[socket.socket] = []
        self._filler: socket.socket | None = None
        self._thread: threading.Thread | None = None
        if stalled:
            self.stall()
        else:
            self._thread = threading.Thread(target=self._accept, name="stallable-echo", daemon=True)
            self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    @property
    def url(self) -> str:
        return f"http://{_hostport(self.host, self.port)}"

    def _accept(self) -> None:
        while not self._stalled.is_set():
            ready, _, _ = select.select([self._listener], [], [], 0.02)
            if ready and not self._stalled.is_set():
                conn, _ = self._listener.accept()
                self.connections += 1
                self._served.append(conn)
                threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := conn.recv(65536):
                conn.sendall(data)

    def _stop_accepting(self) -> None:
        self._stalled.set()
        if self._thread is not None:
            self._thread.join()

    def stall(self) -> None:
        self._stop_accepting()
        self._filler = socket.create_connection(self.address, timeout=2)  # fills the queue

    def close(self) -> None:
        self._stop_accepting()
        for sock in [*self._served, self._filler, self._listener]:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes its echo thread
                sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RefusingPort:
    """A port on ``host`` that is bound but not listening: connecting gets ECONNREFUSED at once.

    Binding (without ``listen``) reserves the number so nothing else takes it during the test.
    """

    connections = 0  # nothing can ever be accepted

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._sock = socket.socket(_family(host), socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self.port = int(self._sock.getsockname()[1])

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    @property
    def url(self) -> str:
        return f"http://{_hostport(self.host, self.port)}"

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StallingPort(StallableEchoServer):
    """A port whose TCP handshake never completes: connecting times out (for connect_timeout tests).
    It never accepts (``connections`` stays 0)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        super().__init__(host, stalled=True)
