"""The address guards hold in every mode: a table of mode x address class x spelling.

Why: `mode: allow` and `mode: learn` admit what is not allowlisted, but a literal must never reach
what a NAME resolving to it could not (docs/policy.md, step 10): private, CGNAT, ULA, documentation and
other non-global literals need private.allow, an explicit IP/CIDR rule or a private origin;
loopback with loopback.allow false and the always-refused addresses stay refused whatever the mode.
"""

from __future__ import annotations

from typing import Any

import pytest

from egressd.policy import Client, Decision, Policy, decide, parse_policy, parse_target

MODES = ("enforce", "ask", "learn", "allow", "off")

# (spelling as a client writes it, canonical address) per class
PRIVATE = [
    ("192.168.1.1", "192.168.1.1"),
    ("0xc0.0xa8.1.1", "192.168.1.1"),
    ("0300.0250.1.1", "192.168.1.1"),
    ("3232235777", "192.168.1.1"),
    ("192.168.257", "192.168.1.1"),
    ("[::ffff:192.168.1.1]", "192.168.1.1"),
    ("[::ffff:c0a8:101]", "192.168.1.1"),
    ("10.1", "10.0.0.1"),
    ("172.16.0.1", "172.16.0.1"),
    ("100.64.0.1", "100.64.0.1"),  # CGNAT
    ("0x64.0x40.0.1", "100.64.0.1"),
    ("[::ffff:100.64.0.1]", "100.64.0.1"),
    ("[fd00::1]", "fd00::1"),  # ULA
    ("[FC00::1]", "fc00::1"),
    ("198.18.0.1", "198.18.0.1"),  # benchmarking
    ("192.0.2.1", "192.0.2.1"),  # documentation
    ("198.51.100.7", "198.51.100.7"),
    ("203.0.113.9", "203.0.113.9"),
    ("[2001:db8::1]", "2001:db8::1"),
    ("[64:ff9b::c0a8:101]", "64:ff9b::c0a8:101"),  # NAT64 carrying 192.168.1.1
    ("[2002:c0a8:101::1]", "2002:c0a8:101::1"),  # 6to4 carrying 192.168.1.1
]
LOOPBACK = ["127.0.0.1", "127.1", "0x7f.1", "2130706433", "[::1]", "[::ffff:127.0.0.1]", "localhost"]
FORBIDDEN = [
    "169.254.169.254",
    "0xa9fea9fe",
    "[::ffff:169.254.169.254]",
    "[fd00:ec2::254]",
    "100.100.100.200",
    "168.63.129.16",
    "[fe80::1]",
    "0.0.0.0",
    "[::]",
    "224.0.0.1",
    "255.255.255.255",
    "240.0.0.1",
]
GLOBAL = ["8.8.8.8", "0x8.0x8.0x8.0x8", "[2606:4700::1111]"]

# what an unlicensed target gets in each mode, by class ("mode-dependent" spelled out)
_UNLICENSED_PRIVATE = {
    "enforce": "private_address",
    "ask": "private_address",
    "learn": "private_address",
    "allow": "private_address",
    "off": "mode_off",
}
_BY_MODE = {
    "enforce": "not_allowlisted",
    "ask": "ask",
    "learn": "learned",
    "allow": "mode_allow",
    "off": "mode_off",
}


def pol(mode: str, **data: Any) -> Policy:
    return parse_policy({"version": 1, "mode": mode, **data}, "guards.yaml")


def check(spelling: str, policy: Policy, scheme: str = "http") -> Decision:
    return decide(parse_target(f"{scheme}://{spelling}/"), Client(), policy)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("spelling", "address"), PRIVATE)
def test_private_literal_needs_a_licence_in_every_mode(mode: str, spelling: str, address: str) -> None:
    decision = check(spelling, pol(mode))
    assert not decision.allowed and not decision.ask
    assert decision.reason == _UNLICENSED_PRIVATE[mode], decision.detail
    if decision.reason == "private_address":
        assert address in decision.detail and f"mode: {mode}" in decision.detail


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("spelling", "address"), PRIVATE)
def test_private_allow_lifts_the_guard_and_the_mode_decides(mode: str, spelling: str, address: str) -> None:
    decision = check(spelling, pol(mode, private={"allow": True}))
    assert decision.reason == _BY_MODE[mode]
    assert decision.allowed is (mode in ("learn", "allow"))
    if mode == "learn":
        assert decision.would_be == "not_allowlisted"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("spelling", "address"), PRIVATE)
def test_an_explicit_ip_or_cidr_rule_licenses_the_literal(mode: str, spelling: str, address: str) -> None:
    for rule in (address, "0.0.0.0/0" if "." in address else "::/0"):
        decision = check(spelling, pol(mode, allow=[rule]))
        if mode == "off":
            assert decision.reason == "mode_off"
        else:
            assert (decision.allowed, decision.reason) == (True, "allowlist"), (rule, decision.detail)
            assert decision.would_be is None


