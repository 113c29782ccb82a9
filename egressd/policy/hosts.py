"""Host canonicalisation and target parsing.

Every decision and every connection uses the ONE spelling produced here, so two spellings of the
same host can never be decided differently (``127.1`` is ``127.0.0.1``, ``BÜCHER.example.`` is
``xn--bcher-kva.example``).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

from .ports import port_number, port_problem

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

__all__ = [
    "Host",
    "IPAddress",
    "Target",
    "TargetError",
    "canonical_host",
    "canonical_ip",
    "make_target",
    "parse_target",
]


class TargetError(ValueError):
    """A host or target that cannot be read unambiguously; always refused.

    ``reason`` is the message without the offending text, for callers that show the entry already.
    """

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason if reason is not None else message


def _error(raw: object, reason: str) -> TargetError:
    return TargetError(f"{raw!r}: {reason}", reason)


_SCHEMES = frozenset({"http", "https", "socks5", "connect"})
_URL_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
# ws/wss travel as HTTP upgrades, so they are decided as http/https.
_URL_SCHEME_AS = {"http": "http", "https": "https", "ws": "http", "wss": "https"}

_FORBIDDEN_CHARS = frozenset(" \t\r\n\v\f@/\\%?#[]<>^|\"'`{}")
_ASCII_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")
# WHATWG "ends in a number": such a host is an IPv4 attempt, never a DNS name.
_NUMERIC_LABEL = re.compile(r"(?:0[xX][0-9a-fA-F]*|[0-9]+)")
_METHOD = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
# Fast paths: texts these match are answered by the general code exactly as by the shortcut.
_PLAIN_CHARS = re.compile(r"[A-Za-z0-9._:-]*")  # none forbidden, control or whitespace
_PLAIN_NAME = re.compile(rf"(?:(?:{_ASCII_LABEL.pattern})\.)*(?:{_ASCII_LABEL.pattern})")
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_DOTTED_QUAD = re.compile(rf"{_OCTET}\.{_OCTET}\.{_OCTET}\.{_OCTET}")  # no legacy forms


@dataclass(frozen=True, slots=True)
class Host:
    """A canonical host: exactly one of ``name`` (lowercase A-label) or ``ip`` is set."""

    name: str | None
    ip: IPAddress | None = None
    # the canonical spelling (IPv6 without brackets), worked out once: every step reads it
    text: str = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "text", self.spelled())

    def spelled(self) -> str:
        """The spelling from the fields now (make_target reads it: a Host may have been changed)."""
        return (self.name or "") if self.ip is None else str(self.ip)

    @property
    def is_ip(self) -> bool:
        return self.ip is not None

    def url_host(self) -> str:
        """Spelling for URLs and authority forms: IPv6 is bracketed."""
        if isinstance(self.ip, ipaddress.IPv6Address):
            return f"[{self.ip}]"
        return self.text

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True, slots=True)
class Target:
    """What a client asked to reach, after canonicalisation (make_target builds it)."""

    host: Host
    port: int
    scheme: str | None = None
    path: str | None = None
    method: str | None = None

    def authority(self) -> str:
        """``host:port`` with IPv6 bracketed, for messages."""
        return f"{self.host.url_host()}:{self.port}"


def join_host_port(host: str, port: int) -> str:
    """``host:port`` for an authority or socket address; an IPv6 literal is bracketed."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def canonical_ip(ip: IPAddress) -> IPAddress:
    """Fold IPv4-mapped (::ffff:a.b.c.d) and IPv4-compatible (::a.b.c.d) IPv6 to the IPv4 address.

    ``::`` and ``::1`` are kept: they are the IPv6 unspecified and loopback addresses.
    """
    if isinstance(ip, ipaddress.IPv6Address):
        mapped = ip.ipv4_mapped
        if mapped is not None:
            return mapped
        value = int(ip)
        if value >> 32 == 0 and value > 1:
            return ipaddress.IPv4Address(value)
    return ip


def _parse_ipv4_part(part: str, raw: str) -> int:
    if part[:2].lower() == "0x":
        digits = part[2:]
        return int(digits, 16) if digits else 0
    if len(part) > 1 and part.startswith("0"):
        if not re.fullmatch(r"[0-7]+", part):
            raise _error(raw, f"invalid octal part {part!r} in IPv4 address")
        return int(part, 8)
    return int(part, 10)


