"""HTTP/1 for the proxy's two sides, sans-I/O, framed by h11 and guarded by egressd's strict head check.

Why h11 and not a parser of our own: two parsers that disagree about where a message ends are a
smuggling hole, and h11 is the one state machine mitmproxy uses too. Why a guard in front of it: h11
accepts bare LF, obs-fold and other spellings an upstream may read otherwise, and has no opinion on
duplicate Content-Length lines or CL+TE; `egressd.wire.http_head.head_problem` sees every head's raw
bytes before h11 does, and the checks below refuse what a proxy must not forward.

`ClientSide` reads the child's requests (h11 server role, a fresh h11 connection per request, so the
bytes of a pipelined request are guarded like the first) and frames the responses sent to it.
`ServerSide` frames what goes upstream (origin-form, hop-by-hop headers removed, canonical Host)
and reads the upstream's responses (h11 client role). No I/O, no mitmproxy, no policy.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import h11

from egressd.policy.reasons import Reason
from egressd.wire.http_fields import (
    FRAMING,
    connection_problem,
    hop_by_hop_names,
    hostport,
    upgrade_protocols,
)
from egressd.wire.http_head import HeadScanner
from egressd.wire.refusal import EGRESSD_HEADERS

MAX_HEAD = 64 * 1024
_STAND_IN = b"Host: egressd.invalid\r\n"  # for h11 only, when a request has no single Host field
Headers = list[tuple[str, str]]
_AUTHORITY = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~%!$&'()*+,;=:[]")


class WireError(Exception):
    """A message egressd must not forward: answered with `status` (or the connection closes)."""

    def __init__(
        self,
        detail: str,
        status: int = 400,
        *,
        reason: Reason = Reason.BAD_REQUEST,
        head: RequestHead | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.status = status
        self.reason = reason  # egressd's reason code (egressd.policy.reasons)
        self.head = head  # the request, when its line could be read (for the audit record)


def _values(headers: Sequence[tuple[str, str]], name: str) -> list[str]:
    return [v for n, v in headers if n.lower() == name]


@dataclass(frozen=True)
class RequestHead:
    """One proxy request: the absolute-form target split once, the host exactly as written."""

    method: str
    scheme: str
    host: str  # as written (brackets of an IPv6 literal removed): the decision canonicalises it
    port: int
    path: str  # origin-form: what the decision and the upstream see
    version: str  # "1.1" or "1.0"
    headers: Headers

    def values(self, name: str) -> list[str]:
        return _values(self.headers, name)

    @property
    def connection(self) -> str:
        return ", ".join(self.values("connection"))

    @property
    def upgrade(self) -> bool:
        """A protocol upgrade: `Connection: upgrade` and an Upgrade header (admitted only as a
        WebSocket handshake, by the request rules)."""
        return upgrade_protocols(self.headers) is not None


@dataclass(frozen=True)
class ResponseHead:
    """A response head from upstream; interim (1xx) heads come before the final one."""

    status: int
    reason: str
    headers: Headers

    def values(self, name: str) -> list[str]:
        return _values(self.headers, name)


@dataclass(frozen=True)
class Body:
    data: bytes


@dataclass(frozen=True)
class End:
    """The message is complete (trailers of a chunked body, if any)."""

    trailers: Headers = field(default_factory=list)


@dataclass(frozen=True)
class Switched:
    """The upstream answered 101: from here the connection carries another protocol (`rest`)."""

    rest: bytes


Event = RequestHead | ResponseHead | Body | End | Switched


TEXT_ENCODING = "latin-1"  # field values and reason phrases as text: every byte kept as one character


def _text(headers: Iterable[tuple[bytes, bytes]]) -> Headers:
    return [(n.decode("ascii"), v.decode(TEXT_ENCODING)) for n, v in headers]


def _bytes(headers: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(n.encode("ascii"), v.encode(TEXT_ENCODING)) for n, v in headers]


def _raw_fields(head: bytes) -> list[tuple[bytes, bytes]]:
    """The field lines of a head that passed head_problem (CRLF only, no folds): for the checks h11
    cannot make because it merges fields (duplicate Content-Length)."""
    fields = []
    for line in head.split(b"\r\n")[1:]:
        if line:
            name, _, value = line.partition(b":")
            fields.append((name.lower(), value.strip(b" \t")))
    return fields


def _framing_problem(fields: list[tuple[bytes, bytes]]) -> str | None:
    """Why a request's framing fields may be read two ways (refused with 400), or None."""
    lengths = [v for n, v in fields if n == b"content-length"]
    codings = [v for n, v in fields if n == b"transfer-encoding"]
    if lengths and codings:
        return "both Content-Length and Transfer-Encoding"
    if len(lengths) > 1 or (lengths and not lengths[0].isdigit()):
        return f"invalid or repeated Content-Length {[v.decode('latin-1') for v in lengths]!r}"
    if codings and (len(codings) > 1 or codings[0].lower() != b"chunked"):
        return f"Transfer-Encoding must be exactly 'chunked', got {[v.decode('latin-1') for v in codings]!r}"
    connection = ", ".join(v.decode("latin-1") for n, v in fields if n == b"connection")
    return connection_problem(connection)


