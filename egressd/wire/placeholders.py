"""Finding egressd's secret placeholders in what a child sends: URLs, header values, bodies.

A placeholder is `egressd-secret-<name>-<token>`, the token 32 random hex digits per run. The matcher
looks for the TOKEN (a child that rewrites the prefix still carries it) in several spellings of the
same bytes: as written, any letter case, percent-encoded (also twice), JSON `\\u00XX` escapes, NUL
bytes dropped (UTF-16), hex-encoded, and base64 (standard and URL-safe, at each of the three
alignments). It is a defence in depth, not a proof: a child can always transform a string in a way
no matcher knows (split it, XOR it, compress it). What holds regardless is that the placeholder is
worthless outside egressd — see docs/secrets.md.

`PlaceholderStream` scans a body chunk by chunk with bounded memory: it holds back the last `window`
bytes of what it saw (the longest spelling a token can take), so a token split across chunks is
found before any byte of it is passed on.

The other way, `ValueMask` is the one masker of the real values in what comes back (every part of a
response, both fronts, every spelling egressd sends a value in), streamed the same way. Sans-I/O,
pure.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import quote, quote_plus

PREFIX = "egressd-secret-"
TOKEN_HEX_DIGITS = 32
_PERCENT = re.compile(rb"%([0-9a-fA-F]{2})")
_UNICODE = re.compile(rb"\\u00([0-9a-fA-F]{2})")
_HEX_PAIR = re.compile(rb"[0-9a-f]{2}")


def placeholder(name: str, token: str) -> str:
    return f"{PREFIX}{name}-{token}"


def token_of(text: str) -> str:
    """The random part of a placeholder."""
    return text.rsplit("-", 1)[-1]


def _base64_cores(token: bytes) -> list[bytes]:
    """The base64 characters only the token determines, at each of the three byte alignments."""
    cores = []
    for offset in range(3):
        encoded = base64.b64encode(b"\0" * offset + token)
        start = -(-8 * offset // 6)  # ceil: the first character with no padding bits in it
        end = (8 * offset + 8 * len(token)) // 6  # floor: the last with no following bits in it
        cores.append(encoded[start:end])
    return cores


def _decoded_rounds(data: bytes) -> list[bytes]:
    """Percent (up to three rounds: %2561) and JSON \\u00XX escapes decoded, the result of every
    step; bounded work. Every step is a view: a later step can eat what an earlier one revealed (a
    `%` before `%2530%2531` decodes to `%0123...`, and the next round reads `%01` as one byte; a
    `\\u00` before it reads `\\u0001` the same way)."""
    views = []
    for _ in range(3):
        start = data
        for escape in (_PERCENT, _UNICODE):
            decoded = escape.sub(lambda m: bytes([int(m.group(1), 16)]), data)
            if decoded != data:
                views.append(decoded)
                data = decoded
        if data == start:
            break
    return views


@dataclass(frozen=True)
class Needles:
    """The tokens to look for, by secret name, in every spelling the matcher knows."""

    tokens: Mapping[str, bytes]  # name -> lower-case hex token

    @classmethod
    def of(cls, placeholders: Mapping[str, str]) -> Needles:
        """From {name: placeholder}."""
        return cls({name: token_of(text).lower().encode("ascii") for name, text in placeholders.items()})

    def __bool__(self) -> bool:
        return bool(self.tokens)

    @property
    def window(self) -> int:
        """The most raw bytes one token can span in any spelling the matcher decodes (a `\\u00XX`
        escape is 6 bytes per character)."""
        longest = max((len(t) for t in self.tokens.values()), default=0)
        return 6 * longest + 8

    def _views(self, data: bytes) -> Iterable[bytes]:
        for view in (data, *_decoded_rounds(data)):
            lower = view.lower()
            yield lower
            if b"\0" in lower:
                yield lower.replace(b"\0", b"")

    def find(self, data: bytes | str) -> str | None:
        """The name of a secret whose token `data` carries in some spelling, or None."""
        if not self.tokens:
            return None
        raw = data.encode("utf-8", "surrogateescape") if isinstance(data, str) else bytes(data)
        views = list(self._views(raw))
        b64 = raw.replace(b"-", b"+").replace(b"_", b"/")
        for name, token in self.tokens.items():
            hexed = token.hex().encode("ascii")
            for view in views:
                if token in view or hexed in view:
                    return name
            if any(core in b64 for core in _base64_cores(token)):
                return name
        return None

    def redact(self, text: str) -> str:
        """`text` with every literal token replaced (for records: a name, never a token)."""
        for token in self.tokens.values():
            text = re.sub(re.escape(token.decode("ascii")), "[redacted]", text, flags=re.IGNORECASE)
        return text


class PlaceholderFound(Exception):
    """A body carried a placeholder; `name` is the secret's name (never its token)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class PlaceholderStream:
    """Scan a body in chunks: `feed` returns what may be passed on (all but the last `window` bytes
    seen), `end` the rest; either raises PlaceholderFound first. Memory: one chunk plus the window."""

    def __init__(self, needles: Needles) -> None:
        self.needles = needles
        self.window = needles.window
        self._held = b""
        self.found: str | None = None

    def feed(self, chunk: bytes) -> bytes:
        if self.found is not None:
            raise PlaceholderFound(self.found)
        data = self._held + bytes(chunk)
        name = self.needles.find(data)
        if name is not None:
            self.found = name
            self._held = b""
            raise PlaceholderFound(name)
        cut = max(0, len(data) - self.window)
        self._held = data[cut:]
        return data[:cut]

    def end(self) -> bytes:
        rest, self._held = self._held, b""
        if self.found is not None:
            raise PlaceholderFound(self.found)
        return rest


