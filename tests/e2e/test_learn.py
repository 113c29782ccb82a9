"""Learn mode and the address guards through the real proxy (`egressd run` + curl), and the loop
learn -> audit -> `egressd policy suggest` -> enforce.

Traffic goes only to 127.0.0.0/8. The "private" targets are refused by the decision before any
connection is attempted: the audit shows the refusal and no connection record for them.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
import yaml

from egressd.policy import load_policy
from tests.support import netns
from tests.support.audit_log import audit_records
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD, EgressdRun, egressd_exec
from tests.support.upstreams import EchoHTTPServer, EchoHTTPSServer


def curl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["curl", "-sS", "-i", "-g", "--path-as-is", "--max-time", "20", *args],
        env=env,
        capture_output=True,
        timeout=60,
    )


def status(result: subprocess.CompletedProcess[bytes]) -> int:
    """The first status code curl printed (the proxy's answer to a CONNECT comes first)."""
    for line in result.stdout.decode("latin-1").splitlines():
        if line.startswith("HTTP/"):
            return int(line.split()[1])
    raise AssertionError(f"no HTTP status: {result.stdout!r} {result.stderr!r}")


def header(result: subprocess.CompletedProcess[bytes], name: str) -> str | None:
    for line in result.stdout.decode("latin-1").splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


@pytest.fixture
def local_upstreams(ca: trustme.CA) -> Iterator[tuple[EchoHTTPServer, EchoHTTPServer, EchoHTTPSServer]]:
    """Plain HTTP on 127.0.0.2 and 127.0.0.3, HTTPS (c.test) on 127.0.0.4: loopback only."""
    with (
        EchoHTTPServer("127.0.0.2", name="a") as a,
        EchoHTTPServer("127.0.0.3", name="b") as b,
        EchoHTTPSServer("127.0.0.4", name="c", ca=ca, hostnames=["c.test", "d.test"]) as c,
    ):
        yield a, b, c


# Literals the guard refuses in mode allow and learn, in several spellings; nothing is connected to.
GUARDED = [
    ("http://0xc0.0xa8.1.1/", "192.168.1.1", "private_address"),
    ("http://192.168.1.1/", "192.168.1.1", "private_address"),
    ("http://[::ffff:192.168.1.1]/", "192.168.1.1", "private_address"),
    ("http://100.64.0.1/", "100.64.0.1", "private_address"),
    ("http://[fd00::1]/", "fd00::1", "private_address"),
    ("https://10.1/", "10.0.0.1", "private_address"),  # a CONNECT
    ("https://[fd00::1]:8443/", "fd00::1", "private_address"),
    ("http://169.254.169.254/latest/meta-data/", "169.254.169.254", "forbidden_address"),
    ("https://0xa9fea9fe/", "169.254.169.254", "forbidden_address"),
]


@pytest.mark.parametrize("mode", ["allow", "learn"])
def test_guards_hold_in_allow_and_learn_through_the_proxy(tmp_path: Path, mode: str) -> None:
    audit = tmp_path / "audit.jsonl"
    with EgressdRun(["--mode", mode, "--audit", str(audit)]) as run:
        env = run.child_env()
        for url, _address, reason in GUARDED:
            result = curl(env, url)
            assert status(result) == 403, (url, result.stdout)
            assert header(result, "X-Egressd-Reason") == reason, url
            assert "error=destination_ip_prohibited" in (header(result, "Proxy-Status") or ""), url
            if reason == "private_address":
                assert "private.allow" in result.stdout.decode("latin-1")
    records = audit_records(audit)
    decisions = [r for r in records if r["event"] == "decision"]
    for _url, address, reason in GUARDED:
        mine = [r for r in decisions if r["host"] == address]
        assert mine and all(r["decision"] == "deny" and r["reason"] == reason for r in mine), mine
    # refused by the decision: no upstream connection was tried, none recorded
    assert not [r for r in decisions if r.get("stage") == "connection"]
    assert not [r for r in records if r["event"] == "decision" and r.get("connected")]


def test_explicit_rule_or_private_allow_lifts_the_guard_through_the_proxy(tmp_path: Path) -> None:
    """A loopback upstream stands in for a private one: the rule 127.0.0.0/8 would not matter to a
    loopback literal, so check the guard's answer before connecting (a name resolving there is the
    other way in; see the round trip below)."""
    result = subprocess.run(
        [*EGRESSD, "check", "--mode", "learn", "--allow", "192.168.0.0/16", "http://0xc0.0xa8.1.1/"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and "reason: allowlist" in result.stdout
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nmode: allow\nprivate: {allow: true}\n")
    result = subprocess.run(
        [*EGRESSD, "check", "--policy", str(policy), "http://[fd00::1]/"], capture_output=True, text=True
    )
    assert result.returncode == 0 and "reason: mode_allow" in result.stdout
    for mode in ("allow", "learn", "ask"):
        refused = subprocess.run(
            [*EGRESSD, "check", "--mode", mode, "http://192.168.1.1/"], capture_output=True, text=True
        )
        assert refused.returncode == 1 and "reason: private_address" in refused.stdout


def _fetch_all(
    env: dict[str, str], a: EchoHTTPServer, b: EchoHTTPServer, c: EchoHTTPSServer, ca: Path
) -> None:
    for url in (f"http://a.test:{a.port}/one?token=x", f"http://b.test:{b.port}/two"):
        result = curl(env, url)
        assert status(result) == 200, (url, result.stdout, result.stderr)
    result = curl(env, "--cacert", str(ca), f"https://c.test:{c.port}/three")
    assert status(result) == 200 and b"/three" in result.stdout, result


def test_learn_audit_suggest_enforce_round_trip(
    tmp_path: Path,
    dns: DnsServer,
    local_upstreams: tuple[EchoHTTPServer, EchoHTTPServer, EchoHTTPSServer],
    ca_file: Path,
) -> None:
    a, b, c = local_upstreams
    for name, server in (("a.test", a), ("b.test", b), ("c.test", c), ("d.test", c)):
        dns.add(name, server.host)
    # names resolve to 127.0.0.x: the explicit CIDR rule is what lets a NAME reach loopback
    learn_policy = tmp_path / "learn.yaml"
    learn_policy.write_text("version: 1\nmode: learn\nallow: ['127.0.0.0/8']\n")
    audit = tmp_path / "audit.jsonl"

    # 1. learn: everything allowed, recorded as learned with what enforce would have said
    with EgressdRun(
        ["--policy", str(learn_policy), "--nameserver", dns.nameserver, "--audit", str(audit)]
    ) as run:
        env = run.child_env()
        _fetch_all(env, a, b, c, ca_file)
        guarded = curl(env, "http://0xc0.0xa8.1.1/")  # the guard holds in learn mode too
        assert status(guarded) == 403 and header(guarded, "X-Egressd-Reason") == "private_address"
    records = [r for r in audit_records(audit) if r["event"] == "decision"]
    for host in ("a.test", "b.test", "c.test"):
        learned = [r for r in records if r["host"] == host and r["reason"] == "learned"]
        assert learned and all(
            r["decision"] == "allow" and r["would_be"] == "not_allowlisted" for r in learned
        )
    tunnel = [r for r in records if r["host"] == "c.test"]
    assert {r["stage"] for r in tunnel} == {"connect", "connection"}  # the CONNECT itself says learned
    assert all(r["reason"] == "learned" for r in tunnel)
    assert not [r for r in records if r["host"] == "192.168.1.1" and r.get("stage") == "connection"]

    # 2. suggest (only what the learn policy lacks) -> a policy egressd's loader accepts
    result = subprocess.run(
        [*EGRESSD, "policy", "suggest", str(audit), "--policy", str(learn_policy)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    suggested = tmp_path / "suggested.yaml"
    suggested.write_text(result.stdout)
    assert sorted(yaml.safe_load(result.stdout)["allow"]) == sorted(
        [f"a.test:{a.port}", f"b.test:{b.port}", f"c.test:{c.port}"]
    )
    assert load_policy(suggested).mode == "enforce"

    # 3. enforce with the suggestion (plus the same loopback licence): exactly those, nothing else
    options = ["--policy", str(suggested), "--allow", "127.0.0.0/8", "--nameserver", dns.nameserver]
    with EgressdRun(options) as run:
        env = run.child_env()
        _fetch_all(env, a, b, c, ca_file)
        other = curl(env, "--cacert", str(ca_file), f"https://d.test:{c.port}/")
        assert status(other) == 403 and header(other, "X-Egressd-Reason") == "not_allowlisted"
        other_port = curl(env, f"http://a.test:{a.port + 1 if a.port < 65535 else 1}/")
        assert status(other_port) == 403 and header(other_port, "X-Egressd-Reason") == "not_allowlisted"


def test_exec_in_learn_mode_names_the_program_and_never_its_arguments(
    tmp_path: Path, dns: DnsServer, local_upstreams: tuple[EchoHTTPServer, EchoHTTPServer, EchoHTTPSServer]
) -> None:
    a, _b, _c = local_upstreams
    dns.add("a.test", a.host)
    audit = tmp_path / "audit.jsonl"
    url = f"http://a.test:{a.port}/x?token=secret-in-argv"
    options = ["--mode", "learn", "--allow", "127.0.0.0/8", "--nameserver", dns.nameserver]
    result = egressd_exec([*options, "--audit", str(audit)], ["curl", "-sS", "-o", "/dev/null", url])
    assert result.returncode == 0, result.stderr
    text = audit.read_text()
    assert "secret-in-argv" not in text  # the audit holds the program, not its arguments
    children = [r for r in audit_records(audit) if r["event"] == "child"]
    assert [(c["program"], c["client"]) for c in children] == [("curl", "egressd")]
    suggested = subprocess.run(
        [*EGRESSD, "policy", "suggest", str(audit)], capture_output=True, text=True, timeout=60
    )
    assert suggested.returncode == 0, suggested.stderr
    assert f'- "a.test:{a.port}"' in suggested.stdout and "# command: curl" in suggested.stdout


def _suggest(*args: str | Path) -> str:
    result = subprocess.run(
        [*EGRESSD, "policy", "suggest", *map(str, args)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_learn_then_enforce_where_registries_resolve_to_private_ranges(
    tmp_path: Path, ca: trustme.CA, ca_file: Path
) -> None:
    """The documented loop on a split-horizon network: the registries' names resolve to a
    documentation range (198.51.100.7) and to RFC 1918 (10.77.0.7), answered by a DNS server the
    test runs on 198.51.100.53. The learning run needs `private.allow` and that nameserver (from its
    policy, nothing on the command line); the suggestion carries both over, so enforcing it alone —
    or merged with the base it was learned under, or with another policy that licenses nothing —
    reaches exactly what was learned."""
    with (
        netns.local_address("10.77.0.7"),
        DnsServer("198.51.100.53") as dns,
        EchoHTTPServer("198.51.100.7", name="registry") as registry,
        EchoHTTPSServer("10.77.0.7", name="mirror", ca=ca, hostnames=["mirror.test"]) as mirror,
    ):
        dns.add("registry.test", registry.host)
        dns.add("mirror.test", mirror.host)
        dns.add("unlearned.test", registry.host)
        dns.add("other.test", mirror.host)
        nameserver = f"198.51.100.53:{dns.port}"
        base = tmp_path / "base.yaml"
        base.write_text(
            "version: 1\nmode: enforce\nprivate: {allow: true}  # our registries live on private ranges\n"
            f"resolver: {{nameservers: ['{nameserver}']}}\n"
        )
        wanted = [
            f"http://registry.test:{registry.port}/pkg",
            f"https://mirror.test:{mirror.port}/file",
            f"http://198.51.100.7:{registry.port}/by-address",  # a private literal, under private.allow
        ]

        def fetch_all(env: dict[str, str]) -> None:
            for url in wanted:
                result = curl(env, "--cacert", str(ca_file), url)
                assert status(result) == 200, (url, result.stdout, result.stderr)

        audit = tmp_path / "audit.jsonl"
        with EgressdRun(["--policy", str(base), "--mode", "learn", "--audit", str(audit)]) as run:
            fetch_all(run.child_env())

        learned = tmp_path / "learned.yaml"
        learned.write_text(_suggest(audit))
        data = yaml.safe_load(learned.read_text())
        assert data["private"] == {"allow": True} and data["resolver"] == {"nameservers": [nameserver]}
        assert sorted(data["allow"]) == sorted(
            [f"198.51.100.7:{registry.port}", f"mirror.test:{mirror.port}", f"registry.test:{registry.port}"]
        )
        text = learned.read_text()
        assert f"carried over from {base}" in text and "10.77.0.7" in text  # the comments say why
        only_new = tmp_path / "only-new.yaml"
        only_new.write_text(_suggest(audit, "--policy", base))
        other = tmp_path / "other.yaml"
        other.write_text("version: 1\nallow: [other.test]  # licenses no private address\n")

        for policies in ([learned], [learned, base], [only_new, base], [learned, other]):
            options = [option for path in policies for option in ("--policy", str(path))]
            with EgressdRun(options) as run:  # no --nameserver: the policies name it
                env = run.child_env()
                fetch_all(env)
                refused = curl(env, f"http://unlearned.test:{registry.port}/")
                assert header(refused, "X-Egressd-Reason") == "not_allowlisted", policies
                if other in policies:  # its rule admits the name, but not at a private address
                    refused = curl(env, f"http://other.test:{mirror.port}/")
                    assert header(refused, "X-Egressd-Reason") == "resolved_forbidden"
