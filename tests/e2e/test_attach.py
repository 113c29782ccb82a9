"""`egressd exec --attach -- CMD`: a child run under an `egressd run` already running.

Why: an agent host that spawns many short tools should not start a proxy per tool, but each tool
must still be decided, audited and counted as itself, with credentials of its own that die with
it. Everything goes through the real commands: `egressd run` in the background, `egressd exec
--attach` around curl, `egressd ps`, the control socket.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from egressd.child.attach import quick_parse
from egressd.control.client import ControlClient
from tests.support.answers import parse_http
from tests.support.attempts import wait_until
from tests.support.audit_log import audit_records
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD, EgressdRun, write_policy
from tests.support.upstreams import EchoHTTPServer

EXIT_CANNOT_RUN = 126

POLICY = """\
version: 1
allow: [up.test, 198.51.100.0/24]
profiles:
  narrow:
    allow: [other.test]
"""


def attach(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [*EGRESSD, "exec", "--attach", *args], capture_output=True, timeout=60, env=env or dict(os.environ)
    )


def curl(url: str) -> list[str]:
    return ["curl", "-sS", "-i", "--max-time", "20", url]


def _run(tmp_path: Path, dns: DnsServer, *extra: str, text: str = POLICY) -> EgressdRun:
    policy = write_policy(tmp_path, text, name=f"policy-{len(list(tmp_path.iterdir()))}.yaml")
    return EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver, *extra])


def test_attached_child_is_decided_audited_and_counted_as_itself(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    dns.add("up.test", upstream.host)
    audit = tmp_path / "audit.jsonl"
    with _run(tmp_path, dns, "--audit", str(audit)) as run:
        allowed = attach("--", *curl(f"http://up.test:{upstream.port}/attached"))
        assert parse_http(allowed.stdout)[0] == 200, allowed.stderr
        assert upstream.requests[-1]["path"] == "/attached"
        refused = attach("--", *curl("http://elsewhere.test/"))
        status, headers, _ = parse_http(refused.stdout)
        assert status == 403 and headers["x-egressd-reason"] == "not_allowlisted"
        [info] = json.loads(subprocess.run([*EGRESSD, "ps", "--json"], capture_output=True, text=True).stdout)
        assert info["pid"] == run.proc.pid  # type: ignore[union-attr]
        curls = {name: c for name, c in info["clients"].items() if name.startswith("curl[")}
        assert sorted((c["allowed"], c["refused"]) for c in curls.values()) == [(0, 1), (1, 0)]
    records = audit_records(audit)
    children = [r for r in records if r.get("event") == "child"]
    assert [c["program"] for c in children] == ["curl", "curl"]
    decided = {r["client"] for r in records if r.get("stage") in ("request", "connect")}
    assert decided == {c["client"] for c in children}  # each decision names its child: curl[PID]


def test_the_child_gets_exec_s_environment_and_its_exit_status(tmp_path: Path, dns: DnsServer) -> None:
    env = {
        **os.environ,
        "EGRESSD_SECRET_OF_EGRESSD": "x",
        "NO_PROXY": "*",
        "https_proxy": "http://elsewhere:1",
    }
    with _run(tmp_path, dns):
        script = "env; exit 7"
        result = attach("--", "sh", "-c", script, env=env)
        assert result.returncode == 7
        lines = dict(line.split("=", 1) for line in result.stdout.decode().splitlines() if "=" in line)
        assert "EGRESSD_SECRET_OF_EGRESSD" not in lines
        assert lines["NO_PROXY"] == "" and lines["https_proxy"] == lines["HTTP_PROXY"]
        assert lines["HTTP_PROXY"].startswith("http://egressd:")
        assert lines["EGRESSD_SOCKS_PROXY"].startswith("socks5h://egressd:")
        missing = attach("--", "no-such-command-egressd")
        assert missing.returncode == 127 and b"command not found" in missing.stderr


def test_the_token_stops_working_when_the_child_exits(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    dns.add("up.test", upstream.host)
    with _run(tmp_path, dns) as run:
        result = attach("--", "sh", "-c", 'printf %s "$HTTP_PROXY"')
        proxy = result.stdout.decode()
        assert proxy.startswith("http://egressd:")

        def refused_407() -> bool:
            late = subprocess.run(
                ["curl", "-sS", "-i", "-x", proxy, f"http://up.test:{upstream.port}/late"],
                capture_output=True,
            )
            return parse_http(late.stdout)[0] == 407

        wait_until(refused_407, "the exited child's token refused")
        # a child alive now works; its token is another
        alive = attach("--", *curl(f"http://up.test:{upstream.port}/alive"))
        assert parse_http(alive.stdout)[0] == 200
        assert all(r["path"] != "/late" for r in upstream.requests)

        # the API's own revocation: DELETE /v1/children/ID (the peer here is this test, alive)
        client = ControlClient(Path(os.environ["EGRESSD_HOME"]) / "run" / f"{run.proc.pid}.sock")  # type: ignore[union-attr]
        child = client.call("POST", "/v1/children", {"command": ["pytest"], "profile": None})
        proxy = child["env"]["HTTP_PROXY"]
        ok = subprocess.run(
            ["curl", "-sS", "-i", "-x", proxy, f"http://up.test:{upstream.port}/"], capture_output=True
        )
        assert parse_http(ok.stdout)[0] == 200
        assert client.call("GET", "/v1/children")["children"][0]["id"] == child["id"]
        client.call("DELETE", f"/v1/children/{child['id']}")
        assert refused_407()
        assert client.call("GET", "/v1/children")["children"] == []


def test_profile_narrows_the_attached_child(tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer) -> None:
    dns.add("up.test", upstream.host)
    with _run(tmp_path, dns):
        narrowed = attach("--profile", "narrow", "--", *curl(f"http://up.test:{upstream.port}/"))
        status, headers, _ = parse_http(narrowed.stdout)
        assert status == 403 and headers["x-egressd-reason"] == "profile"
        unknown = attach("--profile=nope", "--", "true")
        assert unknown.returncode == EXIT_CANNOT_RUN
        assert b"no such profile 'nope'" in unknown.stderr


def test_pid_chooses_between_two_instances(tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer) -> None:
    dns.add("up.test", upstream.host)
    closed = POLICY.replace("allow: [up.test, 198.51.100.0/24]", "allow: []")
    with _run(tmp_path, dns) as open_run, _run(tmp_path, dns, text=closed) as closed_run:
        ambiguous = attach("--", "true")
        assert ambiguous.returncode == EXIT_CANNOT_RUN
        assert b"choose one with --pid" in ambiguous.stderr
        url = f"http://up.test:{upstream.port}/"
        via_open = attach("--pid", str(open_run.proc.pid), "--", *curl(url))  # type: ignore[union-attr]
        assert parse_http(via_open.stdout)[0] == 200
        via_closed = attach(f"--pid={closed_run.proc.pid}", "--", *curl(url))  # type: ignore[union-attr]
        assert parse_http(via_closed.stdout)[0] == 403
        gone = attach("--pid", "1", "--", "true")
        assert gone.returncode == EXIT_CANNOT_RUN and b"no egressd with pid 1" in gone.stderr


def test_no_instance_running_is_a_clear_error() -> None:
    result = attach("--", "true")
    assert result.returncode == EXIT_CANNOT_RUN
    assert b"no egressd is running to attach to" in result.stderr and b"egressd run" in result.stderr


NOT_CAPTURED = b"egressd exec --attach: true is not captured"


@pytest.mark.parametrize(
    "line",
    [["--", "true"], ["true"], ["--pid={pid}", "--", "true"]],
    ids=["quick-path", "click-path", "quick-path-pid"],
)
def test_attach_says_once_that_its_child_is_not_captured(
    tmp_path: Path, dns: DnsServer, line: list[str]
) -> None:
    """An attached child runs on the host's network (no namespace of its own): egressd says so,
    once, on both parsers' paths; --no-capture says the user knows, and silences it."""
    with _run(tmp_path, dns) as run:
        args = [word.format(pid=run.proc.pid) for word in line]  # type: ignore[union-attr]
        told = attach(*args)
        assert told.returncode == 0, told.stderr
        assert told.stderr.count(NOT_CAPTURED) == 1, told.stderr
        assert b"ignore the proxy variables reach the network directly" in told.stderr
        assert b"--no-capture" in told.stderr
        options_end = args.index("--") if "--" in args else len(args) - 1
        for position in (0, options_end):  # first, or last of the options
            quiet = attach(*args[:position], "--no-capture", *args[position:])
            assert quiet.returncode == 0, quiet.stderr
            assert b"captured" not in quiet.stderr, quiet.stderr


