"""Address classification: which addresses are always refused, loopback, private or global.

Checked on the target literal before anything else and on every resolved address, so a name (or an
IPv6 spelling embedding an IPv4 address) cannot reach what the literal could not.
"""

from __future__ import annotations

import enum
import functools
import ipaddress
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

from .hosts import IPAddress

__all__ = ["AddressClass", "classify", "describe", "embedded_ipv4", "embedded_ipv4_candidates"]


class AddressClass(enum.Enum):
    FORBIDDEN = "forbidden"
    LOOPBACK = "loopback"
    PRIVATE = "private"
    GLOBAL = "global"


_V4_FORBIDDEN: tuple[tuple[IPv4Network, str], ...] = (
    (IPv4Network("0.0.0.0/8"), "unspecified"),
    (IPv4Network("169.254.169.254/32"), "cloud metadata"),
    (IPv4Network("169.254.0.0/16"), "link-local"),
    (IPv4Network("100.100.100.200/32"), "cloud metadata"),
    (IPv4Network("168.63.129.16/32"), "cloud metadata"),
    (IPv4Network("255.255.255.255/32"), "broadcast"),
    (IPv4Network("224.0.0.0/4"), "multicast"),
    (IPv4Network("240.0.0.0/4"), "reserved"),
)
_V4_LOOPBACK = IPv4Network("127.0.0.0/8")
_V4_PRIVATE: tuple[IPv4Network, ...] = tuple(
    IPv4Network(n)
    for n in (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "198.18.0.0/15",
        "192.0.0.0/24",
        "192.0.2.0/24",
        "198.51.100.0/24",
        "203.0.113.0/24",
    )
)

_V6_FORBIDDEN: tuple[tuple[IPv6Network, str], ...] = (
    (IPv6Network("::/128"), "unspecified"),
    (IPv6Network("fd00:ec2::254/128"), "cloud metadata"),
    (IPv6Network("fe80::/10"), "link-local"),
    (IPv6Network("fec0::/10"), "site-local"),
    (IPv6Network("ff00::/8"), "multicast"),
)
_V6_LOOPBACK = IPv6Address("::1")
_V6_PRIVATE: tuple[IPv6Network, ...] = tuple(
    IPv6Network(n)
    for n in (
        "fc00::/7",
        "2001:db8::/32",
        "64:ff9b:1::/48",
        "100::/64",
        "100:0:0:1::/64",  # the dummy prefix (RFC 9780); Python 3.12's ipaddress calls it global
        "2001::/23",
        "::ffff:0:0/96",
        "::/96",
        "3fff::/20",  # documentation (RFC 9637); Python 3.12's ipaddress calls it global
        "5f00::/16",  # SRv6 SIDs (RFC 9602), not globally routable
    )
)

_NAT64 = IPv6Network("64:ff9b::/96")
_NAT64_LOCAL = IPv6Network("64:ff9b:1::/48")
_SIIT = IPv6Network("::ffff:0:0:0/96")  # "IPv4-translated" addresses of stateless translators (RFC 6145)
# RFC 6052 layouts a site may pick inside the local-use /48 (prefix /48, /56, /64): the IPv4 bytes,
# skipping the u octet (byte 8), and the suffix bytes that must be zero for that layout to apply.
_NAT64_LOCAL_LAYOUTS: tuple[tuple[tuple[int, ...], range], ...] = (
    ((6, 7, 9, 10), range(11, 16)),
    ((7, 9, 10, 11), range(12, 16)),
    ((9, 10, 11, 12), range(13, 16)),
)
_SIX_TO_FOUR = IPv6Network("2002::/16")
_TEREDO = IPv6Network("2001::/32")


def embedded_ipv4(ip: IPv6Address) -> IPv4Address | None:
    """The IPv4 address an IPv6 address carries (mapped, compatible, SIIT, NAT64, 6to4, Teredo client)."""
    candidates = embedded_ipv4_candidates(ip)
    return candidates[0] if candidates else None


