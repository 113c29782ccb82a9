"""The lean plain-HTTP path: simple absolute-form HTTP/1.x proxy requests without mitmproxy.

mitmproxy costs ~1 ms of CPU per plain-HTTP request; most requests are simple (`GET http://h/p`,
one Host header, no body or a Content-Length body). Those are authenticated, limited, decided,
audited, stripped and forwarded here with the same rules as addons/policy_gate.py (shared through
egressd.admission.http_rules), over pinned upstream connections reused for keep-alive. Any request that
is not clearly simple is handed, at a request boundary and undecided, to the embedded mitmproxy, so
its addons decide it exactly as before. Responses are framed strictly (Content-Length, chunked,
close-delimited); anything ambiguous closes both sides rather than being forwarded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from egressd.admission.http_rules import FRAMING, hop_by_hop_names, hostport
from egressd.admission.pipeline import Admitted, Ask
from egressd.front.server import HIGH_WATER
from egressd.refusal import EGRESSD_HEADERS, Refusal
from egressd.wire.http_head import head_problem, leading_empty_lines

if TYPE_CHECKING:
    from egressd.front.server import FrontProtocol

logger = logging.getLogger(__name__)

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})
_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-")
_TCHAR = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_HEX = frozenset("0123456789abcdefABCDEF")
MAX_CHUNK_LINE = 4096
MAX_TRAILERS = 64 * 1024


class ProtocolError(Exception):
    """The upstream broke HTTP/1 framing: nothing more of this response is forwarded."""


@dataclass
class Request:
    """A simple absolute-form request head, split once."""

    method: str
    host: str  # as written in the request line: the decision canonicalises it
    port: int
    path: str
    version: str
    headers: list[tuple[str, str]]
    length: int  # request body bytes (Content-Length, or 0)
    keep_alive: bool
    connection: str

    def values(self, name: str) -> list[str]:
        return [v for n, v in self.headers if n.lower() == name]


def parse_request(head: bytes) -> Request | None:
    """The request when it is clearly simple; None: hand it to mitmproxy undecided."""
    try:
        text = head.decode("ascii").lstrip("\r\n")
    except UnicodeDecodeError:
        return None
    lines = text[:-4].split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        return None
    method, target, version = parts
    if method not in METHODS or version not in ("HTTP/1.1", "HTTP/1.0") or not target.startswith("http://"):
        return None
    authority, slash, rest = target[7:].partition("/")
    host, colon, port_text = authority.partition(":")
    if not slash or "#" in rest or not host or not _HOST_CHARS.issuperset(host):
        return None
    port = 80
    if colon:
        if not port_text.isdigit() or len(port_text) > 5 or not 0 < int(port_text) < 65536:
            return None
        port = int(port_text)
    headers = _split_headers(lines[1:])
    if headers is None:
        return None
    return _simple_request(method, host, port, "/" + rest, version, headers)


def _split_headers(lines: list[str]) -> list[tuple[str, str]] | None:
    headers = []
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not name or not _TCHAR.issuperset(name):
            return None
        headers.append((name, value.strip(" \t")))
    return headers


def _simple_request(
    method: str, host: str, port: int, path: str, version: str, headers: list[tuple[str, str]]
) -> Request | None:
    names = [n.lower() for n, _ in headers]
    if {"transfer-encoding", "expect", "upgrade"} & set(names) or names.count("host") != 1:
        return None
    if names.count("proxy-authorization") > 1 or names.count("content-length") > 1:
        return None
    connection = ", ".join(v for n, v in headers if n.lower() == "connection")
    tokens = {t.strip().lower() for t in connection.split(",")}
    if "upgrade" in tokens or FRAMING & tokens:  # mitmproxy's addon refuses those (connection_problem)
        return None
    length_text = next((v for n, v in headers if n.lower() == "content-length"), "0")
    if not length_text.isdigit() or len(length_text) > 18:
        return None
    keep_alive = "close" not in tokens and ("keep-alive" in tokens or version == "HTTP/1.1")
    return Request(method, host, port, path, version, headers, int(length_text), keep_alive, connection)


@dataclass
class Response:
    """A response head: status, version, headers, and how its body is framed."""

    status: int
    version: str
    reason: str
    headers: list[tuple[str, str]]

    def values(self, name: str) -> list[str]:
        return [v for n, v in self.headers if n.lower() == name]


def parse_response(head: bytes) -> Response:
    """A strict HTTP/1.x status line and header fields, or ProtocolError."""
    if head_problem(head) is not None:
        raise ProtocolError("malformed response head")
    lines = head.decode("latin-1")[:-4].split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if version not in ("HTTP/1.1", "HTTP/1.0") or len(code) != 3 or not code.isdigit():
        raise ProtocolError(f"malformed status line {lines[0][:100]!r}")
    headers = _split_headers(lines[1:])
    if headers is None:
        raise ProtocolError("malformed response header line")
    return Response(int(code), version, reason, headers)


class ChunkedReader:
    """A strict chunked-body parser: hands out the data, the trailer section, and when it ended."""

    def __init__(self) -> None:
        self.state = "size"
        self.remaining = 0
        self.buf = bytearray()
        self.trailers = bytearray()
        self.done = False

    def feed(self, data: bytes) -> tuple[list[bytes], bytes]:
        """Data pieces decoded from data, and the bytes after the body's end (the next message)."""
        self.buf += data
        out: list[bytes] = []
        while self.buf and not self.done:
            if self.state == "data":
                piece = bytes(self.buf[: self.remaining])
                del self.buf[: len(piece)]
                self.remaining -= len(piece)
                out.append(piece)
                if self.remaining == 0:
                    self.state = "crlf"
            elif not self._step():
                break
        rest = bytes(self.buf) if self.done else b""
        if self.done:
            self.buf.clear()
        return out, rest

    def _step(self) -> bool:
        """One size line, chunk end or trailer line; False when more bytes are needed."""
        if self.state == "crlf":
            if len(self.buf) < 2:
                return False
            if self.buf[:2] != b"\r\n":
                raise ProtocolError("chunk data not followed by CRLF")
            del self.buf[:2]
            self.state = "size"
            return True
        end = self.buf.find(b"\r\n")
        if end < 0:
            if len(self.buf) > MAX_CHUNK_LINE or b"\n" in self.buf:
                raise ProtocolError("malformed chunk line")
            return False
        line = bytes(self.buf[:end])
        del self.buf[: end + 2]
        if self.state == "size":
            self._size_line(line)
        else:
            self._trailer_line(line)
        return True

    def _size_line(self, line: bytes) -> None:
        size, _, extension = line.partition(b";")
        size = size.rstrip(b" \t")
        if not size or len(size) > 16 or not _HEX.issuperset(size.decode("latin-1")):
            raise ProtocolError(f"malformed chunk size {line[:40]!r}")
        if any(c < 0x20 and c != 0x09 or c == 0x7F for c in extension):
            raise ProtocolError("control character in a chunk extension")
        self.remaining = int(size, 16)
        self.state = "data" if self.remaining else "trailer"

    def _trailer_line(self, line: bytes) -> None:
        if line == b"":
            self.done = True
            return
        self.trailers += line + b"\r\n"
        if len(self.trailers) > MAX_TRAILERS or head_problem(line + b"\r\n\r\n") is not None:
            raise ProtocolError("malformed or oversized trailer section")
        if _split_headers([line.decode("latin-1")]) is None or line[:1] in (b" ", b"\t"):
            raise ProtocolError("malformed trailer line")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Upstream(asyncio.Protocol):
    """One pinned upstream connection: relays each response to the client, strictly framed."""

    def __init__(self, client: PlainClient, key: tuple[str, int]) -> None:
        self.client: PlainClient | None = client
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.server_id = ""
        self.buf = bytearray()
        self.phase = "idle"  # idle | head | empty | length | chunked | eof
        self.request: Request | None = None
        self.remaining = 0
        self.chunks: ChunkedReader | None = None
        self.framing = "none"  # none | length | chunked | eof
        self.rechunk = False  # the body goes out chunked (chunked upstream, or cut visibly)
        self.reusable = False
        self.seen = 0  # body bytes forwarded of this response (limits.max_response_bytes)
        self.started = False  # some of this response went to the client

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=HIGH_WATER)

    def send(self, request: Request, data: bytes) -> None:
        self.request, self.phase, self.started = request, "head", False
        assert self.transport is not None
        self.transport.write(data)

    def reuses(self, key: tuple[str, int], client: PlainClient) -> bool:
        """Kept alive, for the same pinned (host, port), and still open."""
        open_ = self.transport is not None and not self.transport.is_closing()
        return open_ and self.reusable and self.key == key and self.client is client

    def close(self) -> None:
        self.client = None
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is None:
            return
        client.count_down(len(data))
        try:
            self._on_bytes(client, data)
        except ProtocolError as exc:
            client.upstream_broke(self, str(exc))
        except Exception as exc:  # noqa: BLE001 - fail closed
            client.internal_error(exc)
        client.flush()

    def _on_bytes(self, client: PlainClient, data: bytes) -> None:
        if self.phase == "idle":
            raise ProtocolError("bytes from the server while no request was outstanding")
        if self.phase == "head":
            self.buf += data
            self._on_head(client)
        elif self.phase == "length":
            self._on_length(client, data)
        elif self.phase == "chunked":
            self._on_chunked(client, data)
        elif self.phase == "eof":
            self._emit(client, data)

    def _on_head(self, client: PlainClient) -> None:
        while self.phase == "head" and self.client is not None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if head_problem(bytes(self.buf)) is not None:
                    raise ProtocolError("malformed or oversized response head")
                return
            head = bytes(self.buf[: end + 4])
            del self.buf[: end + 4]
            self._on_response(client, parse_response(head))
        rest, self.buf = bytes(self.buf), bytearray()
        if self.client is None:
            return
        if self.phase == "empty":
            if rest:
                raise ProtocolError("bytes after a response without a body")
            self._finish(client)
        elif rest:
            self._on_bytes(client, rest)

    def _on_response(self, client: PlainClient, response: Response) -> None:
        request = self.request
        assert request is not None
        if 100 <= response.status < 200:
            if response.status == 101:
                raise ProtocolError("101 Switching Protocols without an upgrade request")
            self.started = True
            client.write(_response_head(response, response.headers))
            return  # an interim response: the final one follows
        framing, length = _framing(request, response)
        tokens = {t.strip().lower() for t in ", ".join(response.values("connection")).split(",")}
        self.reusable = (
            framing != "eof"
            and "close" not in tokens
            and (response.version == "HTTP/1.1" or "keep-alive" in tokens)
        )
        limit = client.limit
        if limit is not None and framing == "length" and length > limit:
            self.phase = "idle"
            client.too_large(self, length, limit)
            return
        headers = response.headers
        self.rechunk = framing == "chunked" or (framing == "eof" and limit is not None)
        if framing == "eof" and self.rechunk:
            headers = [*headers, ("Transfer-Encoding", "chunked")]
        self.started, self.seen = True, 0
        if 300 <= response.status < 400 and (location := response.values("location")):
            client.remember_redirect(location[0])
        client.write(_response_head(response, headers))
        self.framing, self.remaining = framing, length
        self.phase = "empty" if framing == "none" or (framing == "length" and length == 0) else framing
        self.chunks = ChunkedReader() if framing == "chunked" else None

    def _on_length(self, client: PlainClient, data: bytes) -> None:
        piece = data[: self.remaining]
        self.remaining -= len(piece)
        self._emit(client, piece)
        if self.remaining == 0 and self.client is not None:
            if len(data) > len(piece):
                raise ProtocolError("bytes after the response body")
            self._finish(client)

    def _on_chunked(self, client: PlainClient, data: bytes) -> None:
        assert self.chunks is not None
        pieces, rest = self.chunks.feed(data)
        for piece in pieces:
            if piece:
                self._emit(client, piece)
        if self.chunks.done and self.client is not None:
            if rest:
                raise ProtocolError("bytes after the response body")
            client.write(b"0\r\n" + bytes(self.chunks.trailers) + b"\r\n")
            self._finish(client)

    def _emit(self, client: PlainClient, data: bytes) -> None:
        """Body bytes to the client; past limits.max_response_bytes the response is cut."""
        if self.client is None:
            return  # already cut
        self.seen += len(data)
        limit = client.limit
        if limit is not None and self.seen > limit:
            client.cut(self, limit)
            return
        client.write(_chunk(data) if self.rechunk else data)

    def _finish(self, client: PlainClient) -> None:
        self.phase, self.request = "idle", None
        client.response_done(self)

    def connection_lost(self, exc: Exception | None) -> None:
        client = self.client
        self.client = None
        if client is None:
            return
        try:
            if self.phase == "eof":
                if self.rechunk:
                    client.write(b"0\r\n\r\n")
                self.reusable = False
                client.response_done(self)
            else:
                client.upstream_lost(self)
        except Exception as exc2:  # noqa: BLE001 - fail closed
            client.internal_error(exc2)
        client.flush()

    def pause_writing(self) -> None:
        if self.client is not None:
            self.client.pause_reading()

    def resume_writing(self) -> None:
        if self.client is not None:
            self.client.resume_reading()


