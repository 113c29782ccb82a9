"""URL path normalisation and segment-aware prefix matching for path rules.

A path rule is only as good as the agreement between our reading of a path and the server's. Where
servers are known to disagree (encoded slashes next to dot segments, ``..;``, ``//`` with dot
segments, backslashes) the path is refused (None) instead of guessed.
"""

from __future__ import annotations

import re

__all__ = ["normalise_path", "path_matches"]

_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_ALLOWED_RAW = _UNRESERVED | frozenset("!$&'()*+,;=:@/%")
_HEX = re.compile(r"[0-9A-Fa-f]{2}")
_ENCODED_SEPARATOR = re.compile(r"%(?:2[Ff]|5[Cc])")


def _normalise_encoding(path: str) -> str | None:
    """Decode percent-escapes of unreserved characters, uppercase the rest, encode stray bytes."""
    out: list[str] = []
    index = 0
    while index < len(path):
        char = path[index]
        if char == "%":
            pair = path[index + 1 : index + 3]
            if not _HEX.fullmatch(pair):
                return None
            decoded = chr(int(pair, 16))
            out.append(decoded if decoded in _UNRESERVED else "%" + pair.upper())
            index += 3
            continue
        code = ord(char)
        if code <= 0x20 or code == 0x7F or char == "\\":
            return None
        if char in _ALLOWED_RAW:
            out.append(char)
        else:
            # mitmproxy hands over raw non-UTF-8 bytes as surrogate escapes: encode them back to
            # the byte the upstream will receive; any other lone surrogate cannot be sent at all
            try:
                raw_bytes = char.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:
                return None
            out.extend(f"%{byte:02X}" for byte in raw_bytes)
        index += 1
    return "".join(out)


def _is_dot(segment: str) -> bool:
    return segment in (".", "..")


def _ambiguous_dot(segment: str) -> bool:
    """``..;x`` / ``.;x``: some servers (Tomcat, Spring) treat these as dot segments."""
    return ";" in segment and _is_dot(segment.split(";", 1)[0])


def normalise_path(raw: str) -> str | None:
    """Canonical path for prefix matching, or None when the path cannot be read unambiguously."""
    if not isinstance(raw, str):
        return None
    path = re.split(r"[?#]", raw, maxsplit=1)[0]
    if not path.startswith("/") or path.startswith("//"):
        return None
    encoded = _normalise_encoding(path)
    if encoded is None:
        return None
    segments = encoded.split("/")[1:]
    if any(_ambiguous_dot(s) for s in segments):
        return None
    has_dots = any(_is_dot(s) for s in segments)
    if has_dots and "" in segments[:-1]:
        return None  # servers that merge '//' would resolve the dots differently
    if _ENCODED_SEPARATOR.search(encoded):
        alternative = _ENCODED_SEPARATOR.sub("/", encoded).split("/")
        if any(_is_dot(s) or _ambiguous_dot(s) for s in alternative):
            return None  # a server decoding %2F/%5C first would see dot segments we do not
    stack: list[str] = []
    for index, segment in enumerate(segments):
        last = index == len(segments) - 1
        if segment == ".":
            if last:
                stack.append("")
        elif segment == "..":
            if not stack or stack == [""]:
                return None
            stack.pop()
            if last:
                stack.append("")
        else:
            stack.append(segment)
    return "/" + "/".join(stack)


def path_matches(prefix: str, path: str) -> bool:
    """Segment-aware prefix test on normalised paths: ``/api`` covers ``/api/x`` but not ``/apix``."""
    if prefix.endswith("/"):
        return path.startswith(prefix)
    return path == prefix or path.startswith(prefix + "/")
