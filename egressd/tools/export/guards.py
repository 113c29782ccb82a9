"""egressd's address guards as plain network lists, for targets that filter by address.

Why here: every target must refuse at least what egressd refuses by address class (the
always-refused and private classes of docs/architecture.md, and the resolved-address filter), or
the export is wider. The lists are a superset of ``egressd.policy.classify``:
tests/e2e/test_export.py checks each network against the public classifier, walks the edges of
every special-purpose block, and samples addresses to prove nothing non-global falls outside them.
"""

from __future__ import annotations

from ipaddress import IPv4Network, IPv6Network, ip_network

__all__ = ["FORBIDDEN", "LOOPBACK", "MAPPED_V4", "NON_GLOBAL", "PRIVATE", "Network"]

Network = IPv4Network | IPv6Network


def _nets(*texts: str) -> tuple[Network, ...]:
    return tuple(ip_network(t) for t in texts)


# Always refused, no setting lifts them (step 4).
FORBIDDEN: tuple[Network, ...] = _nets(
    "0.0.0.0/8",
    "169.254.0.0/16",
    "100.100.100.200/32",
    "168.63.129.16/32",
    "224.0.0.0/4",
    "240.0.0.0/4",  # includes 255.255.255.255
    "::/128",
    "fd00:ec2::254/128",
    "fe80::/10",
    "fec0::/10",
    "ff00::/8",
)
LOOPBACK: tuple[Network, ...] = _nets("127.0.0.0/8", "::1/128")
# Needs private.allow, an IP/CIDR allow rule or a private origin. IPv6 ranges that embed an IPv4
# address (compatible, NAT64, SIIT, 6to4, Teredo) are all here: egressd classifies them by the
# address they carry, a target cannot, so the export refuses them unless a rule names them (narrower).
PRIVATE: tuple[Network, ...] = _nets(
    "10.0.0.0/8",
    "100.64.0.0/10",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.0.2.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "198.51.100.0/24",
    "203.0.113.0/24",
    "::/96",
    "64:ff9b::/96",
    "64:ff9b:1::/48",
    "100::/64",
    "100:0:0:1::/64",
    "2001::/23",
    "2001:db8::/32",
    "2002::/16",
    "3fff::/20",
    "5f00::/16",
    "fc00::/7",
    "::ffff:0:0:0/96",
)
# IPv4-mapped IPv6 is the IPv4 address itself (egressd classifies it so); a target that keeps IPv4
# addresses as mapped IPv6 internally (Squid) must not get this range in an address list.
MAPPED_V4: Network = ip_network("::ffff:0:0/96")
NON_GLOBAL: tuple[Network, ...] = FORBIDDEN + LOOPBACK + PRIVATE + (MAPPED_V4,)
