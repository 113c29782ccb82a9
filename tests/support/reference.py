"""An independent reference for what egressd must never allow, written from DESIGN.md alone.

Why: a property "egressd refuses what it should" needs a second opinion that shares no code with
egressd/policy. This module imports nothing from egressd: it classifies addresses with the standard
``ipaddress`` module and the ranges DESIGN.md names, interprets a policy *spec* (plain tuples, the
same spec the tests turn into a YAML policy), and answers one question — may this be allowed? It
over-approximates (it may say "may" where egressd refuses); it must never say "no" where egressd
allows.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

Address = IPv4Address | IPv6Address
Network = IPv4Network | IPv6Network


class Klass(Enum):
    FORBIDDEN = "forbidden"
    LOOPBACK = "loopback"
    PRIVATE = "private"
    GLOBAL = "global"


# DESIGN.md step 4: link-local incl. metadata, unspecified, multicast, broadcast, 240/4.
V4_ALWAYS_REFUSED = tuple(
    IPv4Network(n)
    for n in (
        "0.0.0.0/8",
        "169.254.0.0/16",
        "224.0.0.0/4",
        "240.0.0.0/4",
        "100.100.100.200/32",
        "168.63.129.16/32",
    )
)
V6_ALWAYS_REFUSED = tuple(IPv6Network(n) for n in ("::/128", "fe80::/10", "ff00::/8", "fd00:ec2::254/128"))
# DESIGN.md "Address classes": private.
V4_PRIVATE = tuple(
    IPv4Network(n)
    for n in (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "198.18.0.0/15",
        "192.0.2.0/24",
        "198.51.100.0/24",
        "203.0.113.0/24",
    )
)
V6_PRIVATE = tuple(IPv6Network(n) for n in ("fc00::/7", "2001:db8::/32"))


def _bits(value: int, start: int, length: int = 32) -> int:
    """``length`` bits of a 128-bit value starting at bit ``start`` (bit 0 is the most significant)."""
    return (value >> (128 - start - length)) & ((1 << length) - 1)


# RFC 6052 layouts a site may use inside the local-use prefix 64:ff9b:1::/48: the IPv4 address's
# pieces as (first bit, length), skipping the u octet (bits 64-71), and where the zero suffix starts.
_LOCAL_NAT64_LAYOUTS: tuple[tuple[tuple[tuple[int, int], ...], int], ...] = (
    (((48, 16), (72, 16)), 88),  # /48
    (((56, 8), (72, 24)), 96),  # /56
    (((72, 32),), 104),  # /64
    (((96, 32),), 128),  # /96
)


def embedded_v4(ip: IPv6Address) -> list[IPv4Address]:
    """Every IPv4 address an IPv6 address can stand for behind some translator (RFC 6052 NAT64,
    RFC 6145 SIIT, RFC 3056 6to4, RFC 4380 Teredo). Mapped/compatible are not here: they ARE the
    IPv4 host (see ``folded``)."""
    value = int(ip)
    if ip in IPv6Network("::ffff:0:0:0/96") or ip in IPv6Network("64:ff9b::/96"):
        return [IPv4Address(value & 0xFFFFFFFF)]
    if ip in IPv6Network("2002::/16"):
        return [IPv4Address(_bits(value, 16))]
    if ip in IPv6Network("2001::/32"):
        return [IPv4Address(_bits(value, 32)), IPv4Address((value & 0xFFFFFFFF) ^ 0xFFFFFFFF)]
    if ip in IPv6Network("64:ff9b:1::/48"):
        out: list[IPv4Address] = []
        for pieces, suffix in _LOCAL_NAT64_LAYOUTS:
            if suffix < 128 and _bits(value, suffix, 128 - suffix):
                continue  # not this layout: its suffix must be zero
            v4 = 0
            for start, length in pieces:
                v4 = (v4 << length) | _bits(value, start, length)
            if v4:  # an all-zero reading is the zero fill of another layout
                out.append(IPv4Address(v4))
        return out
    return []


def folded(ip: Address) -> Address:
    """IPv4-mapped (::ffff:a.b.c.d) and IPv4-compatible (::a.b.c.d) IPv6 are the IPv4 host."""
    if isinstance(ip, IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if int(ip) >> 32 == 0 and int(ip) > 1:
            return IPv4Address(int(ip))
    return ip


def classify(ip: Address) -> Klass:
    ip = folded(ip)
    if isinstance(ip, IPv4Address):
        if any(ip in n for n in V4_ALWAYS_REFUSED):
            return Klass.FORBIDDEN
        if ip in IPv4Network("127.0.0.0/8"):
            return Klass.LOOPBACK
        if any(ip in n for n in V4_PRIVATE) or not ip.is_global:
            return Klass.PRIVATE
        return Klass.GLOBAL
    if any(ip in n for n in V6_ALWAYS_REFUSED):
        return Klass.FORBIDDEN
    inner = [classify(v4) for v4 in embedded_v4(ip)]
    if Klass.FORBIDDEN in inner:
        return Klass.FORBIDDEN
    if ip == IPv6Address("::1"):
        return Klass.LOOPBACK
    if inner and any(k is not Klass.GLOBAL for k in inner):
        return Klass.PRIVATE  # behind a translator: never loopback, but not global either
    if any(ip in n for n in V6_PRIVATE) or not ip.is_global:
        return Klass.PRIVATE
    return Klass.GLOBAL


# -- a policy spec and the reference's reading of it ----------------------------------------------
@dataclass(frozen=True)
class Rule:
    """``kind``: "name" (it and subdomains), "wild" (subdomains only) or "net" (IP/CIDR)."""

    kind: str
    value: str  # canonical lowercase A-label name, or a network in ipaddress' spelling
    port: int | None = None

    def text(self) -> str:
        """How the rule is written in a policy file."""
        if self.kind == "net":
            network = ipaddress.ip_network(self.value)
            host = str(network.network_address) if network.num_addresses == 1 else str(network)
            if self.port is None:
                return host
            if network.version == 6:
                return f"[{host}]:{self.port}"
            return f"{host}:{self.port}"
        base = ("*." if self.kind == "wild" else "") + self.value
        return base if self.port is None else f"{base}:{self.port}"

    def matches_name(self, name: str, port: int) -> bool:
        if self.port is not None and self.port != port:
            return False
        if self.kind == "name":
            return name == self.value or name.endswith("." + self.value)
        if self.kind == "wild":
            return name.endswith("." + self.value)
        return False

    def matches_ip(self, ip: Address, port: int) -> bool:
        if self.kind != "net" or (self.port is not None and self.port != port):
            return False
        return folded(ip) in ipaddress.ip_network(self.value)


@dataclass(frozen=True)
class Spec:
    mode: str = "enforce"
    allow: tuple[Rule, ...] = ()
    deny: tuple[Rule, ...] = ()
    loopback_allow: bool = True
    loopback_ports: tuple[int, ...] = ()
    private_allow: bool = False
    ports: tuple[int, ...] = ()
    self_addresses: tuple[tuple[Address, int], ...] = field(default=())

    def document(self) -> dict[str, object]:
        """The policy file (as decoded YAML) this spec stands for."""
        return {
            "version": 1,
            "mode": self.mode,
            "allow": [r.text() for r in self.allow],
            "deny": [r.text() for r in self.deny],
            "loopback": {"allow": self.loopback_allow, "ports": list(self.loopback_ports)},
            "private": {"allow": self.private_allow},
            "ports": list(self.ports),
        }


def _is_loopback_name(name: str) -> bool:
    return name == "localhost" or name.endswith(".localhost")


def _loopback_ok(spec: Spec, port: int) -> bool:
    return spec.loopback_allow and (not spec.loopback_ports or port in spec.loopback_ports)


def _is_self(spec: Spec, ip: Address | None, port: int) -> bool:
    for own, own_port in spec.self_addresses:
        if own_port == port and (ip is None or folded(ip) == own or classify(ip) is Klass.LOOPBACK):
            return True
    return False


def may_allow_ip(spec: Spec, ip: Address, port: int) -> bool:
    """May a connection to the IP literal ``ip`` be allowed under ``spec``?"""
    klass = classify(ip)
    if klass is Klass.FORBIDDEN or _is_self(spec, ip, port):
        return False
    if any(r.matches_ip(ip, port) for r in spec.deny):
        return False
    if klass is Klass.LOOPBACK:
        return _loopback_ok(spec, port)
    # DESIGN.md step 10: allow and learn admit any literal, but a non-global one only with
    # private.allow (the guard that holds in every mode) unless a rule names it
    by_mode = spec.mode in ("allow", "learn") and (klass is Klass.GLOBAL or spec.private_allow)
    if not (by_mode or any(r.matches_ip(ip, port) for r in spec.allow)):
        return False
    return not spec.ports or port in spec.ports


def may_allow_name(spec: Spec, name: str, port: int) -> bool:
    """May the NAME (canonical: lowercase A-labels, no trailing dot) be allowed before resolution?"""
    if any(r.matches_name(name, port) for r in spec.deny):
        return False
    if _is_loopback_name(name):
        return _loopback_ok(spec, port) and not _is_self(spec, None, port)
    if not (spec.mode in ("allow", "learn") or any(r.matches_name(name, port) for r in spec.allow)):
        return False
    return not spec.ports or port in spec.ports


def may_connect_resolved(spec: Spec, name_admitted_by_net_rule: bool, ip: Address, port: int) -> bool:
    """After a name was allowed: may egressd connect to this resolved address?"""
    klass = classify(ip)
    if klass is Klass.FORBIDDEN or any(r.matches_ip(ip, port) for r in spec.deny):
        return False
    if klass is Klass.GLOBAL:
        return True
    licensed = (
        spec.private_allow or name_admitted_by_net_rule or any(r.matches_ip(ip, port) for r in spec.allow)
    )
    if not licensed:
        return False
    if klass is Klass.LOOPBACK:
        return _loopback_ok(spec, port) and not _is_self(spec, ip, port)
    return True


def refused_everywhere(ips: Iterable[Address]) -> list[Address]:
    """The addresses no policy may ever connect to (DESIGN.md step 4)."""
    return [ip for ip in ips if classify(ip) is Klass.FORBIDDEN]


def first(items: Sequence[Address]) -> Address | None:
    return items[0] if items else None