def value_spellings(value: str) -> frozenset[bytes]:
    """The spellings of a value egressd sends, and those a server hands back after reading it out of
    a URL and writing it again: as is (a header), percent-encoded (`quote(value)`, a query
    parameter), with `/` kept, with `+` for a space. (egressd never base64-encodes a value.)"""
    forms = (value, quote(value, safe=""), quote(value), quote_plus(value, safe=""), quote_plus(value))
    return frozenset(form.encode("utf-8") for form in forms if form)


def _spelling_pattern(spelling: bytes) -> bytes:
    """A spelling as a regular expression whose percent escapes match in either letter case."""
    parts = []
    for piece in re.split(rb"(%[0-9A-Fa-f]{2})", spelling):
        if _ESCAPE.fullmatch(piece):
            parts.append(
                b"%" + b"".join(b"[" + bytes([c]).upper() + bytes([c]).lower() + b"]" for c in piece[1:])
            )
        elif piece:
            parts.append(re.escape(piece))
    return b"".join(parts)


_ESCAPE = re.compile(rb"%[0-9A-Fa-f]{2}")
# framing fields carry a number or `chunked`: masked, the message would no longer frame
_FRAMING_FIELDS = frozenset({b"content-length", b"transfer-encoding"})


class ValueMask:
    """Mask the real values egressd puts into requests wherever a response echoes them, in every
    spelling of value_spellings: each occurrence becomes as many `*` (the length is kept, so
    Content-Length and chunk framing stay right, and a field stays a valid token). One masker for
    every part of a response on every front: `mask` for a reason phrase, an error's text or a
    field (`fields`, `text`); `feed`/`end` stream a body, holding back the last (longest spelling -
    1) bytes so a value split across chunks or reads is still masked. Every occurrence is masked or
    overlaps a masked one, so no whole spelling survives."""

    def __init__(self, values: Iterable[str]) -> None:
        spellings = sorted({s for v in values if v for s in value_spellings(v)}, key=len, reverse=True)
        self.pattern = re.compile(b"|".join(map(_spelling_pattern, spellings))) if spellings else None
        self.hold = max((len(s) for s in spellings), default=1) - 1
        self._held = b""

    def __bool__(self) -> bool:
        return self.pattern is not None

    def mask(self, data: bytes) -> bytes:
        if self.pattern is None or not data:
            return data
        return self.pattern.sub(lambda m: b"*" * (m.end() - m.start()), data)

    def text(self, value: str, encoding: str = "utf-8") -> str:
        """A text (a field, a reason phrase, an error's detail) with the values masked, in the
        encoding it was decoded with."""
        if self.pattern is None:
            return value
        raw = value.encode(encoding, "surrogateescape")
        masked = self.mask(raw)
        return value if masked == raw else masked.decode(encoding, "surrogateescape")

    def fields(self, fields: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """Header or trailer fields with the values masked in names and values (framing values
        excepted)."""
        return [
            (self.mask(name), value if name.lower() in _FRAMING_FIELDS else self.mask(value))
            for name, value in fields
        ]

    def text_fields(self, fields: Iterable[tuple[str, str]], encoding: str) -> list[tuple[str, str]]:
        """`fields` for fields decoded as text with `encoding`."""
        if self.pattern is None:
            return list(fields)
        raw = [
            (n.encode(encoding, "surrogateescape"), v.encode(encoding, "surrogateescape")) for n, v in fields
        ]
        return [
            (n.decode(encoding, "surrogateescape"), v.decode(encoding, "surrogateescape"))
            for n, v in self.fields(raw)
        ]

    def feed(self, chunk: bytes) -> bytes:
        data = self.mask(self._held + bytes(chunk))
        cut = max(0, len(data) - self.hold)
        self._held = data[cut:]
        return data[:cut]

    def end(self) -> bytes:
        rest, self._held = self._held, b""
        return rest