def split_target(target: str) -> tuple[str, str, int, str]:
    """(scheme, host as written, port, origin-form path) of an absolute-form http:// target."""
    scheme, sep, rest = target.partition("://")
    if not sep or not scheme.isalpha():
        raise WireError(f"a proxy request needs an absolute-form http:// target, got {target[:200]!r}")
    scheme = scheme.lower()
    if scheme != "http":
        raise WireError(f"only http:// targets are proxied as requests (use CONNECT), got {target[:200]!r}")
    cut = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    authority, path = rest[:cut], rest[cut:]
    if "#" in path:
        raise WireError("a fragment in the request target")
    if path.startswith("?"):  # legal, but lenient parsers read `http://evil?@good/` as good
        raise WireError(f"a query right after the authority, without a path: {target[:200]!r}")
    if not authority or not _AUTHORITY.issuperset(authority) or "@" in authority:
        raise WireError(f"malformed authority (userinfo or invalid characters) {authority[:200]!r}")
    port_text = ""
    if authority.startswith("["):
        end = authority.find("]")
        host, after = authority[1:end], authority[end + 1 :]
        if end < 0 or (after and not after.startswith(":")) or ":" not in host:
            raise WireError(
                f"malformed IP-literal authority (brackets hold an IPv6 address) {authority[:200]!r}"
            )
        port_text = after[1:] if after else ""
        has_port = bool(after)
    else:
        host, has_port, port_text = authority.partition(":")[0], ":" in authority, authority.partition(":")[2]
        if "[" in authority or "]" in authority or ":" in port_text:
            raise WireError(f"malformed authority {authority[:200]!r}")
    if has_port and (not port_text.isdigit() or len(port_text) > 5 or not 0 < int(port_text) < 65536):
        raise WireError(f"invalid port in {authority[:200]!r}")
    if not host:
        raise WireError(f"no host in {authority[:200]!r}")
    port = int(port_text) if has_port else 80
    return scheme, host, port, path if path.startswith("/") else "/" + path


def take_head(raw: bytearray, scanner: HeadScanner) -> bytes | None:
    """The complete, guarded head at the start of raw (removed from it, with the empty lines before
    it), or None while more bytes are needed; `scanner` has seen raw's earlier bytes (a fresh one
    for each head). Raises WireError for a head to refuse. CONNECT and plain HTTP read heads here."""
    found = scanner.scan(raw)
    if found is None:
        return None
    status, end = found
    if status:
        raise WireError(str(end), status)
    assert isinstance(end, int)
    head = bytes(raw[scanner.start : end])
    del raw[:end]
    return head


class _Reader:
    """Raw bytes in; every head is guarded before h11 sees it, body bytes go straight to h11."""

    def __init__(self) -> None:
        self.raw = bytearray()
        self.h11: h11.Connection | None = None
        self.in_head = True
        self.scanner: HeadScanner | None = None  # the head being read
        self.eof = False  # the peer ended its side
        self.fed_eof = False  # and h11 was told

    def _take_head(self) -> bytes | None:
        """The next complete, guarded head (removed from raw), or None when more bytes are needed."""
        if not self.raw:
            return None
        if self.scanner is None:
            self.scanner = HeadScanner()
        head = take_head(self.raw, self.scanner)
        if head is not None:
            self.scanner = None
        return head

    def _feed_body(self, conn: h11.Connection) -> None:
        """Between heads, bytes (and the end of input, once) go straight to h11."""
        if self.raw:
            conn.receive_data(bytes(self.raw))
            self.raw.clear()
        if self.eof and not self.fed_eof:
            self.fed_eof = True
            conn.receive_data(b"")

    def _pump(self, conn: h11.Connection) -> list[object]:
        events: list[object] = []
        while True:
            event = _next(conn)
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return events
            events.append(event)
            if isinstance(event, h11.ConnectionClosed):
                return events


