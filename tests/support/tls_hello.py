"""Real TLS ClientHellos for tests of the SNI rule, as they go on the wire, and re-split into records.

Why: the tunnel check reads the ClientHello the way mitmproxy does; tests feed it what OpenSSL
really sends (through Python's ssl module), whole or cut into TLS records of chosen sizes.
"""

from __future__ import annotations

import ssl
import struct


def client_hello(server_hostname: str | None) -> bytes:
    """A real ClientHello from Python's ssl module (OpenSSL), as it goes on the wire."""
    context = ssl.create_default_context()
    context.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_hostname)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        return outgoing.read()
    raise AssertionError("a TLS handshake cannot complete without a server")


def records(message: bytes, sizes: list[int]) -> bytes:
    """A handshake message re-split into TLS records of the given sizes (the rest in one more)."""
    out, offset = [], 0
    for size in sizes + [len(message)]:
        chunk = message[offset : offset + size]
        if not chunk:
            break
        out.append(b"\x16\x03\x01" + struct.pack("!H", len(chunk)) + chunk)
        offset += len(chunk)
    return b"".join(out)