def test_options_of_a_proxy_of_its_own_are_refused(tmp_path: Path) -> None:
    """The click path: `--attach` with --policy (or --allow, ...) would silently mean nothing."""
    result = attach("--allow", "up.test", "--", "true")
    assert result.returncode == 2
    assert b"--attach takes only --pid, --profile and --no-capture" in result.stderr
    result = subprocess.run([*EGRESSD, "exec", "--pid", "5", "--", "true"], capture_output=True, timeout=60)
    assert result.returncode == 2 and b"--pid needs --attach" in result.stderr


@pytest.mark.parametrize(
    ("argv", "parsed"),
    [
        (["exec", "--attach", "--", "true"], (None, None, ["true"], False)),
        (
            ["exec", "--attach", "--pid", "7", "--profile", "p", "--", "a", "--attach"],
            (7, "p", ["a", "--attach"], False),
        ),
        (["exec", "--pid=7", "--attach", "--profile=p", "--", "a"], (7, "p", ["a"], False)),
        (["exec", "--no-capture", "--attach", "--", "a"], (None, None, ["a"], True)),
        (
            ["exec", "--attach", "--no-capture", "--", "a", "--no-capture"],
            (None, None, ["a", "--no-capture"], True),
        ),
        (["exec", "--no-capture", "--", "a"], None),  # no --attach: a plain exec
        (["exec", "--attach", "--no-capture=1", "--", "a"], None),
        (["exec", "--", "a", "--attach"], None),  # CMD's own argument: a plain exec
        (["exec", "--attach", "true"], None),  # no `--`: click says what is wrong
        (["exec", "--attach", "--"], None),  # no command
        (["exec", "--attach", "--pid", "x", "--", "a"], None),
        (["exec", "--attach", "--pid", "-1", "--", "a"], None),
        (["exec", "--attach", "--pid"], None),
        (["exec", "--attach=1", "--", "a"], None),
        (["exec", "--attach", "--policy", "p.yaml", "--", "a"], None),  # click refuses it
        (["run", "--attach", "--", "a"], None),
        ([], None),
    ],
)
def test_the_quick_parser_takes_plain_attach_lines_only(argv: list[str], parsed: object) -> None:
    assert quick_parse(argv) == parsed


