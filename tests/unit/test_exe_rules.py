"""Allow rules scoped by program (`exe`): parsing, the decision, narrowing only, and unknown owners."""

from __future__ import annotations

from typing import Any

import pytest

from egressd.policy import Client, Policy, PolicyError, Program, decide, parse_policy, parse_rule
from egressd.policy.dump import policy_to_data
from egressd.policy.rules import RuleError

NODE = Program("/usr/bin/node", frozenset({"/usr/bin/node"}))
NODEJS = Program("/usr/bin/nodejs", frozenset({"/usr/bin/nodejs", "/usr/bin/node"}))  # node -> nodejs
PYTHON = Program("/usr/bin/python3.11", frozenset({"/usr/bin/python3.11", "/usr/bin/python3"}))
CURL = Program("/usr/bin/curl")
FAKE_CURL = Program("/tmp/x/curl")  # a copy a child made: same name, other path


def pol(**data: Any) -> Policy:
    return parse_policy({"version": 1, **data}, "test.yaml")


def ask(policy: Policy, host: str, program: Program | None, profile: str | None = None) -> tuple[bool, str]:
    decision = decide(f"{host}:443", Client(profile, program), policy)
    return decision.allowed, decision.reason


NPM = pol(allow=[{"host": "registry.npmjs.org", "exe": ["npm", "node"]}, "pypi.org"])


@pytest.mark.parametrize(
    ("program", "allowed", "reason"),
    [
        (NODE, True, "allowlist"),
        (NODEJS, True, "allowlist"),  # known by its system alias
        (Program("/usr/local/bin/npm"), True, "allowlist"),
        (CURL, False, "exe_not_allowed"),
        (PYTHON, False, "exe_not_allowed"),
        (None, False, "exe_not_allowed"),  # the owner could not be determined
        (Program("/usr/bin/node (deleted)"), False, "exe_not_allowed"),  # replaced on disk
        (Program("/usr/bin/nodes"), False, "exe_not_allowed"),
        (Program("/usr/bin/no"), False, "exe_not_allowed"),
    ],
)
def test_a_host_for_some_programs_only(program: Program | None, allowed: bool, reason: str) -> None:
    assert ask(NPM, "registry.npmjs.org", program) == (allowed, reason)
    assert ask(NPM, "sub.registry.npmjs.org", program) == (allowed, reason)  # the rule's subdomains too


def test_other_hosts_are_unaffected() -> None:
    assert ask(NPM, "pypi.org", CURL) == (True, "allowlist")
    assert ask(NPM, "pypi.org", None) == (True, "allowlist")
    assert ask(NPM, "example.test", NODE) == (False, "not_allowlisted")


def test_paths_name_one_executable_exactly() -> None:
    policy = pol(allow=[{"host": "up.test", "exe": ["/usr/bin/curl", "/usr/bin/python3"]}])
    assert ask(policy, "up.test", CURL)[0]
    assert ask(policy, "up.test", PYTHON)[0]  # /usr/bin/python3 is an alias of python3.11
    assert ask(policy, "up.test", FAKE_CURL) == (False, "exe_not_allowed")
    assert ask(pol(allow=[{"host": "up.test", "exe": "curl"}]), "up.test", FAKE_CURL)[0]  # a name is weaker


def test_exe_never_widens_a_rule_without() -> None:
    """A rule without exe admits every program; one with exe admits fewer, never more."""
    both = pol(allow=["up.test", {"host": "up.test", "exe": ["curl"]}])
    assert ask(both, "up.test", PYTHON) == (True, "allowlist")
    assert ask(both, "up.test", None) == (True, "allowlist")
    general = pol(allow=["example.test", {"host": "api.example.test", "exe": ["curl"]}])
    assert ask(general, "api.example.test", PYTHON) == (True, "allowlist")  # example.test covers it
    narrow = pol(allow=[{"host": "up.test", "exe": ["curl"]}], deny=["up.test"])
    assert ask(narrow, "up.test", CURL) == (False, "denylist")  # deny still wins


@pytest.mark.parametrize("mode", ["enforce", "ask", "learn", "allow"])
def test_another_program_is_refused_in_every_mode(mode: str) -> None:
    policy = pol(mode=mode, allow=[{"host": "up.test", "exe": ["curl"]}])
    assert ask(policy, "up.test", PYTHON) == (False, "exe_not_allowed")
    assert ask(policy, "up.test", CURL) == (True, "allowlist")


def test_profiles_narrow_by_program_too() -> None:
    policy = pol(allow=["up.test"], profiles={"tool": {"allow": [{"host": "up.test", "exe": ["curl"]}]}})
    assert ask(policy, "up.test", CURL, "tool") == (True, "allowlist")
    assert ask(policy, "up.test", PYTHON, "tool") == (False, "profile")
    assert ask(policy, "up.test", PYTHON) == (True, "allowlist")
    assert policy.needs_program and not pol(allow=["up.test"]).needs_program


def test_the_refusal_names_the_programs_and_the_owner() -> None:
    decision = decide("registry.npmjs.org:443", Client(None, CURL), NPM)
    assert "npm, node" in decision.detail and "/usr/bin/curl" in decision.detail
    unknown = decide("registry.npmjs.org:443", Client(), NPM)
    assert "could not identify" in unknown.detail


@pytest.mark.parametrize("key", ["deny", "inspect"])
def test_exe_only_on_allow_rules(key: str) -> None:
    with pytest.raises(PolicyError, match=rf"{key}\[0\].*exe is only for allow rules"):
        pol(**{key: [{"host": "up.test", "exe": ["curl"]}]})
    with pytest.raises(PolicyError, match="exe is only for allow rules"):
        pol(profiles={"p": {key if key == "deny" else "deny": [{"host": "up.test", "exe": ["curl"]}]}})


@pytest.mark.parametrize(
    "exe", [[], "", [""], ["bin/curl"], ["./curl"], [" curl"], ["cu\x00rl"], [3], {"a": 1}, [".."], ["."]]
)
def test_bad_exe_entries(exe: object) -> None:
    with pytest.raises(RuleError):
        parse_rule({"host": "up.test", "exe": exe})


def test_exe_entries_are_normalised_and_dumped() -> None:
    rule = parse_rule({"host": "up.test", "exe": ["//usr/bin/../bin/curl", "curl", "curl"]})
    assert rule.exe == ("/usr/bin/curl", "curl")
    policy = pol(allow=[{"host": "up.test", "exe": ["curl"]}])
    assert parse_policy(policy_to_data(policy), "again.yaml").allow == policy.allow