def _framing(request: Request, response: Response) -> tuple[str, int]:
    """(none | length | chunked | eof, Content-Length) of a final response, strictly."""
    if request.method == "HEAD" or response.status in (204, 304):
        return "none", 0
    te = ", ".join(response.values("transfer-encoding"))
    lengths = response.values("content-length")
    if te:
        if lengths:
            raise ProtocolError("both Transfer-Encoding and Content-Length in the response")
        codings = [t.strip().lower() for t in te.split(",")]
        return ("chunked", 0) if codings[-1] == "chunked" else ("eof", 0)
    if lengths:
        if len(lengths) > 1 or not lengths[0].isdigit() or len(lengths[0]) > 18:
            raise ProtocolError(f"invalid Content-Length {lengths!r} in the response")
        return "length", int(lengths[0])
    return "eof", 0


LOST_MID_RESPONSE = "server closed the connection before the response ended"


def request_url(key: tuple[str, int], path: str) -> str:
    """The URL a request is remembered by (redirect memory), whichever path serves it."""
    return f"http://{hostport(*key)}{path}"


def broken_refusal(upstream: Upstream, why: str) -> Refusal | None:
    """Broken framing from upstream: egressd's 502 while nothing of the response went out, else
    None (then both sides close)."""
    logger.info("closing plain-HTTP exchange with %s:%s: %s", *upstream.key, why)
    if upstream.started:
        return None
    return Refusal("connect_error", f"HTTP/1 protocol error: {why}", *upstream.key)


