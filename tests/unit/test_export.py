"""`egressd policy export`, pure: the guard lists against the classifier, and the Smokescreen and
Envoy matching (simulated from their sources) against `decide` on the bypass corpus.

Why: Squid is run for real (tests/test_export_squid.py); Smokescreen and Envoy are not installable
here, so their matching rules — Smokescreen's HostMatchesGlob and Decide order (acl.go), Envoy's
RBAC full-match regexes on :authority — are simulated exactly as their sources state, and every
target they admit must be one egressd admits (never wider); where egressd admits and they do not,
a finding must name the rule.
"""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import sys
from ipaddress import IPv4Address, IPv6Address

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.export import ExportRefused, export_policy
from egressd.export.guards import FORBIDDEN, NON_GLOBAL, PRIVATE
from egressd.policy import (
    AddressClass,
    Client,
    Policy,
    TargetError,
    classify,
    decide,
    parse_policy,
    parse_target,
)
from tests.support.spellings import CASES

POLICY = parse_policy(
    {
        "version": 1,
        "mode": "enforce",
        "allow": ["allowed.test", "*.wild.test", "bücher.test", "port.test:443", "198.51.100.1"],
        "deny": ["denied.test", "bad.allowed.test", "*.sub.wild.test"],
        "loopback": {"allow": False},
    },
    "unit",
)
NAMES = [c.host for c in CASES] + [
    "wild.test",
    "a.wild.test",
    "x.y.wild.test",
    "q.sub.wild.test",
    "sub.wild.test",
    "bad.allowed.test",
    "x.bad.allowed.test",
    "port.test",
    "a.port.test",
]


def _special_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """Every network the standard library's is_global consults, plus the guard lists."""
    found: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = list(NON_GLOBAL)
    for constants in (ipaddress._IPv4Constants, ipaddress._IPv6Constants):  # type: ignore[attr-defined]
        for value in vars(constants).values():
            for item in value if isinstance(value, list | tuple) else (value,):
                if isinstance(item, ipaddress.IPv4Network | ipaddress.IPv6Network):
                    found.append(item)
    return found


def _covered(ip: IPv4Address | IPv6Address) -> bool:
    return any(ip.version == n.version and ip in n for n in NON_GLOBAL)


def test_forbidden_list_is_forbidden() -> None:
    for net in FORBIDDEN:
        for ip in (net.network_address, net.broadcast_address):
            assert classify(ip) is AddressClass.FORBIDDEN, (net, ip)


