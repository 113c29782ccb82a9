"""Table tests for the raw request-head check (request smuggling and oversized heads)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.wire.http_head import (
    MAX_HEAD,
    HeadScanner,
    checked_head_problem,
    head_problem,
    leading_empty_lines,
    starts_like_request,
)

OK = [
    b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n",
    b"\r\nGET / HTTP/1.1\r\nHost: a.test\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a.test\r\nX-Tab: a\tb\r\n\r\nbody\x00\n",  # the body is not the head
    b"GET / HTTP/1.1\r\nHost: a.te",  # incomplete, so far fine
    b"CONNECT a.test:443 HTTP/1.1\r\nHost: a.test:443\r\n\r\n\x16\x03\x01",
]

BAD = [
    (b"GET / HTTP/1.1\nHost: a.test\n\n", 400, "bare LF"),
    (b"GET / HTTP/1.1\r\nHost: a.test\nX: 1\r\n\r\n", 400, "bare LF"),
    (b"GET / HTTP/1.1\r\nX-A: a\rTransfer-Encoding: chunked\r\n\r\n", 400, "bare CR"),
    (b"GET / HTTP/1.1\r\nX-A: a\r\n Transfer-Encoding: chunked\r\n\r\n", 400, "obs-fold"),
    (b"GET / HTTP/1.1\r\nX-A: a\r\n\tb\r\n\r\n", 400, "obs-fold"),
    (b"GET / HTTP/1.1\r\nX-A: a\x00b\r\n\r\n", 400, "control"),
    (b"GET /\x00 HTTP/1.1\r\nHost: a\r\n\r\n", 400, "control"),
    (b"GET / HTTP/1.1\r\nTransfer-Encoding: \x0bchunked\r\n\r\n", 400, "control"),
    (b"GET / HTTP/1.1\r\nHost: \x1ea.test\r\n\r\n", 400, "control"),
    (b"GET / HTTP/1.1\r\nX: \x7f\r\n\r\n", 400, "control"),
    (b"GET /" + b"a" * (MAX_HEAD + 10) + b" HTTP/1.1\r\n\r\n", 431, "longer"),
    (b"GET / HTTP/1.1\r\n" + b"X-A: b\r\n" * 20_000, 431, "longer"),
    (b"GET / HTTP/1.1\r\nX-A: a\x00", 400, "control"),  # refused before the head is complete
]


@pytest.mark.parametrize("head", OK)
def test_fine_heads(head: bytes) -> None:
    assert head_problem(head) is None


@pytest.mark.parametrize(("head", "status", "why"), BAD)
def test_refused_heads(head: bytes, status: int, why: str) -> None:
    problem = head_problem(head)
    assert problem is not None and problem[0] == status and why in problem[1]


# whole heads too: the one-pass match is for complete ones (an empty line ends them)
HEAD_PARTS = st.lists(
    st.sampled_from(
        [b"\r", b"\n", b"\r\n", b"\r\n\r\n", b"\n\n", b" ", b"\t", b"\x00", b"\x0b", b"\x7f"]
        + [b"a", b":", b"\x80"]
    ),
    max_size=40,
).map(b"".join)


@settings(max_examples=3000, deadline=None)
@given(data=HEAD_PARTS)
def test_the_one_pass_match_answers_as_the_checks_do(data: bytes) -> None:
    """head_problem's regex for a clean complete head must never pass what the checks refuse."""
    assert head_problem(data) == checked_head_problem(data, leading_empty_lines(data))


@pytest.mark.parametrize("data", [*OK, *(case[0] for case in BAD)])
def test_the_one_pass_match_answers_as_the_checks_do_on_the_table(data: bytes) -> None:
    assert head_problem(data) == checked_head_problem(data, leading_empty_lines(data))


def test_a_head_just_within_the_limit_passes_and_one_byte_more_does_not() -> None:
    line = b"GET / HTTP/1.1\r\n"
    fill = b"X: " + b"a" * (MAX_HEAD - len(line) - 2 - 5) + b"\r\n"
    head = line + fill + b"\r\n"
    assert len(head) == MAX_HEAD
    assert head_problem(head) is None
    longer = line + b"X: a" + fill[3:] + b"\r\n"
    assert head_problem(longer) == (431, f"request head longer than {MAX_HEAD} bytes")


@settings(max_examples=3000, deadline=None)
@given(data=HEAD_PARTS)
def test_the_scanners_one_pass_answers_as_its_reading_of_new_bytes_does(data: bytes) -> None:
    """HeadScanner's first look (the one-pass match) agrees with its byte-by-byte path."""
    scanner = HeadScanner()
    found = scanner.scan(data)
    slow = HeadScanner()
    slow.start = leading_empty_lines(data)
    assert found == slow.scan_on(data)


@settings(max_examples=500, deadline=None)
@given(data=HEAD_PARTS)
def test_a_head_fed_a_byte_at_a_time_is_answered_as_the_whole_head_is(data: bytes) -> None:
    """The scanner fed the growing buffer one byte at a time ends where one look at it all ends."""
    whole = HeadScanner().scan(data)
    scanner, buffer, found = HeadScanner(), bytearray(), None
    for byte in data:
        buffer.append(byte)
        found = scanner.scan(buffer)
        if found is not None:
            break
    if found is None or whole is None or whole[0] == 0:
        assert found == whole  # the same end of a clean head, or waiting for more in both
    else:
        assert found[0] != 0  # refused both ways (the first look may name another fault)


@pytest.mark.parametrize(
    ("data", "verdict"),
    [
        (b"", None),
        (b"GE", None),
        (b"GET / HTTP/1.1\r\n", True),
        (b"\r\n\r\nGET / HTTP/1.1\r\n", True),  # empty lines first (RFC 9112 2.2)
        (b"get /", True),  # methods are case-sensitive tokens; the decision reads this one as written
        (b"F48A0C2E /m HTTP/1.1\r\n", True),  # a digit first: still a method (mitmproxy guessed not)
        (b"egressd-secret-api-0123 /", True),  # a placeholder as the method: decided, then refused
        (b"%65%67 /m HTTP/1.1", True),  # '%' is a token character: read, refused by the decision
        (b"M" * 1024 + b" /", True),
        (b"M" * 1025 + b" /", False),
        (b"M" * 1025, False),
        (b"SSH-2.0-OpenSSH_9.6\r\n", False),
        (b"\x16\x03\x01\x02\x00", False),
        (b"GET\t/ HTTP/1.1\r\n", False),
        (b"\r\n" * 33 + b"GET / HTTP/1.1", False),
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", True),  # read as HTTP/1, then refused by its parser
    ],
)
def test_what_starts_like_a_request(data: bytes, verdict: bool | None) -> None:
    assert starts_like_request(data) is verdict
