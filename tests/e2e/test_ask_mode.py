"""mode: ask through the real commands: a request waits (nothing reaches the upstream) until an
approver answers — a script over the control API, or a person at the terminal (/dev/tty through a
real pty) — or until ask_timeout; identical asks are one question; always/deny-always edit the
policy file (its comments kept) and the reload applies them; without an approver, no_approver."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from tests.support.asking import attached, finish, run_ask, start_curl
from tests.support.audit_log import audit_records
from tests.support.control import Follower, Terminal, ask_policy, cli, cli_json, wait_for
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD, EgressdRun
from tests.support.upstreams import EchoHTTPServer, EchoHTTPSServer


@pytest.fixture
def up(dns: DnsServer) -> Iterator[EchoHTTPServer]:
    """The upstream on 127.0.0.1, named up.test (and other.test) by the test DNS server."""
    with EchoHTTPServer("127.0.0.1") as server:
        dns.add("up.test", "127.0.0.1")
        dns.add("other.test", "127.0.0.1")
        yield server


def test_without_an_approver_asks_are_refused_at_once(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    with run_ask(ask_policy(tmp_path), dns) as run:
        started = time.monotonic()
        assert finish(start_curl(run, f"http://up.test:{up.port}/")) == (403, "no_approver")
        assert time.monotonic() - started < 10  # at once, not after ask_timeout (30 s)
    assert up.connections == 0


def test_identical_asks_are_one_question_and_one_answer_releases_all(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    with run_ask(ask_policy(tmp_path), dns) as run, Follower() as follower:
        wait_for(attached, what="the follower to attach")
        curls = [start_curl(run, f"http://up.test:{up.port}/same?q=1") for _ in range(5)]
        pending = wait_for(
            lambda: [a for a in cli_json("pending", "--json") if a["waiting"] == 5],
            what="5 waiting on one ask",
        )
        assert len(cli_json("pending", "--json")) == 1
        assert up.connections == 0  # held before resolving and connecting: nothing went upstream
        time.sleep(0.5)
        assert up.connections == 0
        answer = cli("approve", pending[0]["id"])
        assert answer.returncode == 0 and "5 waiting released" in answer.stdout, answer
        assert [finish(c)[0] for c in curls] == [200] * 5
        assert cli_json("pending", "--json") == []
        assert len(follower.asks()) == 1
        # "once": the next request is asked again, and a denial refuses it without reaching upstream
        before = up.connections
        curl = start_curl(run, f"http://up.test:{up.port}/again")
        ask = follower.next_ask(seen=1)
        assert cli("deny", ask["id"]).returncode == 0
        assert finish(curl) == (403, "ask_refused")
        assert up.connections == before


def test_every_approver_hears_the_count_of_waiting_requests_change(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    """A request that joins a question, or leaves it while others still wait (a one-shot grant
    admits one), changes what "Allow once" releases: a follower hears the new count (`waiting`),
    the audit gets no record of it, and the question stays open until it is answered."""
    audit = tmp_path / "audit.jsonl"
    with run_ask(ask_policy(tmp_path), dns, "--audit", str(audit)) as run, Follower() as follower:
        wait_for(attached, what="the follower to attach")
        url = f"http://up.test:{up.port}/counted"
        first = start_curl(run, url)
        ask = follower.next_ask()
        assert ask["waiting"] == 1

        def counts() -> list[int]:
            return [e["waiting"] for e in follower.of("waiting")]

        second, third = start_curl(run, url), start_curl(run, url)
        wait_for(lambda: counts()[-1:] == [3], what="the follower to hear 3 waiting")
        assert cli("grant", f"up.test:{up.port}").returncode == 0  # one-shot: one of the three goes
        wait_for(lambda: counts()[-1:] == [2], what="the follower to hear 2 waiting")
        assert len(follower.asks()) == 1  # one question all along
        answer = cli("approve", ask["id"])
        assert answer.returncode == 0 and "2 waiting released" in answer.stdout, answer
        assert [finish(c)[0] for c in (first, second, third)] == [200, 200, 200]
    notices = [r.get("event") for r in audit_records(audit) if str(r.get("event", "")).startswith("ask")]
    assert "ask" in notices and not any("waiting" in n for n in notices)


def test_ask_timeout_refuses_every_waiter(tmp_path: Path, dns: DnsServer, up: EchoHTTPServer) -> None:
    with run_ask(ask_policy(tmp_path, timeout=1.5), dns) as run, Follower():
        wait_for(attached, what="the follower to attach")
        curls = [start_curl(run, f"http://up.test:{up.port}/") for _ in range(2)]
        assert [finish(c) for c in curls] == [(403, "ask_timeout")] * 2
        assert cli_json("pending", "--json") == []
    assert up.connections == 0


def test_approve_for_this_run_admits_later_requests_without_asking(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    with run_ask(ask_policy(tmp_path), dns) as run, Follower() as follower:
        wait_for(attached, what="the follower to attach")
        curl = start_curl(run, f"http://up.test:{up.port}/first")
        assert cli("approve", "--run", follower.next_ask()["id"]).returncode == 0
        assert finish(curl)[0] == 200
        assert finish(start_curl(run, f"http://up.test:{up.port}/second"))[0] == 200
        assert len(follower.asks()) == 1
        # exact host and port: another name on the same address is asked about again
        other = start_curl(run, f"http://other.test:{up.port}/")
        assert follower.next_ask(seen=1)["host"] == "other.test"
        cli("deny", follower.asks()[1]["id"])
        assert finish(other) == (403, "ask_refused")
    assert "up.test" not in (tmp_path / "policy.yaml").read_text()  # never written


def _audit_reasons(audit: Path, host: str) -> list[tuple[str, str]]:
    rows = audit_records(audit)
    return [
        (r["reason"], r.get("rule")) for r in rows if r.get("host") == host and r.get("stage") == "request"
    ]


def test_always_writes_the_policy_file_keeping_comments_and_the_reload_applies_it(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    policy = ask_policy(tmp_path)
    audit = tmp_path / "audit.jsonl"
    with run_ask(policy, dns, "--audit", str(audit)) as run, Follower() as follower:
        wait_for(attached, what="the follower to attach")
        curl = start_curl(run, f"http://up.test:{up.port}/")
        answer = cli("approve", "--always", follower.next_ask()["id"])
        assert answer.returncode == 0, answer.stderr
        assert finish(curl)[0] == 200
        text = policy.read_text()
        assert f"  - up.test:{up.port}\n" in text
        assert '# the human loop under test: a comment the "always" answers must keep' in text
        assert "  - allowed.test   # listed up front" in text
        assert text.index("allowed.test") < text.index(f"up.test:{up.port}") < text.index("deny:")
        assert run.wait_for_stderr("policy reloaded"), run.stderr

        def by_rule() -> bool:
            assert finish(start_curl(run, f"http://up.test:{up.port}/later"))[0] == 200
            return ("allowlist", f"allow: up.test:{up.port}") in _audit_reasons(audit, "up.test")

        wait_for(by_rule, what="a decision by the written allow rule")
        assert len(follower.asks()) == 1


def test_deny_always_writes_a_deny_rule(tmp_path: Path, dns: DnsServer, up: EchoHTTPServer) -> None:
    policy = ask_policy(tmp_path)
    with run_ask(policy, dns) as run, Follower() as follower:
        wait_for(attached, what="the follower to attach")
        curl = start_curl(run, f"http://up.test:{up.port}/")
        assert cli("deny", "--always", follower.next_ask()["id"]).returncode == 0
        assert finish(curl) == (403, "ask_refused")
        assert policy.read_text().split("deny:")[1].startswith(f"\n  - denied.test\n  - up.test:{up.port}\n")
        wait_for(
            lambda: finish(start_curl(run, f"http://up.test:{up.port}/"))[1] == "denylist",
            what="the reload's deny rule",
        )
        assert len(follower.asks()) == 1
    assert up.connections == 0


def test_approve_all_is_loud_and_approves(tmp_path: Path, dns: DnsServer, up: EchoHTTPServer) -> None:
    with run_ask(ask_policy(tmp_path), dns, "--approve-all") as run:
        assert "WARNING: --approve-all" in run.stderr
        assert finish(start_curl(run, f"http://up.test:{up.port}/")) == (200, None)


def test_terminal_prompt_on_dev_tty_answers_with_a_key(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    """egressd exec in a new session whose controlling terminal is a pty; its stdin, stdout and
    stderr are NOT the terminal: the prompt is on /dev/tty only, and the child's stdout carries
    only the child's output."""
    policy = ask_policy(tmp_path)
    url = f"http://up.test:{up.port}/via-tty"
    command = [*EGRESSD, "exec", "--policy", str(policy), "--nameserver", dns.nameserver, "--"]
    with Terminal([*command, "curl", "-sS", "--max-time", "40", url]) as tty:
        text = tty.read_until(b"then Enter").decode()
        assert f"wants up.test:{up.port} (GET {url})" in text
        assert "curl -sS --max-time 40" in text  # the child's command
        assert "o = allow once" in text and "a = always" in text and "D = deny always" in text
        assert up.connections == 0
        tty.type("o")
        out, err = tty.finish()
    assert tty.proc.returncode == 0, err
    assert json.loads(out)["path"] == "/via-tty"  # stdout: the child's output only
    assert b"wants" not in err and b"wants" not in out


