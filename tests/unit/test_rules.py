"""Host rules and the indexed RuleSet."""

from __future__ import annotations

import ipaddress

import pytest

from egressd.policy import Host, HostRule, RuleError, RuleSet, canonical_host, parse_rule


@pytest.mark.parametrize(
    ("entry", "kind", "name", "network", "port"),
    [
        ("example.com", "name", "example.com", None, None),
        ("Example.COM.", "name", "example.com", None, None),
        ("*.example.com", "wildcard", "example.com", None, None),
        ("*.com", "wildcard", "com", None, None),
        ("host.test:443", "name", "host.test", None, 443),
        ("*.example.com:8443", "wildcard", "example.com", None, 8443),
        ("203.0.113.7", "ip", None, "203.0.113.7/32", None),
        ("203.0.113.7:443", "ip", None, "203.0.113.7/32", 443),
        ("127.1", "ip", None, "127.0.0.1/32", None),
        ("10.0.0.0/8", "cidr", None, "10.0.0.0/8", None),
        ("10.0.0.0/8:5432", "cidr", None, "10.0.0.0/8", 5432),
        ("[2001:db8::1]:443", "ip", None, "2001:db8::1/128", 443),
        ("[2001:db8::1]", "ip", None, "2001:db8::1/128", None),
        ("2001:db8::1", "ip", None, "2001:db8::1/128", None),
        ("2001:db8::/32", "cidr", None, "2001:db8::/32", None),
        ("[2001:db8::/32]:443", "cidr", None, "2001:db8::/32", 443),
        ("::ffff:10.0.0.0/104", "cidr", None, "10.0.0.0/8", None),
        ("bücher.example", "name", "xn--bcher-kva.example", None, None),
        ("xn--bcher-kva.example", "name", "xn--bcher-kva.example", None, None),
    ],
)
def test_parse_rule(entry: str, kind: str, name: str | None, network: str | None, port: int | None) -> None:
    rule = parse_rule(entry)
    assert rule.text == entry
    assert rule.kind == kind
    assert rule.name == name
    assert rule.network == (ipaddress.ip_network(network) if network else None)
    assert rule.port == port


@pytest.mark.parametrize(
    "entry",
    [
        "",
        "*",
        "**",
        "*.",
        "*.*.com",
        "a.*.com",
        "*example.com",
        "example.*",
        "exa mple.com",
        "example.com:0",
        "example.com:65536",
        "example.com:x",
        "example.com:",
        "10.0.0.1/8",  # host bits set
        "10.0.0.0/33",
        "10.0.0.0/8:0",
        "*.10.0.0.1",
        "[2001:db8::1",
        "[2001:db8::1]443",
        "user@example.com",
        "exa%6dple.com",
        "-bad.test",
        "xn--zz.test",
        "256.1.1.1",
        42,
        None,
        {"paths": ["/x"]},
        {"host": "x.test", "bogus": 1},
        {"host": "x.test", "paths": "/x"},
        {"host": "x.test", "paths": ["x"]},
        {"host": "x.test", "paths": ["/../x"]},
        {"host": "x.test", "paths": ["/x?y"]},
        {"host": "x.test", "methods": ["G T"]},
        {"host": "x.test", "methods": "GET"},
    ],
)
def test_parse_rule_rejects(entry: object) -> None:
    with pytest.raises(RuleError):
        parse_rule(entry)  # type: ignore[arg-type]


def test_dict_rule() -> None:
    rule = parse_rule(
        {"host": "api.test:443", "paths": ["/v1/", "/v2/%7Ex/../y"], "methods": ["get", "POST"]}
    )
    assert rule.name == "api.test" and rule.port == 443
    assert rule.paths == ("/v1/", "/v2/y")
    assert rule.methods == ("GET", "POST")
    assert rule.restricted


def host(text: str) -> Host:
    return canonical_host(text)


RULES = RuleSet(
    parse_rule(e)
    for e in [
        "example.com",
        "*.wild.test",
        "exact.wild.test:8443",
        "port.test:443",
        "10.0.0.0/8",
        "10.1.0.0/16:5432",
        "203.0.113.7",
        "2001:db8::/32",
        "bücher.example",
    ]
)


@pytest.mark.parametrize(
    ("target", "port", "expected"),
    [
        ("example.com", 443, "example.com"),
        ("a.b.example.com", 80, "example.com"),
        ("example.com.evil.test", 443, None),
        ("notexample.com", 443, None),
        ("wild.test", 443, None),  # *.x is subdomains only
        ("a.wild.test", 443, "*.wild.test"),
        ("exact.wild.test", 8443, "exact.wild.test:8443"),
        ("exact.wild.test", 443, "*.wild.test"),
        ("port.test", 443, "port.test:443"),
        ("port.test", 80, None),
        ("10.2.3.4", 22, "10.0.0.0/8"),
        ("10.1.2.3", 5432, "10.1.0.0/16:5432"),
        ("10.1.2.3", 80, "10.0.0.0/8"),
        ("11.0.0.1", 80, None),
        ("203.0.113.7", 1, "203.0.113.7"),
        ("203.0.113.8", 1, None),
        ("[2001:db8::5]", 443, "2001:db8::/32"),
        ("[::ffff:10.0.0.1]", 80, "10.0.0.0/8"),
        ("xn--bcher-kva.example", 443, "bücher.example"),
        ("www.BÜCHER.example", 443, "bücher.example"),
    ],
)
def test_ruleset_match(target: str, port: int, expected: str | None) -> None:
    rule = RULES.match(host(target), port)
    assert (rule.text if rule else None) == expected


def test_names_never_match_ip_rules_and_vice_versa() -> None:
    rules = RuleSet([parse_rule("10.0.0.0/8"), parse_rule("example.com")])
    assert rules.match(host("ten.example.net"), 80) is None
    assert rules.match(host("10.0.0.1"), 80) is not None
    assert rules.match_address(ipaddress.ip_address("10.0.0.1"), 80) is not None
    assert rules.match_address(ipaddress.ip_address("::ffff:10.0.0.1"), 80) is not None
    assert rules.match_address(ipaddress.ip_address("93.184.216.34"), 80) is None


def test_ruleset_matches_order_and_len() -> None:
    rules = RuleSet(
        parse_rule(e) for e in ["example.com", "a.example.com", "*.example.com", "a.example.com:443"]
    )
    assert len(rules) == 4
    order = [r.text for r in rules.matches(host("a.example.com"), 443)]
    assert order == ["a.example.com:443", "a.example.com", "example.com", "*.example.com"]
    assert RuleSet([]).match(host("x.test"), 1) is None
    assert not RuleSet([])


def test_ruleset_equality() -> None:
    assert RuleSet([parse_rule("a.test")]) == RuleSet([parse_rule("a.test")])
    assert RuleSet([parse_rule("a.test")]) != RuleSet([parse_rule("b.test")])


def test_hostrule_reference_matches() -> None:
    rule = HostRule("x", "wildcard", "x.test", None, None)
    assert rule.matches(host("a.x.test"), 1)
    assert not rule.matches(host("x.test"), 1)