def _next(conn: h11.Connection) -> object:
    try:
        return conn.next_event()
    except h11.RemoteProtocolError as exc:
        raise WireError(str(exc) or "HTTP/1 protocol error") from exc


class ClientSide(_Reader):
    """The child's side (h11 server role): requests in, responses out, one request at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.request: RequestHead | None = None
        self.done = False  # the current request was read completely
        self.chunked_out = False  # the response to the child is chunked (it may carry trailers)

    @property
    def buffered(self) -> int:
        """Bytes read but not parsed yet (pipelined requests wait here)."""
        return len(self.raw)

    def receive(self, data: bytes) -> list[Event]:
        """Bytes from the child → events of the current request (heads of later requests wait until
        next_request()). Raises WireError."""
        self.raw += data
        if self.done:
            return []
        out: list[Event] = []
        if self.in_head:
            head = self._take_head()
            if head is None:
                if self.eof and self.raw:
                    raise WireError("the connection ended inside a request head")
                return out
            out.append(self._head(head))
            self.in_head = False
        assert self.h11 is not None
        self._feed_body(self.h11)
        for event in self._pump(self.h11):
            if isinstance(event, h11.Data):
                out.append(Body(bytes(event.data)))
            elif isinstance(event, h11.EndOfMessage):
                out.append(End(_text(event.headers.raw_items())))
                self.done = True
                rest, _ = self.h11.trailing_data
                self.raw[:0] = rest  # the next request, guarded in its turn
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise WireError("the connection ended inside a request body")
        return out

    def receive_eof(self) -> list[Event]:
        self.eof = True
        if self.done or (self.in_head and not self.raw):
            return []
        return self.receive(b"")

    def _head(self, head: bytes) -> RequestHead:
        line = head.split(b"\r\n", 1)[0]
        if not line.isascii():
            raise WireError(f"non-ASCII bytes in the request line {ascii(line[:200].decode('latin-1'))}")
        fields = _raw_fields(head)
        problem = _framing_problem(fields)  # before h11, which merges repeated Content-Length fields
        hosts = sum(1 for n, _ in fields if n == b"host")
        # h11 insists on one Host field in HTTP/1.1 (RFC 9112 3.2, for origin servers); a proxy
        # request names its host in the target, and the upstream gets the canonical Host anyway
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        if hosts != 1:
            lines = [x for x in head[:-4].split(b"\r\n") if x.partition(b":")[0].lower() != b"host"]
            head = b"\r\n".join(lines) + b"\r\n" + _STAND_IN + b"\r\n"
        conn.receive_data(head)
        try:
            request = _next(conn)  # the events after the head (End of a bodiless request) come later
        except WireError as exc:
            raise WireError(problem or exc.detail) from exc
        if not isinstance(request, h11.Request):
            raise WireError(problem or "incomplete or malformed request head")
        self.h11 = conn
        method = request.method.decode("ascii")
        target = request.target.decode("ascii")
        if method == "CONNECT" or not target.lower().startswith(("http://", "https://", "ftp://")):
            form = "asterisk" if target == "*" else "origin" if target.startswith("/") else "authority"
            raise WireError(
                f"{form}-form target {target[:200]!r}: a proxy request needs an absolute-form URL"
            )
        scheme, host, port, path = split_target(target)
        headers = _text(request.headers.raw_items())
        if hosts != 1:
            headers = headers[:-1]  # the stand-in
        version = request.http_version.decode("ascii")
        if version not in ("1.1", "1.0"):
            raise WireError(f"HTTP/{version} is not HTTP/1.1 or HTTP/1.0")
        self.request = RequestHead(method, scheme, host, port, path, version, headers)
        if problem is not None:
            raise WireError(problem, head=self.request)
        if hosts > 1:
            raise WireError("more than one Host header", reason=Reason.HOST_MISMATCH, head=self.request)
        if len(_values(headers, "proxy-authorization")) > 1:
            raise WireError("more than one Proxy-Authorization header", head=self.request)
        return self.request

    # -- what the child is sent --------------------------------------------------------------------
    def interim(self, head: ResponseHead) -> bytes:
        """A 1xx response (100 Continue, 103 Early Hints; 101 ends HTTP on this connection)."""
        assert self.h11 is not None
        headers = _bytes(response_headers(head.headers, keep_upgrade=head.status == 101))
        return self.h11.send(
            h11.InformationalResponse(
                status_code=head.status, headers=headers, reason=head.reason.encode(TEXT_ENCODING)
            )
        )

    def response(self, head: ResponseHead) -> bytes:
        """The final response head; framing for this client is h11's (chunked for an unknown length
        to an HTTP/1.1 client, close-delimited to HTTP/1.0)."""
        assert self.h11 is not None
        headers = _bytes(response_headers(head.headers, keep_upgrade=False))
        request = self.request
        self.chunked_out = (
            self.h11.their_http_version == b"1.1"
            and not any(n.lower() == b"content-length" for n, _ in headers)
            and head.status not in (204, 304)
            and (request is None or request.method != "HEAD")
        )
        return (
            self.h11.send(
                h11.Response(
                    status_code=head.status, headers=headers, reason=head.reason.encode(TEXT_ENCODING)
                )
            )
            or b""
        )

    def body(self, data: bytes) -> bytes:
        assert self.h11 is not None
        return self.h11.send(h11.Data(data=data))

    def end(self, trailers: Headers) -> bytes:
        """The end of the response; trailers only where the framing carries them (chunked)."""
        assert self.h11 is not None
        keep = [(n, v) for n, v in trailers if n.lower() not in FRAMING] if self.chunked_out else []
        return self.h11.send(h11.EndOfMessage(headers=_bytes(keep))) or b""

    def next_request(self) -> bool:
        """After a complete exchange: True when the connection stays open for the next request (its
        bytes, already read, are parsed by the next receive())."""
        conn = self.h11
        keep = (
            conn is not None
            and self.done
            and conn.our_state is h11.DONE
            and conn.their_state is h11.DONE
            and not (self.eof and not self.raw)
        )
        self.h11, self.request, self.done, self.in_head = None, None, False, True
        return keep

    def trailing(self) -> bytes:
        """Bytes after the request that was answered 101: the first bytes of the new protocol."""
        rest, self.raw = bytes(self.raw), bytearray()
        return rest


def response_headers(headers: Headers, *, keep_upgrade: bool) -> Headers:
    """Response fields forwarded to the child: no hop-by-hop fields, no framing (h11 frames anew),
    and never egressd's own headers from upstream (a forged refusal)."""
    connection = ", ".join(_values(headers, "connection"))
    drop = set(hop_by_hop_names(connection, keep_upgrade=keep_upgrade)) | set(EGRESSD_HEADERS)
    drop.add("transfer-encoding")
    if not keep_upgrade:
        drop.add("connection")
    return [(n, v) for n, v in headers if n.lower() not in drop]


