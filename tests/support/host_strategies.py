"""Helpers that several test modules use (so none imports another), from the tests of: Property tests:
one spelling per host, one decision per address, index == linear scan."""

from __future__ import annotations

import ipaddress

from hypothesis import strategies as st

V4 = ipaddress.IPv4Address


def octal_part(value: int) -> str:
    return "0" + format(value, "o")


def spellings(address: V4) -> list[str]:
    """Every legacy spelling inet_aton accepts for one address, plus IPv6 forms that fold to it."""
    n = int(address)
    a, b, c, d = address.packed
    return [
        str(address),
        str(address) + ".",
        str(n),
        hex(n),
        hex(n).upper().replace("0X", "0x"),
        "0" + format(n, "o"),
        ".".join(octal_part(x) for x in (a, b, c, d)),
        ".".join(hex(x) for x in (a, b, c, d)),
        f"{a}.{b}.{(c << 8) | d}",
        f"{a}.{(b << 16) | (c << 8) | d}",
        f"{hex(a)}.{b}.{octal_part((c << 8) | d)}",
        f"[::ffff:{address}]",
        f"[::ffff:{(n >> 16):x}:{(n & 0xFFFF):x}]",
    ]


ipv4s = st.integers(min_value=0, max_value=2**32 - 1).map(V4)


LABEL_CHARS = "abcxyz019-_" + "äöüßéñ" + "ABC"


labels = st.text(alphabet=LABEL_CHARS, min_size=1, max_size=12)


names = st.lists(labels, min_size=1, max_size=4).map(".".join) | st.lists(labels, min_size=1, max_size=4).map(
    lambda ls: ".".join(ls) + "."
)


ipv6s = st.integers(min_value=0, max_value=2**128 - 1).map(lambda n: str(ipaddress.IPv6Address(n)))


hosts_raw = (
    names | ipv6s | ipv6s.map(lambda s: f"[{s}]") | ipv4s.flatmap(lambda a: st.sampled_from(spellings(a)))
)


