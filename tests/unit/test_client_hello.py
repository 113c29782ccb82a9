"""egressd.wire.client_hello reads the SNI exactly as mitmproxy's parser does (both tunnel paths agree)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy.net.tls import starts_like_tls_record as mitm_starts_like_tls_record
from mitmproxy.proxy.layers.tls import parse_client_hello as mitm_parse_client_hello

from egressd.wire.client_hello import (
    MAX_CLIENT_HELLO,
    MAX_HELLO_RECORDS,
    Hello,
    HelloReader,
    parse_message,
    starts_like_tls_record,
)
from egressd.wire.sni import WAIT, TunnelStart
from tests.support.tls_hello import client_hello, records


def parse_client_hello(data: bytes) -> Hello | None:
    """The ClientHello at the start of data, read without the front's record limit (mitmproxy's
    reader has none); None if it is not complete yet.

    Raises ValueError for bytes that cannot be a ClientHello (as mitmproxy does).
    """
    return parse_message(HelloReader(limited=False).feed(data))


def outcome(parse: object, data: bytes) -> tuple[str, str | None]:
    """('incomplete', None), ('error', None) or ('hello', sni) — comparable across both parsers."""
    try:
        hello = parse(data)  # type: ignore[operator]
    except Exception:  # noqa: BLE001 - any failure counts as a failure of both
        return ("error", None)
    if hello is None:
        return ("incomplete", None)
    return ("hello", hello.sni)


HELLOS = {
    "name": client_hello("api.example.com"),
    "no sni": client_hello(None),
    "ip (no sni sent)": client_hello("192.0.2.1"),
    "underscore": client_hello("a_b.example.com"),
    "long": client_hello(".".join(["a" * 63] * 3)),
}


@pytest.mark.parametrize("name", sorted(HELLOS))
def test_real_client_hellos_give_the_same_sni(name: str) -> None:
    data = HELLOS[name]
    assert outcome(parse_client_hello, data) == outcome(mitm_parse_client_hello, data)


def test_the_sni_is_read() -> None:
    hello = parse_client_hello(HELLOS["name"])
    assert hello is not None and hello.sni == "api.example.com"
    no_sni = parse_client_hello(HELLOS["no sni"])
    assert no_sni is not None and no_sni.sni is None


@pytest.mark.parametrize("name", sorted(HELLOS))
def test_every_prefix_is_incomplete_for_both(name: str) -> None:
    data = HELLOS[name]
    for cut in range(0, len(data)):
        assert outcome(parse_client_hello, data[:cut]) == outcome(mitm_parse_client_hello, data[:cut])


@pytest.mark.parametrize(
    "sizes",
    [[1], [3], [4], [5, 7], [50, 1, 1], [100, 100]],
    ids=lambda s: "records of " + "+".join(map(str, s)),
)
def test_a_hello_split_across_records(sizes: list[int]) -> None:
    message = HELLOS["name"][5:]
    data = records(message, sizes)
    expected = ("hello", "api.example.com")
    assert outcome(parse_client_hello, data) == outcome(mitm_parse_client_hello, data) == expected


NASTY = {
    "empty record": b"\x16\x03\x01\x00\x00",
    "alert record": b"\x15\x03\x01\x00\x02\x02\x28",
    "handshake then alert": b"\x16\x03\x01\x00\x02\x01\x00" + b"\x15\x03\x01\x00\x02\x02\x28",
    "length says more than the message": b"\x16\x03\x01\x00\x08\x01\x00\x00\x04\x03\x03\x00\x00",
    "truncated body": b"\x16\x03\x01\x00\x06\x01\x00\x00\x02\x03\x03",
    "version 0x0304 record": b"\x16\x03\x04\x00\x01\x01",
    "not TLS": b"GET / HTTP/1.1\r\n\r\n",
    "sni with a NUL": HELLOS["name"].replace(b"api.example.com", b"api.exampl\x00.com"),
    "sni with a slash": HELLOS["name"].replace(b"api.example.com", b"api.exampl/.com"),
    "sni with a space": HELLOS["name"].replace(b"api.example.com", b"api.exampl .com"),
    "sni non-ascii": HELLOS["name"].replace(b"api.example.com", b"api.exampl\xe9.com"),
}


@pytest.mark.parametrize("name", sorted(NASTY))
def test_nasty_inputs_behave_alike(name: str) -> None:
    data = NASTY[name]
    assert outcome(parse_client_hello, data) == outcome(mitm_parse_client_hello, data)
    assert starts_like_tls_record(data) == mitm_starts_like_tls_record(data)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_behave_alike(data: bytes) -> None:
    assert starts_like_tls_record(data) == mitm_starts_like_tls_record(data)
    assert outcome(parse_client_hello, data) == outcome(mitm_parse_client_hello, data)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(HELLOS)), st.integers(min_value=0), st.integers(min_value=0, max_value=255))
def test_mutated_hellos_behave_alike(name: str, position: int, value: int) -> None:
    data = bytearray(HELLOS[name])
    data[position % len(data)] = value
    assert outcome(parse_client_hello, bytes(data)) == outcome(mitm_parse_client_hello, bytes(data))


# -- TunnelStart: the same reading, fed as bytes arrive, at a bounded cost -----------------------
def first_bytes_verdict(tunnel_host: str, data: bytes) -> object:
    """TunnelStart's answer for all of a tunnel's first bytes fed at once."""
    return TunnelStart(tunnel_host).feed(data)


@pytest.mark.parametrize("name", sorted(HELLOS))
@pytest.mark.parametrize("step", [1, 7, 300])
def test_tunnel_start_fed_in_pieces_agrees_with_one_reading(name: str, step: int) -> None:
    """Fed in pieces of any size, TunnelStart answers what one reading of all the bytes answers."""
    data = HELLOS[name]
    start = TunnelStart("api.example.com")
    verdicts = [start.feed(data[i : i + step]) for i in range(0, len(data), step)]
    assert verdicts[:-1] == [WAIT] * (len(verdicts) - 1)
    assert verdicts[-1] == first_bytes_verdict("api.example.com", data)


def test_tunnel_start_refuses_a_hello_in_too_many_records() -> None:
    """A ClientHello in more than MAX_HELLO_RECORDS records is refused, however it arrives."""
    message = HELLOS["name"][5:]
    few = records(message, [len(message) // MAX_HELLO_RECORDS + 1] * MAX_HELLO_RECORDS)
    assert first_bytes_verdict("api.example.com", few) is None
    many = records(message, [1] * (MAX_HELLO_RECORDS + 1))
    verdict = first_bytes_verdict("api.example.com", many)
    assert isinstance(verdict, str) and "records" in verdict
    start = TunnelStart("api.example.com")
    answers = {repr(start.feed(many[i : i + 1])) for i in range(len(many))}
    assert answers == {repr(WAIT), repr(verdict)}


def test_tunnel_start_refuses_a_hello_that_never_ends() -> None:
    """A ClientHello that announces more than MAX_CLIENT_HELLO bytes is refused once that much came."""
    announced = b"\x01" + (0xFFFFFF).to_bytes(3, "big") + bytes(5 * 16000)
    data = records(announced, [16000] * 6)
    start = TunnelStart("api.example.com")
    verdict = start.feed(data[:MAX_CLIENT_HELLO])
    assert verdict is WAIT
    assert start.feed(data[MAX_CLIENT_HELLO:]) == "TLS ClientHello too long"
    assert start.feed(b"more") == "TLS ClientHello too long"


def test_tunnel_start_relays_what_is_not_tls() -> None:
    for data in (b"GET / HTTP/1.1\r\n", b"SSH-2.0-x\r\n", b"\x16", b"\x16\x03\x05rest"):
        assert TunnelStart("api.example.com").feed(data) == (WAIT if data == b"\x16" else None)