def embedded_ipv4_candidates(ip: IPv6Address) -> tuple[IPv4Address, ...]:
    """Every IPv4 address a translator might extract; the first is the canonical one.

    More than one candidate exists for Teredo (client and server) and for the local-use NAT64
    prefix (whose prefix length is a site choice), so classification checks them all.
    """
    value = int(ip)
    low32 = IPv4Address(value & 0xFFFFFFFF)
    if ip.ipv4_mapped is not None:
        return (ip.ipv4_mapped,)
    if value >> 32 == 0:
        return (low32,) if value > 1 else ()
    if ip in _NAT64 or ip in _SIIT:
        return (low32,)
    if ip in _NAT64_LOCAL:
        # The site picks the prefix length (/48 to /96), so every layout whose suffix is zero is a
        # candidate (the /48 one always: a translator may ignore the suffix); the zero fill of another
        # layout is not.
        raw = ip.packed
        first = IPv4Address(bytes(raw[i] for i in _NAT64_LOCAL_LAYOUTS[0][0]))
        layouts = [first]
        for positions, suffix in _NAT64_LOCAL_LAYOUTS[1:]:
            if not any(raw[i] for i in suffix):
                layouts.append(IPv4Address(bytes(raw[i] for i in positions)))
        layouts.append(low32)
        return tuple(dict.fromkeys(v4 for v4 in layouts if int(v4))) or (first,)
    if ip in _SIX_TO_FOUR:
        return (IPv4Address(ip.packed[2:6]),)
    if ip in _TEREDO:
        client = IPv4Address((value & 0xFFFFFFFF) ^ 0xFFFFFFFF)
        server = IPv4Address(ip.packed[4:8])
        return (client, server)
    return ()


def _first_match(
    ip: IPAddress,
    forbidden: tuple[tuple[IPv4Network, str], ...] | tuple[tuple[IPv6Network, str], ...],
    loopback: IPv4Network | IPv6Network,
    private: tuple[IPv4Network, ...] | tuple[IPv6Network, ...],
) -> tuple[AddressClass, str]:
    """The rules as written, first match wins (embedded IPv4 aside); only used to fill the tables."""
    for network, why in forbidden:
        if ip in network:
            return AddressClass.FORBIDDEN, why
    if ip in loopback:
        return AddressClass.LOOPBACK, "loopback"
    for network in private:
        if ip in network:
            return AddressClass.PRIVATE, f"private ({network})"
    if not ip.is_global:
        return AddressClass.PRIVATE, "special-purpose (not global)"
    return AddressClass.GLOBAL, "global"


class _RangeTable[T]:
    """Sorted range starts and the value of each range: one bisect instead of a scan of networks.

    Built from every network boundary the first-match rules can see, so each range lies wholly
    inside or outside each network and the value at its start is the value of all its addresses.
    """

    __slots__ = ("_starts", "_values")

    def __init__(self, boundaries: Iterable[int], value_at: Callable[[int], T]) -> None:
        self._starts: tuple[int, ...] = tuple(sorted(set(boundaries) | {0}))
        self._values: tuple[T, ...] = tuple(value_at(start) for start in self._starts)

    def __call__(self, value: int) -> T:
        return self._values[bisect_right(self._starts, value) - 1]

    def __len__(self) -> int:
        return len(self._starts)


def _bounds(networks: Iterable[IPv4Network | IPv6Network]) -> Iterator[int]:
    """First address of each network and the first address after it (if any)."""
    for network in networks:
        yield int(network.network_address)
        end = int(network.broadcast_address)
        if end < (1 << network.max_prefixlen) - 1:
            yield end + 1


_NETWORK_OR_ADDRESS = (IPv4Network, IPv6Network, IPv4Address, IPv6Address)


def _stdlib_networks(constants: object, version: int) -> list[IPv4Network | IPv6Network]:
    """The networks ``is_global`` consults; read generically, as the lists vary by Python version."""
    found: list[IPv4Network | IPv6Network] = []
    for value in vars(constants).values() if constants is not None else ():
        for item in value if isinstance(value, list | tuple | frozenset | set) else (value,):
            if isinstance(item, _NETWORK_OR_ADDRESS) and item.version == version:
                found.append(ipaddress.ip_network(item))
    return found


