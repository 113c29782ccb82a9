"""The pure parts of the sandbox's capture: the DNS responder's answers, the name table, where a
captured connection is sent, the nftables rules and the launcher's command line.

Why: the integration tests (tests/e2e/test_sandbox_capture.py) prove the whole path with real clients;
these pin the edges a child could push on (odd names, a full table, unknown synthetic addresses,
loopback destinations) without starting a sandbox.
"""

from __future__ import annotations

import hashlib
import ipaddress
import socket
import struct

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import pytest
import trustme

from egressd.admission.handed import HandedOut, candidate_ports
from egressd.front.captured import http_request, parse_message
from egressd.inspect.ca import JKS_PASSWORD, java_truststore
from egressd.policy import parse_policy
from egressd.sandbox.bwrap import LAUNCHER_BOOT, BwrapSpec, bwrap_argv, launcher_command
from egressd.sandbox.capture import ruleset
from egressd.sandbox.intercept import SYNTHETIC, Capture, NameTable, answer


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
    channel, _other = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    capture = Capture(3129, channel)
    known = capture.table.address_for("up.test")
    assert known is not None
    assert capture.target(known, 443) == ("up.test", 443)
    assert capture.target(ipaddress.IPv4Address("198.51.100.7"), 80) == ("198.51.100.7", 80)
    assert capture.target(known + 1, 443) is None  # a synthetic address nobody asked for
    assert capture.target(ipaddress.IPv4Address("127.0.0.1"), 3129) is None  # the listener itself
    # redirected only for the host's loopback ports the policy names: the proxy decides them
    assert capture.target(ipaddress.IPv4Address("127.0.0.1"), 8080) == ("127.0.0.1", 8080)


@pytest.mark.parametrize(
    ("first", "speaks_http"),
    [
        (b"", None),
        (b"G", None),
        (b"GET", None),
        (b"GET ", True),
        (b"POST /x HTTP/1.1\r\n", True),
        (b"\x16\x03\x01\x02\x00", False),  # a TLS ClientHello
        (b"SSH-2.0-OpenSSH_9.2\r\n", False),
        (b"get / HTTP/1.1", False),  # methods are upper case
        (b" GET /", False),
        (b"A" * 20, False),  # longer than any method
        (b"\x00\x00", False),
    ],
)
def test_which_captured_clients_get_the_refusal_in_http(first: bytes, speaks_http: bool | None) -> None:
    assert http_request(first) is speaks_http


def test_the_launchers_message_for_a_captured_connection() -> None:
    assert parse_message(b"up.test 443 198.18.0.1 443") == ("up.test", 443, ("198.18.0.1", 443))
    for bad in (b"", b"up.test 443", b"up.test x 1.2.3.4 5", b"a b c d e", b"\xff 1 2 3"):
        assert parse_message(bad) is None, bad


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


def test_ruleset_for_a_child_that_is_not_sandboxed_sends_every_loopback_port_but_egressds() -> None:
    """exec's capture: a connection to any loopback port reaches the bridge, which tries the
    child's own server there first and else asks the proxy for the host's (decided by the loopback
    rules); the proxy's own listeners in the namespace, and the bridge's own tries, are left alone."""
    rules = ruleset(3129, 1053, [8080], all_loopback=True, own_ports=[3128, 3130, 1080])
    own = "ip saddr != 127.255.255.254 ip daddr 127.0.0.0/8 tcp dport != { 1053, 1080, 3128, 3129, 3130 }"
    assert f"{own} redirect to :3129" in rules
    assert "tcp dport { 8080 }" not in rules  # every port already
    assert rules.index("dport 53") < rules.index(own) < rules.index("ip daddr 127.0.0.0/8 accept")


