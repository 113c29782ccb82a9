"""Where features meet: every place of a request a child can write a secret's placeholder into, on
both fronts.

Why: egressd refuses (`secret_exfiltration`) a request that carries a secret's placeholder to a host
the secret may not go to — but only in the places it scans. A child that has read the source writes
the placeholder where nobody looked: the HTTP method (`curl -X "$API_KEY" http://other.test/`), the
path, the query, a header's value or its name, in the spellings the matcher knows. Each row sends one
such request through the real `egressd run` (plain HTTP, and HTTPS egressd inspects) to a real server
the secret may not go to, and proves it was refused with that reason, that the server never saw the
placeholder, and that the audit keeps no placeholder either.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from tests.support.attempts import wait_until
from tests.support.audit_log import audit_records
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun, write_policy
from tests.support.proxied import FRONTS, Answer, Proxied
from tests.support.raw_upstream import RawUpstream, Script, Seen

ADDRESS = "198.51.100.62"
OK: Script = [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]


def _answer(seen: Seen) -> Script:
    return OK


SPELLINGS = {
    "as-written": lambda ph: ph,
    "token-upper-case": lambda ph: ph.rsplit("-", 1)[1].upper(),
    "percent-encoded": lambda ph: "".join(f"%{ord(c):02X}" for c in ph),
}
# where the child writes it: (method, path, headers) with {} for the spelled placeholder
PLACES = {
    "method": ("{}", "/m", []),
    "path": ("GET", "/p/{}", []),
    "query": ("GET", "/q?k={}", []),
    "header-value": ("GET", "/h", [("X-Anything", "{}")]),
    "header-name": ("GET", "/n", [("X-{}", "1")]),
}
DECIDED_METHOD = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


@dataclass
class Setup:
    run: EgressdRun
    plain: RawUpstream
    tls: RawUpstream
    audit: Path


@pytest.fixture(scope="module")
def setup(ca: trustme.CA, ca_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    directory = tmp_path_factory.mktemp("places")
    (directory / "api.key").write_text("sk-places-REAL\n")
    audit = directory / "audit.jsonl"
    policy = write_policy(
        directory,
        f"""\
version: 1
mode: enforce
allow: [api.test, other.test]
inspect: [other.test]
private: {{allow: true}}
secrets: [{{name: api, from: {{file: {directory / "api.key"}}}, hosts: [api.test], env: API_KEY}}]
""",
    )
    options = ["--policy", str(policy), "--upstream-ca", str(ca_file), "--audit", str(audit)]
    with DnsServer() as dns:
        dns.add("other.test", ADDRESS)
        with (
            RawUpstream(ADDRESS, _answer, name="places-plain") as plain,
            RawUpstream(ADDRESS, _answer, ca=ca, hostnames=["other.test"], name="places-tls") as tls,
            EgressdRun([*options, "--nameserver", dns.nameserver]) as run,
        ):
            yield Setup(run, plain, tls, audit)


def _written_in(setup: Setup, front: str, place: str, written: str) -> Answer:
    """A request to other.test with `written` in `place`."""
    method, path, headers = PLACES[place]
    upstream = setup.plain if front == "plain" else setup.tls
    return Proxied(setup.run).request(
        front,
        f"other.test:{upstream.port}",
        method.format(written),
        path.format(written),
        [(n.format(written), v.format(written)) for n, v in headers],
    )


def _rows() -> Iterator[tuple[str, str, str]]:
    for front in FRONTS:
        for place in PLACES:
            for spelling in SPELLINGS:
                if place == "method" and spelling == "percent-encoded":
                    continue  # not a method egressd reads (refused as invalid_target, below)
                yield front, place, spelling


@pytest.mark.parametrize(("front", "place", "spelling"), list(_rows()))
def test_a_placeholder_anywhere_in_a_request_is_refused(
    setup: Setup, front: str, place: str, spelling: str
) -> None:
    placeholder = setup.run.env["API_KEY"]
    token = placeholder.rsplit("-", 1)[1]
    written = SPELLINGS[spelling](placeholder)
    upstream = setup.plain if front == "plain" else setup.tls
    before = len(upstream.requests())
    answer = _written_in(setup, front, place, written)
    # a method egressd reads (a letter, then letters, digits, '-', '_') is refused for the
    # placeholder; any other for what it is (the random part may start with a digit)
    decided = place != "method" or DECIDED_METHOD.fullmatch(written)
    reason = b"secret_exfiltration" if decided else b"invalid_target"
    assert answer.status == 403 and answer.field(b"x-egressd-reason") == reason, answer.raw[:500]
    if decided:  # the refusal names the secret, never its placeholder
        assert token.encode() not in answer.text().lower()
    seen = upstream.requests()[before:]
    assert not any(token in (s.head + s.body).decode("latin-1").lower() for s in seen), seen
    records = wait_until(
        lambda: [r for r in audit_records(setup.audit) if r.get("reason") == reason.decode()],
        "the refusal's record",
    )
    assert token not in json.dumps(records).lower()


@pytest.mark.parametrize("front", FRONTS)
def test_a_method_egressd_cannot_read_is_refused_too(setup: Setup, front: str) -> None:
    """A percent-encoded placeholder is no method egressd decides: refused before any rule."""
    written = "".join(f"%{ord(c):02X}" for c in setup.run.env["API_KEY"])
    upstream = setup.plain if front == "plain" else setup.tls
    before = len(upstream.requests())
    answer = Proxied(setup.run).request(front, f"other.test:{upstream.port}", written, "/m", [])
    assert answer.status is not None and answer.status >= 400, answer.raw[:500]
    assert upstream.requests()[before:] == []


@pytest.mark.parametrize("front", FRONTS)
def test_the_same_requests_without_a_placeholder_go_through(setup: Setup, front: str) -> None:
    """The table's control: the requests it refuses are refused for the placeholder only."""
    for place in PLACES:
        answer = _written_in(setup, front, place, "plain-Word")
        assert answer.status == 200, (place, answer.raw[:300])
