"""Address classes, including IPv4 embedded in IPv6 (mapped, compatible, NAT64, 6to4, Teredo)."""

from __future__ import annotations

import ipaddress

import pytest

from egressd.policy import AddressClass, canonical_host, classify, embedded_ipv4

F, L, P, G = AddressClass.FORBIDDEN, AddressClass.LOOPBACK, AddressClass.PRIVATE, AddressClass.GLOBAL


def teredo(client: str, server: str = "65.54.227.120") -> str:
    """Teredo address: 2001:0:<server>:<flags>:<port>:<client XOR 0xffffffff>."""
    c = int(ipaddress.IPv4Address(client)) ^ 0xFFFFFFFF
    s = int(ipaddress.IPv4Address(server))
    return str(ipaddress.IPv6Address((0x20010000 << 96) | (s << 64) | (0x8000 << 48) | (0xF227 << 32) | c))


@pytest.mark.parametrize(
    ("address", "klass"),
    [
        # always refused
        ("169.254.169.254", F),
        ("169.254.0.1", F),
        ("169.254.255.255", F),
        ("100.100.100.200", F),
        ("168.63.129.16", F),
        ("0.0.0.0", F),
        ("0.1.2.3", F),
        ("224.0.0.1", F),
        ("239.255.255.250", F),
        ("255.255.255.255", F),
        ("240.0.0.1", F),
        ("250.1.2.3", F),
        ("::", F),
        ("fe80::1", F),
        ("febf::1", F),
        ("fec0::1", F),
        ("ff02::1", F),
        ("ff05::1:3", F),
        ("fd00:ec2::254", F),
        # loopback literals
        ("127.0.0.1", L),
        ("127.255.255.254", L),
        ("::1", L),
        # private / special-purpose
        ("10.0.0.1", P),
        ("172.16.0.1", P),
        ("172.31.255.255", P),
        ("192.168.1.1", P),
        ("100.64.0.1", P),
        ("100.127.255.255", P),
        ("100.100.100.199", P),
        ("198.18.0.1", P),
        ("198.19.255.255", P),
        ("192.0.2.1", P),
        ("198.51.100.7", P),
        ("203.0.113.9", P),
        ("192.0.0.8", P),
        ("fc00::1", P),
        ("fd00::1", P),
        ("fd00:ec2::253", P),
        ("2001:db8::1", P),
        ("100::1", P),
        ("64:ff9b:1:808:8:800::", P),  # local-use NAT64 is not global
        # global
        ("8.8.8.8", G),
        ("1.1.1.1", G),
        ("172.32.0.1", G),
        ("100.128.0.1", G),
        ("169.253.255.255", G),
        ("223.255.255.255", G),
        ("2606:4700:4700::1111", G),
        ("2a00:1450:4001::1", G),
    ],
)
def test_classify(address: str, klass: AddressClass) -> None:
    assert classify(ipaddress.ip_address(address)) is klass


@pytest.mark.parametrize(
    ("address", "klass"),
    [
        ("::ffff:169.254.169.254", F),  # mapped
        ("::ffff:127.0.0.1", L),  # mapped IS the IPv4 host: loopback rules apply (bypass corpus)
        ("::ffff:10.0.0.1", P),
        ("::ffff:8.8.8.8", G),
        ("::a9fe:a9fe", F),  # compatible
        ("::7f00:1", L),  # compatible: folded like mapped (canonical_ip does the same)
        ("::808:808", G),
        ("64:ff9b::a9fe:a9fe", F),  # NAT64
        ("64:ff9b::169.254.169.254", F),
        ("64:ff9b::7f00:1", P),
        ("64:ff9b::a00:1", P),
        ("64:ff9b::808:808", G),
        ("64:ff9b::6464:64c8", F),  # 100.100.100.200
        ("64:ff9b:1:a9fe:a9:fe00::", F),  # local-use NAT64, RFC 6052 /48 layout
        ("64:ff9b:1::a9fe:a9fe", F),  # ... and the /96 layout
        ("2002:a9fe:a9fe::", F),  # 6to4
        ("2002:a9fe:a9fe:1::1", F),
        ("2002:7f00:1::", P),
        ("2002:c0a8:101::1", P),
        ("2002:e000:1::", F),  # multicast
        ("2002:808:808::1", G),
        (teredo("169.254.169.254"), F),
        (teredo("127.0.0.1"), P),
        (teredo("8.8.8.8", server="169.254.169.254"), F),  # server bits checked too
        (teredo("8.8.8.8", server="10.0.0.1"), P),
    ],
)
def test_classify_embedded(address: str, klass: AddressClass) -> None:
    assert classify(ipaddress.ip_address(address)) is klass


@pytest.mark.parametrize(
    ("address", "v4"),
    [
        ("::ffff:1.2.3.4", "1.2.3.4"),
        ("::1.2.3.4", "1.2.3.4"),
        ("64:ff9b::1.2.3.4", "1.2.3.4"),
        ("64:ff9b:1:102:3:400::", "1.2.3.4"),
        ("2002:102:304::", "1.2.3.4"),
        (teredo("1.2.3.4"), "1.2.3.4"),
    ],
)
def test_embedded_ipv4(address: str, v4: str) -> None:
    assert embedded_ipv4(ipaddress.IPv6Address(address)) == ipaddress.IPv4Address(v4)


@pytest.mark.parametrize("address", ["::", "::1", "2001:db8::1", "fe80::1", "2606:4700::1"])
def test_no_embedded_ipv4(address: str) -> None:
    assert embedded_ipv4(ipaddress.IPv6Address(address)) is None


def test_teredo_helper_matches_rfc4380_example() -> None:
    # RFC 4380 5.1 example: client 192.0.2.45, server 65.54.227.120
    example = ipaddress.IPv6Address("2001:0:4136:e378:8000:63bf:3fff:fdd2")
    assert embedded_ipv4(example) == ipaddress.IPv4Address("192.0.2.45")


def test_canonical_mapped_metadata_is_forbidden() -> None:
    host = canonical_host("[::ffff:169.254.169.254]")
    assert host.ip == ipaddress.IPv4Address("169.254.169.254")
    assert host.ip is not None and classify(host.ip) is F
