"""SBPL text: string literals no path can break out of.

A Seatbelt profile is Scheme (Apple's TinyScheme). A path goes into it as a string literal, so a
path with a quote, backslash or parenthesis must stay one literal, or the child's own directory
name would become rules. Quotes and backslashes are escaped (`\\"`, `\\\\`: the same in every
Scheme reader); control characters and undecodable bytes are refused rather than escaped, because
how Apple's reader treats them has not been checked on a Mac. The tests read profiles back with
tests/support/sbpl_reader.py.
"""

from __future__ import annotations

from egressd.sandbox.mounts import MountError


class UnquotablePath(MountError):
    """A path that cannot be put in a Seatbelt profile safely (control characters, bad bytes)."""


def _refused(text: str) -> str | None:
    for char in text:
        if ord(char) < 0x20 or ord(char) == 0x7F:
            return f"the control character {char!r}"
        if 0xD800 <= ord(char) <= 0xDFFF:
            return "bytes that are not UTF-8"
    return None


def quote(text: str) -> str:
    """`text` as one double-quoted SBPL string literal; UnquotablePath when that is not safe."""
    why = _refused(text)
    if why:
        raise UnquotablePath(f"{text!r}: a path with {why} cannot be written into a Seatbelt profile")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
