"""egressd.wire.http1 against h11: every head is parsed once by egressd's grammar, and what egressd
forwards must frame exactly as it decided.

Properties (hypothesis, on heads built from the bytes that matter to framing and smuggling):
- the grammar is h11's: a start line or field line matches egressd's pattern iff it matches h11's;
- a request egressd reads is one h11 reads the same way (method, target, version, fields);
- the head egressd writes upstream, with the body re-framed, is read by h11 as exactly one request
  with the decided framing, the body egressd read, no hop-by-hop field and one canonical Host;
- a response egressd reads and writes to the child is read by h11 as exactly that response, that
  body and its end — and the connection stays open for h11 exactly when egressd keeps it.
"""

from __future__ import annotations

import re

import h11
from h11._abnf import header_field, request_line, status_line
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from egressd.wire.http1 import (
    _REQUEST_HEAD,
    _RESPONSE_HEAD,
    Body,
    ClientSide,
    End,
    RequestHead,
    ResponseHead,
    ServerSide,
    WireError,
    upstream_headers,
)
from egressd.wire.http_fields import HOP_BY_HOP

H11_REQUEST_LINE = re.compile(request_line.encode())
H11_STATUS_LINE = re.compile(status_line.encode())
H11_FIELD = re.compile(header_field.encode())

METHODS = ["GET", "POST", "HEAD", "PUT", "M-SEARCH", "get", "GE T", "GET/", ""]
TARGETS = ["http://up.test/a", "http://up.test:8080/x?y=1", "http://[::1]/", "http://up.test", "/origin"]
TARGETS += ["http://a b/", "*", "http://up.test/\xe9"]
VERSIONS = ["HTTP/1.1", "HTTP/1.0", "HTTP/1.2", "HTTP/2", "http/1.1", "HTTP/1.1 "]
NAMES = ["Host", "X-A", "Content-Length", "Transfer-Encoding", "Connection", "Upgrade", "Keep-Alive", "TE"]
NAMES += ["Proxy-Authorization", "Proxy-Connection", "content-length", "X-B", "Cookie", "Expect"] * 2
NAMES += ["X A", "X\xe9", "", "X(A)"]
VALUES = ["", "a", " a ", "a  b", "\ta\t", "5", "05", "0", "3", "5, 5", "chunked", "Chunked", "identity"]
VALUES += ["close", "keep-alive, X-A", "upgrade", "websocket", "caf\xe9", "\x85", "\xa0", "a,b", "x" * 30]
SEPARATORS = [":", ": ", ": ", ":\t", " :"]

LINE = st.builds(
    lambda n, s, v: f"{n}{s}{v}", st.sampled_from(NAMES), st.sampled_from(SEPARATORS), st.sampled_from(VALUES)
)


def _h11_fields(headers: h11._headers.Headers) -> list[tuple[str, str]]:
    return [(n.decode("latin-1"), v.decode("latin-1")) for n, v in headers.raw_items()]


# -- the grammar --------------------------------------------------------------------------------------
@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(METHODS), st.sampled_from(TARGETS), st.sampled_from(VERSIONS), st.lists(LINE, max_size=5)
)
def test_the_request_grammar_is_h11s(method: str, target: str, version: str, lines: list[str]) -> None:
    first = f"{method} {target} {version}"
    text = "".join(f"{line}\r\n" for line in [first, *lines]) + "\r\n"
    h11_says = H11_REQUEST_LINE.fullmatch(first.encode("latin-1")) is not None and all(
        H11_FIELD.fullmatch(line.encode("latin-1")) for line in lines
    )
    assert (_REQUEST_HEAD.fullmatch(text) is not None) == h11_says, text


STATUS_LINES = [
    "HTTP/1.1 200 OK",
    "HTTP/1.1 200",
    "HTTP/1.1 200 ",
    "HTTP/1.0 404 Not Found",
    "HTTP/1.1 20 OK",
]
STATUS_LINES += [
    "HTTP/1.1 2000 OK",
    "HTTP/1.1 200 caf\xe9 \t x",
    "http/1.1 200 OK",
    "HTTP/1.1  200 OK",
    "ICY 200 OK",
]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(STATUS_LINES), st.lists(LINE, max_size=5))
def test_the_response_grammar_is_h11s(first: str, lines: list[str]) -> None:
    text = "".join(f"{line}\r\n" for line in [first, *lines]) + "\r\n"
    h11_says = H11_STATUS_LINE.fullmatch(first.encode("latin-1")) is not None and all(
        H11_FIELD.fullmatch(line.encode("latin-1")) for line in lines
    )
    assert (_RESPONSE_HEAD.fullmatch(text) is not None) == h11_says, text


