"""The SNI of a TLS ClientHello, read the way mitmproxy reads it, without importing mitmproxy's TLS stack.

The lean tunnel path checks the SNI of every tunnel. mitmproxy's `parse_client_hello` lives in a
module that imports pyOpenSSL and the whole proxy core (~0.3 s); `egressd exec` must not pay that to
start. This module reassembles the handshake from TLS records exactly as
`mitmproxy.proxy.layers.tls.get_client_hello` does and parses it with the same Kaitai parser and the
same validity rule for the server name as `mitmproxy.tls.ClientHello.sni`, so both tunnel paths see
the same SNI (tests/unit/test_client_hello.py checks them against each other).
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

from kaitaistruct import KaitaiStream
from mitmproxy.contrib.kaitaistruct.tls_client_hello import TlsClientHello
from mitmproxy.net.check import is_valid_host


def starts_like_tls_record(data: bytes) -> bool:
    """True if data could be the start of a TLS record (SSLv3 to TLS 1.3); fewer than 3 bytes: no."""
    return len(data) > 2 and data[0] == 0x16 and data[1] == 0x03 and data[2] <= 0x03


def _handshake_bytes(data: bytes) -> bytes | None:
    """The ClientHello handshake message reassembled from complete records, None while incomplete."""
    message = b""
    offset = 0
    while len(data) >= offset + 5:
        header = data[offset : offset + 5]
        if not starts_like_tls_record(header):
            raise ValueError(f"Expected TLS record, got {header!r} instead.")
        size = struct.unpack("!H", header[3:])[0]
        if size == 0:
            raise ValueError("Record must not be empty.")
        offset += 5
        if len(data) < offset + size:
            return None
        message += data[offset : offset + size]
        offset += size
        if len(message) >= 4:
            total = struct.unpack("!I", b"\x00" + message[1:4])[0] + 4
            if len(message) >= total:
                return message[:total]
    return None


@dataclass(frozen=True)
class Hello:
    """What the tunnel check needs of a ClientHello."""

    sni: str | None


def parse_client_hello(data: bytes) -> Hello | None:
    """The ClientHello at the start of data; None if it is not complete yet.

    Raises ValueError for bytes that cannot be a ClientHello (as mitmproxy does).
    """
    message = _handshake_bytes(data)
    if not message:
        return None
    try:
        parsed = TlsClientHello(KaitaiStream(io.BytesIO(message[4:])))
    except EOFError as exc:
        raise ValueError("Invalid ClientHello") from exc
    return Hello(_sni(parsed))


def _sni(parsed: TlsClientHello) -> str | None:
    """mitmproxy's rule: one host_name entry in a server_name extension, and a valid host."""
    extensions = getattr(parsed, "extensions", None)
    if not extensions:
        return None
    for extension in extensions.extensions:
        if (
            extension.type == 0x00
            and len(extension.body.server_names) == 1
            and extension.body.server_names[0].name_type == 0
            and is_valid_host(extension.body.server_names[0].host_name)
        ):
            return str(extension.body.server_names[0].host_name.decode("ascii"))
    return None
