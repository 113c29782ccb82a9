"""The TLS SNI rule for tunnels, shared by the front's tunnels and the mitmproxy tunnel guard: what
a tunnel's first client bytes may be, read at a bounded cost."""

from __future__ import annotations

from egressd.policy import TargetError, canonical_host
from egressd.wire.client_hello import HelloReader, HelloTooLarge, parse_message, starts_like_tls_record


def sni_problem(tunnel_host: str, sni: str | None) -> str | None:
    """None when the SNI may be used in a tunnel to tunnel_host, else what is wrong."""
    try:
        expected = canonical_host(tunnel_host)
    except (TargetError, ValueError):
        return f"tunnel host {tunnel_host!r} is not a valid host"
    if sni is None or sni == "":
        if expected.is_ip:
            return None
        return f"TLS ClientHello without SNI in a tunnel to {expected.text}"
    try:
        named = canonical_host(sni)
    except (TargetError, ValueError):
        return f"TLS SNI {sni!r} is not a valid host name"
    if named != expected:
        return f"TLS SNI {named.text} does not match the tunnel host {expected.text}"
    return None


class _Wait:
    """TunnelStart: the first bytes do not tell yet."""


WAIT = _Wait()


class TunnelStart:
    """The SNI rule on one tunnel's first client bytes, fed as they arrive (each byte read once).

    feed() answers None to relay (a ClientHello for the tunnel's host, or not TLS at all), WAIT for
    more, else why to close the tunnel; once it has answered, it answers the same."""

    def __init__(self, tunnel_host: str) -> None:
        self.tunnel_host = tunnel_host
        self.verdict: str | _Wait | None = WAIT
        self.tls: bool | None = None  # unknown until the first 3 bytes
        self._start = b""
        self._reader: HelloReader | None = None  # made once the first bytes are a TLS record's

    def feed(self, data: bytes) -> str | _Wait | None:
        if self.verdict is not WAIT or not data:
            return self.verdict
        if self.tls is None:
            self._start += data
            if len(self._start) < 3:
                # too short to tell; a first byte other than a handshake record's is not TLS
                self.verdict = WAIT if self._start[0] == 0x16 else None
                return self.verdict
            self.tls = starts_like_tls_record(self._start)
            if not self.tls:
                self.verdict = None
                return None
            data, self._start = self._start, b""
        if self._reader is None:
            self._reader = HelloReader()
        try:
            hello = parse_message(self._reader.feed(data))
        except HelloTooLarge as exc:
            self.verdict = str(exc)
        except Exception:  # noqa: BLE001 - whatever the parser says, the tunnel is closed
            self.verdict = "unparseable TLS ClientHello"
        else:
            if hello is not None:
                self.verdict = sni_problem(self.tunnel_host, hello.sni)
        return self.verdict
