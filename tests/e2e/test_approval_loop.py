"""The approval loop across several egressd instances, through the real commands: an ask ID names
its instance (`approve ID` answers there and nowhere else, whichever instances run), `pending
--follow` and `watch` follow every instance running now or started later (or wait for the one
`--pid` names, and end with it), `pending --interactive` answers asks on a terminal with the keys of
egressd's own prompt, `grant` needs no `--once`, and `ps` shows absolute policy paths in aligned
columns (`--json`: one array)."""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.support.asking import finish, start_curl
from tests.support.control import ASK_POLICY, Follower, Terminal, ask_policy, cli, cli_json, ps_rows, wait_for
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD, EgressdRun
from tests.support.unprivileged import unprivileged_user
from tests.support.upstreams import EchoHTTPServer


@pytest.fixture
def up(dns: DnsServer, upstream: EchoHTTPServer) -> EchoHTTPServer:
    """The upstream, named up.test, other.test and allowed.test by the test DNS server."""
    for name in ("up.test", "other.test", "allowed.test"):
        dns.add(name, upstream.host)
    return upstream


def ask_run(directory: Path, dns: DnsServer, *extra: str, wrapper: tuple[str, ...] = ()) -> EgressdRun:
    directory.mkdir(exist_ok=True)
    options = ["--policy", str(ask_policy(directory)), "--nameserver", dns.nameserver, "--no-prompt"]
    return EgressdRun([*options, *extra], wrapper=wrapper)


def can_answer(pid: int) -> bool:
    return any(r["pid"] == pid and r["approvers"]["can_answer"] for r in ps_rows())


