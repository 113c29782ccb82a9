"""`egressd policy suggest` through the real command: what counts, the folding rule, --policy BASE,
the output loading with egressd's own loader, bad input, and no network use.

The end-to-end learn -> suggest -> enforce round trip through `egressd run` is in tests/e2e/test_learn.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import yaml

from egressd.policy import Client, decide, load_policy, make_target
from tests.support.egressd_cli import EGRESSD

REPO = Path(__file__).resolve().parents[2]
_clock = iter(range(10_000))


def record(host: str, port: int = 443, reason: str = "learned", **extra: Any) -> dict[str, Any]:
    second = next(_clock)
    fields: dict[str, Any] = {
        "time": f"2026-12-01T10:{second // 60:02d}:{second % 60:02d}.000Z",
        "event": "decision",
        "conn": f"c{second}",
        "client": "egressd",
        "stage": "connect",
        "host": host,
        "port": port,
        "decision": "deny" if reason != "learned" else "allow",
        "reason": reason,
    }
    fields.update(extra)
    return fields


def run_record(private: bool, *nameservers: str, event: str = "policy") -> dict[str, Any]:
    """What egressd writes of the policy in force: at start (`policy`) and at each `reload`."""
    return {
        "time": "2026-12-01T09:00:00.000Z",
        "event": event,
        "source": "run.yaml",
        "mode": "learn",
        "private_allow": private,
        "nameservers": list(nameservers),
    }


RUN_PRIVATE = run_record(True)


def write_audit(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def suggest(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*EGRESSD, "policy", "suggest", *map(str, args)], capture_output=True, text=True, timeout=60
    )


def allow_list(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert result.returncode == 0, result.stderr
    data = yaml.safe_load(result.stdout)
    assert data["version"] == 1 and data["mode"] == "enforce"
    return list(data["allow"])


@pytest.mark.parametrize(
    ("hosts", "expected"),
    [
        # below the registrable domain example.com: folds to the common parent
        (["x.api.example.com", "y.api.example.com"], ["api.example.com:443"]),
        (["a.b.api.example.com", "c.api.example.com"], ["api.example.com:443"]),
        # the common parent IS the registrable domain: not widened to all of example.com
        (["a.example.com", "b.example.com"], ["a.example.com:443", "b.example.com:443"]),
        # github.io is a public suffix: two registrable domains, never joined
        (["a.github.io", "b.github.io"], ["a.github.io:443", "b.github.io:443"]),
        (["a.blogspot.com", "b.blogspot.com"], ["a.blogspot.com:443", "b.blogspot.com:443"]),
        (["x.a.github.io", "y.a.github.io"], ["x.a.github.io:443", "y.a.github.io:443"]),
        (["x.s.a.github.io", "y.s.a.github.io"], ["s.a.github.io:443"]),
        # c.kobe.jp is a public suffix (wildcard rule): b.c.kobe.jp is registrable
        (["a.b.c.kobe.jp", "d.b.c.kobe.jp"], ["a.b.c.kobe.jp:443", "d.b.c.kobe.jp:443"]),
        (["x.y.co.uk", "z.y.co.uk"], ["x.y.co.uk:443", "z.y.co.uk:443"]),
        # a name a suggested rule already matches merges into it
        (["example.org", "www.example.org", "cdn.www.example.org"], ["example.org:443"]),
        # unknown TLDs count as public suffixes (.test)
        (["a.test", "b.test"], ["a.test:443", "b.test:443"]),
        # IP literals are never folded
        (["8.8.8.8", "8.8.4.4"], ["8.8.4.4:443", "8.8.8.8:443"]),
        (["2606:4700::1111"], ["[2606:4700::1111]:443"]),
        # internationalised names come out in IDNA form
        (["xn--bcher-kva.example.com"], ["xn--bcher-kva.example.com:443"]),
    ],
)
def test_folding_rule(tmp_path: Path, hosts: list[str], expected: list[str]) -> None:
    audit = write_audit(tmp_path / "audit.jsonl", [record(h) for h in hosts])
    rules = allow_list(suggest(audit))
    assert sorted(rules) == sorted(expected)


def test_comments_counts_ports_times_command_and_what_counts(tmp_path: Path) -> None:
    records: list[dict[str, Any]] = [
        {"time": "2026-12-01T09:59:59.000Z", "event": "child", "client": "egressd", "program": "npm"},
        record("registry.test", 443, conn="t1"),
        record(
            "registry.test", 443, conn="t1", stage="connection", would_be="not_allowlisted"
        ),  # same tunnel
        record("registry.test", 80, "not_allowlisted", stage="request", method="GET", path="/"),
        record("asked.test", 443, "no_approver"),
        record("waited.test", 443, "ask_timeout"),
        # not suggested: allowed by a rule, refused on purpose, or refused by a person
        record("rule.test", 443, "allowlist"),
        record("denied.test", 443, "denylist"),
        record("169.254.169.254", 80, "forbidden_address"),
        record("192.168.1.1", 80, "private_address"),
        record("said-no.test", 443, "ask_refused"),
        record("private.test", 443, "resolved_forbidden"),
        {"time": "2026-12-01T11:00:00.000Z", "event": "closed", "conn": "t1", "host": "registry.test"},
    ]
    audit = write_audit(tmp_path / "audit.jsonl", records)
    result = suggest(audit)
    assert sorted(allow_list(result)) == [
        "asked.test:443",
        "registry.test:443",
        "registry.test:80",
        "waited.test:443",
    ]
    text = result.stdout
    block = text[text.index("# registry.test:") :].split("  - ", 1)[0]
    assert "2 seen" in block and "learned 1" in block and "not_allowlisted 1" in block
    assert "443 (1x)" in block and "80 (1x)" in block
    assert "first 2026-12-01T10:" in block and "last 2026-12-01T10:" in block
    assert "command: npm" in block
    assert result.stderr == ""


def test_base_policy_keeps_only_what_it_lacks_and_output_round_trips(tmp_path: Path) -> None:
    base = tmp_path / "base.yaml"
    base.write_text("version: 1\nmode: learn\nallow: [known.test, '*.wild.test']\n")
    hosts = ["known.test", "sub.known.test", "a.wild.test", "new.test", "x.api.new2.test", "y.api.new2.test"]
    audit = write_audit(tmp_path / "audit.jsonl", [record(h) for h in hosts])
    result = suggest(audit, "--policy", base)
    assert sorted(allow_list(result)) == ["api.new2.test:443", "new.test:443"]
    assert f"only what {base} does not already allow" in result.stdout
    out = tmp_path / "suggested.yaml"
    out.write_text(result.stdout)
    policy = load_policy(out)  # egressd's own loader
    assert policy.mode == "enforce"
    for host in ("new.test", "x.api.new2.test", "y.api.new2.test"):
        assert decide(make_target(host, 443, scheme="connect"), Client(), policy).allowed
    for host, port in (("new.test", 8443), ("other.test", 443), ("new2.test", 443), ("known.test", 443)):
        assert not decide(make_target(host, port, scheme="connect"), Client(), policy).allowed
    # against the suggestion itself: only what it lacks (known.test takes sub.known.test along)
    assert sorted(allow_list(suggest(audit, "--policy", out))) == ["a.wild.test:443", "known.test:443"]


def test_every_output_loads_and_admits_every_learned_target(tmp_path: Path) -> None:
    hosts = [("a.github.io", 443), ("b.github.io", 8443), ("fd00::1", 80), ("x.api.example.com", 443)]
    hosts += [("y.api.example.com", 80), ("203.0.113.7", 443), ("bücher.example", 443), ("8.8.8.8", 53)]
    # the run licensed private addresses: its learned literals are suggested too
    audit = write_audit(tmp_path / "audit.jsonl", [RUN_PRIVATE] + [record(h, p) for h, p in hosts])
    result = suggest(audit)
    out = tmp_path / "s.yaml"
    out.write_text(result.stdout)
    policy = load_policy(out)
    for host, port in hosts:
        decision = decide(make_target(host, port, scheme="connect"), Client(), policy)
        assert decision.allowed, (host, port, decision.reason)
    assert not decide(make_target("c.github.io", 443, scheme="connect"), Client(), policy).allowed
    assert not decide(make_target("a.github.io", 80, scheme="connect"), Client(), policy).allowed


def test_nothing_learned_is_a_valid_empty_policy(tmp_path: Path) -> None:
    audit = write_audit(tmp_path / "audit.jsonl", [record("rule.test", 443, "allowlist")])
    result = suggest(audit)
    assert allow_list(result) == []
    (tmp_path / "s.yaml").write_text(result.stdout)
    assert load_policy(tmp_path / "s.yaml").allow.rules == ()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("", "empty audit"),
        ("\n\n", "empty audit"),
        ('{"event": "decision"}\nnot json\n', "audit.jsonl:2: not a JSON audit record"),
        ('["a list"]\n', "audit.jsonl:1: not a JSON audit record"),
    ],
)
def test_bad_input_exits_2_with_nothing_on_stdout(tmp_path: Path, content: str | None, message: str) -> None:
    audit = tmp_path / "audit.jsonl"
    good = write_audit(tmp_path / "good.jsonl", [record("a.test")])
    if content is not None:
        audit.write_text(content)
    for args in ((audit,), (good, audit)):  # one bad file spoils the whole run
        result = suggest(*args)
        assert result.returncode == 2 and result.stdout == ""
        assert message in result.stderr and str(audit.name) in result.stderr
    missing_base = suggest(good, "--policy", tmp_path / "nope.yaml")
    assert missing_base.returncode == 2 and missing_base.stdout == ""
    assert suggest().returncode == 2  # no AUDIT argument: click's usage error


def test_help_documents_the_folding_rule() -> None:
    result = subprocess.run([*EGRESSD, "policy", "suggest", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for words in ("registrable domain", "api.example.com", "github.io", "--policy BASE", "ask_refused"):
        assert words in " ".join(result.stdout.split())


_NO_NETWORK = """
import socket, sys
def hook(event, args):
    if event.startswith("socket.") or event.startswith("urllib."):
        raise RuntimeError("network use: " + event)
