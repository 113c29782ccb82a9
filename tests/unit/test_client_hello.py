"""egressd.engine.client_hello reads the SNI exactly as mitmproxy's parser does (both tunnel paths agree)."""

from __future__ import annotations

import ssl
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy.net.tls import starts_like_tls_record as mitm_starts_like_tls_record
from mitmproxy.proxy.layers.tls import parse_client_hello as mitm_parse_client_hello

from egressd.engine.client_hello import parse_client_hello, starts_like_tls_record


def client_hello(server_hostname: str | None) -> bytes:
    """A real ClientHello from Python's ssl module (OpenSSL), as it goes on the wire."""
    context = ssl.create_default_context()
    context.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_hostname)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def records(message: bytes, sizes: list[int]) -> bytes:
    """The handshake message of a ClientHello re-split into TLS records of the given sizes."""
    out, offset = b"", 0
    for size in sizes + [len(message)]:
        chunk = message[offset : offset + size]
        if not chunk:
            break
        out += b"\x16\x03\x01" + struct.pack("!H", len(chunk)) + chunk
        offset += len(chunk)
    return out


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
