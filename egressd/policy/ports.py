"""The one reading of a port number, wherever one is written: a policy's rules and nameservers,
the command line, an SSH destination, an imported allowlist, a client's request.

ASCII digits only: ``str.isdigit`` also takes ``'²'`` (which ``int`` then refuses with a
traceback) and ``'٨٠'`` (which ``int`` reads as 80). Leading zeros are read as in a URL; the
digits after them are bounded before ``int`` sees them, so no length of zeros reaches Python's
limit on integer strings.
"""

from __future__ import annotations

__all__ = ["port_number", "port_problem"]

_ASCII_DIGITS = frozenset("0123456789")


def port_number(text: str, *, lowest: int = 1) -> int | None:
    """The port ``text`` spells, if it is one from ``lowest`` to 65535; else None."""
    digits = _significant(text)
    if digits is None or len(digits) > 5:
        return None
    port = int(digits)
    return port if lowest <= port <= 65535 else None


def port_problem(text: str, *, lowest: int = 1) -> str:
    """Why ``text`` is not a port (for a text ``port_number`` refused)."""
    digits = _significant(text)
    if digits is None:
        return f"invalid port {text!r}"
    if len(digits) > 12:
        digits = digits[:12] + "..."
    return f"port {digits} out of range {lowest}-65535"


def _significant(text: str) -> str | None:
    """The digits of ``text`` without leading zeros ("0" for zero), if it is ASCII digits only."""
    if not text or not _ASCII_DIGITS.issuperset(text):
        return None
    return text.lstrip("0") or "0"
