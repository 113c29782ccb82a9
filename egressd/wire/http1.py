"""HTTP/1 for the proxy's two sides, sans-I/O: every head parsed once, bodies framed by h11's readers.

Why this shape: two parsers that disagree about where a message ends are a smuggling hole. Every
head — the child's requests, the upstream's responses, CONNECT heads — first passes egressd's
strict raw-head guard (`egressd.wire.http_head`: CRLF lines only, no control bytes, no folds,
bounded), then ONE parse here by the grammar of RFC 9110/9112 as h11 spells it (`_REQUEST_HEAD`,
`_RESPONSE_HEAD`; tests hold them to h11's answers): the start line, the field lines, and the
framing they make (a Content-Length, chunked, nothing, or for a response the rest of the
connection). The checks below refuse what a proxy must not forward (CL+TE, a repeated or listed
Content-Length, a Connection header naming a framing field). What egressd forwards is written from
those checked fields, minus the hop-by-hop ones, and checked against the same grammar before it
goes out. A Content-Length body is counted here; chunked and close-delimited bodies are read by
h11's own body readers (the framing code of its connection, without a second parse of the head).

`ClientSide` reads the child's requests (one at a time, a pipelined one guarded in its turn) and
frames the responses sent to it as h11's server role would (chunked for an unknown length to an
HTTP/1.1 client, close-delimited to HTTP/1.0). `ServerSide` writes what goes upstream
(origin-form, hop-by-hop fields removed, the canonical Host) and reads the upstream's responses.
No I/O, no mitmproxy, no policy.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import h11
from h11._readers import ChunkedReader, Http10Reader
from h11._receivebuffer import ReceiveBuffer

from egressd.policy.ports import port_number
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
from egressd.wire.remembered import REMEMBERED_HEAD, HeadMemory

MAX_HEAD = 64 * 1024
Headers = list[tuple[str, str]]
TEXT_ENCODING = "latin-1"  # heads as text: every byte kept as one character
_AUTHORITY = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~%!$&'()*+,;=:[]")

# The grammar (RFC 9110 5.5, RFC 9112 3, 4, 5) exactly as h11 spells it (h11/_abnf.py), on a head
# decoded as latin-1: a field value's characters are any byte but NUL and the six ASCII spaces
# (h11's bytes `\s`), obs-text included.
_TOKEN = r"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"
_FIELD_CHAR = r"[^\x00\t\n\x0b\x0c\r ]"
_FIELD_LINE = rf"{_TOKEN}:[ \t]*(?:{_FIELD_CHAR}+(?:[ \t]+{_FIELD_CHAR}+)*)?[ \t]*\r\n"
_VERSION = r"HTTP/([0-9]\.[0-9])"
_REQUEST_LINE = rf"({_TOKEN}) ([\x21-\x7e]+) {_VERSION}"
_STATUS_LINE = rf"{_VERSION} ([0-9]{{3}})(?: ((?:[ \t]|{_FIELD_CHAR})*))?"
_REQUEST_HEAD = re.compile(rf"{_REQUEST_LINE}\r\n(?:{_FIELD_LINE})*\r\n")
_RESPONSE_HEAD = re.compile(rf"{_STATUS_LINE}\r\n(?:{_FIELD_LINE})*\r\n")
_FIELD_LINES = re.compile(rf"(?:{_FIELD_LINE})*\r\n")
_ONE_FIELD = re.compile(_FIELD_LINE)
_LENGTH = re.compile(r"[0-9]{1,20}")  # h11's Content-Length: digits, at most 20


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


def _text(headers: Iterable[tuple[bytes, bytes]]) -> Headers:
    return [(n.decode("ascii"), v.decode(TEXT_ENCODING)) for n, v in headers]


def _fields(lines: list[str]) -> Headers:
    """The fields of a head's field lines (the grammar matched them): names as written, values
    without the whitespace around them."""
    out = []
    for line in lines:
        name, _, value = line.partition(":")
        out.append((name, value.strip(" \t")))
    return out


def _grammar_problem(text: str, start_line: re.Pattern[str], what: str) -> str:
    """Why a head the guard passed does not parse (the first line that breaks the grammar)."""
    lines = text[:-4].split("\r\n")
    if start_line.fullmatch(lines[0]) is None:
        return f"illegal {what} line: {lines[0][:200]!r}"
    for line in lines[1:]:
        if _ONE_FIELD.fullmatch(line + "\r\n") is None:
            return f"illegal header line: {line[:200]!r}"
    return f"malformed {what} head"


_REQUEST_LINE_RE = re.compile(_REQUEST_LINE)
_STATUS_LINE_RE = re.compile(_STATUS_LINE)


def _framing_problem(fields: Headers) -> str | None:
    """Why a request's framing fields may be read two ways (refused with 400), or None."""
    lengths = [v for n, v in fields if n.lower() == "content-length"]
    codings = [v for n, v in fields if n.lower() == "transfer-encoding"]
    if lengths and codings:
        return "both Content-Length and Transfer-Encoding"
    if len(lengths) > 1 or (lengths and _LENGTH.fullmatch(lengths[0]) is None):
        return f"invalid or repeated Content-Length {lengths!r}"
    if codings and (len(codings) > 1 or codings[0].lower() != "chunked"):
        return f"Transfer-Encoding must be exactly 'chunked', got {codings!r}"
    return connection_problem(", ".join(v for n, v in fields if n.lower() == "connection"))