# -- requests -----------------------------------------------------------------------------------------
def _request(head: bytes) -> tuple[RequestHead, list[bytes]] | None:
    """What egressd reads of a request (its head and body pieces), or None when it refuses it."""
    side = ClientSide()
    try:
        events = side.receive(head)
        events += side.receive_eof()
    except WireError:
        return None
    assert isinstance(events[0], RequestHead) and isinstance(events[-1], End)
    return events[0], [e.data for e in events if isinstance(e, Body)]


def _h11_request(data: bytes) -> tuple[h11.Request, bytes, list[object]]:
    """h11 (the server role) reading data: the request, its body, and every later event."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    request = conn.next_event()
    assert isinstance(request, h11.Request), request
    body = b""
    while True:
        event = conn.next_event()
        if isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return request, body, [conn.next_event(), conn.trailing_data[0]]
        else:
            raise AssertionError(f"h11 read {event!r} inside the body")


BODY = st.binary(max_size=40)


@settings(max_examples=500, deadline=None)
@given(
    st.sampled_from(["GET", "POST", "PUT", "OPTIONS"]),
    st.sampled_from(TARGETS[:4]),
    st.sampled_from(["HTTP/1.1", "HTTP/1.0"]),
    st.lists(LINE, max_size=6),
    st.sampled_from(["none", "length", "chunked", "wrong-length"]),
    BODY,
    st.lists(st.integers(1, 9), max_size=4),
)
def test_a_request_is_forwarded_framed_as_decided(
    method: str, target: str, version: str, lines: list[str], framing: str, body: bytes, cuts: list[int]
) -> None:
    if framing in ("length", "wrong-length"):
        lines = [*lines, f"Content-Length: {len(body) + (framing == 'wrong-length')}"]
    elif framing == "chunked":
        lines = [*lines, "Transfer-Encoding: chunked"]
    head = "".join(f"{line}\r\n" for line in [f"{method} {target} {version}", *lines]) + "\r\n"
    sent = body
    if framing == "chunked":
        pieces, at = [], 0
        for cut in cuts:
            pieces.append(body[at : at + cut])
            at += cut
        pieces.append(body[at:])
        sent = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p) + b"0\r\n\r\n"
    elif framing == "none":
        sent = b""
    read = _request(head.encode("latin-1") + sent)
    if read is None:
        return
    request, pieces_read = read
    # h11 reads the child's head the same way (it needs one Host in HTTP/1.1; egressd writes its own)
    hosts = sum(1 for n, _ in request.headers if n.lower() == "host")
    if version == "HTTP/1.0" or hosts == 1:
        theirs, their_body, _ = _h11_request(head.encode("latin-1") + sent)
        assert theirs.method.decode() == request.method and _h11_fields(theirs.headers) == [
            (n, v if n.lower() != "transfer-encoding" else v.lower()) for n, v in request.headers
        ]
        assert their_body == b"".join(pieces_read)
    # what goes upstream: one request, the decided framing, the body read, nothing after it
    upstream = ServerSide()
    out = upstream.request(request, upstream_headers(request, "up.test", 80, set()))
    for piece in pieces_read:
        out += upstream.body(piece)
    out += upstream.end()
    forwarded, forwarded_body, after = _h11_request(out)
    # nothing follows the one request (after an upgrade's, h11 waits to see whether it switches)
    assert after == [h11.PAUSED if request.upgrade else h11.NEED_DATA, b""]
    assert forwarded.method.decode() == request.method and forwarded.target.decode() == request.path
    assert forwarded_body == b"".join(pieces_read)
    names = [n.decode().lower() for n, _ in forwarded.headers]
    assert names.count("host") == 1 and dict(forwarded.headers)[b"host"] == b"up.test"
    assert not set(names) & (set(HOP_BY_HOP) | {"connection"}) or request.upgrade
    framing_fields = ("content-length", "transfer-encoding")
    decided = {n.lower(): v.lower() for n, v in request.headers if n.lower() in framing_fields}
    assert {n.decode(): v.decode() for n, v in forwarded.headers if n.decode() in framing_fields} == decided


# -- responses ----------------------------------------------------------------------------------------
RESPONSE_LINES = st.lists(
    st.sampled_from(
        [
            "X-A: 1",
            "Connection: close",
            "Connection: keep-alive, X-A",
            "Keep-Alive: timeout=5",
            "Proxy-Status: forged",
            "X-Egressd-Reason: forged",
            "Upgrade: h2c",
            "Content-Type: text/plain",
            "X-B: caf\xe9",
        ]
    ),
    max_size=4,
)


@settings(max_examples=500, deadline=None)
@given(
    st.sampled_from(["GET", "HEAD", "POST"]),
    st.sampled_from(["1.1", "1.0"]),
    st.sampled_from([200, 204, 304, 404, 100, 103]),
    st.sampled_from(["HTTP/1.1", "HTTP/1.0"]),
    RESPONSE_LINES,
    st.sampled_from(["length", "listed-length", "chunked", "until-close", "length-and-chunked"]),
    BODY,
    st.integers(1, 12),
)
def test_a_response_reaches_the_child_framed_as_read(
    method: str,
    client_version: str,
    status: int,
    version: str,
    lines: list[str],
    framing: str,
    body: bytes,
    step: int,
) -> None:
    child = ClientSide()
    [request, _] = child.receive(f"{method} http://up.test/ HTTP/{client_version}\r\n\r\n".encode())
    assert isinstance(request, RequestHead)
    upstream = ServerSide()
    upstream.request(request, upstream_headers(request, "up.test", 80, set()))
    upstream.end()
    extra = {
        "length": [f"Content-Length: {len(body)}"],
        "listed-length": [f"Content-Length: {len(body)}, {len(body)}"],
        "chunked": ["Transfer-Encoding: chunked"],
        "until-close": [],
        "length-and-chunked": [f"Content-Length: {len(body)}", "Transfer-Encoding: chunked"],
    }[framing]
    reason = {200: "OK", 204: "No Content", 304: "Not Modified", 404: "Not Found"}.get(status, "Info")
    head = "".join(f"{x}\r\n" for x in [f"{version} {status} {reason}", *lines, *extra]) + "\r\n"
    payload = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if framing == "chunked" and body else body
    if framing == "chunked" and not body:
        payload = b"0\r\n\r\n"
    if method == "HEAD" or status in (204, 304):
        payload = b""  # what a server sends (bytes after a bodiless response are not reused)
    data = head.encode("latin-1") + payload
    events = []
    try:
        for at in range(0, len(data), step):
            events += upstream.receive(data[at : at + step])
        events += upstream.receive_eof()
    except WireError:
        assume(False)
        return
    heads = [e for e in events if isinstance(e, ResponseHead)]
    # after an interim head the bytes are the next head, not a body: a generated body that
    # happens to be a final head is that head, and there is no body of ours to compare
    assume(len(heads) == 1 and heads[0].status >= 200)
    final = heads[-1]
    assert framing != "length-and-chunked"  # refused: both framings
    read_body = b"".join(e.data for e in events if isinstance(e, Body))
    no_body = method == "HEAD" or final.status in (204, 304)
    assert read_body == (b"" if no_body else body)
    # what the child gets, read by h11 as the client of that request
    out = child.response(final)
    for e in events:
        if isinstance(e, Body):
            out += child.body(e.data)
    out += child.end(next(e.trailers for e in events if isinstance(e, End)))
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method=method, target="/", headers=[("Host", "up.test")]))
    client.send(h11.EndOfMessage())
    client.receive_data(out)
    kept = child.next_request()
    if not kept:
        client.receive_data(b"")  # the connection closes after a response that says so
    answer = client.next_event()
    assert isinstance(answer, h11.Response) and answer.status_code == final.status
    names = {n.lower() for n, _ in answer.headers}
    assert not names & {b"keep-alive", b"proxy-status", b"x-egressd-reason", b"upgrade"}
    got = b""
    while True:
        event = client.next_event()
        if isinstance(event, h11.Data):
            got += event.data
            continue
        assert isinstance(event, h11.EndOfMessage), event
        break
    assert got == read_body
    assert (client.their_state is h11.DONE) == kept
    assert client.trailing_data[0] == b""  # nothing after the one response
    assert client.next_event() == (h11.NEED_DATA if kept else h11.ConnectionClosed())