def _parse_legacy_ipv4(text: str, raw: str) -> ipaddress.IPv4Address:
    """Read an IPv4 address the way inet_aton (and WHATWG URL) do: 1-4 parts, hex/octal/decimal."""
    if _DOTTED_QUAD.fullmatch(text):
        a, b, c, d = map(int, text.split("."))
        return ipaddress.IPv4Address(a << 24 | b << 16 | c << 8 | d)
    parts = text.split(".")
    if len(parts) > 4:
        raise _error(raw, "too many parts for an IPv4 address")
    for part in parts:
        if not _NUMERIC_LABEL.fullmatch(part):
            raise _error(raw, f"looks like an IPv4 address but part {part!r} is not a number")
    values = [_parse_ipv4_part(p, raw) for p in parts]
    *head, last = values
    for value in head:
        if value > 255:
            raise _error(raw, "IPv4 part out of range")
    if last >= 256 ** (5 - len(values)):
        raise _error(raw, "IPv4 address out of range")
    number = last
    for index, value in enumerate(head):
        number += value << (8 * (3 - index))
    return ipaddress.IPv4Address(number)


def _check_chars(text: str, raw: str) -> None:
    if _PLAIN_CHARS.fullmatch(text):
        return  # the usual host: no character to look at one by one
    for char in text:
        if char in _FORBIDDEN_CHARS:
            what = "whitespace" if char.isspace() else repr(char)
            raise _error(raw, f"not a valid host (contains {what})")
        code = ord(char)
        if code < 0x20 or 0x7F <= code <= 0x9F:
            raise _error(raw, "not a valid host (contains a control character)")
        if char.isspace():
            raise _error(raw, "not a valid host (contains whitespace)")


def _ascii_label(label: str, raw: str) -> str:
    if label.startswith("xn--"):
        import idna  # here: most hosts are plain ASCII (dnspython's load imports it too)

        try:
            decoded = idna.decode(label)
            again = idna.encode(decoded).decode("ascii")
        except (idna.IDNAError, UnicodeError) as exc:
            raise _error(raw, f"invalid IDNA label {label!r} ({exc})") from None
        if again != label:
            raise _error(raw, f"non-canonical IDNA label {label!r}")
        return label
    if not _ASCII_LABEL.fullmatch(label):
        raise _error(raw, f"invalid label {label!r}")
    return label


def _unicode_label(label: str, raw: str) -> str:
    import idna

    try:
        return idna.alabel(label).decode("ascii")
    except (idna.IDNAError, UnicodeError) as exc:
        raise _error(raw, f"invalid internationalised label {label!r} ({exc})") from None


def _ipv6(text: str, raw: str) -> IPAddress:
    try:
        address = ipaddress.IPv6Address(text)
    except ValueError:
        raise _error(raw, "not a valid IPv6 address") from None
    return canonical_ip(address)


def canonical_host(raw: str) -> Host:
    """Canonicalise a host as written by a client or a policy; raise TargetError if ambiguous.

    Percent-encoding and zone IDs are rejected rather than decoded: a proxy that decodes what the
    upstream library would not (or the reverse) decides about a different host than it connects to.
    """
    if not isinstance(raw, str):
        raise _error(raw, "host must be a string")
    if not raw:
        raise TargetError("empty host")
    if raw.startswith("[") or raw.endswith("]"):
        if not (raw.startswith("[") and raw.endswith("]")) or len(raw) < 3:
            raise _error(raw, "unbalanced brackets")
        inner = raw[1:-1]
        if "%" in inner:
            raise _error(raw, "IPv6 zone IDs are not accepted")
        _check_chars(inner, raw)
        if ":" not in inner:
            raise _error(raw, "brackets are only for IPv6 addresses")
        return Host(name=None, ip=_ipv6(inner, raw))
    _check_chars(raw, raw)
    if ":" in raw:
        return Host(name=None, ip=_ipv6(raw, raw))
    text = raw
    if not text.isascii():
        import idna

        try:
            text = idna.uts46_remap(text, std3_rules=False, transitional=False)
        except (idna.IDNAError, UnicodeError) as exc:
            raise _error(raw, f"invalid internationalised name ({exc})") from None
        _check_chars(text, raw)
        if ":" in text:
            raise _error(raw, "not a valid host (contains ':')")
    if text.endswith("."):
        text = text[:-1]
    if not text:
        raise _error(raw, "empty host")
    if len(text) > 253:
        raise _error(raw, "name longer than 253 characters")
    labels = text.split(".")
    if _NUMERIC_LABEL.fullmatch(labels[-1]):
        return Host(name=None, ip=_parse_legacy_ipv4(text, raw))
    lowered = text.lower()
    if text.isascii() and "xn--" not in lowered and _PLAIN_NAME.fullmatch(lowered):
        return Host(name=lowered, ip=None)  # plain ASCII labels: what the loop below gives
    if any(not label for label in labels):
        raise _error(raw, "empty label")
    encoded: list[str] = []
    for label in labels:
        if label.isascii():
            encoded.append(_ascii_label(label.lower(), raw))
        else:
            encoded.append(_unicode_label(label, raw))
    for label in encoded:
        if len(label) > 63:
            raise _error(raw, "label longer than 63 characters")
    name = ".".join(encoded)
    if len(name) > 253:
        raise _error(raw, "name longer than 253 characters")
    return Host(name=name, ip=None)