@pytest.mark.parametrize("mode", MODES)
def test_a_private_origin_licenses_exactly_that_origin(mode: str) -> None:
    policy = pol(mode, private={"origins": ["http://192.168.1.10:8080"]})
    decision = decide(parse_target("http://0xc0.0xa8.1.10:8080/x"), Client(), policy)
    if mode == "off":
        assert decision.reason == "mode_off"
        return
    assert (decision.allowed, decision.reason) == (True, "private_origin")
    other = decide(parse_target("http://192.168.1.10:8081/x"), Client(), policy)
    assert not other.allowed and other.reason == _UNLICENSED_PRIVATE[mode]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spelling", LOOPBACK)
def test_loopback_disabled_is_refused_in_every_mode(mode: str, spelling: str) -> None:
    for extra in ({}, {"private": {"allow": True}}, {"allow": ["127.0.0.0/8", "::1"]}):
        decision = check(spelling, pol(mode, loopback={"allow": False}, **extra))
        expected = "mode_off" if mode == "off" else "loopback_disabled"
        assert (decision.allowed, decision.reason) == (False, expected), (extra, decision.detail)
    allowed = check(spelling, pol(mode))
    assert allowed.allowed is (mode != "off")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spelling", FORBIDDEN)
def test_always_refused_in_every_mode_whatever_the_policy(mode: str, spelling: str) -> None:
    wide = {"allow": ["0.0.0.0/0", "::/0"], "private": {"allow": True}}
    for extra in ({}, wide):
        decision = check(spelling, pol(mode, **extra))
        expected = "mode_off" if mode == "off" else "forbidden_address"
        assert (decision.allowed, decision.reason) == (False, expected), (extra, decision.detail)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spelling", GLOBAL)
def test_global_literals_follow_the_mode(mode: str, spelling: str) -> None:
    decision = check(spelling, pol(mode))
    assert decision.reason == _BY_MODE[mode]
    assert decision.allowed is (mode in ("learn", "allow"))


@pytest.mark.parametrize("scheme", ["http", "https", "connect"])
def test_learn_allows_a_name_and_says_what_enforce_would_have_said(scheme: str) -> None:
    target = "example.com:443" if scheme == "connect" else f"{scheme}://example.com/"
    decision = decide(target, Client(), pol("learn"))
    assert (decision.allowed, decision.reason, decision.rule) == (True, "learned", "mode: learn")
    assert decision.would_be == "not_allowlisted" and "not_allowlisted" in decision.detail
    assert decision.needs_resolution and not decision.private_ok  # the resolved-address filter applies


def test_learn_keeps_deny_ports_and_profiles() -> None:
    policy = pol(
        "learn",
        deny=["evil.test"],
        ports=[443],
        profiles={"narrow": {"allow": ["ok.test"]}},
    )
    assert decide("evil.test:443", Client(), policy).reason == "denylist"
    assert decide("other.test:8443", Client(), policy).reason == "port"
    assert decide("other.test:443", Client(profile="narrow"), policy).reason == "profile"
    assert decide("ok.test:443", Client(profile="narrow"), policy).reason == "learned"
    # an allowlisted host is decided by its rule, not learned
    assert decide("up.test:443", Client(), pol("learn", allow=["up.test"])).would_be is None


def test_learn_is_a_mode_of_the_file_the_env_and_the_overrides(tmp_path: Any) -> None:
    from egressd.policy import load_policy

    path = tmp_path / "p.yaml"
    path.write_text("version: 1\nmode: learn\n")
    assert load_policy(path).mode == "learn"
    path.write_text("version: 1\nmode: enforce\n")
    assert load_policy(path, env={"EGRESSD_MODE": "learn"}).mode == "learn"
    assert load_policy(path).with_overrides(mode="learn").mode == "learn"


def test_a_learned_name_that_resolves_only_to_guarded_addresses_is_refused() -> None:
    import ipaddress

    from egressd.policy import filter_addresses, resolution_refusal

    policy = pol("learn")
    decision = decide("intranet.test:443", Client(), policy)
    kept, verdicts = filter_addresses(decision, [ipaddress.ip_address("192.168.1.1")], policy)
    assert kept == []
    refused = resolution_refusal(decision, verdicts)
    assert (refused.allowed, refused.reason, refused.would_be) == (False, "resolved_forbidden", None)


@pytest.mark.parametrize("rule", ["up.test", {"host": "up.test", "paths": ["/v1/"]}])
def test_an_allow_rule_keeps_the_private_origin_of_the_same_name(rule: Any) -> None:
    """allow: [up.test] beside private.origins: [http://up.test:8080]: the allow rule decides, and the
    origin still licenses the private address of exactly that origin (not another port)."""
    import ipaddress

    from egressd.policy import filter_addresses

    policy = pol("enforce", allow=[rule], private={"origins": ["http://up.test:8080"]})
    private = [ipaddress.ip_address("172.28.0.5")]
    decision = decide(parse_target("http://up.test:8080/v1/x"), Client(), policy)
    assert decision.allowed and decision.reason == "allowlist"
    assert filter_addresses(decision, private, policy)[0] == private
    other = decide(parse_target("http://up.test:8081/v1/x"), Client(), policy)
    assert other.allowed and filter_addresses(other, private, policy)[0] == []