def test_a_tunnel_waits_unconnected_until_approved(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    """A CONNECT is held before resolution: the upstream sees no connection until the answer."""
    with run_ask(ask_policy(tmp_path), dns) as run, Follower() as follower:
        wait_for(attached, what="the follower to attach")
        curl = subprocess.Popen(
            ["curl", "-sS", "-i", "--max-time", "40", "--proxytunnel", f"http://up.test:{up.port}/tunnelled"],
            env=run.child_env(),
            stdout=subprocess.PIPE,
        )
        ask = follower.next_ask()
        assert (ask["host"], ask["method"]) == ("up.test", "CONNECT")
        time.sleep(0.3)
        assert up.connections == 0
        assert cli("approve", ask["id"]).returncode == 0
        assert finish(curl)[0] == 200
        assert up.connections == 1


def test_an_approved_inspected_tunnel_is_not_asked_again_for_its_requests(
    tmp_path: Path, dns: DnsServer, ca: trustme.CA, ca_file: Path
) -> None:
    """Approved once = this connection: inside an inspected tunnel its requests go on unasked."""
    policy = ask_policy(tmp_path)
    policy.write_text(policy.read_text() + "inspect:\n  - up.test\n")
    dns.add("up.test", "127.0.0.1")
    with EchoHTTPSServer("127.0.0.1", ca=ca, hostnames=["up.test"]) as tls:
        options = ["--upstream-ca", str(ca_file)]
        with run_ask(policy, dns, *options) as run, Follower() as follower:
            wait_for(attached, what="the follower to attach")
            base = f"https://up.test:{tls.port}"
            curl = subprocess.Popen(
                ["curl", "-sS", "--max-time", "40", f"{base}/one", f"{base}/two"],
                env=run.child_env(),
                stdout=subprocess.PIPE,
            )
            ask = follower.next_ask()
            assert (ask["method"], tls.connections) == ("CONNECT", 0)
            assert cli("approve", ask["id"]).returncode == 0
            out, _ = curl.communicate(timeout=60)
            assert [json.loads(line)["path"] for line in out.decode().replace("}{", "}\n{").splitlines()] == [
                "/one",
                "/two",
            ]
            assert len(follower.asks()) == 1


def test_every_ask_outcome_is_counted_in_the_metrics(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    """An approved, a denied and an expired ask each land in egressd_ask_wait_seconds by outcome
    (read from the control socket's GET /metrics, as a monitoring agent would)."""
    with run_ask(ask_policy(tmp_path), dns) as run, Follower() as follower:
        wait_for(attached, what="the follower to attach")
        approved = start_curl(run, f"http://up.test:{up.port}/")
        assert cli("approve", follower.next_ask()["id"]).returncode == 0
        assert finish(approved)[0] == 200
        denied = start_curl(run, f"http://other.test:{up.port}/")
        assert cli("deny", follower.next_ask(seen=1)["id"]).returncode == 0
        assert finish(denied) == (403, "ask_refused")
        text = _scrape(run)
        assert _asks(text, "approved") == 1 and _asks(text, "ask_refused") == 1, text
        assert _asks(text, "ask_timeout") == 0 and _asks(text, "no_approver") == 0
    with run_ask(ask_policy(tmp_path, timeout=1.5), dns) as run, Follower():
        wait_for(attached, what="the follower to attach")
        assert finish(start_curl(run, f"http://up.test:{up.port}/")) == (403, "ask_timeout")
        text = _scrape(run)
        assert _asks(text, "ask_timeout") == 1 and _asks(text, "approved") == 0, text
    assert up.connections == 1


def _scrape(run: EgressdRun) -> str:
    """GET /metrics on this instance's control socket."""
    from egressd.control.client import find_instances

    [instance] = [i for i in find_instances()[1] if i.pid == run.proc.pid]
    command = ["curl", "-sS", "--fail", "--unix-socket", str(instance.path), "http://egressd/metrics"]
    return subprocess.run(command, capture_output=True, text=True, timeout=20, check=True).stdout


def _asks(text: str, outcome: str) -> float:
    from tests.support.metrics_text import sample

    return sample(text, "egressd_ask_wait_seconds_count", outcome=outcome)
