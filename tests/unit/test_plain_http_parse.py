"""The lean plain-HTTP path's parsers: what it serves itself, what it hands to mitmproxy, and strict
chunked framing (every malformed body is an error, never a guess)."""

from __future__ import annotations

import pytest

from egressd.front.plain_http import ChunkedReader, ProtocolError, parse_request


def _head(first: str, *headers: str) -> bytes:
    return ("\r\n".join([first, *headers]) + "\r\n\r\n").encode("latin-1")


def test_simple_request_is_served() -> None:
    request = parse_request(_head("GET http://Up.Test:8080/a?b=1 HTTP/1.1", "Host: up.test:8080"))
    assert request is not None
    assert (request.method, request.host, request.port, request.path) == ("GET", "Up.Test", 8080, "/a?b=1")
    assert request.keep_alive and request.length == 0


def test_content_length_and_keep_alive_rules() -> None:
    post = parse_request(_head("POST http://h/ HTTP/1.0", "Host: h", "Content-Length: 12"))
    assert post is not None and post.length == 12 and not post.keep_alive
    kept = parse_request(_head("GET http://h/ HTTP/1.0", "Host: h", "Connection: keep-alive"))
    assert kept is not None and kept.keep_alive
    closed = parse_request(_head("GET http://h/ HTTP/1.1", "Host: h", "Connection: close"))
    assert closed is not None and not closed.keep_alive


@pytest.mark.parametrize(
    "head",
    [
        _head("POST http://h/ HTTP/1.1", "Host: h", "Transfer-Encoding: chunked"),
        _head("POST http://h/ HTTP/1.1", "Host: h", "Transfer-Encoding: chunked", "Content-Length: 3"),
        _head("POST http://h/ HTTP/1.1", "Host: h", "Content-Length: 3", "Content-Length: 3"),
        _head("POST http://h/ HTTP/1.1", "Host: h", "Content-Length: +3"),
        _head("POST http://h/ HTTP/1.1", "Host: h", "Expect: 100-continue"),
        _head("GET http://h/ HTTP/1.1", "Host: h", "Connection: Upgrade", "Upgrade: websocket"),
        _head("GET http://h/ HTTP/1.1", "Host: h", "Upgrade: h2c"),
        _head("GET http://h/ HTTP/1.1"),
        _head("GET http://h/ HTTP/1.1", "Host: h", "Host: h"),
        _head("GET http://h/ HTTP/1.1", "Host : h"),
        _head("GET /origin-form HTTP/1.1", "Host: h"),
        _head("GET https://h/ HTTP/1.1", "Host: h"),
        _head("CONNECT h:443 HTTP/1.1", "Host: h:443"),
        _head("TRACE http://h/ HTTP/1.1", "Host: h"),
        _head("get http://h/ HTTP/1.1", "Host: h"),
        _head("GET http://h/ HTTP/2.0", "Host: h"),
        _head("GET http://user@h/ HTTP/1.1", "Host: h"),
        _head("GET http://[::1]/ HTTP/1.1", "Host: [::1]"),
        _head("GET http://h%2e/ HTTP/1.1", "Host: h"),
        _head("GET http://h:0/ HTTP/1.1", "Host: h"),
        _head("GET http://h:99999/ HTTP/1.1", "Host: h"),
        _head("GET http://h HTTP/1.1", "Host: h"),
        _head("GET http://h/#frag HTTP/1.1", "Host: h"),
        _head("GET http://h/  HTTP/1.1", "Host: h"),
        _head("GET http://faß.test/ HTTP/1.1", "Host: h"),
        _head("GET http://h/ HTTP/1.1", "Host: h", "Proxy-Authorization: a", "Proxy-Authorization: b"),
    ],
)
def test_unusual_requests_go_to_mitmproxy(head: bytes) -> None:
    assert parse_request(head) is None


def _decode(reader: ChunkedReader, *parts: bytes) -> bytes:
    out = b""
    for part in parts:
        pieces, rest = reader.feed(part)
        assert rest == b""
        out += b"".join(pieces)
    return out


def test_chunked_body_byte_by_byte_with_extension_and_trailers() -> None:
    body = b"5;name=value\r\nhello\r\nA\r\n0123456789\r\n0\r\nX-T: 1\r\n\r\n"
    reader = ChunkedReader()
    assert _decode(reader, *[body[i : i + 1] for i in range(len(body))]) == b"hello0123456789"
    assert reader.done and bytes(reader.trailers) == b"X-T: 1\r\n"


def test_chunked_body_end_leaves_the_next_bytes() -> None:
    reader = ChunkedReader()
    pieces, rest = reader.feed(b"1\r\na\r\n0\r\n\r\nHTTP/1.1 200")
    assert pieces == [b"a"] and reader.done and rest == b"HTTP/1.1 200"


@pytest.mark.parametrize(
    "body",
    [
        b"5\r\nhelloXX",  # no CRLF after the data
        b"g\r\n",  # not hex
        b"\r\n",  # empty size
        b"-1\r\n",
        b"0x5\r\n",
        b"5\nhello\r\n",  # bare LF
        b"1" * 17 + b"\r\n",  # too long
        b"5;\x01\r\n",  # control character in an extension
        b"0\r\nbad trailer\r\n",
        b"0\r\n folded: x\r\n",
        b"1" * 5000,  # a size line without end
    ],
)
def test_malformed_chunked_bodies_are_errors(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        ChunkedReader().feed(body)