def _response_length(fields: Headers) -> tuple[int | None, bool]:
    """(Content-Length, chunked) of a response, as h11 reads them: a list of equal lengths is one
    length; lengths that differ, an unknown coding or both framings are a broken response."""
    length: str | None = None
    chunked = False
    for name, value in fields:
        lower = name.lower()
        if lower == "content-length":
            lengths = {v.strip() for v in value.split(",")}
            one = lengths.pop() if len(lengths) == 1 else ""
            if _LENGTH.fullmatch(one) is None or (length is not None and one != length):
                raise WireError(f"conflicting or invalid Content-Length {value[:200]!r}", 502)
            length = one
        elif lower == "transfer-encoding":
            if chunked or value.lower() != "chunked":
                raise WireError(f"Transfer-Encoding must be exactly 'chunked', got {value[:200]!r}", 502)
            chunked = True
    if chunked and length is not None:
        raise WireError("both Content-Length and Transfer-Encoding in a response", 502)
    return (int(length) if length is not None else None), chunked


def _closes(version: str, fields: Headers) -> bool:
    """Whether a message ends its connection (HTTP/1.0, or `close` in its Connection field)."""
    if version != "1.1":
        return True
    for name, value in fields:
        if name.lower() == "connection" and "close" in {t.strip().lower() for t in value.split(",")}:
            return True
    return False


def _head_text(start: str, fields: Iterable[tuple[str, str]], grammar: re.Pattern[str]) -> bytes:
    """A head egressd writes (the Host field first, as h11 writes it), checked against the grammar
    it was read by: a value egressd put in (a secret's) can never add a line."""
    host = [f"{n}: {v}\r\n" for n, v in fields if n.lower() == "host"]
    rest = [f"{n}: {v}\r\n" for n, v in fields if n.lower() != "host"]
    text = "".join([start, "\r\n", *host, *rest, "\r\n"])
    if grammar.fullmatch(text) is None:
        raise ValueError(f"egressd would write a head that is not HTTP/1: {text[:200]!r}")
    return text.encode(TEXT_ENCODING)


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
    port = port_number(port_text) if has_port else 80
    if port is None:
        raise WireError(f"invalid port in {authority[:200]!r}")
    if not host:
        raise WireError(f"no host in {authority[:200]!r}")
    return scheme, host, port, path if path.startswith("/") else "/" + path


