"""The client side of a CONNECT (egressd.wire.connect_client): where the proxy's answer ends.

Every byte after a 200's head is the tunnel's and must reach the program; a refusal's text is for a
person and never tunnel bytes. Split reads, a 1xx first, a body without a length, garbage.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from egressd.wire.connect_client import MAX_BODY, AnswerError, ConnectClient

REFUSAL = (
    b"HTTP/1.1 403 Forbidden\r\nX-Egressd-Reason: not_allowlisted\r\nContent-Length: 11\r\n\r\nnot allowed"
)


def _feed(answer: bytes, cuts: list[int] | None = None, close: bool = False) -> ConnectClient:
    client = ConnectClient("git.test", 22)
    pieces, last = [], 0
    for cut in sorted(cuts or []):
        pieces.append(answer[last:cut])
        last = cut
    pieces.append(answer[last:])
    for piece in pieces:
        if piece and client.feed(piece):
            break
    if close and not client.done:
        client.feed(b"")
    return client


def test_the_request_names_the_target_and_the_credentials() -> None:
    assert ConnectClient("2001:db8::1", 22, "Basic eDp5").request == (
        b"CONNECT [2001:db8::1]:22 HTTP/1.1\r\nHost: [2001:db8::1]:22\r\n"
        b"Proxy-Authorization: Basic eDp5\r\n\r\n"
    )


@pytest.mark.parametrize(
    ("answer", "admitted", "tunnel"),
    [
        (b"HTTP/1.1 200 Connection established\r\n\r\n", True, b""),
        (b"HTTP/1.1 200 OK\r\n\r\nSSH-2.0-server\r\n", True, b"SSH-2.0-server\r\n"),  # the server spoke first
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\nx", True, b"x"),  # a 1xx is not the answer
        (b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\nhello", True, b"hello"),  # a 2xx has no body
        (b"HTTP/1.1 204 No Content\r\n\r\n", False, b""),  # only a 200 opens the tunnel
    ],
)
def test_after_a_2xx_every_byte_is_the_tunnels(answer: bytes, admitted: bool, tunnel: bytes) -> None:
    client = _feed(answer)
    assert client.done and client.admitted is admitted and client.tunnel == tunnel


def test_a_refusal_gives_its_status_reason_and_text() -> None:
    client = _feed(REFUSAL)
    assert client.done and not client.admitted and client.tunnel == b""
    assert client.refusal() == (
        "the proxy answered: HTTP/1.1 403 Forbidden (reason: not_allowlisted)\nnot allowed"
    )


def test_a_refusal_without_a_length_ends_at_the_close_and_its_text_is_bounded() -> None:
    client = _feed(b"HTTP/1.0 502 Bad Gateway\r\n\r\n" + b"x" * 10, close=True)
    assert client.done and bytes(client.body) == b"x" * 10
    cut = _feed(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 50\r\n\r\nonly this", close=True)
    assert cut.done and not cut.admitted and bytes(cut.body) == b"only this"
    long = _feed(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 100000\r\n\r\n" + b"y" * 100000)
    assert long.done and len(long.body) == MAX_BODY


@pytest.mark.parametrize(
    "answer",
    [
        b"SSH-2.0-OpenSSH_9.6\r\n\r\n",  # not a proxy at all
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nbad header\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70000,  # a head without end
    ],
)
def test_garbage_is_an_error_not_a_tunnel(answer: bytes) -> None:
    with pytest.raises(AnswerError):
        _feed(answer, close=True)


def test_a_proxy_that_closes_without_answering() -> None:
    client = ConnectClient("git.test", 22)
    assert not client.feed(b"HTTP/1.1 200")
    with pytest.raises(AnswerError, match="without answering"):
        client.feed(b"")


@given(st.lists(st.integers(min_value=1, max_value=len(REFUSAL) + 40), max_size=6))
def test_split_reads_change_nothing(cuts: list[int]) -> None:
    tunnel = b"HTTP/1.1 200 OK\r\nVia: egressd\r\n\r\nfirst bytes of the tunnel"
    head = tunnel.index(b"\r\n\r\n") + 4  # cut in the head: the tunnel's bytes arrive with its end
    assert _feed(tunnel, [c for c in cuts if c < head]).tunnel == b"first bytes of the tunnel"
    refused = _feed(REFUSAL, [c for c in cuts if c < len(REFUSAL)])
    assert refused.done and bytes(refused.body) == b"not allowed"