def _parse_port(text: str, raw: str) -> int:
    port = port_number(text)
    if port is None:
        raise _error(raw, port_problem(text))
    return port


def _split_authority(authority: str, raw: str) -> tuple[str, str | None]:
    """Split ``host[:port]`` / ``[v6][:port]`` / bare IPv6 into host text and port text."""
    if authority.startswith("["):
        end = authority.find("]")
        if end < 0:
            raise _error(raw, "unbalanced brackets")
        host, rest = authority[: end + 1], authority[end + 1 :]
        if not rest:
            return host, None
        if not rest.startswith(":"):
            raise _error(raw, "unexpected text after ']'")
        return host, rest[1:]
    colons = authority.count(":")
    if colons == 0:
        return authority, None
    if colons == 1:
        host, port = authority.split(":")
        return host, port
    return authority, None  # a bare IPv6 literal: no port can be attached without brackets


def parse_target(text: str, default_port: int | None = None) -> Target:
    """Parse a URL (http/https/ws/wss) or ``HOST[:PORT]`` / ``[v6]:PORT`` for ``egressd check``.

    Userinfo is refused: ``http://allowed.test@evil.test/`` names evil.test, and a reader that got
    that wrong would allow it.
    """
    if not isinstance(text, str) or not text:
        raise TargetError("empty target")
    _check_no_space(text)
    if "://" in text:
        scheme_text, rest = text.split("://", 1)
        scheme_key = scheme_text.lower()
        if scheme_key not in _URL_SCHEME_AS:
            raise _error(text, f"unsupported scheme {scheme_text!r} (http, https, ws, wss)")
        cut = len(rest)
        for sep in "/?#":
            pos = rest.find(sep)
            if 0 <= pos < cut:
                cut = pos
        authority, tail = rest[:cut], rest[cut:]
        if "@" in authority:
            raise _error(text, "credentials (userinfo) in a URL are not accepted")
        if "\\" in authority:
            raise _error(text, "backslash in the authority")
        if not authority:
            raise _error(text, "URL has no host")
        host_text, port_text = _split_authority(authority, text)
        port = _URL_DEFAULT_PORTS[scheme_key] if port_text is None else _parse_port(port_text, text)
        tail = tail.split("#", 1)[0]
        if not tail.startswith("/"):
            tail = "/" + tail
        return make_target(host_text, port, scheme=_URL_SCHEME_AS[scheme_key], path=tail)
    if "@" in text or "/" in text:
        raise _error(text, "expected HOST[:PORT] or a URL")
    host_text, port_text = _split_authority(text, text)
    if port_text is None:
        if default_port is None:
            raise _error(text, "no port given")
        port = default_port
    else:
        port = _parse_port(port_text, text)
    return make_target(host_text, port)


def _check_no_space(text: str) -> None:
    if text.isascii() and text.isprintable() and " " not in text:
        return  # printable ASCII but the space: no character to look at one by one
    for char in text:
        if char.isspace() or ord(char) < 0x20 or ord(char) == 0x7F:
            raise _error(text, "target contains whitespace or control characters")


def make_target(
    host: str | Host,
    port: int,
    *,
    scheme: str | None = None,
    path: str | None = None,
    method: str | None = None,
) -> Target:
    """Build a canonical Target; the engine calls this with what the client sent."""
    canonical = canonical_host(host.spelled() if isinstance(host, Host) else host)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise TargetError(f"{canonical.text}: port {port!r} out of range 1-65535")
    if scheme is not None:
        scheme = scheme.lower()
        if scheme not in _SCHEMES:
            raise TargetError(f"{canonical.text}: unknown scheme {scheme!r}")
    if method is not None and not _METHOD.fullmatch(method):  # kept as written: methods are
        raise TargetError(f"{canonical.text}: invalid method {method!r}")  # case-sensitive (RFC 9110)
    return Target(host=canonical, port=port, scheme=scheme, path=path, method=method)
