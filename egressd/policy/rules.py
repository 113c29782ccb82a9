"""Host rules (allow/deny/inspect entries) and an indexed RuleSet.

Matching is by index, never by scanning every rule: a policy with thousands of entries costs the
same per connection as one with three (walk the name's labels; one dict per CIDR prefix length).
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network
from typing import Literal

from .hosts import Host, IPAddress, TargetError, canonical_host, canonical_ip
from .paths import normalise_path
from .ports import port_number, port_problem
from .schema import PolicyError, Reader

__all__ = ["HostRule", "RuleError", "RuleSet", "parse_rule", "read_methods"]

RuleKind = Literal["name", "wildcard", "ip", "cidr"]
_METHOD = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
_RULE_KEYS = ("host", "paths", "methods", "exe", "websocket", "private")


class RuleError(ValueError):
    """A host rule that cannot be read; the message says why."""


@dataclass(frozen=True)
class HostRule:
    """One allow/deny/inspect entry, canonicalised; ``text`` is kept for "the rule that decided"."""

    text: str
    kind: RuleKind
    name: str | None
    network: IPv4Network | IPv6Network | None
    port: int | None
    paths: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()
    # programs this rule admits (allow rules only): a name matches an executable's file name or a
    # system alias of it, a path (with "/") the executable's own path; empty = every program
    exe: tuple[str, ...] = ()
    # a path/method rule relays a WebSocket upgrade of a request it admits only when it says so
    websocket: bool = False
    # a name this rule admits may resolve to private addresses (`private.allow` for this rule
    # only; allow rules only): how a merge keeps one policy's licence to its own rules
    private: bool = False

    def matches(self, host: Host, port: int) -> bool:
        """Reference semantics, one rule at a time (RuleSet uses indexes for the same answer)."""
        if self.port is not None and self.port != port:
            return False
        if host.ip is not None:
            return self.network is not None and canonical_ip(host.ip) in self.network
        if host.name is None or self.name is None:
            return False
        if self.kind == "name":
            return host.name == self.name or host.name.endswith("." + self.name)
        if self.kind == "wildcard":
            return host.name.endswith("." + self.name)
        return False

    @property
    def restricted(self) -> bool:
        """True when the rule admits only some paths or methods."""
        return bool(self.paths or self.methods)

    def describe(self) -> str:
        """The rule as written plus its path/method restriction, for messages."""
        extra = ""
        if self.paths:
            extra += " " + ",".join(self.paths)
        if self.methods:
            extra += " " + ",".join(self.methods)
        if self.exe:
            extra += " exe " + ",".join(self.exe)
        if self.websocket:
            extra += " websocket"
        if self.private:
            extra += " private"
        return self.text + extra


def _parse_port(text: str) -> int:
    port = port_number(text)
    if port is None:
        raise RuleError(port_problem(text))
    return port


def _network(text: str) -> IPv4Network | IPv6Network:
    try:
        network = ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        raise RuleError(f"not a valid CIDR ({exc})") from None
    if isinstance(network, IPv6Network) and network.prefixlen >= 96:
        mapped = canonical_ip(network.network_address)
        if isinstance(mapped, ipaddress.IPv4Address) and network.network_address.ipv4_mapped is not None:
            return IPv4Network(f"{mapped}/{network.prefixlen - 96}")
    return network


def _split_port(text: str) -> tuple[str, int | None]:
    """Split a trailing ``:PORT`` off a non-bracketed, single-colon form."""
    if text.count(":") == 1:
        host, port = text.split(":")
        return host, _parse_port(port)
    return text, None


def _parse_host_text(text: str) -> tuple[RuleKind, str | None, IPv4Network | IPv6Network | None, int | None]:
    if not text:
        raise RuleError("empty rule")
    if any(c.isspace() for c in text):
        raise RuleError("not a valid host (contains whitespace)")
    port: int | None = None
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise RuleError("unbalanced brackets")
        inner, rest = text[1:end], text[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise RuleError("unexpected text after ']'")
            port = _parse_port(rest[1:])
        if "/" in inner:
            return "cidr", None, _network(inner), port
        text = f"[{inner}]"
    elif "/" in text:
        address, _, length = text.partition("/")
        if ":" in length:
            length, _, port_text = length.partition(":")
            port = _parse_port(port_text)
        return "cidr", None, _network(f"{address}/{length}"), port
    else:
        text, port = _split_port(text)
    wildcard = text.startswith("*.")
    host_text = text[2:] if wildcard else text
    if "*" in host_text:
        raise RuleError("a wildcard is only allowed as a leading '*.' label")
    try:
        host = canonical_host(host_text)
    except TargetError as exc:
        raise RuleError(exc.reason) from None
    if host.ip is not None:
        if wildcard:
            raise RuleError("a wildcard cannot apply to an IP address")
        return "ip", None, ipaddress.ip_network(host.ip), port
    return ("wildcard" if wildcard else "name"), host.name, None, port


def _read_paths(reader: Reader, value: object, key: str) -> tuple[str, ...]:
    out: list[str] = []
    for where, path in reader.items(value, key, what=" of path prefixes"):
        if not isinstance(path, str) or not path.startswith("/"):
            raise reader.fail(where, "must be a string starting with '/'", path)
        if "?" in path or "#" in path:
            raise reader.fail(where, "must not contain a query or fragment", path)
        normal = normalise_path(path)
        if normal is None:
            raise reader.fail(where, "not a valid path", path)
        out.append(normal)
    return tuple(dict.fromkeys(out))


def read_methods(reader: Reader, value: object, key: str) -> tuple[str, ...]:
    """HTTP method names, upper-cased, each once: a rule's `methods` and a built-in allowance's."""
    out: list[str] = []
    for where, method in reader.items(value, key, what=" of HTTP methods"):
        if not isinstance(method, str) or not _METHOD.fullmatch(method):
            raise reader.fail(where, "not a valid HTTP method", method)
        out.append(method.upper())
    return tuple(dict.fromkeys(out))


def _read_exe(reader: Reader, value: object, key: str) -> tuple[str, ...]:
    """Program names (``node``) or absolute executable paths (``/usr/bin/node``), normalised."""
    if value is None:
        return ()
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list | tuple) or not names:
        why = "must be a program name, an absolute path, or a non-empty list of them"
        raise reader.fail(key, why, value)
    out: list[str] = []
    for where, name in reader.items(names, key):
        if not isinstance(name, str) or not name or "\x00" in name or name != name.strip():
            raise reader.fail(where, "must be a program name or an absolute path", name)
        if "/" in name:
            if not name.startswith("/"):
                raise reader.fail(where, "a path must be absolute", name)
            name = posixpath.normpath(name)
            name = "/" + name.lstrip("/")  # normpath keeps a leading "//"
        elif name in (".", ".."):
            raise reader.fail(where, "not a program name", name)
        out.append(name)
    return tuple(dict.fromkeys(out))


def _rule_from_mapping(entry: Mapping[str, object]) -> HostRule:
    """The mapping form, read by the policy's schema reader with key paths inside the rule: the
    caller names the rule itself (``allow[2]``), the message the field (``paths[0]: ...``)."""
    reader = Reader("")
    try:
        data = reader.mapping(entry, "", _RULE_KEYS)
        host = reader.text(data.get("host"), "host")
        websocket = reader.bool(data.get("websocket"), "websocket", False)
        private = reader.bool(data.get("private"), "private", False)
        kind, name, network, port = _parse_host_text(host)
        paths = _read_paths(reader, data.get("paths"), "paths")
        methods = read_methods(reader, data.get("methods"), "methods")
        exe = _read_exe(reader, data.get("exe"), "exe")
    except PolicyError as exc:
        raise RuleError(exc.located()) from None
    return HostRule(
        text=host,
        kind=kind,
        name=name,
        network=network,
        port=port,
        paths=paths,
        methods=methods,
        exe=exe,
        websocket=websocket,
        private=private,
    )


def parse_rule(entry: str | Mapping[str, object]) -> HostRule:
    """Parse ``host[:port]``, ``*.suffix``, IP/CIDR[:port], ``[v6]:port`` or
    ``{host, paths, methods, exe, websocket, private}``."""
    if isinstance(entry, Mapping):
        return _rule_from_mapping(entry)
    if not isinstance(entry, str):
        raise RuleError("a rule must be a string or a mapping with 'host'")
    kind, name, network, port = _parse_host_text(entry)
    return HostRule(text=entry, kind=kind, name=name, network=network, port=port)


def _by_specificity(rules: list[HostRule]) -> tuple[HostRule, ...]:
    """At one index slot, port-specific rules come before any-port ones; order of writing otherwise."""
    return tuple(sorted(rules, key=lambda r: r.port is None))


def _for_port(rules: tuple[HostRule, ...], port: int) -> Sequence[HostRule]:
    """The rules of one index slot that apply to ``port``, in order."""
    if len(rules) == 1:  # the usual slot: no list to build
        return rules if rules[0].port is None or rules[0].port == port else ()
    return [rule for rule in rules if rule.port is None or rule.port == port]


def _mask(prefix: int, bits: int) -> int:
    return ((1 << prefix) - 1) << (bits - prefix) if prefix else 0


class RuleSet:
    """An immutable, indexed set of host rules."""

    __slots__ = ("_below", "_masks", "_names", "rules")

    def __init__(self, rules: Iterable[HostRule] = ()) -> None:
        self.rules: tuple[HostRule, ...] = tuple(rules)
        names: dict[str, list[HostRule]] = {}
        wildcards: dict[str, list[HostRule]] = {}
        networks: dict[tuple[int, int], dict[int, list[HostRule]]] = {}
        for rule in self.rules:
            if rule.kind == "name" and rule.name is not None:
                names.setdefault(rule.name, []).append(rule)
            elif rule.kind == "wildcard" and rule.name is not None:
                wildcards.setdefault(rule.name, []).append(rule)
            elif rule.network is not None:
                key = (rule.network.version, rule.network.prefixlen)
                slot = networks.setdefault(key, {})
                slot.setdefault(int(rule.network.network_address), []).append(rule)
        self._names = {k: _by_specificity(v) for k, v in names.items()}
        # A proper suffix of the target name is matched by its name rules, then its wildcard rules:
        # one lookup per label.
        self._below = {
            suffix: _by_specificity(names.get(suffix, [])) + _by_specificity(wildcards.get(suffix, []))
            for suffix in names.keys() | wildcards.keys()
        }
        # Per IP version, longest prefix first: (netmask as an integer, network address -> rules).
        self._masks = {
            version: tuple(
                (_mask(prefix, bits), {a: _by_specificity(r) for a, r in networks[(version, prefix)].items()})
                for prefix in sorted((p for v, p in networks if v == version), reverse=True)
            )
            for version, bits in ((4, 32), (6, 128))
        }

    def __len__(self) -> int:
        return len(self.rules)

    def __bool__(self) -> bool:
        return bool(self.rules)

    def __iter__(self) -> Iterator[HostRule]:
        return iter(self.rules)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RuleSet) and other.rules == self.rules

    def __hash__(self) -> int:
        return hash(self.rules)

    def __repr__(self) -> str:
        return f"RuleSet({[r.text for r in self.rules]!r})"

    def _address_matches(self, ip: IPAddress, port: int) -> list[HostRule]:
        ip = canonical_ip(ip)
        value = int(ip)
        found: list[HostRule] = []
        for mask, slot in self._masks.get(ip.version, ()):
            rules = slot.get(value & mask)
            if rules:
                found += _for_port(rules, port)
        return found

    def _name_matches(self, name: str, port: int) -> list[HostRule]:
        rules = self._names.get(name)
        found = list(_for_port(rules, port)) if rules else []
        below = self._below
        _, dot, suffix = name.partition(".")
        while dot:
            rules = below.get(suffix)
            if rules:
                found += _for_port(rules, port)
            _, dot, suffix = suffix.partition(".")
        return found

    def matching(self, host: Host, port: int) -> list[HostRule]:
        """Every matching rule as a new list, most specific first (what ``matches`` iterates over)."""
        if not self.rules:
            return []
        if host.ip is not None:
            return self._address_matches(host.ip, port)
        if host.name is None:
            return []
        return self._name_matches(host.name, port)

    def matches(self, host: Host, port: int) -> Iterator[HostRule]:
        """Every matching rule, most specific first (longest name suffix / longest prefix)."""
        return iter(self.matching(host, port))

    def match(self, host: Host, port: int) -> HostRule | None:
        """The most specific matching rule, or None."""
        found = self.matching(host, port)
        return found[0] if found else None

    def match_address(self, ip: IPAddress, port: int) -> HostRule | None:
        """Most specific IP/CIDR rule for a resolved address (name rules never match addresses)."""
        found = self._address_matches(ip, port)
        return found[0] if found else None