sys.addaudithook(hook)
from egressd.cli import main
sys.argv = ["egressd", "policy", "suggest", sys.argv[1]]
main()
"""


def test_public_suffix_list_is_bundled_never_downloaded(tmp_path: Path) -> None:
    audit = write_audit(tmp_path / "audit.jsonl", [record("x.api.example.com"), record("y.api.example.com")])
    result = subprocess.run(
        [sys.executable, "-c", _NO_NETWORK, str(audit)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert allow_list(result) == ["api.example.com:443"]
    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"publicsuffixlist=={version('publicsuffixlist')}" in pins  # pinned: the list changes only with it


PRIVATE_LITERALS = [("10.0.0.1", 80), ("172.17.0.1", 2375), ("fd00::1", 6443), ("100.64.0.1", 80)]
PRIVATE_LITERALS += [("192.168.1.1", 80), ("198.51.100.7", 443), ("64:ff9b::c0a8:101", 443)]


def _literal_records(reason: str) -> list[dict[str, Any]]:
    return [record(host, port, reason) for host, port in PRIVATE_LITERALS] + [record("8.8.8.8", 53, reason)]


@pytest.mark.parametrize(
    ("before", "reason", "base_private", "licensed"),
    [
        # an audit of an egressd that refused private literals not_allowlisted in enforce
        ([], "not_allowlisted", False, False),
        ([run_record(False)], "not_allowlisted", False, False),
        # learned, but the run's policy did not license them (only an IP rule could have admitted)
        ([run_record(False)], "learned", False, False),
        ([], "learned", False, False),
        # the run's policy had private.allow: at start, or from a reload before the records
        ([run_record(True)], "learned", False, True),
        ([run_record(True)], "not_allowlisted", False, True),
        ([run_record(False), run_record(True, event="reload")], "learned", False, True),
        # a reload took the licence away before the records: not licensed
        ([run_record(True), run_record(False, event="reload")], "learned", False, False),
        # BASE licenses them
        ([], "learned", True, True),
        ([run_record(False)], "not_allowlisted", True, True),
    ],
)
def test_a_non_global_literal_is_suggested_only_where_private_allow_licensed_it(
    tmp_path: Path, before: list[dict[str, Any]], reason: str, base_private: bool, licensed: bool
) -> None:
    audit = write_audit(tmp_path / "audit.jsonl", [*before, *_literal_records(reason)])
    base = tmp_path / "base.yaml"
    base.write_text(f"version: 1\nprivate: {{allow: {str(base_private).lower()}}}\nallow: [known.test]\n")
    result = suggest(audit, "--policy", base)
    rules = allow_list(result)
    literals = [f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in PRIVATE_LITERALS]
    assert "8.8.8.8:53" in rules  # a global address is suggested either way
    data = yaml.safe_load(result.stdout)
    if licensed:
        assert sorted(rules) == sorted([*literals, "8.8.8.8:53"])
        assert data["private"] == {"allow": True}
        assert "licensed by private.allow in" in result.stdout
    else:
        assert rules == ["8.8.8.8:53"]
        assert "private" not in data
        for literal in literals:
            assert f"# left out: {literal}: not a global address" in result.stdout, literal
    (tmp_path / "s.yaml").write_text(result.stdout)
    load_policy(tmp_path / "s.yaml")


def test_names_that_reached_private_addresses_carry_the_runs_licence_and_nameservers(tmp_path: Path) -> None:
    def tunnel(host: str, conn: str, connected: str) -> list[dict[str, Any]]:
        return [
            record(host, 443, conn=conn),
            record(host, 443, conn=conn, stage="connection", connected=f"{connected}:443"),
        ]

    records = [
        run_record(True, "198.51.100.53:5353"),
        *tunnel("registry.test", "t1", "10.1.2.3"),
        *tunnel("global.test", "t2", "8.8.4.4"),
    ]
    result = suggest(write_audit(tmp_path / "a.jsonl", records))
    data = yaml.safe_load(result.stdout)
    assert sorted(data["allow"]) == ["global.test:443", "registry.test:443"]
    assert data["private"] == {"allow": True} and data["resolver"] == {"nameservers": ["198.51.100.53:5353"]}
    assert "registry.test (10.1.2.3)" in result.stdout and "global.test (" not in result.stdout
    # nothing reached a private address: nothing to carry but the nameservers
    only_global = [run_record(True, "198.51.100.53"), *tunnel("global.test", "t3", "8.8.4.4")]
    data = yaml.safe_load(suggest(write_audit(tmp_path / "b.jsonl", only_global)).stdout)
    assert "private" not in data and data["resolver"] == {"nameservers": ["198.51.100.53"]}
    # reached under a rule of the run's (an IP/CIDR rule), not private.allow: the rule is suggested
    # (a name rule admits no private address by itself) and no licence is carried over
    cidr = [run_record(False), *tunnel("registry.test", "t4", "10.1.2.3")]
    result = suggest(write_audit(tmp_path / "c.jsonl", cidr))
    data = yaml.safe_load(result.stdout)
    assert data["allow"] == ["registry.test:443"] and "private" not in data
    assert "reached under an IP/CIDR rule or a private origin" in result.stdout
