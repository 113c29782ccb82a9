"""`egressd policy export`, pure: the guard lists against the classifier, refusals, the report, and
the loss tables docs/scale.md shows.

Why: each engine's decisions are checked on one target table elsewhere (tests/e2e/test_export_squid.py
on the real Squid, tests/unit/test_export_envoy.py and tests/unit/test_export_smokescreen.py on Envoy's API
types and Smokescreen's documented rules); these are the parts that need no engine at all.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
from ipaddress import IPv4Address, IPv6Address
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.policy import (
    AddressClass,
    Policy,
    classify,
    parse_policy,
)
from egressd.tools.export import ExportRefused, export_policy
from egressd.tools.export.guards import FORBIDDEN, NON_GLOBAL, PRIVATE
from egressd.tools.export.report import LOSSES, NARROWER, READS, TARGET_KINDS, WIDER
from tests.support import reference as ref
from tests.support.export_targets import MEASURED
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


def loss_table_markdown() -> str:
    """docs/scale.md's tables: per kind of target, what each engine decides differently, then why."""
    targets = ("squid", "smokescreen", "envoy", "cilium", "istio")
    short = {NARROWER: "narrower", READS: "reads the host", WIDER: "**wider**"}
    lines = ["| target kind | " + " | ".join(targets) + " |", "|---|" + "---|" * len(targets)]
    for kind in TARGET_KINDS:
        cells = [
            ", ".join(dict.fromkeys(short[x.how] for x in LOSSES[t].get(kind, ()))) or "same" for t in targets
        ]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines += ["", "| target kind | what it is |", "|---|---|"]
    lines += [f"| {kind} | {what} |" for kind, what in TARGET_KINDS.items()]
    lines.append("")
    for target in targets:
        for kind in TARGET_KINDS:
            for loss in LOSSES[target].get(kind, ()):
                seen = " (not on the test table)" if target in MEASURED and not loss.in_table else ""
                lines.append(f"- {target}, {kind}: {loss.how}: {loss.detail}{seen}")
    return "\n".join(lines) + "\n"


def _special_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """Every network the standard library's is_global consults, the IANA special-purpose registries'
    blocks (tests/support/reference.py), and the guard lists."""
    found: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = list(NON_GLOBAL)
    found += [block for block, _, _ in (*ref.V4_SPECIAL, *ref.V6_SPECIAL)]
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


def test_scale_doc_shows_the_loss_tables() -> None:
    """docs/scale.md shows the loss report's tables as they are (a change to one changes both)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "scale.md").read_text()
    assert loss_table_markdown() in doc


def test_report_json_has_the_losses_per_kind() -> None:
    data = json.loads(export_policy(POLICY, "envoy").report_json())
    assert {"how": "narrower", "detail": LOSSES["envoy"]["address spelling"][0].detail} in data["kinds"][
        "address spelling"
    ]
    assert set(data["kinds"]) <= set(TARGET_KINDS)
