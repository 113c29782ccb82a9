"""The SNI of a TLS ClientHello, read the way mitmproxy reads it, without importing mitmproxy's TLS stack.

The front checks the SNI of every tunnel it relays. mitmproxy's `parse_client_hello` lives in a
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


# A ClientHello fits one record (up to 16 KiB); clients that split it use a few. Beyond these, the
# tunnel is refused: the cost of reading a ClientHello stays bounded whatever its shape.
MAX_CLIENT_HELLO = 64 * 1024  # bytes on the wire
MAX_HELLO_RECORDS = 64


class HelloTooLarge(ValueError):
    """The ClientHello is not complete within MAX_CLIENT_HELLO bytes or MAX_HELLO_RECORDS records."""


class HelloReader:
    """Reassembles the ClientHello handshake message from TLS records as bytes arrive.

    Each byte is looked at once (a record is taken when it is complete), so a hello that trickles in
    costs what its size costs, not its size times the number of reads. `limited=False` reads without
    the caps (the reference reading, compared with mitmproxy's in the unit tests)."""

    def __init__(self, *, limited: bool = True) -> None:
        self.limited = limited
        self._pending = bytearray()  # the start of a record not complete yet
        self._message = bytearray()
        self.records = 0
        self.size = 0

    def feed(self, data: bytes) -> bytes | None:
        """The complete handshake message once it is there; None while it is not. Raises ValueError
        for bytes that cannot be a ClientHello (as mitmproxy does), HelloTooLarge past the caps."""
        self._pending += data
        self.size += len(data)
        offset = 0
        try:
            while len(self._pending) >= offset + 5:
                header = bytes(self._pending[offset : offset + 5])
                if not starts_like_tls_record(header):
                    raise ValueError(f"Expected TLS record, got {header!r} instead.")
                size = struct.unpack("!H", header[3:])[0]
                if size == 0:
                    raise ValueError("Record must not be empty.")
                if len(self._pending) < offset + 5 + size:
                    break
                self.records += 1
                if self.limited and self.records > MAX_HELLO_RECORDS:
                    raise HelloTooLarge(f"TLS ClientHello split into more than {MAX_HELLO_RECORDS} records")
                self._message += self._pending[offset + 5 : offset + 5 + size]
                offset += 5 + size
                if len(self._message) >= 4:
                    total = struct.unpack("!I", b"\x00" + self._message[1:4])[0] + 4
                    if len(self._message) >= total:
                        return bytes(self._message[:total])
        finally:
            del self._pending[:offset]
        if self.limited and self.size > MAX_CLIENT_HELLO:
            raise HelloTooLarge("TLS ClientHello too long")
        return None


@dataclass(frozen=True)
class Hello:
    """What the tunnel check needs of a ClientHello."""

    sni: str | None


def parse_message(message: bytes | None) -> Hello | None:
    """The Hello in a complete handshake message from HelloReader (None: not complete yet)."""
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