def test_launcher_and_bwrap_arguments_for_capture() -> None:
    argv = launcher_command(
        "/py", "/r", 5, 7, 8, [], ["curl"], setup_fd=9, capture=(3129, 1053), names_fd=10, captures_fd=12
    )
    assert argv == (
        "/py", "-I", "-S", "-c", LAUNCHER_BOOT, "/r", "--control-fd", "5", "--status-fd", "7",
        "--handover-fd", "8", "--setup-fd", "9", "--capture", "3129,1053", "--names-fd", "10",
        "--captures-fd", "12", "--", "curl",
    )  # fmt: skip
    unshared = launcher_command("/py", "/r", 5, 7, 8, [], ["curl"], unshare=True)
    assert unshared[-3:] == ("--unshare", "--", "curl")
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


def test_real_answers_none_and_stand_ins() -> None:
    table = NameTable()
    v4, v6 = ipaddress.ip_address("198.51.100.2"), ipaddress.ip_address("3fff::1")

    def reply(name: str, rdtype: str, real: list[ipaddress.IPv4Address | ipaddress.IPv6Address] | None):
        wire = answer(table, dns.message.make_query(name, rdtype).to_wire(), real)
        assert wire is not None
        return dns.message.from_wire(wire)

    assert addresses(reply("up.test", "A", [v4, v6])) == ["198.51.100.2"]
    assert reply("up.test", "AAAA", [v4, v6]).answer == []  # IPv4 there: capture is IPv4
    assert addresses(reply("v6only.test", "AAAA", [v6])) == ["3fff::1"]
    assert reply("v6only.test", "A", [v6]).answer == []
    refused = reply("refused.test", "A", [])
    assert refused.rcode() == dns.rcode.NXDOMAIN and refused.answer == []
    assert reply("refused.test", "AAAA", []).rcode() == dns.rcode.NXDOMAIN
    (stand_in,) = addresses(reply("asked.test", "A", None))
    assert ipaddress.ip_address(stand_in) in SYNTHETIC
    assert table.name_for(ipaddress.IPv4Address(stand_in)) == "asked.test"


def test_handed_out_addresses_are_bounded_and_expire() -> None:
    handed = HandedOut(limit=2, keep=10.0)
    one, two = ipaddress.ip_address("198.51.100.1"), ipaddress.ip_address("198.51.100.2")
    handed.record("a.test", [one], now=0.0)
    handed.record("b.test", [two], now=1.0)
    assert handed.get("a.test", now=5.0) == (one,)
    handed.record("c.test", [two], now=2.0)  # the oldest answer goes
    assert handed.get("a.test", now=5.0) is None and handed.get("c.test", now=5.0) == (two,)
    assert handed.get("b.test", now=11.5) is None  # kept 10 s after its answer
    handed.record("c.test", [one], now=3.0)  # a newer answer replaces the older
    assert handed.get("c.test", now=5.0) == (one,)


def test_names_are_decided_on_the_ports_clients_use_and_those_the_policy_names() -> None:
    policy = parse_policy(
        {
            "version": 1,
            "allow": ["git.test:22", "db.test:5432", "web.test"],
            "ports": [443, 8443],
            "profiles": {"ci": {"allow": ["x.test:9000"]}},
        },
        "p.yaml",
    )
    assert candidate_ports(policy) == (443, 80, 8443, 22, 5432, 9000)


async def test_a_known_answer_is_filtered_like_a_lookup() -> None:
    """The addresses a child was given are pinned without a lookup, and still pass the filter for
    the connection's own port: a known loopback address is refused unless the port is named."""
    from egressd.admission.resolve import pin
    from egressd.policy import decide, parse_target
    from egressd.policy.decision import Client

    policy = parse_policy(
        {"version": 1, "allow": ["up.test"], "private": {"allow": True}, "loopback": {"ports": [8080]}},
        "p.yaml",
    )
    decision = decide(parse_target("up.test:443"), Client(), policy)
    _, found, _, _, lookup = await pin(decision, policy, (ipaddress.ip_address("198.51.100.2"),))
    assert found is not None and [str(a) for a in found.addresses] == ["198.51.100.2"]
    assert lookup is None
    _, found, refusal, _, _ = await pin(decision, policy, (ipaddress.ip_address("127.0.0.1"),))
    assert found is None and refusal is not None and refusal.reason == "resolved_forbidden"
