"""`--only` and `--profile` narrow the policy: pure tests of the synthetic profile.

The intersection of two host rules is checked against the reference matcher (HostRule.matches,
plus the decision function's "a localhost name also matches 127.0.0.1 rules") over a small
universe of hosts, ports and rules, so "exact" is proved rather than hoped. End-to-end refusals
with reason `profile`, through a real sandbox, are in test_sandbox_integration.py.
"""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.policy import (
    Client,
    Host,
    HostRule,
    PolicyError,
    canonical_host,
    decide,
    parse_policy,
    parse_rule,
)
from egressd.sandbox.narrow import Narrowing, intersect, intersect_sets, parse_only, profile_name

LOCALHOST = ipaddress.IPv4Address("127.0.0.1")
NAMES = ["test", "a.test", "b.test", "x.a.test", "y.x.a.test", "localhost", "db.localhost", "other"]
IPS = ["127.0.0.1", "127.0.0.2", "10.0.0.1", "10.0.1.1", "10.1.0.1", "::1", "2001:db8::1"]
PORTS = [22, 80, 443]
HOSTS = [canonical_host(h) for h in NAMES + IPS]
RULE_HOSTS = [
    *NAMES,
    *(f"*.{n}" for n in NAMES),
    *IPS,
    "10.0.0.0/8",
    "10.0.0.0/16",
    "10.0.0.0/24",
    "127.0.0.0/8",
    "2001:db8::/32",
    "[::1]",
]


def _with_port(host: str, port: int | None) -> str:
    if port is None:
        return host
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}" if "/" not in host else f"{host}:{port}"
    return f"{host}:{port}"


rules = st.builds(
    lambda host, port: parse_rule(_with_port(host, port)),
    st.sampled_from(RULE_HOSTS),
    st.sampled_from([None, *PORTS]),
)


def _loopback_name(host: Host) -> bool:
    return host.name is not None and (host.name == "localhost" or host.name.endswith(".localhost"))


def admits(rule_list: list[HostRule] | tuple[HostRule, ...], host: Host, port: int) -> bool:
    """The decision function's matching: a localhost name also matches rules for 127.0.0.1."""
    for rule in rule_list:
        if rule.matches(host, port):
            return True
        if _loopback_name(host) and rule.matches(Host(name=None, ip=LOCALHOST), port):
            return True
    return False


@settings(max_examples=400, deadline=None)
@given(rules, rules)
def test_intersection_of_two_rules_is_exact(a: HostRule, b: HostRule) -> None:
    both = intersect(a, b)
    for host in HOSTS:
        for port in PORTS:
            expected = admits([a], host, port) and admits([b], host, port)
            got = both is not None and admits([both], host, port)
            assert got == expected, (a.text, b.text, both and both.text, host, port)


@settings(max_examples=150, deadline=None)
@given(st.lists(rules, min_size=1, max_size=4), st.lists(rules, min_size=1, max_size=4))
def test_intersection_of_rule_sets_is_exact(a: list[HostRule], b: list[HostRule]) -> None:
    both = intersect_sets(a, b)
    for host in HOSTS:
        for port in PORTS:
            assert admits(both, host, port) == (admits(a, host, port) and admits(b, host, port))


def test_intersection_examples() -> None:
    def text(a: str, b: str) -> str | None:
        rule = intersect(parse_rule(a), parse_rule(b))
        return rule.text if rule else None

    assert text("example.com", "api.example.com:443") == "api.example.com:443"
    assert text("*.example.com", "example.com") == "*.example.com"
    assert text("example.com:80", "example.com:443") is None
    assert text("example.com", "example.org") is None
    assert text("10.0.0.0/8", "10.1.2.3") == "10.1.2.3"
    assert text("2001:db8::/32:443", "2001:db8::1") == "[2001:db8::1]:443"
    assert text("127.0.0.1:11434", "localhost") == "localhost:11434"
    assert text("example.com", "10.0.0.0/8") is None


def test_intersection_keeps_the_profiles_paths() -> None:
    rule = intersect(
        parse_rule({"host": "example.com", "paths": ["/v1"], "methods": ["GET"]}),
        parse_rule("api.example.com"),
    )
    assert rule is not None and rule.paths == ("/v1",) and rule.methods == ("GET",)


# -- the synthetic profile in a policy --------------------------------------------------------
POLICY = parse_policy(
    {
        "version": 1,
        "allow": ["allowed.test", "also.test", "10.0.0.0/8"],
        "deny": ["bad.allowed.test"],
        "profiles": {"agent": {"allow": ["allowed.test", "10.0.0.0/8"], "deny": ["10.9.0.0/16"]}},
    },
    "policy.yaml",
)


def _decide(policy: object, target: str, profile: str | None) -> tuple[bool, str]:
    decision = decide(target, Client(profile=profile), policy)  # type: ignore[arg-type]
    return decision.allowed, decision.reason


def test_only_narrows_never_widens() -> None:
    narrowing = Narrowing(parse_only(["allowed.test", "outside.test"]), None)
    policy = narrowing(POLICY)
    name = narrowing.profile
    assert name == "sandbox"
    assert _decide(policy, "allowed.test:443", name) == (True, "allowlist")
    # the policy allows it, --only does not list it -> profile
    assert _decide(policy, "also.test:443", name) == (False, "profile")
    # --only lists it, the policy refuses it -> still refused, by the policy
    assert _decide(policy, "outside.test:443", name) == (False, "not_allowlisted")
    assert _decide(policy, "bad.allowed.test:443", name) == (False, "denylist")


def test_only_with_profile_intersects_both() -> None:
    narrowing = Narrowing(parse_only(["allowed.test", "also.test", "10.9.0.0/16", "10.1.0.0/16"]), "agent")
    policy = narrowing(POLICY)
    name = narrowing.profile
    assert name == "agent.sandbox"
    assert _decide(policy, "allowed.test:443", name) == (True, "allowlist")
    assert _decide(policy, "also.test:443", name) == (False, "profile")  # not in profile agent
    assert _decide(policy, "10.1.2.3:443", name) == (True, "allowlist")
    assert _decide(policy, "10.9.1.1:443", name) == (False, "profile")  # agent's deny is kept
    assert _decide(policy, "10.2.0.1:443", name) == (False, "profile")  # not in --only


def test_profile_name_is_fixed_across_reloads() -> None:
    narrowing = Narrowing(parse_only(["allowed.test"]), None)
    narrowing(POLICY)
    hostile = parse_policy(
        {"version": 1, "allow": ["allowed.test", "also.test"], "profiles": {"sandbox": {}}}, "p.yaml"
    )
    reloaded = narrowing(hostile)
    # the policy's own "sandbox" profile (which would allow everything) is replaced, not used
    assert narrowing.profile == "sandbox"
    assert _decide(reloaded, "also.test:443", "sandbox") == (False, "profile")


def test_profile_name_avoids_the_policys_profiles() -> None:
    assert profile_name(None, ["sandbox", "sandbox2"]) == "sandbox3"
    assert profile_name("agent", ["agent"]) == "agent.sandbox"


def test_unknown_base_profile_is_an_error_not_a_widening() -> None:
    with pytest.raises(PolicyError, match="no such profile"):
        Narrowing(parse_only(["allowed.test"]), "missing")(POLICY)


def test_bad_only_rule_names_the_option() -> None:
    with pytest.raises(PolicyError, match=r"--only\[1\]"):
        parse_only(["ok.test", "bad host"])
