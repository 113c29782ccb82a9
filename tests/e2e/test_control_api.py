"""The control API through the real commands: `ps`, `pending`, `grant`, `watch`, the socket's
permissions (another user cannot connect), the child never seeing it (env, sandbox), stale sockets
and `--pid`; one-shot grants (exactly one request within the TTL, exact scope, never lifting a
deny rule, an always-refused address or the private-address guard)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from tests.support.asking import finish, start_curl
from tests.support.control import ask_policy, cli, ps_rows, wait_for
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD, EgressdRun, egressd_exec
from tests.support.upstreams import EchoHTTPServer, EchoHTTPSServer


@pytest.fixture
def up(dns: DnsServer) -> Iterator[EchoHTTPServer]:
    with EchoHTTPServer("127.0.0.1") as server:
        dns.add("up.test", "127.0.0.1")
        dns.add("denied.test", "127.0.0.1")
        yield server


def run_dir(home: Path) -> Path:
    return home / "run"


def enforce_run(tmp_path: Path, dns: DnsServer, *, private: bool = True) -> EgressdRun:
    policy = ask_policy(tmp_path, mode="enforce", private=private)
    return EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver, "--no-prompt"])


def test_ps_shows_the_instance_and_its_counts(tmp_path: Path, dns: DnsServer, up: EchoHTTPServer) -> None:
    with enforce_run(tmp_path, dns) as run:
        assert finish(start_curl(run, f"http://up.test:{up.port}/"))[1] == "not_allowlisted"
        [row] = ps_rows()
        assert row["pid"] == run.proc.pid and row["mode"] == "enforce"
        assert row["policy"] == str(tmp_path / "policy.yaml")
        assert row["command"][:2] == ["egressd", "run"]
        assert row["counts"]["refused"] == 1 and row["counts"]["pending"] == 0
        text = cli("ps").stdout
        assert str(run.proc.pid) in text and "enforce" in text


NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")


def as_nobody(sock: Path) -> subprocess.CompletedProcess[str]:
    """curl to the control API as uid 65534 (tests run as root)."""
    url = "http://egressd/v1/info"
    command = [*NOBODY, "curl", "-sS", "-i", "--max-time", "10", "--unix-socket", str(sock), url]
    return subprocess.run(command, capture_output=True, text=True, timeout=30)


def test_socket_is_the_users_alone(
    tmp_path: Path, dns: DnsServer, shared_tmpdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a home every user can walk to (pytest's tmp_path is not): only the run dir keeps others out
    egressd_home = shared_tmpdir / "home"
    egressd_home.mkdir(mode=0o755)
    os.chmod(shared_tmpdir, 0o755)
    monkeypatch.setenv("EGRESSD_HOME", str(egressd_home))
    with enforce_run(tmp_path, dns) as run:
        directory = run_dir(egressd_home)
        sock = directory / f"{run.proc.pid}.sock"
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert stat.S_ISSOCK(os.stat(sock).st_mode) and stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        # another user cannot connect, even with the socket's path in hand
        other = as_nobody(sock)
        assert other.returncode == 7 and not other.stdout, other  # 7: cannot connect
        # even with the directory and socket opened up by mistake, the peer check refuses another uid
        os.chmod(directory, 0o711)
        os.chmod(sock, 0o666)
        other = as_nobody(sock)
        assert other.stdout.startswith("HTTP/1.1 403"), other
        assert "its own user only" in other.stdout
        os.chmod(directory, 0o700)


def test_an_unsafe_run_dir_is_never_used(tmp_path: Path, dns: DnsServer, egressd_home: Path) -> None:
    directory = run_dir(egressd_home)
    directory.mkdir(mode=0o755)
    os.chmod(directory, 0o755)
    with enforce_run(tmp_path, dns) as run:
        assert run.wait_for_stderr("control API off"), run.stderr
        assert "must be 0700" in run.stderr
        assert list(directory.iterdir()) == []
        refused = cli("ps")
        assert refused.returncode == 2 and "must be 0700" in refused.stderr


def test_the_child_never_sees_the_control_socket(tmp_path: Path, dns: DnsServer, egressd_home: Path) -> None:
    policy = ask_policy(tmp_path, mode="enforce")
    code = "import json,os,sys; json.dump(dict(os.environ), sys.stdout)"
    result = egressd_exec(["--policy", str(policy), "--no-prompt"], [sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    env = json.loads(result.stdout)
    directory = str(run_dir(egressd_home))
    assert not [k for k, v in env.items() if directory in v or ".sock" in v]
    # inherited descriptors: none is the control socket
    code = "import os; print([os.readlink(f'/proc/self/fd/{f}') for f in os.listdir('/proc/self/fd')])"
    result = egressd_exec(["--policy", str(policy), "--no-prompt"], [sys.executable, "-c", code])
    assert b"socket:" not in result.stdout, result.stdout


@pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap")
def test_the_sandbox_hides_the_run_dir(
    tmp_path: Path, dns: DnsServer, shared_tmpdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With XDG_RUNTIME_DIR (no EGRESSD_HOME), the run dir is $XDG_RUNTIME_DIR/egressd: hidden too,
    while the rest of the runtime dir (a place the read-only root shows) stays visible."""
    runtime = shared_tmpdir / "xdg"
    runtime.mkdir(mode=0o700)
    (runtime / "other").mkdir()
    (runtime / "other" / "seen").write_text("x")
    home = shared_tmpdir / "home"
    home.mkdir()
    monkeypatch.delenv("EGRESSD_HOME")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("HOME", str(home))
    work = tmp_path / "work"
    work.mkdir()
    (work / ".t").mkdir()
    policy = ask_policy(tmp_path, mode="enforce")
    look = (
        "import os,sys\n"
        f"d={str(runtime / 'egressd')!r}\n"
        "print('visible' if os.path.isdir(d) and os.listdir(d) else 'hidden')\n"
        f"print(os.listdir({str(runtime / 'other')!r}))\n"
    )
    env = dict(os.environ, TMPDIR=str(work / ".t"))
    result = subprocess.run(
        [*EGRESSD, "sandbox", "--policy", str(policy), "--no-prompt", "--", sys.executable, "-c", look],
        cwd=work,
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [b"hidden", b"['seen']"], result.stderr
    sockets = [p for p in (runtime / "egressd").iterdir()]
    assert sockets == []  # removed when egressd exited


def test_stale_sockets_are_cleaned_and_pid_selects(
    tmp_path: Path, dns: DnsServer, egressd_home: Path
) -> None:
    directory = run_dir(egressd_home)
    directory.mkdir(mode=0o700)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = directory / f"{dead.pid}.sock"
    leftover = socket.socket(socket.AF_UNIX)
    leftover.bind(str(stale))
    leftover.close()
    (tmp_path / "b").mkdir()
    with enforce_run(tmp_path, dns) as one, enforce_run(tmp_path / "b", dns) as two:
        rows = ps_rows()
        assert sorted(r["pid"] for r in rows) == sorted([one.proc.pid, two.proc.pid])
        assert not stale.exists()
        ambiguous = cli("grant", "some.test")  # a grant is for one instance: which one?
        assert ambiguous.returncode == 2
        assert "choose one with --pid" in ambiguous.stderr
        assert str(one.proc.pid) in ambiguous.stderr and str(two.proc.pid) in ambiguous.stderr
        assert cli("grant", "some.test", "--pid", str(two.proc.pid)).returncode == 0
        assert cli("pending").returncode == 0  # the asks of both
        assert cli("pending", "--pid", str(two.proc.pid)).returncode == 0
        assert "no egressd with pid" in cli("pending", "--pid", str(dead.pid)).stderr
    assert ps_rows() == []
    assert "no egressd is running" in cli("pending").stderr


def test_watch_streams_live_decisions(tmp_path: Path, dns: DnsServer, up: EchoHTTPServer) -> None:
    with enforce_run(tmp_path, dns) as run:
        watch = subprocess.Popen([*EGRESSD, "watch", "--json"], stdout=subprocess.PIPE, text=True)
        lines: list[dict] = []
        reader = threading.Thread(
            target=lambda: [lines.append(json.loads(x)) for x in watch.stdout], daemon=True
        )
        reader.start()
        try:

            def seen() -> bool:
                finish(start_curl(run, f"http://up.test:{up.port}/watched?token=secret"))
                return any(e.get("host") == "up.test" and e.get("reason") == "not_allowlisted" for e in lines)

            wait_for(seen, what="the refusal on the watch stream")
            # the watch may start between a connection's decision and its close: its first event
            # of up.test can be that close, so the decision read is the first one it heard
            event = next(e for e in lines if e.get("host") == "up.test" and e.get("event") == "decision")
            assert event["reason"] == "not_allowlisted" and event["path"] == "/watched?<redacted>"
            # a watcher sees which program asked, though nothing else turned the lookup on
            assert os.path.basename(event["exe"]) == "curl" and isinstance(event["pid"], int), event
        finally:
            watch.terminate()
            watch.wait(10)


# -- one-shot grants ---------------------------------------------------------------------------------
def test_grant_once_admits_exactly_one_of_racing_requests(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    with enforce_run(tmp_path, dns) as run:
        url = f"http://up.test:{up.port}/a"
        granted = cli("grant", url, "--once", "--ttl", "60")
        assert granted.returncode == 0 and "once" in granted.stdout, granted.stderr
        assert [g["target"] for g in json.loads(_info_grants())] == [url]
        curls = [start_curl(run, url) for _ in range(8)]
        results = [finish(c) for c in curls]
        assert sorted(results) == [(200, None)] + [(403, "not_allowlisted")] * 7
        assert up.connections == 1
        # consumed: the next identical request is decided normally
        assert finish(start_curl(run, url)) == (403, "not_allowlisted")
        assert json.loads(_info_grants()) == []


def _info_grants() -> str:
    from egressd.control.client import ControlClient, find_instances

    [found] = find_instances()[1]
    return json.dumps(ControlClient(found.path).call("GET", "/v1/grants")["grants"])


def test_a_grant_is_exact(tmp_path: Path, dns: DnsServer, up: EchoHTTPServer) -> None:
    other_port = EchoHTTPServer("127.0.0.1")
    with enforce_run(tmp_path, dns) as run, other_port:
        assert cli("grant", f"http://up.test:{up.port}/a", "--once").returncode == 0
        for url in (
            f"http://up.test:{up.port}/b",
            f"http://up.test:{up.port}/a?more",
            f"http://up.test:{up.port}/a/b",
            f"http://up.test:{other_port.port}/a",
            f"http://sub.up.test:{up.port}/a",
        ):
            assert finish(start_curl(run, url)) == (403, "not_allowlisted"), url
        assert up.connections == 0 and other_port.connections == 0
        assert finish(start_curl(run, f"http://up.test:{up.port}/a"))[0] == 200


def test_a_grant_never_lifts_deny_forbidden_or_private_guards(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    with enforce_run(tmp_path, dns, private=False) as run:
        for target, url, reason in (
            (f"denied.test:{up.port}", f"http://denied.test:{up.port}/", "denylist"),
            ("169.254.169.254:80", "http://169.254.169.254/", "forbidden_address"),
            ("10.1.2.3:80", "http://10.1.2.3/", "private_address"),
            (f"up.test:{up.port}", f"http://up.test:{up.port}/", "resolved_forbidden"),  # 127.0.0.1
        ):
            assert cli("grant", target, "--once").returncode == 0
            assert finish(start_curl(run, url)) == (403, reason), target
        assert up.connections == 0


def test_grant_errors_are_clear(tmp_path: Path, dns: DnsServer) -> None:
    with enforce_run(tmp_path, dns):
        bad = cli("grant", "http://user@x.test/")
        assert bad.returncode == 1 and "userinfo" in bad.stderr
        assert cli("grant", "x.test", "--ttl", "0").returncode == 2


def test_an_https_url_grant_admits_that_path_only_through_inspection(
    tmp_path: Path, dns: DnsServer, ca: trustme.CA, ca_file: Path
) -> None:
    """A CONNECT shows no path: the tunnel is inspected and the request inside uses the grant."""
    policy = ask_policy(tmp_path, mode="enforce")
    policy.write_text(policy.read_text() + "inspect:\n  - inspected.test\n")  # inspection on
    dns.add("up.test", "127.0.0.1")
    with EchoHTTPSServer("127.0.0.1", ca=ca, hostnames=["up.test"]) as tls:
        options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--no-prompt"]
        with EgressdRun([*options, "--upstream-ca", str(ca_file)]) as run:
            base = f"https://up.test:{tls.port}"
            assert cli("grant", f"{base}/a", "--once").returncode == 0
            assert finish(start_curl(run, f"{base}/b")) == (403, "not_allowlisted")  # inside the tunnel
            assert finish(start_curl(run, f"{base}/a")) == (200, None)
            assert finish(start_curl(run, f"{base}/a")) == (403, "not_allowlisted")  # used: the CONNECT
            assert [r["path"] for r in tls.requests] == ["/a"]


HUGE = "1" + "0" * 400  # a JSON integer past a float's range

# (path, raw body, words the 400 must hold): each field is read with the policy's schema reader
BAD_BODIES = [
    ("/v1/grants", '{"target": "a.test", "ttl": ' + HUGE + "}", "ttl:"),
    ("/v1/grants", '{"target": "a.test", "ttl": 1e400}', "ttl: inf"),
    ("/v1/grants", '{"target": "a.test", "ttl": NaN}', "ttl: nan"),
    ("/v1/grants", '{"target": "a.test", "ttl": true}', "ttl: True"),
    ("/v1/grants", '{"target": "a.test", "ttl": -5}', "ttl: -5"),
    ("/v1/grants", '{"target": "a.test", "once": "yes"}', "once: 'yes'"),
    ("/v1/grants", '{"target": ["a.test"]}', "target:"),
    ("/v1/grants", '{"target": "a.test", "tll": 5}', "tll: unknown key"),
    ("/v1/grants", '["a.test"]', "JSON object"),
    ("/v1/grants", "{", "JSON object"),
    ("/v1/listeners", '{"host": "127.0.0.1", "port": "8080"}', "port: '8080'"),
    ("/v1/listeners", '{"host": "127.0.0.1", "port": ' + HUGE + "}", "port:"),
    ("/v1/listeners", '{"host": "127.0.0.1", "port": true}', "port: True"),
    ("/v1/listeners", '{"host": "x.test", "port": 8080}', "host: 'x.test'"),
    ("/v1/children", '{"command": ["curl", 5]}', "command[1]: 5"),
    ("/v1/children", '{"command": "curl"}', "command: 'curl'"),
    ("/v1/children", '{"command": ["curl"], "profile": 5}', "profile: 5"),
    ("/v1/asks/1-x-1", '{"answer": 5}', "answer: 5"),
    ("/v1/asks/1-x-1", '{"answer": "once", "by": ["me"]}', "by: ['me']"),
    ("/v1/policy/rules", '{"op": "add", "list": "ports", "rule": "a.test"}', "list: 'ports'"),
    ("/v1/policy/rules", '{"op": "replace", "list": "allow", "rule": "a.test"}', "op: 'replace'"),
    ("/v1/policy/rules", '{"op": "add", "list": "allow", "rule": null}', "rule: None"),
]


def test_every_request_body_is_checked_and_answered_400_naming_the_field(
    tmp_path: Path, dns: DnsServer, egressd_home: Path
) -> None:
    with enforce_run(tmp_path, dns) as run:
        sock = run_dir(egressd_home) / f"{run.proc.pid}.sock"
        for path, body, words in BAD_BODIES:
            answer = subprocess.run(
                [
                    "curl",
                    "-sS",
                    "--max-time",
                    "10",
                    "--unix-socket",
                    str(sock),
                    "-w",
                    "\n%{http_code}",
                    "-X",
                    "POST",
                    "-H",
                    "Content-Type: application/json",
                    "--data-binary",
                    body,
                    f"http://egressd{path}",
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
            text, _, status = answer.stdout.rpartition("\n")
            assert status == "400", (path, body[:80], answer.stdout[:300])
            assert words in json.loads(text)["error"], (path, body[:80], text[:300])
        assert "Traceback" not in run.stderr and "Error handling request" not in run.stderr
        assert run.proc.poll() is None


def test_policy_endpoints_show_and_edit_the_file_and_count_per_child(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    """GET /v1/policy and POST /v1/policy/rules (the dashboard's policy panel): invalid entries are
    refused with a message and the file left alone; a valid one is written (comments kept) and
    applied by the reload; `clients` counts per child."""
    from egressd.control.client import ControlClient, ControlError, find_instances

    with enforce_run(tmp_path, dns) as run:
        [found] = find_instances()[1]
        client = ControlClient(found.path)
        policy = client.call("GET", "/v1/policy")
        assert policy["writable"] and "denied.test" in policy["effective"]["deny"]
        assert policy["file"]["allow"] == ["allowed.test"]
        before = (tmp_path / "policy.yaml").read_text()
        for bad in (
            {"op": "add", "list": "allow", "rule": "a b"},
            {"op": "add", "list": "ports", "rule": "x"},
        ):
            with pytest.raises(ControlError) as caught:
                client.call("POST", "/v1/policy/rules", bad)
            assert caught.value.status == 400 and str(caught.value)
        with pytest.raises(ControlError, match="not in deny"):
            client.call("POST", "/v1/policy/rules", {"op": "remove", "list": "deny", "rule": "nope.test"})
        assert (tmp_path / "policy.yaml").read_text() == before
        assert finish(start_curl(run, f"http://up.test:{up.port}/"))[1] == "not_allowlisted"
        done = client.call("POST", "/v1/policy/rules", {"op": "add", "list": "allow", "rule": "up.test"})
        assert "added up.test to allow" in done["done"]
        assert "# the human loop under test" in (tmp_path / "policy.yaml").read_text()
        wait_for(lambda: finish(start_curl(run, f"http://up.test:{up.port}/"))[0] == 200, what="the reload")
        clients = client.call("GET", "/v1/info")["clients"]
        assert sum(c["refused"] for c in clients.values()) >= 1
        assert sum(c["allowed"] for c in clients.values()) >= 1
        client.call("POST", "/v1/policy/rules", {"op": "remove", "list": "allow", "rule": "up.test"})
        assert "up.test" not in (tmp_path / "policy.yaml").read_text()