def take_head(raw: bytearray, scanner: HeadScanner) -> bytes | None:
    """The complete, guarded head at the start of raw (removed from it, with the empty lines before
    it), or None while more bytes are needed; `scanner` has seen raw's earlier bytes (a fresh one
    for each head). Raises WireError for a head to refuse. CONNECT and plain HTTP read heads here."""
    first = scanner.searched == 0 and scanner.start == 0
    if first:
        cut = raw.find(b"\r\n\r\n", 0, REMEMBERED_HEAD) + 4
        if cut > 3 and (head := bytes(raw[:cut])) in _clean_heads:
            del raw[:cut]
            return head
    found = scanner.scan(raw)
    if found is None:
        return None
    status, end = found
    if status:
        raise WireError(str(end), status)
    assert isinstance(end, int)
    head = bytes(raw[scanner.start : end])
    if first and scanner.start == 0:
        _clean_heads.keep(head, None)
    del raw[:end]
    return head


# The complete heads the guard passed at the start of the first bytes read for a head (a child
# sends the same head again and again, a server answers with the same head): the guard is a pure
# function of a head's bytes up to its first empty line, which is where it ends, so the same bytes
# again, whatever follows them (a body), pass without its scan. A head that is refused, or arrives
# in pieces, is scanned each time.
_clean_heads: HeadMemory[None] = HeadMemory()


# -- bodies -------------------------------------------------------------------------------------------
_NO_TRAILERS = End([])  # shared: nobody changes an event


class _Counted:
    """A Content-Length body: counted here (the parsed head said how long)."""

    __slots__ = ("left",)

    def __init__(self, length: int) -> None:
        self.left = length

    def read(self, raw: bytearray, eof: bool) -> tuple[list[Event], bool]:
        """(events, whether the body ended) from raw (what is read is removed from it)."""
        out: list[Event] = []
        if self.left and raw:
            take = min(self.left, len(raw))
            out.append(Body(bytes(raw[:take])))
            del raw[:take]
            self.left -= take
        if not self.left:
            out.append(_NO_TRAILERS)
            return out, True
        if eof:
            raise WireError("the connection ended inside a message body")
        return out, False


class _Framed:
    """A chunked or close-delimited body, read by h11's body readers (ChunkedReader, Http10Reader):
    h11's own framing, fed the body's bytes only (the head was parsed once, above)."""

    __slots__ = ("buffer", "reader")

    def __init__(self, reader: ChunkedReader | Http10Reader) -> None:
        self.reader = reader
        self.buffer = ReceiveBuffer()

    def read(self, raw: bytearray, eof: bool) -> tuple[list[Event], bool]:
        if raw:
            self.buffer += raw
            raw.clear()
        out: list[Event] = []
        while True:
            try:
                event = self.reader(self.buffer)
                if event is None and eof and not self.buffer:
                    event = self.reader.read_eof()
            except h11.ProtocolError as exc:
                raise WireError(str(exc) or "HTTP/1 protocol error") from exc
            if isinstance(event, h11.Data):
                out.append(Body(bytes(event.data)))
            elif isinstance(event, h11.EndOfMessage):
                out.append(End(_text(event.headers.raw_items())) if event.headers else _NO_TRAILERS)
                raw += bytes(self.buffer)  # what follows the body (a pipelined request)
                return out, True
            elif eof:
                raise WireError("the connection ended inside a message body")
            elif len(self.buffer) > MAX_HEAD:  # a chunk line or trailers without end (h11's bound)
                raise WireError(f"a chunk header or trailers longer than {MAX_HEAD} bytes", 431)
            else:
                return out, False


Reader = _Counted | _Framed


class _Side:
    """Raw bytes in; every head is guarded and parsed once, body bytes go to the body's reader."""

    def __init__(self) -> None:
        self.raw = bytearray()
        self.in_head = True
        self.scanner: HeadScanner | None = None  # the head being read
        self.reader: Reader | None = None  # the body being read
        self.eof = False  # the peer ended its side
        self.fed_eof = False  # and the reader was told

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

    def _body(self, out: list[Event]) -> bool:
        """Events of the body being read into out; True when it ended."""
        assert self.reader is not None
        self.fed_eof = self.eof
        events, ended = self.reader.read(self.raw, self.eof)
        out += events
        if ended:
            self.reader = None
        return ended


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data) if data else b""