def test_an_ask_id_names_its_instance_and_approve_answers_there(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    """Two instances ask at once: `pending` lists both asks (each ID starts with its egressd's
    pid), `approve ID` without --pid answers that instance's ask only, and an ID of an instance
    that has ended is refused even though another instance runs and asks."""
    with ask_run(tmp_path / "a", dns) as one, ask_run(tmp_path / "b", dns) as two, Follower() as follower:
        wait_for(lambda: can_answer(one.proc.pid) and can_answer(two.proc.pid), what="the follower")
        first = start_curl(one, f"http://up.test:{up.port}/one")
        second = start_curl(two, f"http://up.test:{up.port}/two")
        asks = wait_for(lambda: cli_json("pending", "--json") if len(follower.asks()) >= 2 else None)
        assert len(asks) == 2, asks
        by_pid = {ask["id"].split("-")[0]: ask for ask in asks}
        assert set(by_pid) == {str(one.proc.pid), str(two.proc.pid)}
        assert all(re.fullmatch(r"\d+-[0-9a-f]{4}-\d+", ask["id"]) for ask in asks)
        # identical requests in two instances are two questions with two IDs, never one
        ask_two = by_pid[str(two.proc.pid)]
        approved = cli("approve", ask_two["id"], "--run")
        assert approved.returncode == 0, approved.stderr
        assert finish(second)[0] == 200
        assert first.poll() is None  # the other instance's ask still waits
        # the wrong --pid for an ID is refused, not answered elsewhere
        ask_one = by_pid[str(one.proc.pid)]
        wrong = cli("approve", ask_one["id"], "--pid", str(two.proc.pid))
        assert wrong.returncode == 2 and f"belongs to the egressd with pid {one.proc.pid}" in wrong.stderr
        assert first.poll() is None
        assert cli("deny", ask_one["id"]).returncode == 0
        assert finish(first) == (403, "ask_refused")
        assert [r["path"] for r in up.requests] == ["/two"]
        # a grant "for this run" went to instance two only: instance one asks again
        again = start_curl(one, f"http://up.test:{up.port}/again")
        ask = follower.next_ask(seen=2)
        assert ask["id"].startswith(f"{one.proc.pid}-") and ask["egressd_pid"] == one.proc.pid
        stale_id = ask["id"]
        assert cli("deny", stale_id).returncode == 0
        assert finish(again) == (403, "ask_refused")
    # the instance has gone: its IDs name no running egressd, whichever else runs then
    with ask_run(tmp_path / "c", dns):
        gone = cli("approve", stale_id)
        assert gone.returncode == 2 and f"no egressd with pid {one.proc.pid} is running" in gone.stderr
        assert "not an ask ID" in cli("approve", "a1b2c3").stderr


def test_pending_follow_waits_for_instances_and_follows_every_one(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    """Started with no egressd running, `pending --follow` waits (it does not exit), then follows
    each instance that starts, says when one ends, and goes on with the others."""
    with Follower() as follower:
        time.sleep(1.5)
        assert follower.proc.poll() is None, "the follower exited with no egressd running"
        with ask_run(tmp_path / "a", dns) as one:
            wait_for(lambda: can_answer(one.proc.pid), what="the follower to attach to the first")
            with ask_run(tmp_path / "b", dns) as two:
                wait_for(lambda: can_answer(two.proc.pid), what="the follower to attach to the second")
                curls = [start_curl(run, f"http://up.test:{up.port}/") for run in (one, two)]
                asks = [follower.next_ask(), follower.next_ask(seen=1)]
                assert {a["egressd_pid"] for a in asks} == {one.proc.pid, two.proc.pid}
                for ask in asks:
                    assert cli("approve", ask["id"]).returncode == 0
                assert [finish(c)[0] for c in curls] == [200, 200]
            # the second has ended: the follower goes on with the first
            curl = start_curl(one, f"http://other.test:{up.port}/")
            ask = follower.next_ask(seen=2)
            assert ask["egressd_pid"] == one.proc.pid
            assert cli("approve", ask["id"]).returncode == 0
            assert finish(curl)[0] == 200
        assert follower.proc.poll() is None
    _out, err = follower.proc.communicate(timeout=10)
    assert "no egressd is running yet; waiting for one to start" in err
    assert f"following egressd {one.proc.pid}" in err and f"egressd {two.proc.pid} ended" in err


def test_follow_with_pid_waits_for_that_instance_and_ends_with_it(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    """`pending --follow --pid N` and `watch --pid N` before N runs: both wait for it, follow it
    (not the other instance running), and exit 0 when it ends."""
    gate = tmp_path / "go"
    # `sh` waits for the gate, then becomes egressd: its pid is known before egressd starts
    wrapper = ("sh", "-c", f'while [ ! -e {gate} ]; do sleep 0.05; done; exec "$@"', "sh")
    with ask_run(tmp_path / "other", dns) as other:
        named = ask_run(tmp_path / "named", dns, wrapper=wrapper)
        starter = threading.Thread(target=named.start, daemon=True)
        starter.start()
        wait_for(lambda: named.proc is not None, what="the wrapper to start")
        assert named.proc is not None
        pid = named.proc.pid
        follower = Follower("--pid", str(pid))
        watch = subprocess.Popen(
            [*EGRESSD, "watch", "--json", "--pid", str(pid)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(1.5)
            assert follower.proc.poll() is None and watch.poll() is None
            assert not can_answer(other.proc.pid)  # it follows the named one only
            gate.touch()
            starter.join(60)
            wait_for(lambda: can_answer(pid), what="the follower to attach to the named instance")
            curl = start_curl(named, f"http://up.test:{up.port}/named")
            ask = follower.next_ask()
            assert ask["egressd_pid"] == pid
            assert cli("approve", ask["id"]).returncode == 0
            assert finish(curl)[0] == 200
            assert finish(start_curl(other, f"http://up.test:{up.port}/")) == (403, "no_approver")
            named.stop()
            assert follower.proc.wait(20) == 0
            out, err = watch.communicate(timeout=20)
            assert watch.returncode == 0
        finally:
            named.stop()
            follower.stop()
            if watch.poll() is None:
                watch.kill()
                watch.wait()
    assert f"waiting for the egressd with pid {pid} to start" in err
    assert f"egressd {pid} ended" in err
    events = [json.loads(line) for line in out.splitlines()]
    decided = [e for e in events if e.get("event") == "decision" and e.get("path") == "/named"]
    assert decided and all(e["egressd_pid"] == pid for e in events), events


def test_watch_follows_every_instance(tmp_path: Path, dns: DnsServer, up: EchoHTTPServer) -> None:
    """`watch` started before any egressd: the decisions of each instance that starts, each line
    led by its egressd's pid."""
    watch = subprocess.Popen([*EGRESSD, "watch"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(watch.stdout or ()), daemon=True)
    reader.start()
    try:
        time.sleep(1.0)
        assert watch.poll() is None, "watch exited with no egressd running"
        with ask_run(tmp_path / "a", dns) as one, ask_run(tmp_path / "b", dns) as two:
            for run, name in ((one, "one"), (two, "two")):
                wait_for(
                    lambda run=run, name=name: (
                        finish(start_curl(run, f"http://allowed.test:{up.port}/{name}")) is not None
                        and any(f"/{name}" in line for line in lines)
                    ),
                    what=f"instance {name}'s decision on the watch",
                )
    finally:
        watch.terminate()
        watch.wait(10)
    for run, name in ((one, "one"), (two, "two")):
        line = next(line for line in lines if f"/{name}" in line)
        assert line.split()[0] == str(run.proc.pid), line


def test_pending_interactive_answers_on_the_terminal(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    """For an agent run without a terminal: `egressd pending --interactive` on the user's
    terminal shows each ask of any instance and answers it with egressd's prompt keys."""
    with ask_run(tmp_path, dns) as run:
        with Terminal([*EGRESSD, "pending", "--interactive"]) as tty:
            wait_for(lambda: can_answer(run.proc.pid), what="the interactive follower")
            curl = start_curl(run, f"http://up.test:{up.port}/asked")
            text = tty.read_until(b"then Enter").decode()
            assert f"wants up.test:{up.port} (GET http://up.test:{up.port}/asked)" in text
            assert "o = allow once" in text and "a = always" in text and "D = deny always" in text
            assert up.connections == 0
            tty.type("o")
            assert finish(curl)[0] == 200
            assert b"once" in tty.read_until(b"once")
            denied = start_curl(run, f"http://other.test:{up.port}/denied")
            tty.read_until(b"then Enter")
            tty.type("d")
            assert finish(denied) == (403, "ask_refused")
        assert [r["path"] for r in up.requests] == ["/asked"]


def test_pending_interactive_needs_a_terminal() -> None:
    result = subprocess.run(
        ["setsid", *EGRESSD, "pending", "--interactive"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2 and "needs a terminal" in result.stderr, result.stderr


def test_grant_is_one_shot_without_saying_once(tmp_path: Path, dns: DnsServer, up: EchoHTTPServer) -> None:
    policy = ask_policy(tmp_path, mode="enforce")
    with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver, "--no-prompt"]) as run:
        granted = cli("grant", f"up.test:{up.port}")
        assert granted.returncode == 0 and "once" in granted.stdout, granted.stderr
        assert finish(start_curl(run, f"http://up.test:{up.port}/first"))[0] == 200
        assert finish(start_curl(run, f"http://up.test:{up.port}/second")) == (403, "not_allowlisted")
        assert cli("grant", f"up.test:{up.port}", "--once").returncode == 0  # still accepted
        assert finish(start_curl(run, f"http://up.test:{up.port}/third"))[0] == 200


def test_ps_absolute_policy_paths_aligned_columns_and_one_json_array(tmp_path: Path, dns: DnsServer) -> None:
    """Started with a relative --policy, ps names the file absolutely; the columns of rows of
    different widths line up under their headings; --json is one array."""
    short, longer = tmp_path / "p", tmp_path / "a-much-longer-directory-name"
    for directory in (short, longer):
        directory.mkdir()
        ask_policy(directory)
    options = ["--nameserver", dns.nameserver, "--no-prompt", "--policy", "policy.yaml"]
    with (
        EgressdRun(options, wrapper=("env", "-C", str(short))) as one,
        EgressdRun([*options, "--allow", "x.test"], wrapper=("env", "-C", str(longer))) as two,
    ):
        rows = ps_rows()
        assert {r["pid"]: r["policy"] for r in rows} == {
            one.proc.pid: str(short / "policy.yaml"),
            two.proc.pid: str(longer / "policy.yaml"),
        }
        text = cli("ps").stdout
    lines = text.splitlines()
    assert len(lines) == 3, text
    header = lines[0]
    for heading in ("MODE", "POLICY", "COMMAND"):  # left-aligned: each cell starts under its heading
        column = header.index(heading)
        assert all(line[column - 2 : column] == "  " and line[column] != " " for line in lines[1:]), text
    for heading in ("PID", "ALLOWED", "PENDING"):  # numbers: each cell ends under its heading's end
        end = header.index(heading) + len(heading)
        assert all(line[end - 1].isdigit() and line[end : end + 2] == "  " for line in lines[1:]), text
    assert str(short / "policy.yaml") in lines[1] + lines[2]


def test_watch_never_writes_a_programs_escape_sequences(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    """The child names its own executables: one called with a terminal escape sequence in its
    name shows in `watch` with the escape spelled out, never sent to the user's terminal."""
    evil = tmp_path / "cu\x1b]0;owned\x07rl\x1b[2J"
    shutil.copy("/usr/bin/curl", evil)
    with ask_run(tmp_path / "a", dns) as run:
        watch = subprocess.Popen([*EGRESSD, "watch", "--pid", str(run.proc.pid)], stdout=subprocess.PIPE)
        try:
            out = b""

            def seen() -> bool:
                nonlocal out
                subprocess.run([str(evil), "-s", "-o", "/dev/null", f"http://allowed.test:{up.port}/x"],
                               env=run.child_env(), timeout=30)  # fmt: skip
                ready, _, _ = select.select([watch.stdout], [], [], 1)
                if ready:
                    out += os.read(watch.stdout.fileno(), 65536)  # type: ignore[union-attr]
                return b"/x" in out and b"owned" in out

            wait_for(seen, what="the decision on the watch (once it attached, programs are looked up)")
        finally:
            watch.terminate()
            watch.wait(10)
    assert b"\x1b" not in out and b"\x07" not in out
    assert b"cu\\x1b]0;owned\\x07rl\\x1b[2J" in out


def test_the_loop_as_an_unprivileged_user(dns: DnsServer, up: EchoHTTPServer) -> None:
    """A user who is not root, with a real home and no EGRESSD_HOME (the run directory is
    ~/.config/egressd/run): their egressd asks, their `pending --follow` sees the ask with its
    instance's pid, their `approve ID` answers it. Another user's `approve` of that ID finds no
    such egressd: the ID leads only to the sockets of the user who runs it."""
    with unprivileged_user() as user:
        policy = user.write("policy.yaml", ASK_POLICY.format(timeout=30))
        options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--no-prompt"]
        run = user.popen([*EGRESSD, "run", *options], cwd=user.home)
        follower = user.popen([*EGRESSD, "pending", "--follow", "--json"], cwd=user.home)
        asks: list[dict] = []
        threading.Thread(
            target=lambda: asks.extend(json.loads(line) for line in follower.stdout or ()), daemon=True
        ).start()
        try:
            assert run.stdout is not None
            env = dict(os.environ)
            while "http_proxy" not in env:  # (runuser keeps the pipe open: read up to what curl needs)
                words = shlex.split(run.stdout.readline().decode() or "end=", comments=True)
                assert words, "egressd run printed no proxy settings"
                key, _, value = words[-1].partition("=")
                env[key] = value
            rows = lambda: json.loads(user.run([*EGRESSD, "ps", "--json"], cwd=user.home).stdout)  # noqa: E731
            wait_for(lambda: any(r["approvers"]["can_answer"] for r in rows()), what="the user's follower")
            [row] = rows()
            pid = row["pid"]  # egressd's own (runuser runs it as a child)
            assert row["socket"] == str(user.home / ".config/egressd/run" / f"{pid}.sock")
            curl = subprocess.Popen(
                ["curl", "-sS", "-i", "--max-time", "40", f"http://up.test:{up.port}/mine"],
                env=env,
                stdout=subprocess.PIPE,
            )
            ask = wait_for(lambda: asks[0] if asks else None, what="the ask on the user's follower")
            assert ask["id"].startswith(f"{pid}-") and ask["egressd_pid"] == pid
            other = cli("approve", ask["id"])  # root, with its own EGRESSD_HOME
            assert other.returncode == 2 and f"no egressd with pid {pid}" in other.stderr
            mine = user.run([*EGRESSD, "approve", ask["id"]], cwd=user.home)
            assert mine.returncode == 0, mine.stderr
            assert finish(curl)[0] == 200
        finally:
            for proc in (follower, run):
                proc.terminate()
                proc.wait(20)


def test_an_allowed_tunnel_shows_in_watch_and_counts_in_ps(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    """An allowed tunnel's only record is its upstream connection's: `watch` shows it once as an
    allow, and `ps` counts it, as a plain-HTTP request (decision and connection records) counts
    once too."""
    dns.add("tunnel.test", up.host)
    dns.add("attached.test", up.host)
    policy = tmp_path / "policy.yaml"
    # the test upstream listens on 127.0.0.1
    policy.write_text(
        "version: 1\nmode: enforce\nallow: [tunnel.test, attached.test]\nprivate:\n  allow: true\n"
    )
    options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--no-prompt"]
    with EgressdRun(options) as run:
        watch = subprocess.Popen(
            [*EGRESSD, "watch", "--pid", str(run.proc.pid)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(watch.stdout or ()), daemon=True)
        reader.start()
        def curl(*args: str) -> None:
            done = subprocess.run(
                ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "-x", run.proxy_url, *args],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert done.stdout == "200", done.stderr

        def attached() -> bool:  # the watch follows from its start, not before: ask until it says so
            curl(f"http://attached.test:{up.port}/attached")
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                if any("attached.test" in line for line in lines):
                    return True
                time.sleep(0.05)
            return False

        try:
            wait_for(attached, timeout=60, what="the watch attached")
            url = f"http://tunnel.test:{up.port}/through-a-tunnel"
            plain = f"http://tunnel.test:{up.port}/plain"
            curl("-p", url)
            curl(plain)
            wait_for(
                lambda: (
                    any(" connection " in line and "tunnel.test" in line for line in lines)
                    and any("/plain" in line for line in lines)
                ),
                what="the tunnel and the request on the watch",
            )
            counts = next(r for r in ps_rows() if r["pid"] == run.proc.pid)["counts"]
        finally:
            watch.terminate()
            watch.wait(10)
    # the tunnel, told by its connection's record; the request by its own, its connection's not again
    tunnels = [line for line in lines if " connection " in line and "tunnel.test" in line]
    assert tunnels and all(line.split()[1] == "allow" for line in tunnels), lines
    requests = [line for line in lines if " request " in line and "tunnel.test" in line]
    assert requests and all("/plain" in line for line in requests), lines
    assert len(tunnels) == len(requests), lines  # one tunnel per try, one request per try: each once
    assert not [line for line in lines if " connection " in line and "attached.test" in line], lines
    assert counts["allowed"] >= 3 and counts["refused"] == 0, counts