def test_the_attach_path_imports_no_cli_policy_loop_or_engine(tmp_path: Path, dns: DnsServer) -> None:
    """The start-up of every attached child is egressd's overhead: the modules it loads are the
    standard library's few, h11 (which reads the control API's answer) and egressd's small ones
    (what `python -X importtime` lists)."""
    with _run(tmp_path, dns):
        result = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "egressd", "exec", "--attach", "--", "true"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line}
    assert "egressd.child.attach" in loaded
    heavy = {"click", "asyncio", "logging", "http.client", "ssl", "email", "yaml", "ruamel.yaml", "mitmproxy"}
    heavy |= {"egressd.policy", "egressd.cli", "egressd.session", "egressd.child.process"}
    heavy |= {"uvloop", "aiohttp"}
    assert not heavy & loaded, sorted(heavy & loaded)


def test_an_attached_child_gets_the_secrets_placeholders_never_their_values(
    tmp_path: Path, dns: DnsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The instance's secrets apply to attached children as to its own: the placeholder in the
    child's variable, and the variable the value is read from removed from the attaching
    environment too (the caller's shell may hold it as well)."""
    text = POLICY.replace("allow: [up.test, 198.51.100.0/24]", "allow: [api.test, 198.51.100.0/24]") + (
        "secrets:\n"
        "  - name: api\n"
        "    from: {env: REAL_API_KEY}\n"
        "    hosts: [api.test]\n"
        "    env: CHILD_API_KEY\n"
    )
    value = "sk-real-value-never-shown"
    monkeypatch.setenv("REAL_API_KEY", value)  # egressd run's own environment
    with _run(tmp_path, dns, text=text):
        env = {**os.environ, "REAL_API_KEY": value, "CHILD_API_KEY": value}
        result = attach("--", "env", env=env)
    assert result.returncode == 0, result.stderr
    lines = dict(line.split("=", 1) for line in result.stdout.decode().splitlines() if "=" in line)
    assert lines["CHILD_API_KEY"].startswith("egressd-secret-api-")
    assert "REAL_API_KEY" not in lines
    assert value.encode() not in result.stdout
