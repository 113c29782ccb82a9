"""An upstream that answers with exactly the bytes a test scripts (plain or TLS), and records what it got.

Why: the attacks on what egressd forwards back to the child live in bytes no ordinary server writes on
request: a secret in the status line's reason phrase, in a `103 Early Hints` or in chunked trailers, a
value split across two writes, a `101` for a protocol nobody should relay. `RawUpstream.script` maps
each request to the pieces to send (bytes, or a float: a pause, so a piece arrives in a read of its
own). After a `101` the server keeps reading and records every byte the client sends through
(`Seen.after`), so a test can prove that no raw request reached it behind an upgrade.
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trustme

from tests.support.upstreams import CountingAccepts, ServedInThread

Script = list[bytes | float]


@dataclass
class Seen:
    """One request as it arrived: method and target as written, fields in order, the body de-chunked."""

    method: str
    target: str
    fields: list[tuple[str, str]]
    head: bytes
    body: bytes = b""
    after: bytes = b""  # what the client sent after a 101 (the upgraded connection)

    def header(self, name: str) -> str | None:
        values = [v for n, v in self.fields if n.lower() == name.lower()]
        return values[0] if values else None


class _Conn:
    """Buffered reads from one client socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def until(self, marker: bytes) -> bytes | None:
        while marker not in self.buf:
            if not self.fill():
                return None
        found, _, self.buf = self.buf.partition(marker)
        return found

    def exactly(self, n: int) -> bytes | None:
        while len(self.buf) < n:
            if not self.fill():
                return None
        found, self.buf = self.buf[:n], self.buf[n:]
        return found


def _read_request(conn: _Conn) -> Seen | None:
    head = conn.until(b"\r\n\r\n")
    if head is None:
        return None
    line, *lines = head.decode("latin-1").split("\r\n")
    method, target = (line.split(" ") + ["", ""])[:2]
    fields = [(n.strip(), v.strip()) for n, _, v in (x.partition(":") for x in lines)]
    seen = Seen(method, target, fields, head)
    if (seen.header("transfer-encoding") or "").lower() == "chunked":
        while (size_line := conn.until(b"\r\n")) is not None and size_line != b"0":
            chunk = conn.exactly(int(size_line.split(b";")[0], 16) + 2) or b""
            seen.body += chunk[:-2]
        if conn.buf.startswith(b"\r\n"):
            conn.exactly(2)
        else:  # trailer fields, then the empty line
            conn.until(b"\r\n\r\n")
    elif (length := seen.header("content-length")) and length.isdigit():
        seen.body = conn.exactly(int(length)) or b""
    return seen


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        owner = self.server.owner
        sock: socket.socket = self.request
        sock.settimeout(owner.read_timeout)
        conn = _Conn(sock)
        try:
            while (seen := _read_request(conn)) is not None:
                with owner.lock:
                    owner.seen.append(seen)
                switched = self._answer(sock, owner.script(seen))
                if switched:
                    seen.after = conn.buf
                    conn.buf = b""
                    while conn.fill():
                        seen.after += conn.buf
                        conn.buf = b""
                    return
                if (seen.header("connection") or "").lower() == "close":
                    return
        except (OSError, TypeError):
            return

    @staticmethod
    def _answer(sock: socket.socket, pieces: Script) -> bool:
        """Send the scripted pieces; True when they switched protocols (a final 101)."""
        switched = False
        for piece in pieces:
            if isinstance(piece, float):
                time.sleep(piece)
                continue
            sock.sendall(piece)
            switched = switched or piece.startswith(b"HTTP/1.1 101 ")
        return switched


class _Server(CountingAccepts, socketserver.ThreadingTCPServer):
    def __init__(self, owner: RawUpstream, addr: tuple[str, int]) -> None:
        self.owner = owner
        super().__init__(addr, _Handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        """TLS in the connection's own thread: a silent client holds up nobody else."""
        context = self.owner.ssl_context
        if context is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(self.owner.read_timeout)
        try:
            wrapped = context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return
        with self.owner.lock:
            self.owner.open_sockets.add(wrapped)
        try:
            super().finish_request(wrapped, client_address)
        finally:
            with contextlib.suppress(OSError):
                wrapped.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        return


class RawUpstream(ServedInThread):
    """HTTP/1.1 on `host`, TLS with a certificate for `hostnames` when `ca` is given; `script(seen)`
    answers each request. `seen` lists every request in arrival order."""

    def __init__(
        self,
        host: str,
        script: Callable[[Seen], Script],
        *,
        ca: trustme.CA | None = None,
        hostnames: list[str] | None = None,
        name: str = "raw-upstream",
        read_timeout: float = 10.0,
    ) -> None:
        self.host = host
        self.port = 0
        self.name = name
        self.script = script
        self.read_timeout = read_timeout
        self.connections = 0
        self.seen: list[Seen] = []
        self.lock = threading.Lock()
        self.open_sockets: set[socket.socket] = set()
        self.ssl_context: ssl.SSLContext | None = None
        if ca is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ca.issue_cert(*(hostnames or [host])).configure_cert(context)
            context.set_alpn_protocols(["http/1.1"])
            self.ssl_context = context
        self._server: socketserver.BaseServer | None = None
        self._thread: threading.Thread | None = None

    def _make_server(self) -> socketserver.BaseServer:
        return _Server(self, (self.host, 0))

    def requests(self) -> list[Seen]:
        with self.lock:
            return list(self.seen)
