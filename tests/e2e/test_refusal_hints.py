"""Refusal hints through the real commands (`exec`, `run`): what the child's body and the person's
stderr say names the command they run, the file and the exact line to edit, and following it
admits the target.

Why: hints that did not work in their context sent people the wrong way: `--allow HOST` for a host
the child's profile narrows (the flag widens the policy, never the profile), `--allow <CIDR of the
address>` instead of the address, "retrying will not help" when the next attempt is asked again,
"allow with" for what a person had just denied for good. (`sandbox`, `acp`, `mcp run` and the
gateway: their own test modules.)
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from tests.support.control import Follower, approver_attached, ask_policy, cli, wait_for
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun, egressd_exec, write_policy
from tests.support.upstreams import EchoHTTPServer

PROFILED = """\
version: 1
mode: enforce
allow:
  - up.test
  - other.test
  - 198.51.100.0/24   # the test's upstreams
profiles:
  agent:
    allow:
      - up.test
"""

CURL = ["curl", "-s", "--max-time", "20"]


def _lines(result: subprocess.CompletedProcess[bytes]) -> list[str]:
    return result.stderr.decode().splitlines()


def _profiled(tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer) -> tuple[Path, list[str], str]:
    """The policy, the options of a child with profile agent, and a URL the profile leaves out."""
    dns.add("other.test", upstream.host)
    policy = write_policy(tmp_path, PROFILED)
    options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--profile", "agent"]
    return policy, options, f"http://other.test:{upstream.port}/x"


def test_a_profile_refusal_names_the_line_to_add_to_the_profile(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    policy, options, url = _profiled(tmp_path, dns, upstream)
    result = egressd_exec(options, [*CURL, url])
    body = result.stdout.decode()
    line = f"the line '- other.test:{upstream.port}' under profiles.agent.allow in {policy}"
    assert "reason: profile" in body, body
    assert f"To allow it, a person can add {line} (a saved edit applies at once)\n" in body, body
    assert "--allow" not in body and "the policy's allow list" not in body  # neither would admit it
    told = (
        f"egressd: refused other.test:{upstream.port} (profile) - add {line} (a saved edit applies at once)"
    )
    assert told in _lines(result), result.stderr
    assert _lines(result)[-1].endswith(f" - add {line} (a saved edit applies at once)")
    assert upstream.connections == 0


def test_following_the_profile_hint_admits_the_target(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    """The line the hint names, added where it says, admits the target in the running proxy."""
    policy, options, url = _profiled(tmp_path, dns, upstream)
    with EgressdRun(options) as run:
        refused = subprocess.run(
            [*CURL, url], env=run.child_env(), capture_output=True, text=True, timeout=60
        )
        found = re.search(
            r"a person can add the line '(- \S+)' under profiles\.(\w+)\.allow in (\S+) ", refused.stdout
        )
        assert found is not None, refused.stdout
        entry, profile, file = found.groups()
        assert (profile, file) == ("agent", str(policy))
        text = policy.read_text()
        policy.write_text(text.replace("      - up.test\n", f"      - up.test\n      {entry}\n"))

        def admitted() -> bool:
            done = subprocess.run(
                [*CURL, "-o", "/dev/null", "-w", "%{http_code}", url],
                env=run.child_env(),
                capture_output=True,
                text=True,
                timeout=60,
            )
            return done.stdout == "200"

        wait_for(admitted, what="the profile's new line to admit the target")
    assert upstream.requests[-1]["path"] == "/x"


def test_resolved_forbidden_names_each_address_and_private_allow(tmp_path: Path, dns: DnsServer) -> None:
    """A name resolving to documentation and private addresses (split-horizon DNS, a mirror): a
    rule for each real address, and private.allow; never an always-refused one. Nothing is
    connected: the name is refused once resolved."""
    dns.add("mirror.test", "203.0.113.80", "169.254.169.254", "10.20.30.40")
    policy = write_policy(tmp_path, "version: 1\nallow: [mirror.test]\n")
    result = egressd_exec(
        ["--policy", str(policy), "--nameserver", dns.nameserver], [*CURL, "http://mirror.test/"]
    )
    body = result.stdout.decode()
    assert "reason: resolved_forbidden" in body, body
    hint = body.split("To allow it, a person can run: egressd exec ", 1)[1]
    flags = hint.split(" -- <command>", 1)[0].split()
    assert sorted(flags) == sorted(["--allow", "--allow", "10.20.30.40/32", "203.0.113.80/32"]), hint
    assert f"or set private.allow: true in {policy})" in hint
    assert "CIDR of" not in body and "169.254" not in hint  # an always-refused address is never offered
    told = next(line for line in _lines(result) if "(resolved_forbidden)" in line)
    assert told == f"egressd: refused mirror.test:80 (resolved_forbidden) - allow with: {' '.join(flags)}"


def test_following_the_address_hint_admits_the_target(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    """The flags the stderr line names, given to the same command, admit the name: a name the
    test's DNS answers with its upstream's documentation-range address, as split-horizon DNS
    answers with a private one."""
    dns.add("dev.test", upstream.host)
    policy = write_policy(tmp_path, "version: 1\nallow: [dev.test]\n")
    options = ["--policy", str(policy), "--nameserver", dns.nameserver]
    url = f"http://dev.test:{upstream.port}/dev"
    refused = egressd_exec(options, [*CURL, url])
    line = next(line for line in _lines(refused) if "(resolved_forbidden)" in line)
    flags = shlex.split(line.split(" - allow with: ", 1)[1])
    assert flags == ["--allow", f"{upstream.host}/32"], line
    admitted = egressd_exec([*options, *flags], [*CURL, "-o", "/dev/null", "-w", "%{http_code}", url])
    assert admitted.stdout == b"200", admitted.stderr
    assert upstream.requests[-1]["path"] == "/dev"


def _curl(run: EgressdRun, url: str) -> str:
    return subprocess.run(
        [*CURL, url], env=run.child_env(), capture_output=True, text=True, timeout=60
    ).stdout


def test_no_approver_says_how_to_become_one(tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer) -> None:
    dns.add("up.test", upstream.host)
    with EgressdRun(
        ["--policy", str(ask_policy(tmp_path)), "--nameserver", dns.nameserver, "--no-prompt"]
    ) as run:
        body = _curl(run, f"http://up.test:{upstream.port}/")
    assert "reason: no_approver" in body, body
    assert "retrying" not in body
    for way in ("egressd pending --follow", "egressd approve ID", "egressd dashboard", "in a terminal"):
        assert way in body, body


def test_ask_timeout_says_the_next_attempt_is_asked_again(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    dns.add("up.test", upstream.host)
    options = [
        "--policy",
        str(ask_policy(tmp_path, timeout=1.5)),
        "--nameserver",
        dns.nameserver,
        "--no-prompt",
    ]
    with EgressdRun(options) as run, Follower():
        wait_for(approver_attached, what="the follower to attach")
        body = _curl(run, f"http://up.test:{upstream.port}/")
    assert "reason: ask_timeout" in body, body
    assert "retrying" not in body and "The next attempt is asked again" in body
    assert "egressd run --allow up.test:" in body  # the command this proxy runs as


def test_after_deny_always_nothing_says_allow(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    """A person answered "deny always": neither the refusal nor the stderr line nor the summary
    at exit tells how to allow it."""
    dns.add("telemetry.test", upstream.host)
    policy = ask_policy(tmp_path)
    run = EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver, "--no-prompt"]).start()
    try:
        with Follower() as follower:
            wait_for(approver_attached, what="the follower to attach")
            curl = subprocess.Popen(
                [*CURL, f"http://telemetry.test:{upstream.port}/"],
                env=run.child_env(),
                stdout=subprocess.PIPE,
                text=True,
            )
            assert cli("deny", "--always", follower.next_ask()["id"]).returncode == 0
            body, _ = curl.communicate(timeout=60)
    finally:
        run.stop()
    assert "reason: ask_refused" in body and "denied always" in body, body
    assert "To allow it" not in body and "--allow" not in body
    lines = run.stderr.splitlines()
    told = [line for line in lines if line.startswith("egressd: refused")]
    assert told and not [line for line in told if "allow with" in line or "--allow" in line], lines
    assert told[-1].startswith("egressd: refused 1 host: telemetry.test (ask_refused"), lines
    assert upstream.connections == 0