def _last_chunk(trailers: Headers) -> bytes:
    lines = "".join(f"{n}: {v}\r\n" for n, v in trailers)
    text = f"{lines}\r\n"
    if _FIELD_LINES.fullmatch(text) is None:
        raise ValueError(f"egressd would write trailers that are not HTTP/1: {text[:200]!r}")
    return b"0\r\n" + text.encode(TEXT_ENCODING)


def read_request(head: bytes) -> tuple[RequestHead, int | None, bool, bool]:
    """One complete request head (the raw-head guard already passed it), parsed: (the request, its
    Content-Length, whether its body is chunked, whether the connection may carry another request
    after it). Raises WireError.

    A child sends the same head again and again on a kept-alive connection: the last heads read
    are remembered by their exact bytes (egressd.wire.remembered). Reading is a pure
    function of those bytes and what it returns is never changed, so a remembered answer is the
    answer; a head that raises is read again each time; only short heads are kept."""
    read = _read_requests.get(head)
    if read is None:
        read = _read_requests.keep(head, _read_request(head))
    return read


def _read_request(head: bytes) -> tuple[RequestHead, int | None, bool, bool]:
    line = head[: head.find(b"\r\n")]
    if not line.isascii():
        raise WireError(f"non-ASCII bytes in the request line {ascii(line[:200].decode('latin-1'))}")
    text = head.decode(TEXT_ENCODING)
    lines = text[:-4].split("\r\n")
    fields = _fields(lines[1:])
    problem = _framing_problem(fields)
    parsed = _REQUEST_HEAD.fullmatch(text)
    if parsed is None:
        raise WireError(problem or _grammar_problem(text, _REQUEST_LINE_RE, "request"))
    method, target, version = parsed.groups()
    if method == "CONNECT" or not target.lower().startswith(("http://", "https://", "ftp://")):
        form = "asterisk" if target == "*" else "origin" if target.startswith("/") else "authority"
        raise WireError(f"{form}-form target {target[:200]!r}: a proxy request needs an absolute-form URL")
    scheme, host, port, path = split_target(target)
    if version not in ("1.1", "1.0"):
        raise WireError(f"HTTP/{version} is not HTTP/1.1 or HTTP/1.0")
    request = RequestHead(method, scheme, host, port, path, version, fields)
    if problem is not None:
        raise WireError(problem, head=request)
    hosts = proxy_authorizations = 0
    length: str | None = None
    chunked = False
    for name, value in fields:
        lower = name.lower()
        if lower == "host":
            hosts += 1
        elif lower == "proxy-authorization":
            proxy_authorizations += 1
        elif lower == "content-length":
            length = value
        elif lower == "transfer-encoding":
            chunked = True
    if hosts > 1:
        raise WireError("more than one Host header", reason=Reason.HOST_MISMATCH, head=request)
    if proxy_authorizations > 1:
        raise WireError("more than one Proxy-Authorization header", head=request)
    return request, int(length) if length is not None else None, chunked, not _closes(version, fields)


