"""Private IP literals through the real `egressd run`: the address guard's reason in every mode, on
every front, and `egressd policy suggest` never turns such a refusal into an allow rule.

A private literal (RFC 1918, the Docker API on 172.17.0.1:2375, ULA, CGNAT) is one a name could not
resolve to without `private.allow`; enforce refuses it with the guard's reason (`private_address`)
as allow, learn and ask do, so a learned policy built from the audit never admits it. Nothing is
connected to: the decision refuses before anything is resolved or dialled (and the test's network
namespace has no route to these addresses anyway).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.support.attempts import wait_until
from tests.support.audit_log import audit_records
from tests.support.corpus import FRONTS, ProxyClient, attempt, socks_address
from tests.support.egressd_cli import EGRESSD, EgressdRun

MODES = ("enforce", "ask", "learn", "allow")
SOCKS_NOT_ALLOWED = 2  # RFC 1928: connection not allowed by ruleset

# (as written in a URL, the canonical address, the port)
LITERALS = [
    ("10.0.0.1", "10.0.0.1", 80),
    ("0xa.1", "10.0.0.1", 80),
    ("172.17.0.1", "172.17.0.1", 2375),  # the Docker API
    ("[::ffff:172.17.0.1]", "172.17.0.1", 2375),
    ("[fd00::1]", "fd00::1", 6443),
    ("100.64.0.1", "100.64.0.1", 80),
    ("192.168.1.1", "192.168.1.1", 80),
    ("3232235777", "192.168.1.1", 80),
    ("[64:ff9b::c0a8:101]", "64:ff9b::c0a8:101", 443),  # NAT64 carrying 192.168.1.1
]
STAGES = {"http": "request", "connect": "connect", "socks-name": "socks", "socks-address": "socks"}


@dataclass
class Run:
    mode: str
    client: ProxyClient
    audit: Path


@pytest.fixture(scope="module", params=MODES)
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    mode = str(request.param)
    audit = tmp_path_factory.mktemp(f"literals-{mode}") / "audit.jsonl"
    # ask: no approver is attached; a guarded literal is refused before anyone would be asked
    with EgressdRun(["--mode", mode, "--audit", str(audit), "--no-prompt"]) as egressd:
        yield Run(mode, ProxyClient.from_env(egressd.env), audit)


CASES = [
    pytest.param(front, *literal, id=f"{front}-{literal[0]}:{literal[2]}")
    for front in FRONTS
    for literal in LITERALS
    if front != "socks-address" or socks_address(literal[0]) is not None
]


@pytest.mark.parametrize(("front", "written", "address", "port"), CASES)
def test_a_private_literal_gets_the_guards_reason_in_every_mode(
    run: Run, front: str, written: str, address: str, port: int
) -> None:
    status, reason = attempt(run.client, front, written, port, "/containers/json")
    if front.startswith("socks"):
        assert status == SOCKS_NOT_ALLOWED
    else:
        assert (status, reason) == (403, "private_address")
    stage = STAGES[front]

    def recorded() -> list[dict[str, object]]:
        return [
            r
            for r in audit_records(run.audit)
            if r.get("event") == "decision"
            and (r.get("host"), r.get("port"), r.get("stage")) == (address, port, stage)
        ]

    records = wait_until(recorded, f"the audit record of {front} {written}:{port}")
    assert {(r["decision"], r["reason"]) for r in records} == {("deny", "private_address")}
    assert not [r for r in audit_records(run.audit) if r.get("host") == address and r.get("connected")]


def test_suggest_never_turns_a_private_literal_into_a_rule(run: Run, tmp_path: Path) -> None:
    for written, _address, port in LITERALS:
        for front in ("http", "connect"):
            attempt(run.client, front, written, port, "/containers/json")
    addresses = {address for _, address, _ in LITERALS}
    wait_until(
        lambda: addresses <= {r.get("host") for r in audit_records(run.audit)}, "every literal in the audit"
    )
    result = subprocess.run(
        [*EGRESSD, "policy", "suggest", str(run.audit)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert not (yaml.safe_load(result.stdout).get("allow") or []), result.stdout
    for address in addresses:
        assert address not in result.stdout
