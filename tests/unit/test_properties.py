"""Property tests: one spelling per host, one decision per address, index == linear scan."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from egressd.policy import (
    Client,
    Host,
    HostRule,
    RuleSet,
    TargetError,
    addresses,
    canonical_host,
    classify,
    decide,
    decide_written,
    hosts,
    make_target,
    parse_policy,
    parse_rule,
)
from egressd.policy.addresses import describe
from tests.support import reference as ref
from tests.support.host_strategies import V4, hosts_raw, ipv4s, spellings

# -- spellings ------------------------------------------------------------------------------------


def embedding_spellings(address: V4) -> list[str]:
    """IPv6 spellings that carry the address (NAT64, 6to4) without folding to it."""
    n = int(address)
    hi, lo = n >> 16, n & 0xFFFF
    return [f"[64:ff9b::{hi:x}:{lo:x}]", f"[2002:{hi:x}:{lo:x}::1]"]


forbidden_v4 = st.sampled_from(ref.V4_ALWAYS_REFUSED).flatmap(
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
    found = ruleset.matching(host, port)
    assert found == expected
    found.clear()  # a new list each time: the index is not touched
    assert ruleset.matching(host, port) == expected
    if host.ip is not None:
        assert ruleset.match_address(host.ip, port) == (expected[0] if expected else None)
    assert len(ruleset) == len(rules)


# -- every address gets a class the RFC tables allow (tests/support/reference.py) ---------------

V6 = ipaddress.IPv6Address
V4_NET, V6_NET = ipaddress.IPv4Network, ipaddress.IPv6Network


def _blocks() -> list[V4_NET | V6_NET]:
    """Every block the reference names: the registries' entries and the contract's own lists."""
    special = [block for block, _, _ in (*ref.V4_SPECIAL, *ref.V6_SPECIAL)]
    return [
        *special,
        *ref.V4_ALWAYS_REFUSED,
        *ref.V6_ALWAYS_REFUSED,
        ref.V6_SITE_LOCAL,
        ref.V6_GLOBAL_UNICAST,
    ]


def _edges(version: int) -> list[int]:
    """The first and last address of every block of that version, and their neighbours."""
    top = 2**32 - 1 if version == 4 else 2**128 - 1
    out = set()
    for block in _blocks():
        if block.version == version:
            first, last = int(block.network_address), int(block.broadcast_address)
            out |= {
                v
                for v in (first - 1, first, first + 1, (first + last) // 2, last - 1, last, last + 1)
                if 0 <= v <= top
            }
    return sorted(out)


V4_EDGES, V6_EDGES = _edges(4), _edges(6)
v4_edges = st.sampled_from(V4_EDGES).map(V4)
v6_edges = st.sampled_from(V6_EDGES).map(V6)
EMBEDDING_PREFIXES = [  # (prefix value, bits below it): mapped, compatible, SIIT, NAT64, 6to4, Teredo
    (0xFFFF << 32, 32),
    (0, 32),
    (0xFFFF << 48, 32),
    (0x64FF9B << 96, 32),
    (0x64FF9B0001 << 80, 80),
    (0x2002 << 112, 112),
    (0x20010000 << 96, 96),
]
v4_interesting = ipv4s | v4_edges
v6_embedding = st.builds(
    lambda prefix, v4, spread, shift: V6(prefix[0] | ((int(v4) << shift | spread) & ((1 << prefix[1]) - 1))),
    st.sampled_from(EMBEDDING_PREFIXES),
    v4_interesting,
    st.integers(0, 2**32 - 1),
    st.sampled_from([0, 16, 32, 40, 48, 64]),
)
v6_any = st.integers(0, 2**128 - 1).map(V6)


def _check(ip: V4 | V6) -> None:
    allowed = sorted(klass.value for klass in ref.classes(ip))  # the two modules' enums, by value
    assert classify(ip).value in allowed, (ip, describe(ip), allowed)
    assert describe(ip)[0] is classify(ip)


def test_every_registry_block_and_its_edges_get_a_class_the_rfcs_allow() -> None:
    """Each block of the IANA special-purpose registries and of egressd's contract, at its first,
    middle and last address and just outside it: a network missing from egressd's tables, or one
    too wide or too narrow, shows here."""
    for value in V4_EDGES:
        _check(V4(value))
    for value in V6_EDGES:
        _check(V6(value))


@settings(max_examples=600)
@given(v4_interesting)
def test_ipv4_class_is_one_the_rfcs_allow(ip: V4) -> None:
    _check(ip)


@settings(max_examples=600)
@given(v6_any | v6_edges | v6_embedding | v4_interesting.map(lambda v4: V6(int(v4))))
def test_ipv6_class_is_one_the_rfcs_allow(ip: V6) -> None:
    _check(ip)


@settings(max_examples=300)
@given(st.sampled_from(addresses._V4_TABLE._starts) | st.sampled_from(addresses._V6_TABLE._starts))
def test_the_range_tables_answer_as_their_rules_at_every_edge(start: int) -> None:
    """The lookup tables are filled from first-match rules; at each range start and next to it the
    table answers what the rules say for that very address (an off-by-one would not)."""
    for value in (start - 1, start, start + 1):
        if start < 2**32 and 0 <= value < 2**32 and start in addresses._V4_TABLE._starts:
            ip4 = V4(value)
            rules = (addresses._V4_FORBIDDEN, addresses._V4_LOOPBACK, addresses._V4_PRIVATE)
            assert addresses._V4_TABLE(value) == addresses._first_match(ip4, *rules), ip4
        if 0 <= value < 2**128 and start in addresses._V6_TABLE._starts:
            ip6 = V6(value)
            rules6 = (addresses._V6_FORBIDDEN, V6_NET(addresses._V6_LOOPBACK), addresses._V6_PRIVATE)
            assert addresses._V6_TABLE(value)[0] == addresses._first_match(ip6, *rules6), ip6


# -- trusting make_target's Targets is sound: making one again from its fields changes nothing -----

schemes = st.sampled_from([None, "connect", "HTTP", "https", "Socks5"])
methods = st.sampled_from([None, "CONNECT", "get", "Post", "x-y_z"])
paths = st.sampled_from([None, "/", "/v1/x", "/a/../b", "/%2e%2e/x", "nope"])


@settings(max_examples=400)
@given(hosts_raw | st.text(max_size=30), st.integers(1, 65535), schemes, paths, methods)
def test_make_target_is_idempotent(
    raw: str, port: int, scheme: str | None, path: str | None, method: str | None
) -> None:
    try:
        made = make_target(raw, port, scheme=scheme, path=path, method=method)
    except TargetError:
        assume(False)
        return
    again = make_target(made.host.text, made.port, scheme=made.scheme, path=made.path, method=made.method)
    assert again == made
    assert again.host.text == made.host.text and again.authority() == made.authority()


NAMES_POLICY = parse_policy(
    {
        "version": 1,
        "allow": ["example.com", "*.svc.test", "10.0.0.0/8", {"host": "api.test", "paths": ["/v1"]}],
        "deny": ["bad.example.com", {"host": "api.test", "paths": ["/v1/admin"]}],
    },
    "names.yaml",
)


@settings(max_examples=400)
@given(hosts_raw | st.text(max_size=30), st.integers(0, 70000), schemes, paths, methods)
def test_a_written_target_decides_as_its_canonical_target(
    raw: str, port: int, scheme: str | None, path: str | None, method: str | None
) -> None:
    """The pipeline decides what a client wrote (decide_written); any spelling of a target decides
    exactly as the canonical Target does, and the decision carries that target, never the spelling."""
    written = decide_written(raw, port, Client(), NAMES_POLICY, scheme=scheme, path=path, method=method)
    try:
        made = make_target(raw, port, scheme=scheme, path=path, method=method)
    except TargetError:
        assert written.reason == "invalid_target" and not written.allowed and written.target is None
        return
    assert written == decide(made, Client(), NAMES_POLICY)
    assert written.target == made and written.target.host.text == made.host.text


# -- the fast paths of canonical_host answer as the general code does ------------------------------

FORBIDDEN_HOST_CHARS = frozenset(" \t\r\n\v\f@/\\%?#[]<>^|\"'`{}")


def reference_bad_char(text: str) -> bool:
    return any(
        c in FORBIDDEN_HOST_CHARS or ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c.isspace() for c in text
    )


def reference_name(text: str) -> str | None:
    """A plain ASCII name label by label, as the general loop reads it (None: not a plain name)."""
    labels = text.lower().removesuffix(".").split(".")
    plain = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")
    if any(not plain.fullmatch(label) or label.startswith("xn--") for label in labels):
        return None
    return ".".join(labels)


host_chars = st.text(alphabet="abcXYZ019._-:@%/ \t\x00\x7f\x85\u2003é[]", max_size=20)
NUMERIC = re.compile(r"(?:0[xX][0-9a-fA-F]*|[0-9]+)")
ascii_names = st.lists(
    st.from_regex(r"[a-zA-Z0-9_]([a-zA-Z0-9_-]{0,6}[a-zA-Z0-9_])?", fullmatch=True)
    | st.text(alphabet="abcXYZ0189_-", min_size=0, max_size=8)
    | st.sampled_from(["xn--bcher-kva", "xn--x", "a" * 64]),
    min_size=1,
    max_size=4,
).map(".".join)


def rejects(check: Callable[[str], None], text: str) -> bool:
    try:
        check(text)
    except TargetError:
        return True
    return False


@settings(max_examples=500)
@given(host_chars)
def test_character_checks_agree_with_reference(text: str) -> None:
    assert rejects(lambda t: hosts._check_chars(t, t), text) == reference_bad_char(text)
    spaces = any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in text)
    assert rejects(hosts._check_no_space, text) == spaces


@settings(max_examples=500)
@given(ascii_names)
def test_plain_names_read_as_label_by_label(text: str) -> None:
    expected = reference_name(text)
    try:
        host: Host | None = canonical_host(text)
    except TargetError:
        host = None
    if expected is not None and len(expected) <= 253 and not NUMERIC.fullmatch(expected.split(".")[-1]):
        assert host == Host(name=expected)
        assert canonical_host(text.removesuffix(".") + ".") == host
    elif host is not None:  # only an IP or a name with an IDNA label gets past the general code
        assert host.ip is not None or "xn--" in (host.name or "")


@given(ipv4s)
def test_dotted_quad_reads_as_the_address(address: V4) -> None:
    assert canonical_host(str(address)) == Host(name=None, ip=address)
    assert hosts._parse_legacy_ipv4(str(address), str(address)) == address