class ClientSide(_Side):
    """The child's side: requests in, responses out, one request at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.request: RequestHead | None = None
        self.done = False  # the current request was read completely
        self.answered = False  # ... and its response was sent completely
        self.keep_alive = True  # the connection may carry another request after this exchange
        self.chunked_out = False  # the response to the child is chunked (it may carry trailers)
        # what response() wrote last: (head, HEAD asked, version, keep-alive before, chunked, after, bytes)
        self.last_response: tuple[ResponseHead, bool, str, bool, bool, bool, bytes] | None = None

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
            request = self._head(head)
            out.append(request)
            self.in_head = False
        if self.reader is None:
            out.append(_NO_TRAILERS)
            self.done = True
            return out
        try:
            self.done = self._body(out)
        except WireError as exc:
            if not self.eof:
                raise
            raise WireError("the connection ended inside a request body") from exc
        return out

    def receive_eof(self) -> list[Event]:
        self.eof = True
        if self.done or (self.in_head and not self.raw):
            return []
        return self.receive(b"")

    def _head(self, head: bytes) -> RequestHead:
        try:
            request, length, chunked, keep_alive = read_request(head)
        except WireError as exc:
            if exc.head is not None:
                self.request = exc.head
            raise
        self.request = request
        if chunked:
            self.reader = _Framed(ChunkedReader())
        elif length:
            self.reader = _Counted(length)
        self.keep_alive = keep_alive
        return request

    # -- what the child is sent --------------------------------------------------------------------
    def interim(self, head: ResponseHead) -> bytes:
        """A 1xx response (100 Continue, 103 Early Hints; 101 ends HTTP on this connection)."""
        fields = response_headers(head.headers, keep_upgrade=head.status == 101)
        return _head_text(f"HTTP/1.1 {head.status} {head.reason}", fields, _RESPONSE_HEAD)

    def response(self, head: ResponseHead) -> bytes:
        """The final response head, framed for this client as h11's server role frames it: a
        Content-Length kept, an unknown length chunked to an HTTP/1.1 client and close-delimited to
        HTTP/1.0, `Connection: close` when this exchange ends the connection.

        The same head (read_response remembers it) framed for the same kind of request as the last
        one on this connection is written as that one was: the framing is a pure function of the
        head, the request's method and version and whether the connection was to stay open."""
        request = self.request
        head_only = request is not None and request.method == "HEAD"
        version = request.version if request is not None else "1.1"
        asked = (head, head_only, version, self.keep_alive)
        last = self.last_response
        if last is not None and last[0] is head and last[1:4] == asked[1:]:
            _, _, _, _, self.chunked_out, self.keep_alive, sent = last
            return sent
        sent = self._framed(head, head_only, version)
        self.last_response = (*asked, self.chunked_out, self.keep_alive, sent)
        return sent

    def _framed(self, head: ResponseHead, head_only: bool, version: str) -> bytes:
        fields = response_headers(head.headers, keep_upgrade=False)
        bodiless = head.status in (204, 304)
        length = any(n.lower() == "content-length" for n, _ in fields)
        close = not self.keep_alive
        self.chunked_out = False
        if not bodiless and not length:  # h11 frames HEAD's answer as GET's
            if version == "1.1":
                fields.append(("Transfer-Encoding", "chunked"))
                self.chunked_out = not head_only
            elif not head_only:
                close = True
        if close:
            self.keep_alive = False
            fields.append(("Connection", "close"))
        return _head_text(f"HTTP/1.1 {head.status} {head.reason}", fields, _RESPONSE_HEAD)

    def body(self, data: bytes) -> bytes:
        return _chunk(data) if self.chunked_out else data

    def end(self, trailers: Headers) -> bytes:
        """The end of the response; trailers only where the framing carries them (chunked)."""
        self.answered = True
        if not self.chunked_out:
            return b""
        return _last_chunk([(n, v) for n, v in trailers if n.lower() not in FRAMING])

    def next_request(self) -> bool:
        """After a complete exchange: True when the connection stays open for the next request (its
        bytes, already read, are parsed by the next receive())."""
        keep = self.done and self.answered and self.keep_alive and not (self.eof and not self.raw)
        self.request, self.done, self.answered, self.in_head, self.reader = None, False, False, True, None
        self.keep_alive = True
        return keep

    def trailing(self) -> bytes:
        """Bytes after the request that was answered 101: the first bytes of the new protocol."""
        rest, self.raw = bytes(self.raw), bytearray()
        return rest


