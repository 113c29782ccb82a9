"""DESTINATION for `egressd ssh`: `[user@]host` or `ssh://[user@]host[:port]`.

Parsed here (not left to ssh) so that a destination can never be taken for an ssh option and so
that the port of an ssh:// URL becomes `-p PORT`, which works on every OpenSSH version.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

from egressd.policy.ports import port_number


class DestinationError(ValueError):
    """The DESTINATION argument is not usable; the message says why."""


@dataclass(frozen=True)
class Destination:
    host: str
    user: str | None = None
    port: int | None = None

    @property
    def target(self) -> str:
        """What ssh gets as its destination argument (`user@host` or `host`)."""
        return f"{self.user}@{self.host}" if self.user else self.host

    @property
    def port_args(self) -> list[str]:
        return ["-p", str(self.port)] if self.port is not None else []

    def __str__(self) -> str:
        if self.port is None:
            return self.target
        host = f"[{self.host}]" if ":" in self.host else self.host
        user = f"{self.user}@" if self.user else ""
        return f"ssh://{user}{host}:{self.port}"


def _check_part(text: str, what: str, original: str) -> str:
    if not text:
        raise DestinationError(f"{original!r}: empty {what}")
    if text.startswith("-"):
        raise DestinationError(f"{original!r}: a {what} must not start with '-' (ssh would read an option)")
    if any(ch.isspace() or not ch.isprintable() for ch in text):
        raise DestinationError(f"{original!r}: the {what} contains whitespace or control characters")
    if "/" in text or ("@" in text and what == "host"):
        raise DestinationError(f"{original!r}: {text!r} is not a valid {what}")
    return text


def _parse_port(text: str, original: str) -> int:
    port = port_number(text)
    if port is None:
        raise DestinationError(f"{original!r}: port must be 1-65535")
    return port


def _parse_url(rest: str, original: str) -> Destination:
    if rest.endswith("/"):
        rest = rest[:-1]
    if any(ch in rest for ch in "/?#"):
        raise DestinationError(f"{original!r}: an ssh:// destination has no path, query or fragment")
    user: str | None = None
    if "@" in rest:
        raw_user, _, rest = rest.rpartition("@")
        user = _check_part(unquote(raw_user), "user", original)
    port: int | None = None
    if rest.startswith("["):
        end = rest.find("]")
        if end < 0:
            raise DestinationError(f"{original!r}: unclosed '[' in the host")
        host, tail = rest[1:end], rest[end + 1 :]
        if tail:
            if not tail.startswith(":"):
                raise DestinationError(f"{original!r}: unexpected {tail!r} after the host")
            port = _parse_port(tail[1:], original)
    elif ":" in rest:
        host, _, port_text = rest.rpartition(":")
        if ":" in host:
            raise DestinationError(f"{original!r}: write an IPv6 address in brackets: ssh://[2001:db8::1]:22")
        port = _parse_port(port_text, original)
    else:
        host = rest
    return Destination(_check_part(host, "host", original), user, port)


def parse_destination(text: str) -> Destination:
    """`[user@]host` or `ssh://[user@]host[:port]` (IPv6 in brackets in the URL form)."""
    if text.lower().startswith("ssh://"):
        return _parse_url(text[6:], text)
    user: str | None = None
    host = text
    if "@" in text:
        raw_user, _, host = text.rpartition("@")
        user = _check_part(raw_user, "user", text)
    return Destination(_check_part(host, "host", text), user)