def test_every_non_global_edge_is_in_the_guard() -> None:
    """First, last and middle address of every special network: non-global means guarded."""
    for net in _special_networks():
        size = net.num_addresses
        for ip in (net.network_address, net.broadcast_address, net.network_address + size // 2):
            if classify(ip) is not AddressClass.GLOBAL:
                assert _covered(ip), (net, ip, classify(ip))


@settings(max_examples=3000, deadline=None)
@given(st.integers(0, 2**32 - 1) | st.integers(0, 2**128 - 1))
def test_guard_is_a_superset_of_the_classifier(value: int) -> None:
    """Never wider: any address egressd does not call global is in the exported guard."""
    ip: IPv4Address | IPv6Address = IPv4Address(value) if value < 2**32 else IPv6Address(value)
    if classify(ip) is not AddressClass.GLOBAL:
        assert _covered(ip), (ip, classify(ip))


def test_private_list_covers_no_global_ipv4() -> None:
    """The IPv4 private list refuses nothing egressd calls global (it would break, not widen)."""
    for net in PRIVATE:
        if net.version == 4:
            assert classify(net.network_address) is not AddressClass.GLOBAL, net


# -- Smokescreen, simulated from stripe/smokescreen pkg/smokescreen/acl/v1/acl.go ------------------
def _glob_match(host: str, glob: str) -> bool:
    h, wildcard = host.lower().rstrip("."), glob.startswith("*.")
    g = glob[2:] if wildcard else glob
    return h.endswith("." + g) if wildcard else h == g


def _smokescreen_allows(acl: dict, host: str) -> bool:
    rule = acl["default"]
    if any(_glob_match(host, g) for g in rule.get("allowed_domains") or []):
        return True
    if any(_glob_match(host, g) for g in acl["global_deny_list"]):
        return False
    if any(_glob_match(host, g) for g in acl["global_allow_list"]):
        return True
    return rule["action"] in ("open", "report")


def _egressd(host: str, port: int = 443) -> tuple[bool, str]:
    decision = decide(f"{host}:{port}", Client(), POLICY)
    return decision.allowed, decision.rule or ""


def _canonical(host: str) -> str | None:
    """The name both engines would see (smokescreen normalizes names as egressd does); None: skip."""
    try:
        target = parse_target(f"{host}:443")
    except TargetError:
        return None
    return target.host.name


def _predicted(result_findings: list, rule: str) -> bool:
    return any(rule == d or rule.startswith(d + " ") for f in result_findings for d in f.decides)


def test_smokescreen_never_wider_and_differences_predicted() -> None:
    result = export_policy(POLICY, "smokescreen")
    acl = yaml.safe_load(result.text)
    for host in NAMES:
        name = _canonical(host)
        if name is None or name == "localhost" or name.endswith(".localhost"):
            continue
        allowed, rule = _egressd(name)
        theirs = _smokescreen_allows(acl, name)
        assert not (theirs and not allowed), (host, "smokescreen is wider")
        if allowed and not theirs:
            assert _predicted(result.findings, rule), (host, rule)


# -- Envoy, simulated: RBAC DENY then ALLOW, full-match regexes on :authority --------------------
def _envoy_allows(boot: dict, authority: str) -> bool:
    filters = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    for f in filters["http_filters"]:
        if f["name"] != "envoy.filters.http.rbac":
            continue
        rules = f["typed_config"]["rules"]
        regexes = [
            p["permissions"][0]["header"]["string_match"]["safe_regex"]["regex"]
            for p in rules["policies"].values()
        ]
        hit = any(re.fullmatch(rx, authority) for rx in regexes)
        if rules["action"] == "DENY" and hit:
            return False
        if rules["action"] == "ALLOW" and not hit:
            return False
    return True


@pytest.mark.parametrize("port", [443, 8443])
def test_envoy_never_wider_and_differences_predicted(port: int) -> None:
    result = export_policy(POLICY, "envoy")
    boot = yaml.safe_load(result.text)
    for host in NAMES:
        if any(c in host for c in " \t\r\n") or not host.isascii():
            continue  # not a valid :authority: Envoy's codec refuses it
        authority = f"{host}:{port}"
        allowed, rule = _egressd(host, port)
        theirs = _envoy_allows(boot, authority)
        if theirs and not allowed:
            # Envoy admits spellings egressd refuses as unparseable (the report's `target` finding):
            # only ones that are, or are under, a name egressd admits (a trailing dot, bad punycode).
            name = host.rstrip(".").lower()
            parent = name.partition(".")[2]
            assert decide(f"{host}:{port}", Client(), POLICY).reason == "invalid_target", authority
            assert _egressd(name, port)[0] or _egressd(parent, port)[0], (authority, "envoy is wider")
        if allowed and not theirs:
            assert _predicted(result.findings, rule), (authority, rule)


# -- refusals and the report ---------------------------------------------------------------------
def test_refused_when_only_wider_is_possible() -> None:
    wide = parse_policy({"version": 1, "allow": ["0.0.0.0/0"]}, "wide")
    with pytest.raises(ExportRefused):
        export_policy(wide, "smokescreen")
    allow_mode = parse_policy({"version": 1, "mode": "allow", "deny": ["evil.test"]}, "allow-mode")
    with pytest.raises(ExportRefused):
        export_policy(allow_mode, "cilium")


def test_cli_reports_on_stderr_and_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nmode: ask\nallow: [{host: api.test, paths: [/v1]}]\n")
    report = tmp_path / "r.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "egressd",
            "policy",
            "export",
            "--to",
            "squid",
            "--policy",
            str(policy),
            "--report-json",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "http_access deny all" in out.stdout
    assert "dropped: allow[0]" in out.stderr and "denied: mode 'ask'" in out.stderr
    data = json.loads(report.read_text())
    assert data["wider"] is False
    assert {"allow: api.test", "mode: ask"} <= {d for f in data["findings"] for d in f["decides"]}
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "egressd",
            "policy",
            "export",
            "--to",
            "cilium",
            "--policy",
            str(tmp_path / "x.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2  # no such file: egressd's usual set-up failure


def test_profiles_and_learn_are_reported() -> None:
    policy: Policy = parse_policy(
        {"version": 1, "allow": ["a.test"], "profiles": {"ci": {"allow": ["a.test"]}}}, "p"
    )
    for target in ("squid", "smokescreen", "cilium", "istio", "envoy"):
        findings = export_policy(policy, target).findings
        assert any(f.setting == "profiles.ci" for f in findings), target
