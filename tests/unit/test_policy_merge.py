"""merge_policies: admitted only where one policy admits, refused wherever one denies, any order."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.policy import Client, PolicyError, decide, make_target, parse_policy, parse_rule
from egressd.policy.dump import policy_to_data
from egressd.policy.merge import merge_policies

NAMES = ["a.test", "b.a.test", "c.test", "xn--bcher-kva.test", "d.c.test"]
IPS = ["10.1.2.3", "203.0.113.7", "127.0.0.1", "::1", "2001:db8::5"]
PORTS = [22, 80, 443, 11434]
RULES = (
    NAMES
    + [f"*.{n}" for n in NAMES]
    + [f"{n}:{p}" for n in NAMES[:3] for p in PORTS]
    + ["*.a.test:443", "10.0.0.0/8", "10.1.2.0/24:22", "203.0.113.7", "[2001:db8::5]:443", "2001:db8::/32"]
)
HARD = {"denylist", "forbidden_address", "loopback_disabled", "loopback_port", "mode_off", "self"}

rules = st.lists(st.sampled_from(RULES), max_size=5)
ports = st.lists(st.sampled_from(PORTS), max_size=3, unique=True)


@st.composite
def policies(draw: st.DrawFn) -> dict[str, object]:
    return {
        "mode": draw(st.sampled_from(["enforce", "enforce", "ask", "learn", "allow", "off"])),
        "allow": draw(rules),
        "deny": draw(st.lists(st.sampled_from(RULES), max_size=2)),
        "ports": draw(ports),
        "loopback": {"allow": draw(st.booleans() | st.just(True)), "ports": draw(ports)},
        "private": {
            "allow": draw(st.booleans()),
            "origins": draw(
                st.lists(st.sampled_from(["http://10.1.2.3:80", "https://10.1.2.3:8443"]), max_size=1)
            ),
        },
        "websocket": draw(st.booleans()),
    }


targets = st.tuples(st.sampled_from(NAMES + IPS + ["localhost", "e.test"]), st.sampled_from(PORTS + [8080]))


def _load(data: dict[str, object], name: str):  # noqa: ANN202 - test helper
    return parse_policy(data, name)


def _decide(host: str, port: int, policy, scheme: str = "https"):  # noqa: ANN001, ANN202
    return decide(make_target(host, port, scheme=scheme), Client(), policy)


@settings(max_examples=400, deadline=None)
@given(st.lists(policies(), min_size=2, max_size=3), targets)
def test_merge_never_widens_and_deny_wins(datas: list[dict[str, object]], target: tuple[str, int]) -> None:
    loaded = [_load(d, f"p{i}.yaml") for i, d in enumerate(datas)]
    merged = merge_policies(loaded)
    host, port = target
    answer = _decide(host, port, merged)
    each = [_decide(host, port, p) for p in loaded]
    if answer.allowed:
        assert any(d.allowed for d in each), (answer, each)
    if any(d.reason in HARD for d in each):
        assert not answer.allowed, (answer, each)
    if answer.ask:  # asks only where one of them would ask or admit
        assert any(d.allowed or d.ask for d in each)
    if answer.allowed and _may_go_private(answer, merged):  # a name's licence to private addresses
        assert any(d.allowed and _may_go_private(d, p) for d, p in zip(each, loaded, strict=True))


def _may_go_private(decision, policy) -> bool:  # noqa: ANN001 - test helper
    """May the addresses a name resolves to be private (the resolved-address filter's licence)?"""
    return decision.private_ok or policy.private.allow


@settings(max_examples=300, deadline=None)
@given(st.lists(policies(), min_size=2, max_size=3), targets)
def test_merge_is_order_independent(datas: list[dict[str, object]], target: tuple[str, int]) -> None:
    loaded = [_load(d, f"p{i}.yaml") for i, d in enumerate(datas)]
    host, port = target
    answers = {
        (d.allowed, d.ask, d.reason)
        for order in itertools.permutations(loaded)
        for d in [_decide(host, port, merge_policies(list(order)))]
    }
    assert len(answers) == 1, answers


@settings(max_examples=200, deadline=None)
@given(st.lists(policies(), min_size=2, max_size=3))
def test_merged_policy_round_trips_through_the_file_format(datas: list[dict[str, object]]) -> None:
    merged = merge_policies([_load(d, f"p{i}.yaml") for i, d in enumerate(datas)])
    again = parse_policy(policy_to_data(merged), "again")
    for host, port in itertools.product(NAMES + IPS, PORTS):
        one, two = _decide(host, port, merged), _decide(host, port, again)
        assert (one.allowed, one.reason) == (two.allowed, two.reason)


def test_each_preset_keeps_its_own_ports() -> None:
    npm = parse_policy({"allow": ["registry.npmjs.org"], "ports": [443]}, "npm")
    github = parse_policy({"allow": ["github.com"], "ports": [22, 443]}, "github")
    merged = merge_policies([npm, github])
    assert _decide("github.com", 22, merged).allowed
    assert not _decide("registry.npmjs.org", 22, merged).allowed
    assert _decide("registry.npmjs.org", 443, merged).allowed
    assert merged.ports == (22, 443)
    assert [r.text for r in merged.allow.rules] == [
        "registry.npmjs.org:443",
        "github.com:22",
        "github.com:443",
    ]


def test_folded_rule_text_parses_back_to_the_same_rule() -> None:
    base = parse_policy({"allow": ["*.a.test", "10.0.0.0/8", "203.0.113.7", "2001:db8::/32", "::1"]}, "x")
    other = parse_policy({"ports": [443, 8443]}, "y")
    merged = merge_policies([replace(base, ports=(443,)), other])
    for rule in merged.allow.rules:
        again = parse_rule(rule.text)
        assert (again.kind, again.name, again.network, again.port) == (
            rule.kind,
            rule.name,
            rule.network,
            rule.port,
        )


def test_restrictions_hold_where_any_policy_has_them() -> None:
    loose = parse_policy({"mode": "ask", "private": {"allow": True}, "websocket": True}, "loose")
    tight = parse_policy(
        {"mode": "enforce", "loopback": {"ports": [11434]}, "limits": {"max_connections": 5}}, "tight"
    )
    merged = merge_policies([loose, tight])
    assert merged.mode == "enforce" and merged.private.allow is False
    assert merged.loopback.ports == (11434,) and merged.limits.max_connections == 5
    assert not _decide("127.0.0.1", 8080, merged).allowed
    assert _decide("127.0.0.1", 11434, merged).allowed


def test_audit_refuse_wins_but_a_presets_default_does_not_vote() -> None:
    """One of the user's policies refusing what cannot be recorded is enough; a shipped preset's
    `refuse` is only its default and does not outvote the user's `continue`."""
    going = parse_policy({"audit": {"on_failure": "continue", "max_queue_bytes": 65536}}, "going")
    strict = parse_policy({}, "strict")
    preset = parse_policy({"preset": {"name": "p", "version": 1}}, "preset")
    assert merge_policies([going, strict]).audit.on_failure == "refuse"
    assert merge_policies([going, strict]).audit.max_queue_bytes == 65536
    assert merge_policies([going, preset]).audit.on_failure == "continue"


def test_disjoint_loopback_ports_leave_no_loopback() -> None:
    one = parse_policy({"loopback": {"ports": [11434]}}, "one")
    two = parse_policy({"loopback": {"ports": [8080]}}, "two")
    merged = merge_policies([one, two])
    for port in (11434, 8080, 22):
        assert not _decide("127.0.0.1", port, merged).allowed


def test_conflicting_nameservers_and_port_bound_builtins_are_refused() -> None:
    one = parse_policy({"resolver": {"nameservers": ["127.0.0.1:5353"]}}, "one.yaml")
    two = parse_policy({"resolver": {"nameservers": ["127.0.0.2"]}}, "two.yaml")
    with pytest.raises(PolicyError, match="different nameservers"):
        merge_policies([one, two])
    built = parse_policy({"builtin": [{"host": "x.test", "paths": ["/a"]}], "ports": [443]}, "b.yaml")
    with pytest.raises(PolicyError, match="b.yaml: builtin"):
        merge_policies([built, parse_policy({}, "open.yaml")])
    assert merge_policies([built, parse_policy({"ports": [443]}, "same.yaml")]).builtin == built.builtin


def test_secrets_are_kept_and_still_go_only_to_allowed_hosts() -> None:
    secret = {"name": "api", "from": {"env": "API_KEY"}, "hosts": ["api.a.test"], "env": "API_KEY"}
    mine = parse_policy({"allow": ["api.a.test"], "secrets": [secret]}, "mine.yaml")
    merged = merge_policies([parse_policy({"allow": ["b.test"], "ports": [443]}, "b.yaml"), mine])
    assert [s.name for s in merged.secrets] == ["api"]
    assert merge_policies([mine, mine]).secrets == mine.secrets  # the same file twice
    with pytest.raises(PolicyError, match="denied by the policy"):
        merge_policies([mine, parse_policy({"deny": ["api.a.test"]}, "deny.yaml")])
    other = {**secret, "name": "other"}  # another name, the same child variable
    with pytest.raises(PolicyError, match="two secrets give the child this variable"):
        merge_policies([mine, parse_policy({"allow": ["api.a.test"], "secrets": [other]}, "o.yaml")])


def test_a_policys_private_allow_stays_with_its_own_rules() -> None:
    """`--policy learned.yaml --policy other.yaml`: learned's names keep resolving to the private
    mirrors its private.allow licensed; other's do not (it licensed nothing)."""
    learned = parse_policy({"allow": ["registry.test:443", "10.0.0.0/8:22"], "private": {"allow": True}}, "l")
    other = parse_policy({"allow": ["other.test", "registry.test:443"]}, "o")
    for merged in (merge_policies([learned, other]), merge_policies([other, learned])):
        assert merged.private.allow is False
        assert _decide("registry.test", 443, merged).private_ok
        assert not _decide("other.test", 443, merged).private_ok
        assert not _decide("registry.test", 444, merged).allowed
        again = parse_policy(policy_to_data(merged), "again")  # `policy show` keeps it
        assert again.allow == merged.allow and _decide("registry.test", 443, again).private_ok
    assert {"host": "registry.test:443", "private": True} in policy_to_data(merged)["allow"]
    both = merge_policies([learned, parse_policy({"private": {"allow": True}}, "p")])
    assert both.private.allow and not any(rule.private for rule in both.allow)


def test_a_private_rule_licenses_only_what_it_admits() -> None:
    policy = parse_policy(
        {"allow": [{"host": "mirror.test", "private": True, "paths": ["/pkg/"]}, "mirror.test"]}, "x"
    )
    assert _decide("mirror.test", 443, policy, scheme="http").private_ok is False  # path unknown here

    def get(path: str):  # noqa: ANN202 - test helper
        target = make_target("mirror.test", 80, scheme="http", path=path, method="GET")
        return decide(target, Client(), policy)

    assert get("/pkg/a").allowed and get("/pkg/a").private_ok
    assert get("/other").allowed and not get("/other").private_ok


@pytest.mark.parametrize("where", ["deny", "inspect", "profiles.ci.allow", "profiles.ci.deny"])
def test_private_is_only_for_the_policys_own_allow_rules(where: str) -> None:
    rule = {"host": "x.test", "private": True}
    data: dict[str, object] = {"profiles": {"ci": {"allow": [rule]}}} if where == "profiles.ci.allow" else {}
    if where == "profiles.ci.deny":
        data = {"profiles": {"ci": {"deny": [rule]}}}
    elif not where.startswith("profiles"):
        data = {where: [rule]}
    with pytest.raises(PolicyError, match="private is only for the policy's allow rules"):
        parse_policy(data, "p.yaml")
    with pytest.raises(PolicyError, match="private: 'yes': must be true or false"):
        parse_policy({"allow": [{"host": "x.test", "private": "yes"}]}, "p.yaml")