def upstream_headers(request: RequestHead, host: str, port: int, strip: set[str]) -> Headers:
    """What goes upstream: hop-by-hop and proxy fields removed, the Host field the canonical target,
    an upgrade kept only when asked for (request.upgrade: the request rules admitted it as a
    WebSocket handshake)."""
    upgrade = request.upgrade
    drop = set(hop_by_hop_names(request.connection, keep_upgrade=upgrade)) | {"connection"} | strip
    canonical = hostport(host, port)
    headers = [
        (n, canonical if n.lower() == "host" else v) for n, v in request.headers if n.lower() not in drop
    ]
    if not any(n.lower() == "host" for n, _ in headers):
        headers.insert(0, ("Host", canonical))
    if upgrade:
        headers.append(("Connection", "Upgrade"))
    return headers


class ServerSide(_Reader):
    """The upstream's side (h11 client role) of one pinned connection, reused for keep-alive."""

    def __init__(self) -> None:
        super().__init__()
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        self.in_head = False  # no response is expected before a request went out
        self.switched = False

    def request(self, request: RequestHead, headers: Headers) -> bytes:
        """The request head in origin-form (h11 writes HTTP/1.1 whatever the child spoke)."""
        assert self.h11 is not None
        self.in_head = True
        return (
            self.h11.send(h11.Request(method=request.method, target=request.path, headers=_bytes(headers)))
            or b""
        )

    def body(self, data: bytes) -> bytes:
        assert self.h11 is not None
        return self.h11.send(h11.Data(data=data)) or b"" if data else b""

    def end(self) -> bytes:
        assert self.h11 is not None
        return self.h11.send(h11.EndOfMessage()) or b""

    @property
    def sending(self) -> bool:
        """The request body is still going out."""
        return self.h11 is not None and self.h11.our_state is h11.SEND_BODY

    def receive(self, data: bytes) -> list[Event]:
        """Bytes from upstream → response events. Raises WireError (the upstream broke HTTP/1)."""
        assert self.h11 is not None
        self.raw += data
        out: list[Event] = []
        while not self.switched:
            if self.in_head:
                head = self._take_head()
                if head is None:
                    if self.eof:
                        raise WireError("the server closed the connection before the response ended", 502)
                    break
                self.h11.receive_data(head)
            else:
                self._feed_body(self.h11)
            for event in self._pump(self.h11):
                out += self._event(event)
            if not self.raw or self.switched:
                break
        return out

    def receive_eof(self) -> list[Event]:
        self.eof = True
        return self.receive(b"")

    def _event(self, event: object) -> list[Event]:
        assert self.h11 is not None
        if isinstance(event, h11.InformationalResponse):
            head = ResponseHead(
                event.status_code, event.reason.decode(TEXT_ENCODING), _text(event.headers.raw_items())
            )
            if event.status_code == 101:
                self.switched = True
                rest, _ = self.h11.trailing_data
                return [head, Switched(bytes(rest) + bytes(self.raw))]
            return [head]
        if isinstance(event, h11.Response):
            self.in_head = False
            return [
                ResponseHead(
                    event.status_code, event.reason.decode(TEXT_ENCODING), _text(event.headers.raw_items())
                )
            ]
        if isinstance(event, h11.Data):
            return [Body(bytes(event.data))]
        if isinstance(event, h11.EndOfMessage):
            return [End(_text(event.headers.raw_items()))]
        if isinstance(event, h11.ConnectionClosed):
            return []
        raise WireError(f"unexpected HTTP/1 event {type(event).__name__}", 502)

    def reusable(self) -> bool:
        """After a complete exchange: whether the connection can carry the next request (then it is
        reset for it); bytes the server sent unasked make it unusable."""
        conn = self.h11
        if conn is None or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
            return False
        if conn.trailing_data[0] or self.raw:
            return False
        conn.start_next_cycle()
        self.in_head = False
        return True


