"""`egressd policy suggest` through the real command: what counts, the folding rule, --policy BASE,
the output loading with egressd's own loader, bad input, and no network use.

The end-to-end learn -> suggest -> enforce round trip through `egressd run` is in tests/test_learn.py.
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

REPO = Path(__file__).resolve().parent.parent
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
    hosts += [("y.api.example.com", 80), ("203.0.113.7", 443), ("bücher.example", 443)]
    audit = write_audit(tmp_path / "audit.jsonl", [record(h, p) for h, p in hosts])
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
