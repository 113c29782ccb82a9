"""Property tests: egressd's pure core never allows what an independent reference refuses.

Why: the bypass corpus lists the tricks we thought of; these properties let hypothesis look for the
ones we did not. Every generated target carries its ground truth (the address or name it spells),
every generated policy is a spec that tests/support/reference.py reads on its own, and the one
property is: ``decide`` (and the address filter after it) allows ⇒ the reference allows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import re
import socket
from ipaddress import IPv4Address, IPv6Address, IPv6Network

from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st

from egressd.policy import (
    Client,
    PolicyError,
    TargetError,
    canonical_host,
    decide,
    filter_addresses,
    make_target,
    parse_policy,
    parse_target,
)
from tests.support import reference as ref

PORTS = (80, 443, 8080)
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- addresses, biased towards the ranges that matter ----------------------------------------------
_V4_NETS = [
    ipaddress.IPv4Network(n)
    for n in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "100.100.100.200/32",
        "127.0.0.0/8",
        "168.63.129.16/32",
        "169.254.169.254/32",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.0.2.0/24",
        "192.168.0.0/16",
        "198.18.0.0/15",
        "198.51.100.0/24",
        "203.0.113.0/24",
        "224.0.0.0/4",
        "240.0.0.0/4",
        "255.255.255.255/32",
        "8.8.8.0/24",
    )
]
_V6_PREFIXES = [
    IPv6Network(n)
    for n in (
        "::/96",
        "::ffff:0:0/96",
        "::ffff:0:0:0/96",
        "64:ff9b::/96",
        "64:ff9b:1::/48",
        "2002::/16",
        "2001::/32",
        "2001:db8::/32",
        "fc00::/7",
        "fd00:ec2::254/128",
        "fe80::/10",
        "fec0::/10",
        "ff00::/8",
        "::1/128",
        "::/128",
        "2606:4700::/32",
        "3fff::/20",
    )
]


def _in(network: ipaddress.IPv4Network | IPv6Network) -> st.SearchStrategy[IPv4Address | IPv6Address]:
    return st.integers(0, network.num_addresses - 1).map(lambda i: network.network_address + i)


v4s: st.SearchStrategy[IPv4Address] = st.one_of(
    st.sampled_from(_V4_NETS).flatmap(_in), st.integers(0, 2**32 - 1).map(IPv4Address)
)  # type: ignore[assignment]
v6s: st.SearchStrategy[IPv6Address] = st.one_of(
    st.sampled_from(_V6_PREFIXES).flatmap(_in), st.integers(0, 2**128 - 1).map(IPv6Address)
)  # type: ignore[assignment]


def _v6_embedding(v4: IPv4Address, how: str) -> IPv6Address:
    n = int(v4)
    if how == "mapped":
        return IPv6Address((0xFFFF << 32) | n)
    if how == "compatible":
        return IPv6Address(n)
    if how == "nat64":
        return IPv6Address((0x64FF9B << 96) | n)
    if how == "siit":
        return IPv6Address((0xFFFF << 48) | n)
    if how == "6to4":
        return IPv6Address((0x2002 << 112) | (n << 80) | 1)
    if how == "teredo":
        return IPv6Address((0x20010000 << 96) | (0x4136E378 << 64) | (n ^ 0xFFFFFFFF))
    if how == "local56":  # 64:ff9b:1:XX<a>::  with the /56 layout (site byte 0x12)
        raw = bytearray(IPv6Address("64:ff9b:1::").packed)
        four = v4.packed
        raw[6], raw[7], raw[9], raw[10], raw[11] = 0x12, four[0], four[1], four[2], four[3]
        return IPv6Address(bytes(raw))
    raise AssertionError(how)


EMBEDDINGS = ["mapped", "compatible", "nat64", "siit", "6to4", "teredo", "local56"]
embeddings = st.builds(_v6_embedding, v4s, st.sampled_from(EMBEDDINGS))
# what a DNS answer may hold: any address, and IPv4 addresses wrapped in IPv6 every known way
answers = st.one_of(v4s, v6s, embeddings)


def _part(value: int, radix: str) -> str:
    if radix == "hex":
        return hex(value)
    if radix == "HEX":
        return "0X" + format(value, "X")
    if radix == "oct":
        return "0" + format(value, "o")
    return str(value)


@st.composite
def v4_spellings(draw: st.DrawFn, address: IPv4Address) -> tuple[str, IPv4Address | IPv6Address]:
    """A legacy (inet_aton / WHATWG) or IPv6-wrapped spelling of ``address``, and what it means."""
    n = int(address)
    a, b, c, d = address.packed
    form = draw(st.sampled_from(["4", "3", "2", "1", "mapped", "mapped-hex", "compat"]))
    radix = st.sampled_from(["dec", "hex", "HEX", "oct"])
    if form == "4":
        text = ".".join(_part(x, draw(radix)) for x in (a, b, c, d))
    elif form == "3":
        text = ".".join(_part(x, draw(radix)) for x in (a, b, (c << 8) | d))
    elif form == "2":
        text = ".".join(_part(x, draw(radix)) for x in (a, (b << 16) | (c << 8) | d))
    elif form == "1":
        text = _part(n, draw(radix))
    elif form == "mapped":
        return f"[::ffff:{address}]", address
    elif form == "mapped-hex":
        return f"[::FFFF:{n >> 16:x}:{n & 0xFFFF:x}]", address
    else:
        six = IPv6Address(n)
        return f"[::{address}]", ref.folded(six)
    if draw(st.booleans()):
        text += "."
    return text, address


@st.composite
def v6_spellings(draw: st.DrawFn, address: IPv6Address) -> tuple[str, IPv4Address | IPv6Address]:
    form = draw(st.sampled_from(["compressed", "exploded", "upper"]))
    text = {
        "compressed": address.compressed,
        "exploded": address.exploded,
        "upper": address.compressed.upper(),
    }[form]
    return f"[{text}]", ref.folded(address)


@st.composite
def ip_targets(draw: st.DrawFn) -> tuple[str, IPv4Address | IPv6Address]:
    """(host as written in a URL, the address it means)."""
    kind = draw(st.sampled_from(["v4", "v6", "embedded"]))
    if kind == "v4":
        return draw(v4_spellings(draw(v4s)))
    if kind == "v6":
        return draw(v6_spellings(draw(v6s)))
    return draw(v6_spellings(draw(embeddings)))


LABELS = ["a", "b", "allowed", "evil", "test", "localhost", "xn--bcher-kva", "c-d", "_x", "0x7f", "1a"]
names = st.lists(st.sampled_from(LABELS), min_size=1, max_size=4).map(".".join)
# a rule must be a name: its last label may not be a number (that is an IPv4 attempt, refused)
rule_names = names.filter(lambda n: not re.fullmatch(r"0[xX][0-9a-fA-F]*|[0-9]+", n.rsplit(".", 1)[-1]))


@st.composite
def name_targets(draw: st.DrawFn) -> tuple[str, str]:
    """(host as written, canonical name) — case and one trailing dot do not change the name."""
    name = draw(rule_names)  # a name, not an IPv4 attempt (those are ip_targets)
    written = "".join(ch.upper() if draw(st.booleans()) else ch for ch in name)
    if draw(st.booleans()):
        written += "."
    return written, name


# -- policies: a spec the reference reads, and the YAML document egressd reads ----------------------
_RULE_NETS = [
    "10.0.0.0/8",
    "127.0.0.0/8",
    "127.0.0.1/32",
    "169.254.0.0/16",
    "169.254.169.254/32",
    "198.51.100.0/24",
    "198.51.100.7/32",
    "0.0.0.0/0",
    "8.0.0.0/7",
    "::/0",
    "2001:db8::/32",
    "2001:db8::1/128",
    "64:ff9b::/96",
    "2002::/16",
    "fc00::/7",
    "::1/128",
]
ports_or_none = st.sampled_from([None, None, *PORTS])
rules = st.one_of(
    st.builds(ref.Rule, st.just("name"), rule_names, ports_or_none),
    st.builds(ref.Rule, st.just("wild"), rule_names, ports_or_none),
    st.builds(ref.Rule, st.just("net"), st.sampled_from(_RULE_NETS), ports_or_none),
)
specs = st.builds(
    ref.Spec,
    mode=st.sampled_from(["enforce", "enforce", "allow", "learn"]),
    allow=st.lists(rules, max_size=6).map(tuple),
    deny=st.lists(rules, max_size=3).map(tuple),
    loopback_allow=st.booleans(),
    loopback_ports=st.lists(st.sampled_from(PORTS), max_size=2, unique=True).map(tuple),
    private_allow=st.booleans(),
    ports=st.lists(st.sampled_from(PORTS), max_size=2, unique=True).map(tuple),
    self_addresses=st.sampled_from([(), ((IPv4Address("127.0.0.1"), 8080),)]),
)


def _policy(spec: ref.Spec):  # type: ignore[no-untyped-def]
    return parse_policy(spec.document(), "spec.yaml")


def _decide(spec: ref.Spec, host: str, port: int):  # type: ignore[no-untyped-def]
    return decide(f"{host}:{port}", Client(), _policy(spec), self_addresses=spec.self_addresses)


# -- the properties -----------------------------------------------------------------------------
@st.composite
def covering_rule(draw: st.DrawFn, address: IPv4Address | IPv6Address) -> ref.Rule:
    """An allow rule whose network contains ``address`` (so that allows actually happen)."""
    length = draw(st.integers(0, address.max_prefixlen))
    network = ipaddress.ip_network(f"{address}/{length}", strict=False)
    return ref.Rule("net", str(network), draw(ports_or_none))


@SETTINGS
@given(specs, ip_targets(), st.sampled_from(PORTS), st.data())
def test_ip_literal_never_allowed_when_the_reference_refuses(
    spec: ref.Spec, target: tuple[str, IPv4Address | IPv6Address], port: int, data: st.DataObject
) -> None:
    host, truth = target
    if data.draw(st.booleans(), label="add a covering allow rule"):
        spec = dataclasses.replace(spec, allow=(*spec.allow, data.draw(covering_rule(truth))))
    decision = _decide(spec, host, port)
    event(f"allowed={decision.allowed}")
    if decision.allowed:
        assert ref.may_allow_ip(spec, truth, port), (host, truth, decision.reason, decision.rule, spec)
        assert decision.target is not None and decision.target.host.ip is not None
        assert ref.folded(decision.target.host.ip) == truth  # connects to what it decided about
    if ref.classify(truth) is ref.Klass.FORBIDDEN:
        assert not decision.allowed


@SETTINGS
@given(specs, name_targets(), st.sampled_from(PORTS))
def test_name_never_allowed_when_the_reference_refuses(
    spec: ref.Spec, target: tuple[str, str], port: int
) -> None:
    host, truth = target
    decision = _decide(spec, host, port)
    event(f"allowed={decision.allowed}")
    if decision.allowed:
        assert ref.may_allow_name(spec, truth, port), (host, decision.reason, decision.rule, spec)
        assert decision.target is not None and decision.target.host.name == truth


@SETTINGS
@given(specs, name_targets(), st.sampled_from(PORTS), st.lists(answers, min_size=1, max_size=6))
def test_resolved_addresses_never_kept_when_the_reference_refuses(
    spec: ref.Spec, target: tuple[str, str], port: int, answer: list[IPv4Address | IPv6Address]
) -> None:
    """After a name is allowed, the address filter keeps only what the reference would connect to."""
    host, truth = target
    assume(not re.fullmatch(r"0[xX][0-9a-fA-F]*|[0-9]+", truth.rsplit(".", 1)[-1]))
    spec = dataclasses.replace(spec, allow=(*spec.allow, ref.Rule("name", truth)))  # the name is allowed
    policy = _policy(spec)
    decision = decide(f"{host}:{port}", Client(), policy, self_addresses=spec.self_addresses)
    event(f"allowed={decision.allowed}")
    assume(decision.allowed and decision.needs_resolution)
    kept, _verdicts = filter_addresses(decision, answer, policy)
    assert len(kept) <= 4
    for address in kept:
        assert ref.may_connect_resolved(spec, False, address, port), (address, spec)


@SETTINGS
@given(ip_targets(), st.integers(1, 65535))
@example(("[::ffff:0:169.254.169.254]", IPv6Address("::ffff:0:a9fe:a9fe")), 80)
@example(("[64:ff9b:1:12a9:fe:a9fe::]", IPv6Address("64:ff9b:1:12a9:fe:a9fe::")), 80)
def test_always_refused_in_every_spelling_under_an_allow_everything_policy(
    target: tuple[str, IPv4Address | IPv6Address], port: int
) -> None:
    host, truth = target
    spec = ref.Spec(
        mode="allow", allow=(ref.Rule("net", "0.0.0.0/0"), ref.Rule("net", "::/0")), private_allow=True
    )
    decision = _decide(spec, host, port)
    if ref.classify(truth) is ref.Klass.FORBIDDEN:
        assert (decision.allowed, decision.reason) == (False, "forbidden_address"), (host, truth)


# -- the canonicaliser against the C library's readers ----------------------------------------------
@settings(max_examples=500, deadline=None)
@given(st.text(alphabet="0123456789abcdefxX.", min_size=1, max_size=24))
def test_ipv4_reading_agrees_with_inet_aton(text: str) -> None:
    """Whatever inet_aton (what many clients use) reads as an address, egressd reads as the same
    address — never as a name it would send to DNS."""
    try:
        libc = IPv4Address(socket.inet_aton(text))
    except OSError:
        return
    try:
        host = canonical_host(text)
    except TargetError:
        return  # refusing is always safe
    assert host.ip is not None, (text, libc, host)
    assert host.ip == libc, (text, libc, host.ip)


@settings(max_examples=500, deadline=None)
@given(st.one_of(v6s.map(str), st.text(alphabet="0123456789abcdefABCDEF:.", min_size=2, max_size=45)))
def test_ipv6_reading_agrees_with_inet_pton(text: str) -> None:
    try:
        libc = IPv6Address(socket.inet_pton(socket.AF_INET6, text))
    except OSError:
        return
    try:
        host = canonical_host(f"[{text}]")
    except TargetError:
        return
    assert host.ip is not None and ref.folded(host.ip) == ref.folded(libc), (text, libc, host.ip)


# -- no crash, no hang: arbitrary text and arbitrary policy documents --------------------------------
@settings(max_examples=500, deadline=1000)
@given(st.text(max_size=300))
def test_target_parsing_only_raises_target_error(text: str) -> None:
    for parse in (canonical_host, parse_target, lambda t: make_target(t, 443)):
        with contextlib.suppress(TargetError):  # anything else fails the test
            parse(text)  # type: ignore[operator]
    decision = decide(text, Client(), _policy(ref.Spec(mode="allow")))
    assert decision.reason != "internal_error", decision.detail


_KEYS = [
    "version",
    "mode",
    "allow",
    "deny",
    "loopback",
    "private",
    "builtin",
    "inspect",
    "ports",
    "credentials",
    "limits",
    "resolver",
    "profiles",
    "websocket",
    "allow",
    "host",
    "paths",
    "methods",
    "origins",
    "nameservers",
    "strip_on_host_change",
    "connect_timeout",
    "max_response_bytes",
]
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=40),
    st.sampled_from(
        ["enforce", "off", "1.2.3.4", "*.x", "http://a:1", "/p/", "GET", "10.0.0.0/8:443", "[::1]:80"]
    ),
)
documents = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=8), inner, max_size=6),
    ),
    max_leaves=30,
)


@settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(_KEYS), documents, max_size=8).map(lambda d: {"version": 1, **d}))
def test_policy_loading_is_all_or_nothing(document: dict[str, object]) -> None:
    """A policy document either loads or raises PolicyError naming the file — nothing else — and a
    policy that loads decides without internal errors."""
    try:
        policy = parse_policy(document, "fuzz.yaml")
    except PolicyError as exc:
        assert str(exc).startswith("fuzz.yaml"), exc
        return
    for target in (
        "example.com:443",
        "127.0.0.1:80",
        "[::1]:8080",
        "http://10.1.2.3/x",
        "169.254.169.254:80",
    ):
        decision = decide(target, Client(profile=next(iter(policy.profiles), None)), policy)
        assert decision.reason != "internal_error", (target, decision.detail)
