"""The entries a policy file and the command line both give (host rules, nameservers): shared by
the loader and ``Policy.with_overrides``, below both of them."""

from __future__ import annotations

import ipaddress
from typing import Any, cast

from .ports import port_number, port_problem
from .rules import HostRule, RuleError, parse_rule
from .schema import PolicyError, item

__all__ = ["PolicyError", "parse_nameserver", "parse_rule_list"]


def parse_rule_list(entries: list[object], source: str, key: str) -> tuple[HostRule, ...]:
    """Parse host rules, naming ``key[i]`` and the entry on error."""
    out: list[HostRule] = []
    for index, entry in enumerate(entries):
        try:
            out.append(parse_rule(cast(Any, entry)))
        except RuleError as exc:
            raise PolicyError(source, item(key, index), entry, str(exc)) from None
    return tuple(out)


def parse_nameserver(entry: object, source: str, key: str) -> tuple[str, int]:
    """``IP``, ``IP:PORT``, ``[v6]:PORT`` or bare IPv6 → (IP text, port); names are refused."""
    if not isinstance(entry, str) or not entry:
        raise PolicyError(source, key, entry, "nameserver must be a string 'IP' or 'IP:PORT'")
    text, port = entry, 53
    if entry.startswith("["):
        end = entry.find("]")
        rest = entry[end + 1 :] if end > 0 else "x"
        if rest and not rest.startswith(":"):
            raise PolicyError(source, key, entry, "expected [IPv6]:PORT")
        text = entry[1:end]
        if rest:
            port = _nameserver_port(rest[1:], source, key, entry)
    elif entry.count(":") == 1:
        text, port_text = entry.split(":")
        port = _nameserver_port(port_text, source, key, entry)
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        raise PolicyError(source, key, entry, "nameserver must be an IP address (not a name)") from None
    return str(address), port


def _nameserver_port(text: str, source: str, key: str, entry: str) -> int:
    port = port_number(text)
    if port is None:
        raise PolicyError(source, key, entry, port_problem(text))
    return port