def response_headers(headers: Headers, *, keep_upgrade: bool) -> Headers:
    """Response fields forwarded to the child: no hop-by-hop fields, no framing (egressd frames
    anew), and never egressd's own headers from upstream (a forged refusal)."""
    connection = ", ".join(_values(headers, "connection"))
    drop = set(hop_by_hop_names(connection, keep_upgrade=keep_upgrade)) | set(EGRESSD_HEADERS)
    drop.add("transfer-encoding")
    if not keep_upgrade:
        drop.add("connection")
    return [(n, v) for n, v in headers if n.lower() not in drop]


def upstream_headers(request: RequestHead, host: str, port: int, strip: AbstractSet[str]) -> Headers:
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


def read_response(head: bytes) -> tuple[ResponseHead, int | None, bool, bool]:
    """One complete response head (the raw-head guard already passed it), parsed: (the response,
    its Content-Length, whether its body is chunked, whether it ends the connection). Raises
    WireError.

    A server answers one request much as it answered the last: the last heads read are remembered
    by their exact bytes, as request heads are (egressd.wire.remembered)."""
    read = _read_responses.get(head)
    if read is None:
        read = _read_responses.keep(head, _read_response(head))
    return read


def _read_response(head: bytes) -> tuple[ResponseHead, int | None, bool, bool]:
    text = head.decode(TEXT_ENCODING)
    parsed = _RESPONSE_HEAD.fullmatch(text)
    if parsed is None:
        raise WireError(_grammar_problem(text, _STATUS_LINE_RE, "status"), 502)
    version, status_text, reason = parsed.groups()
    status = int(status_text)
    fields = _fields(text[:-4].split("\r\n")[1:])
    length, chunked = _response_length(fields)
    if status < 100:
        raise WireError(f"status {status_text} is not HTTP", 502)
    return ResponseHead(status, reason or "", fields), length, chunked, _closes(version, fields)


class ServerSide(_Side):
    """The upstream's side of one pinned connection, reused for keep-alive."""

    def __init__(self) -> None:
        super().__init__()
        self.in_head = False  # no response is expected before a request went out
        self.switched = False
        self.method = ""  # of the request the response answers (HEAD: no body)
        self.upgrade = False  # the request asked for an upgrade: a 101 may switch
        self.chunked = False  # the request's body goes out chunked
        self.sending = False  # the request's body is still going out
        self.complete = False  # the final response was read completely
        self.closes = False  # the response ends the connection
        # what request_to() wrote last: (head, host, port, strip, upgrade, chunked, sending, bytes)
        self.last_sent: tuple[RequestHead, str, int, AbstractSet[str], bool, bool, bool, bytes] | None = None

    def request(self, request: RequestHead, headers: Headers) -> bytes:
        """The request head in origin-form (HTTP/1.1 whatever the child spoke)."""
        self.in_head, self.complete, self.closes = True, False, False
        self.method = request.method
        self.upgrade = self.chunked = False
        length = "0"
        for name, value in headers:
            lower = name.lower()
            if lower == "upgrade":
                self.upgrade = True
            elif lower == "transfer-encoding":
                self.chunked = True
            elif lower == "content-length":
                length = value
        self.sending = self.chunked or length != "0"
        return _head_text(f"{request.method} {request.path} HTTP/1.1", headers, _REQUEST_HEAD)

    def request_to(self, request: RequestHead, host: str, port: int, strip: AbstractSet[str]) -> bytes:
        """The request head as it goes to host:port: request() of upstream_headers(). A kept-alive
        connection's next request is most often its last one again — the same head (read_request
        remembers it), target and fields stripped — and is written as that one was: both are pure
        functions of those, and neither a head nor its fields are ever changed."""
        last = self.last_sent
        if last is not None and last[0] is request and last[1:4] == (host, port, strip):
            self.in_head, self.complete, self.closes = True, False, False
            self.method = request.method
            _, _, _, _, self.upgrade, self.chunked, self.sending, sent = last
            return sent
        sent = self.request(request, upstream_headers(request, host, port, strip))
        self.last_sent = (request, host, port, strip, self.upgrade, self.chunked, self.sending, sent)
        return sent

    def body(self, data: bytes) -> bytes:
        return _chunk(data) if self.chunked else data

    def end(self) -> bytes:
        self.sending = False
        return b"0\r\n\r\n" if self.chunked else b""

    def receive(self, data: bytes) -> list[Event]:
        """Bytes from upstream → response events. Raises WireError (the upstream broke HTTP/1)."""
        if data and not (self.in_head or self.reader is not None or self.switched):
            raise WireError("the server sent bytes before it was asked anything", 502)
        self.raw += data
        out: list[Event] = []
        while not self.switched:
            if self.in_head:
                head = self._take_head()
                if head is None:
                    if self.eof:
                        raise WireError("the server closed the connection before the response ended", 502)
                    break
                self._response(head, out)
            elif self.reader is not None:
                if not self._body(out):
                    break
                self.complete = True
            else:
                break  # nothing asked: bytes wait here (the connection is not reused)
        return out

    def receive_eof(self) -> list[Event]:
        self.eof = True
        return self.receive(b"")

    def _response(self, head: bytes, out: list[Event]) -> None:
        response, length, chunked, closes = read_response(head)
        status = response.status
        if status == 101 and not self.upgrade:
            raise WireError("101 Switching Protocols to a request that asked for no upgrade", 502)
        out.append(response)
        if status < 200:
            if status == 101:
                self.switched = True
                rest, self.raw = bytes(self.raw), bytearray()
                out.append(Switched(rest))
            return
        self.in_head = False
        self.closes = closes
        if status in (204, 304) or self.method == "HEAD" or (length == 0 and not chunked):
            out.append(_NO_TRAILERS)
            self.complete = True
        elif chunked:
            self.reader = _Framed(ChunkedReader())
        elif length is not None:
            self.reader = _Counted(length)
        else:
            self.reader = _Framed(Http10Reader())
            self.closes = True

    def reusable(self) -> bool:
        """After a complete exchange: whether the connection can carry the next request (then it is
        reset for it); bytes the server sent unasked make it unusable."""
        if not self.complete or self.sending or self.closes or self.switched or self.raw or self.eof:
            return False
        self.in_head = self.complete = False
        return True