@dataclass(frozen=True)
class ConnectHead:
    """A CONNECT request: its authority split once (host as written) and its Proxy-Authorization."""

    host: str
    port: int
    authorization: str | None


def read_connect(head: bytes) -> ConnectHead:
    """One complete CONNECT head (the raw-head guard already passed it) read by h11. Raises WireError.

    A child sends the same head again and again (one client library, one registry, one token), and
    h11 reads it slowly next to the rest of a tunnel's set-up: the last heads read are remembered,
    by their exact bytes. Reading is a pure function of those bytes, so a remembered answer is the
    answer; a head that raises is read again each time; only short heads are kept (at most 256 of 2 KiB)."""
    if len(head) <= _REMEMBERED_HEAD:
        return _read_connect_remembered(head)
    return _read_connect(head)


def _read_connect(head: bytes) -> ConnectHead:
    line = head.split(b"\r\n", 1)[0]
    if not line.isascii():
        raise WireError(f"non-ASCII bytes in the CONNECT request line {ascii(line[:200].decode('latin-1'))}")
    fields = _raw_fields(head)
    if sum(1 for n, _ in fields if n == b"host") != 1:  # h11 insists on one Host field in HTTP/1.1
        lines = [x for x in head[:-4].split(b"\r\n") if x.partition(b":")[0].lower() != b"host"]
        head = b"\r\n".join(lines) + b"\r\n" + _STAND_IN + b"\r\n"
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    conn.receive_data(head)
    request = _next(conn)
    if (
        not isinstance(request, h11.Request)
        or request.method != b"CONNECT"
        or request.http_version not in (b"1.1", b"1.0")
    ):
        raise WireError(f"malformed CONNECT request line {line[:200].decode('latin-1')!r}")
    authority = request.target.decode("ascii")
    host, sep, port_text = authority.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or len(port_text) > 5 or not 0 < int(port_text) < 65536:
        raise WireError(f"CONNECT needs host:port, got {authority[:200]!r}")
    credentials = [v for n, v in _text(request.headers.raw_items()) if n.lower() == "proxy-authorization"]
    if len(credentials) > 1:
        raise WireError("more than one Proxy-Authorization header")
    return ConnectHead(host, int(port_text), credentials[0].strip() if credentials else None)


_REMEMBERED_HEAD = 2048
_read_connect_remembered = functools.lru_cache(maxsize=256)(_read_connect)
