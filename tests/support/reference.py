"""An independent reference for what egressd must never allow, written from the RFCs' tables.

Why: a property "egressd refuses what it should" needs a second opinion that shares no code and
no table with egressd/policy, or a wrong network in egressd's tables would be copied into the test
that should catch it. This module imports nothing from egressd. It classifies addresses from the
IANA IPv4 and IPv6 Special-Purpose Address Registries (RFC 6890, with RFC 8190's "globally
reachable" column, as the registries stand in 2025: each entry cites the RFC that assigned it),
the address architecture (RFC 4291), the translation formats (RFC 6052, 6145, 3056, 4380, 8215),
and egressd's own contract for the addresses no setting lifts (docs/architecture.md, "Address
classes"). Where the registry leaves room (a globally reachable service inside a reserved block,
an N/A entry) every class egressd may choose is accepted: egressd may be stricter than the
registry, never looser.

It also interprets a policy *spec* (plain tuples, the same spec the tests turn into a YAML policy)
and answers one question — may this be allowed? It over-approximates (it may say "may" where
egressd refuses); it must never say "no" where egressd allows.
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


# egressd's contract: refused in every mode, no setting lifts it. Link-local (RFC 3927, RFC 4291
# §2.5.6) with the cloud metadata endpoints in and beside it (169.254.169.254; AWS's IPv6
# fd00:ec2::254; Alibaba Cloud's 100.100.100.200; Azure's 168.63.129.16), unspecified ("this
# network" RFC 791 §3.2, :: RFC 4291 §2.5.2), multicast (RFC 5771, RFC 4291 §2.7), limited
# broadcast (RFC 919 §7) and the reserved 240.0.0.0/4 (RFC 1112 §4).
V4_ALWAYS_REFUSED = tuple(
    IPv4Network(n)
    for n in (
        "0.0.0.0/8",
        "169.254.0.0/16",
        "100.100.100.200/32",
        "168.63.129.16/32",
        "224.0.0.0/4",
        "240.0.0.0/4",
        "255.255.255.255/32",
    )
)
V6_ALWAYS_REFUSED = tuple(IPv6Network(n) for n in ("::/128", "fe80::/10", "fd00:ec2::254/128", "ff00::/8"))
V4_LOOPBACK = IPv4Network("127.0.0.0/8")  # RFC 1122 §3.2.1.3
V6_LOOPBACK = IPv6Address("::1")  # RFC 4291 §2.5.3
# RFC 3879 deprecated site-local unicast: never global; egressd may refuse it outright
V6_SITE_LOCAL = IPv6Network("fec0::/10")
# RFC 4291 §2.4, IANA's IPv6 Address Space registry: only 2000::/3 is given out as global unicast
V6_GLOBAL_UNICAST = IPv6Network("2000::/3")

Entry = tuple[Network, bool | None, str]


def _registry(text: str) -> tuple[Entry, ...]:
    """Rows of `block  globally-reachable  what and where`, as the registry lists them."""
    entries = []
    for line in text.strip().splitlines():
        block, reachable, why = line.split(None, 2)
        entries.append((ipaddress.ip_network(block), {"yes": True, "no": False}.get(reachable), why))
    return tuple(entries)


# IANA IPv4 Special-Purpose Address Registry: (block, globally reachable, what and where). The most
# specific block holding an address decides; n/a is the registry's N/A.
V4_SPECIAL = _registry(
    """
    0.0.0.0/8            no   this network, RFC 791 §3.2
    10.0.0.0/8           no   private use, RFC 1918
    100.64.0.0/10        no   shared address space (CGNAT), RFC 6598
    127.0.0.0/8          no   loopback, RFC 1122
    169.254.0.0/16       no   link local, RFC 3927
    172.16.0.0/12        no   private use, RFC 1918
    192.0.0.0/24         no   IETF protocol assignments, RFC 6890 §2.1
    192.0.0.9/32         yes  port control protocol anycast, RFC 7723
    192.0.0.10/32        yes  TURN anycast, RFC 8155
    192.0.2.0/24         no   documentation (TEST-NET-1), RFC 5737
    192.31.196.0/24      yes  AS112-v4, RFC 7535
    192.52.193.0/24      yes  AMT, RFC 7450
    192.88.99.0/24       n/a  deprecated 6to4 relay anycast, RFC 7526
    192.168.0.0/16       no   private use, RFC 1918
    192.175.48.0/24      yes  direct delegation AS112 service, RFC 7534
    198.18.0.0/15        no   benchmarking, RFC 2544
    198.51.100.0/24      no   documentation (TEST-NET-2), RFC 5737
    203.0.113.0/24       no   documentation (TEST-NET-3), RFC 5737
    240.0.0.0/4          no   reserved, RFC 1112 §4
    255.255.255.255/32   no   limited broadcast, RFC 8190, RFC 919 §7
    """
)
# IANA IPv6 Special-Purpose Address Registry, read the same way.
V6_SPECIAL = _registry(
    """
    ::1/128              no   loopback, RFC 4291
    ::/128               no   unspecified, RFC 4291
    ::ffff:0:0/96        no   IPv4-mapped, RFC 4291
    64:ff9b::/96         yes  IPv4-IPv6 translation, RFC 6052
    64:ff9b:1::/48       no   IPv4-IPv6 translation for local use, RFC 8215
    100::/64             no   discard-only, RFC 6666
    100:0:0:1::/64       no   dummy IPv6 prefix, RFC 9780
    2001::/23            no   IETF protocol assignments, RFC 2928
    2001::/32            n/a  Teredo, RFC 4380, RFC 8190
    2001:1::1/128        yes  port control protocol anycast, RFC 7723
    2001:1::2/128        yes  TURN anycast, RFC 8155
    2001:1::3/128        yes  DNS-SD service registration protocol anycast, RFC 9665
    2001:2::/48          no   benchmarking, RFC 5180
    2001:3::/32          yes  AMT, RFC 7450
    2001:4:112::/48      yes  AS112-v6, RFC 7535
    2001:10::/28         no   deprecated ORCHID, RFC 4843
    2001:20::/28         yes  ORCHIDv2, RFC 7343
    2001:30::/28         yes  drone remote ID entity tags, RFC 9374
    2001:db8::/32        no   documentation, RFC 3849
    2002::/16            n/a  6to4, RFC 3056
    2620:4f:8000::/48    yes  direct delegation AS112 service, RFC 7534
    3fff::/20            no   documentation, RFC 9637
    5f00::/16            no   segment routing (SRv6) SIDs, RFC 9602
    fc00::/7             no   unique local, RFC 4193
    fe80::/10            no   link-local unicast, RFC 4291
    """
)


def registry_entry(ip: Address) -> Entry | None:
    """The most specific registry block holding ``ip``, or None when no entry names it."""
    table = V4_SPECIAL if ip.version == 4 else V6_SPECIAL
    found = [entry for entry in table if ip.version == entry[0].version and ip in entry[0]]
    return max(found, key=lambda entry: entry[0].prefixlen) if found else None


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


def embedded_v4(ip: IPv6Address, *, loose: bool = False) -> list[IPv4Address]:
    """Every IPv4 address an IPv6 address can stand for behind some translator (RFC 6052 NAT64,
    RFC 6145 SIIT, RFC 3056 6to4, RFC 4380 Teredo). Mapped/compatible are not here: they ARE the
    IPv4 host (see ``folded``). ``loose``: also the local-use layouts whose suffix is not zero (RFC
    6052 §2.2 says it SHOULD be: a translator may ignore it)."""
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
            if not loose and suffix < 128 and _bits(value, suffix, 128 - suffix):
                continue  # not this layout: its suffix would be zero
            v4 = 0
            for start, length in pieces:
                v4 = (v4 << length) | _bits(value, start, length)
            out.append(IPv4Address(v4))  # all zero: the zero fill of another layout, or 0.0.0.0
        return out
    return []


def folded(ip: Address) -> Address:
    """IPv4-mapped (::ffff:a.b.c.d) and IPv4-compatible (::a.b.c.d, RFC 4291 §2.5.5) IPv6 are the
    IPv4 host: a dual-stack socket connecting to one reaches the other."""
    if isinstance(ip, IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if int(ip) >> 32 == 0 and int(ip) > 1:
            return IPv4Address(int(ip))
    return ip


FORBIDDEN = frozenset({Klass.FORBIDDEN})
LOOPBACK = frozenset({Klass.LOOPBACK})
PRIVATE = frozenset({Klass.PRIVATE})
GLOBAL = frozenset({Klass.GLOBAL})
SPECIAL_SERVICE = frozenset({Klass.GLOBAL, Klass.PRIVATE})  # reachable, but egressd may refuse it


def _registry_classes(ip: Address) -> frozenset[Klass]:
    entry = registry_entry(ip)
    if entry is None:
        if isinstance(ip, IPv6Address) and ip not in V6_GLOBAL_UNICAST:
            return SPECIAL_SERVICE  # reserved by the IETF, never given out: either reading holds
        return GLOBAL
    return PRIVATE if entry[1] is False else SPECIAL_SERVICE


def classes(ip: Address) -> frozenset[Klass]:
    """Every class egressd may give ``ip``: one where the contract and the registries fix it, two
    where the registry leaves egressd room to be stricter."""
    ip = folded(ip)
    if isinstance(ip, IPv4Address):
        if any(ip in n for n in V4_ALWAYS_REFUSED):
            return FORBIDDEN
        if ip in V4_LOOPBACK:
            return LOOPBACK
        return _registry_classes(ip)
    if any(ip in n for n in V6_ALWAYS_REFUSED):
        return FORBIDDEN
    if ip == V6_LOOPBACK:
        return LOOPBACK
    own = frozenset({Klass.PRIVATE, Klass.FORBIDDEN}) if ip in V6_SITE_LOCAL else _registry_classes(ip)
    readings = embedded_v4(ip)
    inner = [classes(v4) for v4 in readings if int(v4)]
    # what egressd may also refuse: a layout reading 0.0.0.0 (the unspecified host, or another
    # layout's zero fill), and what a translator ignoring a non-zero suffix would reach
    stricter: frozenset[Klass] = frozenset()
    for v4 in embedded_v4(ip, loose=True):
        reached = classes(v4) if int(v4) else FORBIDDEN
        if Klass.FORBIDDEN in reached:
            stricter |= FORBIDDEN
        elif reached != GLOBAL:
            stricter |= PRIVATE
    if FORBIDDEN in inner:
        return FORBIDDEN  # what a translator would reach is never reachable
    if any(Klass.GLOBAL not in k for k in inner):
        return PRIVATE | stricter  # behind a translator: never loopback, and not global either
    if any(Klass.PRIVATE in k for k in inner):
        return own | PRIVATE | stricter
    return own | stricter


def classify(ip: Address) -> Klass:
    """The most permissive class egressd may give ``ip`` (the reference over-approximates)."""
    allowed = classes(ip)
    for klass in (Klass.GLOBAL, Klass.PRIVATE, Klass.LOOPBACK):
        if klass in allowed:
            return klass
    return Klass.FORBIDDEN


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
    # decision order, step 10: allow and learn admit any literal, but a non-global one only with
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
    """The addresses no policy may ever connect to (the always-refused class)."""
    return [ip for ip in ips if classify(ip) is Klass.FORBIDDEN]


def first(items: Sequence[Address]) -> Address | None:
    return items[0] if items else None
