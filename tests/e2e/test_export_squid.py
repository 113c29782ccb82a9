"""`egressd policy export --to squid`, loaded by Debian's real squid and compared with egressd.

Why: an export is only worth something if the engine that loads it decides like egressd. The
exported include file is parsed (`squid -k parse`) and served by squid on loopback; the bypass
spelling corpus plus the export's own rule kinds (wildcard, port, path, CIDR) go through BOTH
`egressd run` and that squid (CONNECT and absolute-form GET). Every difference must be one the
export report predicted (a finding whose `decides` names the egressd rule that allowed it), and it
may only ever be narrower: squid allowing what egressd refuses is always a failure. All servers
sit on addresses local to the test namespace; a refused target must reach none of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from egressd.policy import Client, Decision, decide, load_policy
from tests.support.corpus import ProxyClient, Response, ServerSet, tunnel_get
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD, EgressdRun
from tests.support.export_targets import EXTRA_NAMES, HOSTS, measured_losses, policy_text, target_kind
from tests.support.spellings import ALLOWED_V4, DNS_NAMES, SERVER_HOSTS
from tests.support.squid import base_conf, wait_port
from tests.support.upstreams import free_port

pytestmark = pytest.mark.skipif(shutil.which("squid") is None, reason="squid is not installed")

SQUID_DNS = "127.0.0.53"  # squid asks port 53 only: the test DNS server listens there


@dataclass
class Squid:
    proc: subprocess.Popen[bytes]
    port: int
    directory: Path


def squid_conf(directory: Path, include: Path, port: int, squid_dns: str) -> str:
    """Test scaffolding around the exported include file: loopback port, no cache, files in tmp."""
    return "\n".join(
        [
            *base_conf(directory, port),
            f"dns_nameservers {squid_dns}",
            "negative_dns_ttl 1 second",
            "dns_timeout 2 seconds",  # a name the test DNS server cannot read gets no answer
            "dns_retransmit_interval 1 second",
            f"include {include}",
            "",
        ]
    )


@dataclass
class Lab:
    policy_file: Path
    export: str
    report: dict[str, object]
    egressd: ProxyClient
    squid: ProxyClient
    servers: ServerSet
    kinds: dict[str, dict[str, set[str]]] = field(default_factory=dict)  # front -> kind -> how it differed

    @property
    def port(self) -> int:
        return self.servers.port


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    with open_lab(tmp_path_factory.mktemp("squid"), _policy_text(), SQUID_DNS) as opened:
        yield opened


def _policy_text() -> str:
    return policy_text()


@contextlib.contextmanager
def open_lab(tmp: Path, policy_text: str, squid_dns: str) -> Iterator[Lab]:
    """Export the policy, start squid on it and `egressd run` with it, with the corpus's servers."""
    os.chmod(tmp, 0o777)  # squid drops to its own user for logs and the pid file
    policy_file = tmp / "policy.yaml"
    policy_file.write_text(policy_text)
    report_file = tmp / "report.json"
    out = subprocess.run(
        [
            *EGRESSD,
            "policy",
            "export",
            "--to",
            "squid",
            "--policy",
            str(policy_file),
            "--report-json",
            str(report_file),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    include = tmp / "egressd.conf"
    include.write_text(out.stdout)
    (tmp / "hosts").write_text("")
    port = free_port("127.0.0.1")
    conf = tmp / "squid.conf"
    conf.write_text(squid_conf(tmp, include, port, squid_dns))
    parsed = subprocess.run(
        ["squid", "-k", "parse", "-f", str(conf)], capture_output=True, text=True, timeout=60
    )
    assert parsed.returncode == 0, parsed.stderr
    assert "WARNING" not in parsed.stderr.replace("WARNING: HTTP requires", ""), parsed.stderr
    with DnsServer(squid_dns, 53) as dns, DnsServer() as dns2, ServerSet(SERVER_HOSTS) as servers:
        for server in (dns, dns2):
            for name, address in {**DNS_NAMES, **EXTRA_NAMES}.items():
                server.add(name, address)
        proc = subprocess.Popen(
            ["squid", "-N", "-f", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            wait_port(port, proc, tmp / "cache.log")
            with EgressdRun(["--policy", str(policy_file), "--nameserver", dns2.nameserver]) as run:
                yield Lab(
                    policy_file,
                    out.stdout,
                    json.loads(report_file.read_text()),
                    ProxyClient.from_env(run.env),
                    ProxyClient("127.0.0.1", port, "child", "unused"),
                    servers,
                )
        finally:
            proc.terminate()
            proc.wait(20)


def _answered(response: Response | None) -> str | None:
    """The upstream server that answered, or None for a refusal."""
    if response is None or response.status != 200 or response.reason is not None:
        return None
    try:
        return str(json.loads(response.body)["server"])
    except (ValueError, KeyError):
        return None


def _via(client: ProxyClient, front: str, host: str, port: int) -> str | None:
    try:
        return _exchange(client, front, host, port)
    except (TimeoutError, ConnectionError) as exc:
        raise AssertionError(f"{front} {host!r} through {client.port}: {exc}") from exc


def _exchange(client: ProxyClient, front: str, host: str, port: int) -> str | None:
    if front == "get":
        return _answered(client.get(f"http://{host}:{port}/spell", host=f"{host}:{port}"))
    with client.connect(f"{host}:{port}") as (response, sock):
        if response is None or response.status != 200:
            return None
        return _answered(tunnel_get(sock, host))


def _decision(lab: Lab, host: str, front: str) -> Decision:
    """egressd's pure decision for the target as this front sends it."""
    target = f"http://{host}:{lab.port}/spell" if front == "get" else f"{host}:{lab.port}"
    return decide(target, Client(), load_policy(lab.policy_file))


def _predicted(lab: Lab, host: str, front: str) -> bool:
    """The report names the egressd rule that allowed this target as one squid narrows."""
    rule = _decision(lab, host, front).rule or ""
    findings = lab.report["findings"]
    assert isinstance(findings, list)
    decides = [d for f in findings for d in f["decides"]]
    return any(rule == d or rule.startswith(d + " ") for d in decides)


def squid_reading(host: str) -> str:
    """The host squid's URL parser reads where egressd refuses the spelling as unparseable (the
    export report's `target` finding says so): trailing dots stripped, brackets around a name
    dropped, userinfo before '@' ignored. Squid then decides that host, so egressd must allow it."""
    host = host.rpartition("@")[2].rstrip(".")
    if host.startswith("[") and host.endswith("]") and ":" not in host:
        host = host[1:-1]
    return host


def _same_host_allowed(lab: Lab, host: str, front: str) -> bool:
    """Squid admitted a spelling egressd refused: only if egressd admits the host squid read."""
    reading = squid_reading(host)
    target = f"http://{reading}:{lab.port}/" if front == "get" else f"{reading}:{lab.port}"
    return reading != host and decide(target, Client(), load_policy(lab.policy_file)).allowed


@pytest.mark.parametrize("front", ["get", "connect"])
def test_squid_decides_like_egressd(lab: Lab, front: str) -> None:
    """One table per front: every target through both; differences must be predicted and narrower."""
    rows: list[tuple[str, str | None, str | None, bool]] = []
    for host in HOSTS:
        before = lab.servers.counts()
        mine = _via(lab.egressd, front, host, lab.port)
        theirs = _via(lab.squid, front, host, lab.port)
        after = lab.servers.counts()
        reached = {h for h in after if after[h] != before[h]}
        answered = {a.removeprefix("http-") for a in (mine, theirs) if a is not None}
        if not _decision(lab, host, front).allowed:  # (an inspected tunnel connects, then refuses)
            assert reached <= answered, (host, "a refused target reached", reached - answered)
        if mine != theirs:
            predicted = (
                _predicted(lab, host, front) if theirs is None else _same_host_allowed(lab, host, front)
            )
            rows.append((host, mine, theirs, predicted))
    policy = load_policy(lab.policy_file)
    kinds = {h: target_kind(policy, h, lab.port) for h, *_ in rows}
    table = "\n".join(f"{kinds[h]:28} {h!r}: egressd={m} squid={t} predicted={p}" for h, m, t, p in rows)
    print(f"{front}: {len(HOSTS)} targets, {len(rows)} differences\n{table}")
    assert all(p for *_, p in rows), "unpredicted differences:\n" + table
    wider = [
        h for h, m, t, _ in rows if m is None and t is not None and not _same_host_allowed(lab, h, front)
    ]
    assert not wider, "squid is wider:\n" + table
    seen: dict[str, set[str]] = {}
    for h, mine, _theirs, _p in rows:
        seen.setdefault(kinds[h], set()).add("narrower" if mine is not None else "reads the host it names")
    lab.kinds[front] = seen


def test_loss_report_says_what_squid_does(lab: Lab) -> None:
    """Per target kind, the differences both fronts showed are exactly what the loss report says
    (runs after the differential of each front, which records them)."""
    if set(lab.kinds) != {"get", "connect"}:
        pytest.skip("needs both runs of test_squid_decides_like_egressd in this session")
    seen: dict[str, set[str]] = {}
    for front_kinds in lab.kinds.values():
        for kind, hows in front_kinds.items():
            seen.setdefault(kind, set()).update(hows)
    assert seen == measured_losses("squid")


def test_export_report_is_machine_readable(lab: Lab) -> None:
    """The report says what was dropped, narrowed, denied, and that it is never wider."""
    assert lab.report["target"] == "squid" and lab.report["wider"] is False
    findings = {(f["setting"], f["action"]) for f in lab.report["findings"]}  # type: ignore[union-attr]
    assert ("allow[2]", "dropped") in findings  # pathy.test's path rule
    assert "http_access deny all" in lab.export.splitlines()[-1]


def test_wildcard_is_not_the_apex(lab: Lab) -> None:
    """`*.wild.test` admits a.wild.test and x.y.wild.test, never wild.test, in both engines."""
    for front in ("get", "connect"):
        for client in (lab.egressd, lab.squid):
            assert _via(client, front, "wild.test", lab.port) is None
            assert _via(client, front, "x.y.wild.test", lab.port) == f"http-{ALLOWED_V4}"


def test_path_rule_is_dropped_not_widened(lab: Lab) -> None:
    """`{host: pathy.test, paths: [/ok]}`: egressd admits /ok only; squid cannot see paths, so the
    export leaves the rule out — squid refuses /ok too (narrower, predicted) and never admits /other."""
    ok = f"http://pathy.test:{lab.port}/ok"
    assert _answered(lab.egressd.get(ok, host=f"pathy.test:{lab.port}")) == f"http-{ALLOWED_V4}"
    assert _answered(lab.squid.get(ok, host=f"pathy.test:{lab.port}")) is None
    assert _via(lab.squid, "get", "pathy.test", lab.port) is None
    rule = decide(ok, Client(), load_policy(lab.policy_file)).rule
    assert rule == "allow: pathy.test"
    assert any(rule in f["decides"] for f in lab.report["findings"])  # type: ignore[union-attr]


def test_host_header_naming_another_host(lab: Lab) -> None:
    """An allowed target with a Host header naming another host: egressd refuses it (host_mismatch);
    squid forwards it with the Host header rewritten to the decided target. Either way no upstream
    gets a request naming a host nobody decided."""
    url = f"http://allowed.test:{lab.port}/spell"
    mine = lab.egressd.get(url, host=f"evil.test:{lab.port}")
    assert mine is not None and mine.reason == "host_mismatch"
    theirs = lab.squid.get(url, host=f"evil.test:{lab.port}")
    assert theirs is not None
    if theirs.status == 200:
        assert json.loads(theirs.body)["headers"]["host"] == f"allowed.test:{lab.port}"


LOOPBACK_POLICY = """\
version: 1
mode: enforce
allow: [allowed.test, 198.51.100.1]  # the address licenses the name (a documentation range)
loopback: {allow: true}
"""


def test_loopback_is_refused_centrally(tmp_path: Path) -> None:
    """egressd admits loopback (the child's own machine); the exported squid refuses it — a central
    proxy's loopback is not the child's — and the report predicts exactly that (`loopback.allow`)."""
    with open_lab(tmp_path, LOOPBACK_POLICY, "127.0.0.54") as opened:
        for host in ("127.0.0.1", "localhost", "[::1]", "127.1"):
            for front in ("get", "connect"):
                mine = _via(opened.egressd, front, host, opened.port)
                assert mine is not None and mine.startswith("http-"), (host, front)
                assert _via(opened.squid, front, host, opened.port) is None, (host, front)
                assert _predicted(opened, host, front), (host, front)
        assert _via(opened.squid, "connect", "allowed.test", opened.port) == f"http-{ALLOWED_V4}"