def too_large_refusal(key: tuple[str, int], length: int, limit: int) -> Refusal:
    """egressd's 502 for a Content-Length over limits.max_response_bytes (before any body)."""
    detail = f"the response is {length} bytes; limits.max_response_bytes is {limit}"
    return Refusal("response_too_large", detail, *key)


def _response_head(response: Response, headers: list[tuple[str, str]]) -> bytes:
    """The head as the client gets it: egressd's own headers are never forwarded from upstream."""
    lines = [f"{response.version} {response.status} {response.reason}"]
    lines += [f"{n}: {v}" for n, v in headers if n.lower() not in EGRESSD_HEADERS]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class PlainClient(asyncio.Protocol):
    """The client side of the lean plain-HTTP path: one request at a time, in order."""

    def __init__(self, front: FrontProtocol, pending: bytes) -> None:
        assert front.state is not None and front.transport is not None
        self.front = front
        self.rt = front.rt
        self.state = front.state
        self.transport: asyncio.Transport = front.transport
        self.inbuf = bytearray(pending)
        self.state.bytes_up += len(pending)  # read before the lean path took over
        self.out: list[bytes] = []
        self.paused = False
        self.phase = "head"  # head | deciding | body | wait | closed | handoff
        self.request: Request | None = None
        self.upstream: Upstream | None = None
        self.to_send = 0
        self.requests = 0
        self.client_eof = False
        self.limit = self.rt.policies.get().limits.max_response_bytes
        self.url = ""
        self.last_active = time.monotonic()
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None

    # -- the client connection ---------------------------------------------------------------
    def start(self) -> None:
        limits = self.rt.policies.get().limits
        left = limits.header_timeout - (time.monotonic() - self.state.started)
        self.timer = asyncio.get_running_loop().call_later(max(0.0, left), self._watch)
        self._guarded(self._next)

    def _watch(self) -> None:
        """limits.header_timeout for the first head, limits.idle_timeout after it."""
        if self.phase in ("closed", "handoff"):
            return
        limits = self.rt.policies.get().limits
        now = time.monotonic()
        if self.requests == 0 and self.phase == "head":
            left = limits.header_timeout - (now - self.state.started)
            if left <= 0:
                self.rt.header_timeout(self.state, limits.header_timeout)
                self.close()
                return
        else:
            left = limits.idle_timeout - (now - self.last_active)
            if left <= 0:
                self.close()
                return
        self.timer = asyncio.get_running_loop().call_later(left, self._watch)

    def data_received(self, data: bytes) -> None:
        self.state.bytes_up += len(data)
        self.last_active = time.monotonic()
        if self.phase == "body":
            self._guarded(self._forward_body, data)
            return
        self.inbuf += data
        if self.phase == "head":
            self._guarded(self._next)
        elif len(self.inbuf) > HIGH_WATER:
            self.pause_reading()  # pipelined requests wait for the one in flight

    def eof_received(self) -> bool:
        self.client_eof = True
        # the answer to a request sent in full still goes out; then the connection closes
        return self.phase in ("deciding", "wait")

    def connection_lost(self, exc: Exception | None) -> None:
        if self.phase == "handoff":
            return
        self.phase = "closed"
        if self.timer is not None:
            self.timer.cancel()
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self._drop_upstream()
        self.front.finish()

    def pause_writing(self) -> None:
        """The client reads slowly: stop reading the response from upstream."""
        upstream = self.upstream.transport if self.upstream is not None else None
        if upstream is not None:
            upstream.pause_reading()

    def resume_writing(self) -> None:
        upstream = self.upstream.transport if self.upstream is not None else None
        if upstream is not None:
            upstream.resume_reading()

    def pause_reading(self) -> None:
        if not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        """Read again, unless pipelined requests already fill the buffer."""
        if self.paused and self.phase != "closed" and len(self.inbuf) <= HIGH_WATER:
            self.paused = False
            self.transport.resume_reading()

    def write(self, data: bytes) -> None:
        """Queued until flush(): one send per upstream read, not one per head and body piece."""
        self.out.append(data)

    def flush(self) -> None:
        if self.out:
            data = b"".join(self.out)
            self.out.clear()
            if not self.transport.is_closing():
                self.transport.write(data)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def count_down(self, n: int) -> None:
        self.state.bytes_down += n
        self.last_active = time.monotonic()

    # -- one request ---------------------------------------------------------------------------
    def _next(self) -> None:
        """Parse the next request head when it is complete; unusual ones go to mitmproxy."""
        if self.phase == "head":
            del self.inbuf[: leading_empty_lines(self.inbuf)]  # RFC 9112 2.2
        if self.phase != "head" or not self.inbuf:
            if self.phase == "head" and self.client_eof:
                self.close()
            return
        if head_problem(bytes(self.inbuf)) is not None:
            self._hand_off(b"")  # mitmproxy's head guard answers it with the same check
            return
        end = self.inbuf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.inbuf[: end + 4])
        request = parse_request(head)
        if request is None:
            self._hand_off(b"")
            return
        del self.inbuf[: end + 4]
        self.state.head_seen = True
        self.requests += 1
        self.phase = "deciding"
        self.task = asyncio.get_running_loop().create_task(self._admit_and_go(request))

    async def _admit_and_go(self, request: Request) -> None:
        try:
            admitted = await self._admit(request)
            if isinstance(admitted, Refusal):
                self._refuse(admitted)
            elif self.phase == "deciding":
                self._go(request, admitted)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - fail closed
            self.internal_error(exc)

    async def _admit(self, request: Request) -> Admitted | Refusal:
        """The request through the admission pipeline, as every front's requests go."""
        authorization = request.values("proxy-authorization")
        ask = Ask(
            "request",
            request.host,
            request.port,
            scheme="http",
            method=request.method,
            path=request.path,
            credentials=authorization[0] if authorization else None,
            headers=request.headers,
        )
        return await self.rt.admit(self.state, ask)

    def _go(self, request: Request, admitted: Admitted) -> None:
        key = (admitted.host, admitted.port)
        self.request = request
        self.url = request_url(key, request.path)
        head = self._outgoing_head(request, key)
        upstream = self.upstream
        if upstream is not None and upstream.reuses(key, self):
            self._send(upstream, request, head)
            return
        self._drop_upstream()
        self.task = asyncio.get_running_loop().create_task(self._open_and_send(admitted, key, request, head))

    def _outgoing_head(self, request: Request, key: tuple[str, int]) -> bytes:
        """Origin-form, canonical Host, no hop-by-hop headers, credentials stripped after a
        cross-origin redirect."""
        drop = set(hop_by_hop_names(request.connection, keep_upgrade=False))
        drop |= self._credentials_to_strip(request, key, drop)
        lines = [f"{request.method} {request.path} {request.version}"]
        for name, value in request.headers:
            lower = name.lower()
            if lower in drop:
                continue
            lines.append(f"{name}: {hostport(*key)}" if lower == "host" else f"{name}: {value}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")

    def _credentials_to_strip(self, request: Request, key: tuple[str, int], dropped: set[str]) -> set[str]:
        origin = self.rt.redirects.take(self.state.client_key, self.url)
        if origin is None:
            return set()
        present = {n.lower() for n, _ in request.headers} - dropped  # as after the hop-by-hop strip
        names = self.rt.policies.get().credentials.strip_on_host_change
        stripped = [name for name in names if name.lower() in present]
        self.rt.notice(
            self.state,
            "credentials_stripped",
            redirected_from=origin,
            host=key[0],
            port=key[1],
            stripped=stripped,
        )
        return {name.lower() for name in stripped}

    def remember_redirect(self, location: str) -> None:
        self.rt.redirects.remember(self.state.client_key, self.url, location)

    async def _open_and_send(
        self, admitted: Admitted, key: tuple[str, int], request: Request, head: bytes
    ) -> None:
        try:
            upstream = await self._open(admitted, key)
            if upstream is not None and self.phase == "deciding":
                self._send(upstream, request, head)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - fail closed
            self.internal_error(exc)

    async def _open(self, admitted: Admitted, key: tuple[str, int]) -> Upstream | None:
        """A new upstream connection to the addresses the pipeline pins for this request."""
        rt = self.rt
        upstream = Upstream(self, key)
        upstream.server_id = f"{self.state.conn_id}-up{self.requests}"
        refusal = await rt.connect(self.state, admitted, upstream, upstream.server_id)
        if refusal is not None:
            return self._refuse(refusal)
        if self.phase != "deciding":
            upstream.close()
            rt.disconnected(upstream.server_id)
            return None
        self.upstream = upstream
        return upstream

    def _send(self, upstream: Upstream, request: Request, head: bytes) -> None:
        body = bytes(self.inbuf[: request.length])
        del self.inbuf[: len(body)]
        self.to_send = request.length - len(body)
        upstream.send(request, head + body)
        if self.to_send:
            if self.client_eof:
                self.close()  # the body never comes: nothing half-sent stays open
                return
            self.phase = "body"
            self.resume_reading()
        else:
            self.phase = "wait"

    def _forward_body(self, data: bytes) -> None:
        piece = data[: self.to_send]
        self.to_send -= len(piece)
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.write(piece)
        if self.to_send == 0:
            self.inbuf += data[len(piece) :]
            self.phase = "wait"
            if len(self.inbuf) > HIGH_WATER:
                self.pause_reading()

    # -- the response ---------------------------------------------------------------------------
    def response_done(self, upstream: Upstream) -> None:
        """The response is complete: the next request is read (keep-alive) or the client closes."""
        request = self.request
        raw_eof = upstream.framing == "eof" and not upstream.rechunk  # only the close ends it
        keep = request is not None and request.keep_alive and self.phase == "wait" and not raw_eof
        if not upstream.reusable or not keep:
            self._drop_upstream()
        self.request = None
        if not keep or self.client_eof and not self.inbuf:
            self.phase = "closed-pending"
            self.close()
            return
        self.phase = "head"
        self.resume_reading()
        self._next()

    def too_large(self, upstream: Upstream, length: int, limit: int) -> None:
        """Content-Length over limits.max_response_bytes: egressd's 502 instead, before any body."""
        self._audit_cut(length, limit)
        self._drop_upstream()
        self._refuse(too_large_refusal(upstream.key, length, limit))

    def cut(self, upstream: Upstream, limit: int) -> None:
        """A response of unknown length passed the limit: close mid-body (a visible truncation)."""
        self._audit_cut(upstream.seen, limit)
        self._drop_upstream()
        self.close()

    def _audit_cut(self, seen: int, limit: int) -> None:
        request = self.request
        assert request is not None and self.state.host is not None and self.state.port is not None
        state = self.state
        where = {"host": state.host, "port": state.port, "path": request.path}
        self.rt.notice(state, "response_cut", **where, limit=limit, bytes=seen)

    def upstream_broke(self, upstream: Upstream, why: str) -> None:
        """Broken framing from upstream: a 502 when nothing was sent yet, else both sides close."""
        refusal = broken_refusal(upstream, why)
        self._drop_upstream()
        if refusal is None:
            self.close()
        else:
            self._refuse(refusal)

    def upstream_lost(self, upstream: Upstream) -> None:
        if upstream is not self.upstream:
            return
        self.rt.disconnected(upstream.server_id)
        self.upstream = None
        if upstream.phase == "idle":
            return  # a kept-alive connection the server closed: the next request opens another
        self.upstream_broke(upstream, LOST_MID_RESPONSE)

    def _drop_upstream(self) -> None:
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            self.rt.disconnected(upstream.server_id)
            upstream.close()

    # -- endings -------------------------------------------------------------------------------
    def _refuse(self, refusal: Refusal) -> None:
        self.flush()
        self.phase = "closed-pending"
        self._drop_upstream()
        self.front._refuse(refusal)

    def _hand_off(self, head: bytes) -> None:
        """Give the client, from this request on and undecided, to the embedded mitmproxy."""
        self._drop_upstream()
        if self.timer is not None:
            self.timer.cancel()
        self.phase = "handoff"
        pending, self.inbuf = head + bytes(self.inbuf), bytearray()
        self.front._plain_hand_off(pending)

    def internal_error(self, exc: BaseException) -> None:
        """A bug on the lean path refuses (never forwards) and is audited, like fail_closed."""
        refusal = self.rt.internal_error("plain_http", exc)
        started = self.upstream is not None and self.upstream.started
        self._drop_upstream()
        if started:
            self.close()
        else:
            self._refuse(refusal)

    def _guarded(self, step: Callable[..., None], *args: bytes) -> None:
        try:
            step(*args)
        except Exception as exc:  # noqa: BLE001 - fail closed
            self.internal_error(exc)
