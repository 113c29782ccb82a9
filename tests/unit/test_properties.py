"""Property tests: one spelling per host, one decision per address, index == linear scan."""

from __future__ import annotations

import ipaddress

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from egressd.policy import (
    Client,
    HostRule,
    RuleSet,
    TargetError,
    canonical_host,
    decide,
    parse_policy,
    parse_rule,
)

V4 = ipaddress.IPv4Address

# -- spellings ------------------------------------------------------------------------------------


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


def embedding_spellings(address: V4) -> list[str]:
    """IPv6 spellings that carry the address (NAT64, 6to4) without folding to it."""
    n = int(address)
    hi, lo = n >> 16, n & 0xFFFF
    return [f"[64:ff9b::{hi:x}:{lo:x}]", f"[2002:{hi:x}:{lo:x}::1]"]


ipv4s = st.integers(min_value=0, max_value=2**32 - 1).map(V4)

FORBIDDEN_NETS = [
    ipaddress.IPv4Network(n)
    for n in (
        "0.0.0.0/8",
        "169.254.0.0/16",
        "224.0.0.0/4",
        "240.0.0.0/4",
        "100.100.100.200/32",
        "168.63.129.16/32",
    )
]
forbidden_v4 = st.sampled_from(FORBIDDEN_NETS).flatmap(
    lambda net: st.integers(0, net.num_addresses - 1).map(lambda i: net.network_address + i)
)

SAMPLE_POLICY = parse_policy(
    {
        "version": 1,
        "mode": "enforce",
        "allow": ["10.0.0.0/8", "198.51.100.0/24:443", "8.0.0.0/7", "203.0.113.7"],
        "deny": ["10.1.0.0/16", "9.9.9.9"],
        "loopback": {"ports": [3000, 8080]},
        "ports": [80, 443, 3000],
    },
    "sample.yaml",
)
ALLOW_ALL = parse_policy(
    {"version": 1, "mode": "allow", "allow": ["0.0.0.0/0", "::/0"], "private": {"allow": True}}, "all.yaml"
)


@given(ipv4s, st.sampled_from([80, 443, 3000, 8080]))
def test_every_ipv4_spelling_is_one_address_with_one_decision(address: V4, port: int) -> None:
    answers = set()
    for spelling in spellings(address):
        host = canonical_host(spelling)
        assert host.ip == address, spelling
        host_part = spelling if spelling.startswith("[") else spelling
        decision = decide(f"{host_part}:{port}", Client(), SAMPLE_POLICY)
        answers.add((decision.allowed, decision.reason, decision.rule))
    assert len(answers) == 1, answers


@given(forbidden_v4, st.integers(1, 65535))
def test_forbidden_refused_in_every_spelling(address: V4, port: int) -> None:
    for spelling in spellings(address) + embedding_spellings(address):
        decision = decide(f"{spelling}:{port}", Client(), ALLOW_ALL)
        assert (decision.allowed, decision.reason) == (False, "forbidden_address"), spelling


# -- canonical_host is idempotent ----------------------------------------------------------------

LABEL_CHARS = "abcxyz019-_" + "äöüßéñ" + "ABC"
labels = st.text(alphabet=LABEL_CHARS, min_size=1, max_size=12)
names = st.lists(labels, min_size=1, max_size=4).map(".".join) | st.lists(labels, min_size=1, max_size=4).map(
    lambda ls: ".".join(ls) + "."
)
ipv6s = st.integers(min_value=0, max_value=2**128 - 1).map(lambda n: str(ipaddress.IPv6Address(n)))
hosts_raw = (
    names | ipv6s | ipv6s.map(lambda s: f"[{s}]") | ipv4s.flatmap(lambda a: st.sampled_from(spellings(a)))
)


@settings(max_examples=400)
@given(hosts_raw | st.text(max_size=30))
def test_canonical_host_is_idempotent(raw: str) -> None:
    try:
        host = canonical_host(raw)
    except TargetError:
        assume(False)
        return
    assert canonical_host(host.text) == host
    assert canonical_host(host.url_host()) == host
    if host.name is not None:
        assert host.name == host.name.lower() and host.name.isascii()
        assert not host.name.endswith(".")


# -- the index agrees with a linear scan ---------------------------------------------------------

SMALL_LABELS = st.sampled_from(["a", "b", "c", "xn--bcher-kva", "d1"])
small_names = st.lists(SMALL_LABELS, min_size=1, max_size=4).map(".".join)
ports = st.sampled_from([None, 80, 443])


def with_port(text: str, port: int | None) -> str:
    return text if port is None else f"{text}:{port}"


name_rules = st.builds(
    lambda wild, name, port: with_port(("*." if wild else "") + name, port), st.booleans(), small_names, ports
)
small_v4 = st.integers(0, 255).map(lambda x: V4((10 << 24) | (x << 16) | (x % 7)))
cidr_rules = st.builds(
    lambda address, length, port: with_port(
        str(ipaddress.ip_network(f"{address}/{length}", strict=False)), port
    ),
    small_v4,
    st.sampled_from([8, 12, 16, 24, 30, 32]),
    ports,
)
v6_rules = st.builds(
    lambda n, length: str(ipaddress.ip_network(f"2001:db8::{n:x}/{length}", strict=False)),
    st.integers(0, 0xFFFF),
    st.sampled_from([32, 64, 112, 120, 128]),
)
rule_texts = st.lists(name_rules | cidr_rules | v6_rules, max_size=25)
targets = small_names | small_v4.map(str) | st.integers(0, 0xFFFF).map(lambda n: f"[2001:db8::{n:x}]")


def reference_key(rule: HostRule, index: int) -> tuple[int, int, int, int]:
    """Most specific first: longest suffix / prefix, then exact name over wildcard, then a port."""
    if rule.network is not None:
        return (rule.network.prefixlen, 0, rule.port is not None, -index)
    assert rule.name is not None
    return (rule.name.count(".") + 1, rule.kind == "name", rule.port is not None, -index)


def reference_match(rules: list[HostRule], target: str, port: int) -> list[HostRule]:
    host = canonical_host(target)
    found = [(reference_key(r, i), r) for i, r in enumerate(rules) if r.matches(host, port)]
    return [r for _, r in sorted(found, key=lambda pair: pair[0], reverse=True)]


@settings(max_examples=300)
@given(rule_texts, targets, st.sampled_from([80, 443, 8080]))
def test_ruleset_agrees_with_linear_reference(texts: list[str], target: str, port: int) -> None:
    rules = [parse_rule(t) for t in texts]
    ruleset = RuleSet(rules)
    host = canonical_host(target)
    expected = reference_match(rules, target, port)
    assert ruleset.match(host, port) == (expected[0] if expected else None)
    assert list(ruleset.matches(host, port)) == expected
    if host.ip is not None:
        assert ruleset.match_address(host.ip, port) == (expected[0] if expected else None)
    assert len(ruleset) == len(rules)