_EMBEDDING: tuple[IPv6Network, ...] = (
    IPv6Network("::/96"),  # IPv4-compatible (and :: / ::1, which embed nothing)
    IPv6Network("::ffff:0:0/96"),  # IPv4-mapped
    _NAT64,
    _NAT64_LOCAL,
    _SIIT,
    _SIX_TO_FOUR,
    _TEREDO,
)

_V4Table = _RangeTable[tuple[AddressClass, str]]
# per range: the IPv6 class ignoring embedded IPv4, and whether the range carries an IPv4 address
_V6Table = _RangeTable[tuple[tuple[AddressClass, str], bool]]


@functools.cache
def _tables() -> tuple[_V4Table, _V6Table]:
    """The range tables, built with the first classification (~2 ms: a wrapped command's start
    classifies no address before its child starts)."""
    v4: _V4Table = _RangeTable(
        _bounds(
            [n for n, _ in _V4_FORBIDDEN]
            + [_V4_LOOPBACK, *_V4_PRIVATE]
            + _stdlib_networks(getattr(ipaddress, "_IPv4Constants", None), 4)
        ),
        lambda start: _first_match(IPv4Address(start), _V4_FORBIDDEN, _V4_LOOPBACK, _V4_PRIVATE),
    )
    v6: _V6Table = _RangeTable(
        _bounds(
            [n for n, _ in _V6_FORBIDDEN]
            + [IPv6Network(_V6_LOOPBACK), *_V6_PRIVATE, *_EMBEDDING]
            + _stdlib_networks(getattr(ipaddress, "_IPv6Constants", None), 6)
        ),
        lambda start: (
            _first_match(IPv6Address(start), _V6_FORBIDDEN, IPv6Network(_V6_LOOPBACK), _V6_PRIVATE),
            any(IPv6Address(start) in network for network in _EMBEDDING),
        ),
    )
    return v4, v6


def __getattr__(name: str) -> object:
    """`_V4_TABLE` and `_V6_TABLE`: the tables, by name."""
    if name == "_V4_TABLE":
        return _tables()[0]
    if name == "_V6_TABLE":
        return _tables()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _classify_v4(ip: IPv4Address) -> tuple[AddressClass, str]:
    return _tables()[0](int(ip))


def _classify_v6(ip: IPv6Address) -> tuple[AddressClass, str]:
    plain, embeds = _tables()[1](int(ip))
    if not embeds and isinstance(ip, IPv6Address):  # anything else fails below
        return plain
    candidates = embedded_ipv4_candidates(ip)
    if candidates and (ip.ipv4_mapped is not None or int(ip) >> 32 == 0):
        # Mapped/compatible forms ARE the IPv4 host (a dual-stack socket connecting to
        # ::ffff:127.0.0.1 reaches 127.0.0.1): same class, LOOPBACK included, so loopback rules
        # (loopback.allow, loopback.ports, egressd's own port) apply to them too.
        klass, why = _classify_v4(candidates[0])
        return klass, why if klass is AddressClass.GLOBAL else f"embeds {candidates[0]} ({why})"
    worst: tuple[AddressClass, str] | None = None
    for v4 in candidates:
        klass, why = _classify_v4(v4)
        if klass is AddressClass.FORBIDDEN:
            return klass, f"embeds {v4} ({why})"
        if klass is not AddressClass.GLOBAL and worst is None:
            worst = (AddressClass.PRIVATE, f"embeds {v4} ({why})")
    return worst if worst is not None else plain


def describe(ip: IPAddress) -> tuple[AddressClass, str]:
    """Class plus a short human reason (for refusal details)."""
    if isinstance(ip, ipaddress.IPv4Address):
        return _classify_v4(ip)
    return _classify_v6(ip)


def classify(ip: IPAddress) -> AddressClass:
    """Class of an address in any spelling.

    IPv4-mapped/compatible addresses get the class of their IPv4 address (LOOPBACK included); an
    IPv4 address behind a translator (NAT64, 6to4, Teredo, SIIT) is never LOOPBACK, only PRIVATE.
    """
    return describe(ip)[0]
