"""The pure parts of the sandbox's capture: the DNS responder's answers, the name table, where a
captured connection is sent, the nftables rules and the launcher's command line.

Why: the integration tests (tests/test_sandbox_capture.py) prove the whole path with real clients;
these pin the edges a child could push on (odd names, a full table, unknown synthetic addresses,
loopback destinations) without starting a sandbox.
"""

from __future__ import annotations

import hashlib
import ipaddress
import struct

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import trustme

from egressd.ca import JKS_PASSWORD, java_truststore
from egressd.sandbox.bwrap import LAUNCHER_BOOT, BwrapSpec, bwrap_argv, launcher_command
from egressd.sandbox.capture import ruleset
from egressd.sandbox.intercept import SYNTHETIC, Capture, NameTable, answer, connect_head


def ask(table: NameTable, name: str, rdtype: str = "A") -> dns.message.Message:
    reply = answer(table, dns.message.make_query(name, rdtype).to_wire())
    assert reply is not None
    return dns.message.from_wire(reply)


def addresses(message: dns.message.Message) -> list[str]:
    return [r.address for rrset in message.answer for r in rrset]


def test_one_stable_synthetic_address_per_name() -> None:
    table = NameTable()
    first = addresses(ask(table, "up.test"))
    assert len(first) == 1 and ipaddress.ip_address(first[0]) in SYNTHETIC
    assert addresses(ask(table, "UP.Test.")) == first
    other = addresses(ask(table, "other.test"))
    assert other != first
    assert table.name_for(ipaddress.IPv4Address(first[0])) == "up.test"


def test_aaaa_and_other_types_have_no_data() -> None:
    table = NameTable()
    for rdtype in ("AAAA", "MX", "TXT", "HTTPS"):
        reply = ask(table, "up.test", rdtype)
        assert reply.rcode() == dns.rcode.NOERROR and reply.answer == []
    assert table.name_for(SYNTHETIC.network_address + 1) is None  # nothing handed out


def test_odd_names_are_refused_and_non_queries_dropped() -> None:
    table = NameTable()
    for name in ("a b.test", "crlf\r\n.test", "semi;colon.test", "."):
        assert ask(table, name).rcode() == dns.rcode.REFUSED, name
    assert answer(table, b"\x00\x01garbage") is None
    response = dns.message.make_response(dns.message.make_query("up.test", "A"))
    assert answer(table, response.to_wire()) is None


def test_a_full_table_fails_instead_of_growing() -> None:
    table = NameTable(limit=2)
    assert addresses(ask(table, "a.test")) and addresses(ask(table, "b.test"))
    assert ask(table, "c.test").rcode() == dns.rcode.SERVFAIL
    assert addresses(ask(table, "a.test"))  # known names still answer


def test_where_a_captured_connection_goes() -> None:
    capture = Capture(("127.0.0.1", 3128), "egressd:token", 3129)
    known = capture.table.address_for("up.test")
    assert known is not None
    assert capture.target(known, 443) == ("up.test", 443)
    assert capture.target(ipaddress.IPv4Address("198.51.100.7"), 80) == ("198.51.100.7", 80)
    assert capture.target(known + 1, 443) is None  # a synthetic address nobody asked for
    assert capture.target(ipaddress.IPv4Address("127.0.0.1"), 3129) is None  # the listener itself
    # redirected only for the host's loopback ports the policy names: the proxy decides them
    assert capture.target(ipaddress.IPv4Address("127.0.0.1"), 8080) == ("127.0.0.1", 8080)


def test_connect_head_carries_the_childs_credentials() -> None:
    assert connect_head("up.test", 443, "egressd:tok") == (
        b"CONNECT up.test:443 HTTP/1.1\r\nHost: up.test:443\r\n"
        b"Proxy-Authorization: Basic ZWdyZXNzZDp0b2s=\r\n\r\n"
    )


def test_ruleset_redirects_tcp_and_dns_and_drops_the_rest() -> None:
    rules = ruleset(3129, 1053)
    assert "udp dport 53 redirect to :1053" in rules and "tcp dport 53 redirect to :1053" in rules
    assert "meta l4proto tcp redirect to :3129" in rules
    assert "policy drop;" in rules
    # DNS is redirected before the loopback exemption, TCP after it
    assert rules.index("dport 53") < rules.index("ip daddr 127.0.0.0/8 accept") < rules.index(":3129")


def test_ruleset_sends_the_named_host_loopback_ports_to_the_proxy() -> None:
    rules = ruleset(3129, 1053, [8080, 5432, 8080])
    named = "ip saddr != 127.255.255.254 ip daddr 127.0.0.0/8 tcp dport { 5432, 8080 } redirect to :3129"
    assert named in rules
    # after DNS, before the sandbox's own loopback is let alone
    assert rules.index("dport 53") < rules.index(named) < rules.index("ip daddr 127.0.0.0/8 accept")
    assert "tcp dport {" not in ruleset(3129, 1053)


def test_launcher_and_bwrap_arguments_for_capture() -> None:
    argv = launcher_command(
        "/py", "/r", 5, 7, 8, [], ["curl"], setup_fd=9, capture=(3129, 1053, "127.0.0.1:3128")
    )
    assert argv == (
        "/py", "-I", "-S", "-c", LAUNCHER_BOOT, "/r", "--control-fd", "5", "--status-fd", "7",
        "--handover-fd", "8", "--setup-fd", "9", "--capture", "3129,1053=127.0.0.1:3128", "--", "curl",
    )  # fmt: skip
    spec = BwrapSpec("bwrap", "/w", (), ("true",), info_fd=11)
    args = bwrap_argv(spec)
    assert args[args.index("--info-fd") + 1] == "11"
    assert args.index("--info-fd") < args.index("--")


def test_java_truststore_holds_every_certificate_of_the_bundle() -> None:
    """The JVM's trust store for inspection: a JKS with one trusted-certificate entry per PEM
    certificate, and the integrity digest Java checks when given the password."""
    first, second = trustme.CA(), trustme.CA()
    pem = first.cert_pem.bytes() + b"\n" + second.cert_pem.bytes()
    store = java_truststore(pem, now=0)
    magic, version, count = struct.unpack(">IIi", store[:12])
    assert (magic, version, count) == (0xFEEDFEED, 2, 2)
    assert store[12:16] == struct.pack(">i", 2)  # a trusted-certificate entry
    body, digest = store[:-20], store[-20:]
    assert digest == hashlib.sha1(JKS_PASSWORD.encode("utf-16-be") + b"Mighty Aphrodite" + body).digest()