@dataclass(frozen=True)
class ConnectHead:
    """A CONNECT request: its authority split once (host as written) and its Proxy-Authorization."""

    host: str
    port: int
    authorization: str | None


def read_connect(head: bytes) -> ConnectHead:
    """One complete CONNECT head (the raw-head guard already passed it), parsed. Raises WireError.
    Read each time: the front remembers what it read from a head (egressd.front.tunnel)."""
    line = head[: head.find(b"\r\n")]
    if not line.isascii():
        raise WireError(f"non-ASCII bytes in the CONNECT request line {ascii(line[:200].decode('latin-1'))}")
    text = head.decode(TEXT_ENCODING)
    parsed = _REQUEST_HEAD.fullmatch(text)
    if parsed is None:
        raise WireError(_grammar_problem(text, _REQUEST_LINE_RE, "CONNECT request"))
    method, authority, version = parsed.groups()
    if method != "CONNECT" or version not in ("1.1", "1.0"):
        raise WireError(f"malformed CONNECT request line {line[:200].decode('latin-1')!r}")
    host, sep, port_text = authority.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    port = port_number(port_text)
    if not sep or not host or port is None:
        raise WireError(f"CONNECT needs host:port, got {authority[:200]!r}")
    credentials = [v for n, v in _fields(text[:-4].split("\r\n")[1:]) if n.lower() == "proxy-authorization"]
    if len(credentials) > 1:
        raise WireError("more than one Proxy-Authorization header")
    return ConnectHead(host, port, credentials[0].strip() if credentials else None)


# the request and response heads read, by their exact bytes (read_request, read_response)
_read_requests: HeadMemory[tuple[RequestHead, int | None, bool, bool]] = HeadMemory()
_read_responses: HeadMemory[tuple[ResponseHead, int | None, bool, bool]] = HeadMemory()
