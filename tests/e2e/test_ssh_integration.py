"""`egressd ssh` for real: a real sshd in a "remote" namespace, upstreams in an "internet" namespace.

The remote has no route to the internet namespace (except in the remote-egress tests, which add
one), the client — this pytest session's namespace — reaches both. Every command below runs the
real `egressd ssh` with the system OpenSSH client against that sshd, and the remote side runs real
curl and python3. See tests/support/ssh_lab.py for the topology.
"""

from __future__ import annotations

import ipaddress
import json
import os
import pwd
import random
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.support import ssh_lab
from tests.support.audit_log import audit_records
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD
from tests.support.ssh_lab import INTERNET, SshLab
from tests.support.ssh_session import POLICY, Running, listening, peers, probe, results, sleepers, wait_for
from tests.support.upstreams import EchoHTTPServer, EchoHTTPSServer

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.needs_root("creates named network namespaces (`ip netns add`) and runs sshd in one"),
]
pytest_plugins = ("tests.support.ssh_fixtures",)  # the lab and its fixtures

# up.test over HTTPS for /ok only: egressd must intercept TLS to see the path
POLICY_INSPECT = f"""\
version: 1
mode: enforce
allow:
  - {{host: up.test, paths: [/ok]}}
  - {ssh_lab.INTERNET_NET}
"""
POLICY_UP_DENIED = POLICY.replace("  - denied.test\n", "  - denied.test\n  - up.test\n")


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    return path


# -- helpers -------------------------------------------------------------------------------------
def ssh_argv(
    lab: SshLab, options: Sequence[str], command: Sequence[str], destination: str | None = None
) -> list[str]:
    return [*EGRESSD, "ssh", *options, *lab.ssh_options(), destination or lab.destination, "--", *command]


def egressd_ssh(
    lab: SshLab,
    options: Sequence[str],
    command: Sequence[str],
    *,
    destination: str | None = None,
    input: bytes | None = None,  # noqa: A002
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ssh_argv(lab, options, command, destination),
        input=input,
        capture_output=True,
        timeout=60,
        env=env,
        stdin=None if input is not None else subprocess.DEVNULL,
    )


def relay_options(policy: Path, dns: DnsServer, *extra: str) -> list[str]:
    return ["--policy", str(policy), "--nameserver", dns.nameserver, *extra]


# -- relay mode ----------------------------------------------------------------------------------
def test_relay_allowed_only_through_the_client_refused_with_reason(
    lab: SshLab, names: DnsServer, internet: EchoHTTPServer, policy: Path
) -> None:
    url = f"http://up.test:{internet.port}"
    requests = probe(
        f"relay={url}/python",
        f"denied=http://denied.test:{internet.port}/",
        f"nope=http://nope.test:{internet.port}/",
        f"direct:direct=http://{INTERNET}:{internet.port}/direct",
    )
    curl = f"curl -sS --max-time 10 -o /dev/null -w 'curl %{{http_code}}\\n' {url}/curl"
    script = f"{curl} && exec {shlex.join(requests)}"
    audit = policy.parent / "audit.jsonl"
    result = egressd_ssh(lab, relay_options(policy, names, "--audit", str(audit)), ["sh", "-c", script])
    assert result.returncode == 0, result.stderr
    out = results(result.stdout)
    assert result.stdout.startswith(b"curl 200\n"), result.stdout
    # allowed: 200, and the upstream saw the CLIENT's address: the request left from the client
    assert out["relay"]["status"] == 200
    assert {r["path"] for r in internet.requests} == {"/curl", "/python"}
    assert peers(internet) == {ssh_lab.CLIENT_TO_INTERNET}
    # refused: 403 with the reason, readable by the remote child
    assert out["denied"]["status"] == 403 and out["denied"]["reason"] == "denylist"
    assert "denied.test" in out["denied"]["body"] and "policy decision" in out["denied"]["body"]
    assert "denylist" in out["denied"]["proxy_status"]
    assert out["nope"]["status"] == 403 and out["nope"]["reason"] == "not_allowlisted"
    assert "egressd ssh --allow nope.test" in out["nope"]["body"]  # the command the user runs
    # the remote's own way out does not exist: no route to the internet namespace
    assert out["direct"]["status"] is None
    assert "unreachable" in out["direct"]["error"].lower()
    # the two allowed requests (one kept-alive upstream connection may carry both); nothing from a
    # refused one
    assert 1 <= internet.connections <= 2
    # decided and audited here, on the client, like any `exec` child's requests
    records = audit_records(audit)
    decided = {(r["host"], r["decision"], r["reason"]) for r in records if r["event"] == "decision"}
    assert {("up.test", "allow", "allowlist"), ("denied.test", "deny", "denylist")} <= decided


SECRET_POLICY = (
    POLICY
    + """\
secrets:
  - name: upkey
    from: {env: SSH_TEST_UPKEY}
    hosts: [up.test]
    env: UPKEY
"""
)


def test_relay_the_remote_command_gets_a_placeholder_the_client_puts_the_value_in(
    lab: SshLab, names: DnsServer, internet: EchoHTTPServer, tmp_path: Path
) -> None:
    policy = tmp_path / "secret.yaml"
    policy.write_text(SECRET_POLICY)
    value = "sk-relay-value-7f3e"
    url = f"http://up.test:{internet.port}/keyed"
    curl = f'curl -sS --max-time 10 -o /dev/null -H "Authorization: Bearer $UPKEY" {url}'
    script = f'printf "%s\\n" "$UPKEY"; {curl}'
    env = {**os.environ, "SSH_TEST_UPKEY": value}
    result = egressd_ssh(lab, relay_options(policy, names), ["sh", "-c", script], env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(b"egressd-secret-upkey-"), result.stdout
    assert value.encode() not in result.stdout + result.stderr
    [request] = internet.requests
    assert request["headers"]["authorization"] == f"Bearer {value}"  # put in here, on the client


@pytest.mark.parametrize(
    ("extra", "loopback_ports", "expected"),
    [
        ([], None, (403, "loopback_disabled")),
        (["--client-loopback"], "SERVICE", (200, None)),
        (["--client-loopback"], "1", (403, "loopback_port")),
    ],
)
def test_relay_client_own_addresses_fall_under_the_loopback_rules(
    lab: SshLab,
    names: DnsServer,
    tmp_path: Path,
    extra: list[str],
    loopback_ports: str | None,
    expected: tuple[int, str | None],
) -> None:
    """The client's LAN address (198.18.0.5, inside an allowed CIDR) leads to the client's own
    services just as 127.0.0.1 does: through the relay it is loopback, in every spelling."""
    service = EchoHTTPServer(ssh_lab.CLIENT_TO_INTERNET, name="client-service").start()
    try:
        names.add("client.test", ssh_lab.CLIENT_TO_INTERNET)
        text = POLICY.replace("allow:\n", "allow:\n  - client.test\n")
        if loopback_ports is not None:
            ports = str(service.port) if loopback_ports == "SERVICE" else loopback_ports
            text += f"loopback:\n  allow: true\n  ports: [{ports}]\n"
        policy = tmp_path / "policy.yaml"
        policy.write_text(text)
        lan = f"{ssh_lab.CLIENT_TO_INTERNET}:{service.port}"
        requests = probe(
            f"lan=http://{lan}/lan",
            f"mapped=http://[::ffff:{ssh_lab.CLIENT_TO_INTERNET}]:{service.port}/mapped",
        )
        result = egressd_ssh(lab, relay_options(policy, names, *extra), requests)
        assert result.returncode == 0, result.stderr
        out = results(result.stdout)
        for name in ("lan", "mapped"):
            assert (out[name]["status"], out[name]["reason"]) == expected, out[name]
        if expected[0] == 403:
            assert service.requests == []
        # a name for that address gets the same answer (the allowed CIDR licenses the address)
        named = egressd_ssh(
            lab, relay_options(policy, names, *extra), probe(f"name=http://client.test:{service.port}/name")
        )
        assert results(named.stdout)["name"]["status"] == expected[0], named.stdout
        assert ("/name" in {r["path"] for r in service.requests}) == (expected[0] == 200)
    finally:
        service.stop()


def test_relay_port_needs_the_childs_credentials(
    lab: SshLab, names: DnsServer, internet: EchoHTTPServer, policy: Path
) -> None:
    """Anyone on the remote can connect to the forwarded port; without the credentials: 407."""
    script = 'printf "%s\\n" "$HTTP_PROXY"; read _ignored'
    with Running(ssh_argv(lab, relay_options(policy, names), ["sh", "-c", script])) as run:
        proxy_url = run.line().strip()
        credentials, _, hostport = proxy_url.removeprefix("http://").rpartition("@")
        token = credentials.partition(":")[2]
        assert hostport.startswith("127.0.0.1:") and len(token) >= 20, proxy_url
        target = f"http://up.test:{internet.port}/other-user"

        def curl_as_nobody(*proxy_args: str) -> tuple[int, dict[str, str]]:
            done = lab.run_remote(
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "curl",
                "-sS",
                "-i",
                "--max-time",
                "10",
                *proxy_args,
                target,
            )
            head = done.stdout.split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:])}
            return int(head[0].split()[1]), headers

        status, headers = curl_as_nobody("--proxy", f"http://{hostport}")
        assert status == 407
        assert headers["proxy-authenticate"].lower().startswith("basic")
        assert headers["x-egressd-reason"] == "proxy_auth_required"
        status, _ = curl_as_nobody("--proxy", f"http://egressd:wrong-token@{hostport}")
        assert status == 407
        assert internet.connections == 0
        # the credentials, not the user, are what counts: with them another user gets through
        status, _ = curl_as_nobody("--proxy", f"http://{credentials}@{hostport}")
        assert status == 200 and internet.connections == 1
        # and they are nowhere in a command line (other users of the remote can read those)
        leaks = [(pid, line) for pid, line in ssh_lab.all_cmdlines() if token in line]
        assert not leaks
        run.send(b"done\n")
        assert run.finish() == 0, run.stderr


def test_relay_policy_edit_applies_to_the_running_session(
    lab: SshLab, names: DnsServer, internet: EchoHTTPServer, policy: Path
) -> None:
    url = f"http://up.test:{internet.port}"
    script = f"{shlex.join(probe(f'before={url}/1'))}; read _go; exec {shlex.join(probe(f'after={url}/2'))}"
    with Running(ssh_argv(lab, relay_options(policy, names, "--trace"), ["sh", "-c", script])) as run:
        assert json.loads(run.line())["status"] == 200
        policy.write_text(POLICY_UP_DENIED)
        run.wait_stderr("policy reloaded from")
        run.send(b"go\n")
        after = json.loads(run.line())
        assert after["status"] == 403 and after["reason"] == "denylist"
        assert run.finish() == 0, run.stderr
    assert [r["path"] for r in internet.requests] == ["/1"]


def test_relay_stdio_and_exit_status_pass_through(lab: SshLab, policy: Path, names: DnsServer) -> None:
    data = bytes(random.Random(5).randrange(256) for _ in range(200_000)) + b"\n~.\n~C\nend\n"
    # DESTINATION as user@host with the port given as an ssh option
    result = egressd_ssh(
        lab,
        [*relay_options(policy, names), "--ssh-option", f"Port={ssh_lab.SSH_PORT}"],
        ["cat"],
        destination=f"root@{ssh_lab.REMOTE}",
        input=data,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == data
    result = egressd_ssh(lab, relay_options(policy, names), ["sh", "-c", "echo to-stderr >&2; exit 7"])
    assert result.returncode == 7
    assert result.stdout == b""
    assert b"to-stderr" in result.stderr


def test_relay_signals_reach_the_remote_command(lab: SshLab, policy: Path, names: DnsServer) -> None:
    trap = 'trap "echo got-TERM; exit 9" TERM; echo ready; while :; do sleep 0.1; done'
    with Running(ssh_argv(lab, relay_options(policy, names), ["sh", "-c", trap])) as run:
        assert run.line() == "ready\n"
        run.proc.send_signal(signal.SIGTERM)
        assert run.line() == "got-TERM\n"
        assert run.finish() == 9
    # a command that dies of the signal: egressd dies of it too, as with `exec`
    with Running(
        ssh_argv(lab, relay_options(policy, names), ["sh", "-c", "echo ready; exec sleep 60"])
    ) as run:
        assert run.line() == "ready\n"
        run.proc.send_signal(signal.SIGINT)
        assert run.finish() == -signal.SIGINT


def test_relay_ctrl_c_on_a_terminal(lab: SshLab, policy: Path, names: DnsServer) -> None:
    """Ctrl-C in a terminal: without a pty the remote command gets SIGINT and egressd dies of it;
    with --ssh-option RequestTTY=yes it travels as a byte to the remote pty (255 then, as ssh -t)."""
    for extra, script, expected in (
        ([], "echo ready; exec sleep 60", -signal.SIGINT),
        (["--ssh-option", "RequestTTY=yes"], "tty; echo ready; exec sleep 60", 255),
    ):
        output, returncode = _on_terminal(
            ssh_argv(lab, [*relay_options(policy, names), *extra], ["sh", "-c", script]), b"ready", b"\x03"
        )
        assert returncode == expected, output
        if extra:
            assert b"/dev/pts/" in output  # the remote command had a pseudo-terminal


def test_relay_tls_inspection_trusts_the_clients_ca_on_the_remote(
    lab: SshLab, names: DnsServer, internet_tls: EchoHTTPSServer, ca_file: Path, tmp_path: Path
) -> None:
    """Path rules over HTTPS through the relay: the client's proxy intercepts, and the remote child
    verifies it with the CA bundle egressd copied over (the upstream's own CA is not in it)."""
    policy = tmp_path / "inspect.yaml"
    policy.write_text(POLICY_INSPECT)
    base = f"https://up.test:{internet_tls.port}"
    write = "-w '%{http_code} %header{x-egressd-reason}\\n'"
    script = f"curl -sS -o /dev/null {write} {base}/ok && curl -sS -o /dev/null {write} {base}/no"
    options = relay_options(policy, names, "--upstream-ca", str(ca_file))
    result = egressd_ssh(lab, options, ["sh", "-c", f'echo "$CURL_CA_BUNDLE"; {script}'])
    assert result.returncode == 0, result.stderr
    bundle, ok, refused = result.stdout.decode().splitlines()
    assert bundle.startswith(f"{lab.remote_tmp}/egressd-ssh.") and bundle.endswith("/ca.pem")
    assert ok.split()[0] == "200"
    assert refused.split()[0] == "403" and refused.split()[1] != ""
    assert [r["path"] for r in internet_tls.requests] == ["/ok"]
    assert peers(internet_tls) == {ssh_lab.CLIENT_TO_INTERNET}


@pytest.mark.parametrize("what", ["remote sshd", "local ssh"])
def test_relay_ssh_killed_mid_session_ends_the_run_cleanly(
    lab: SshLab, policy: Path, names: DnsServer, request: pytest.FixtureRequest, what: str
) -> None:
    # where egressd keeps its control socket (short: a Unix socket path has ~100 bytes)
    workdir = Path(tempfile.mkdtemp(prefix="eg-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(workdir, ignore_errors=True))
    env = {**os.environ, "TMPDIR": str(workdir)}
    tag = f"62.{os.getpid()}"
    with Running(
        ssh_argv(lab, relay_options(policy, names), ["sh", "-c", f"echo ready; sleep {tag}"]), env=env
    ) as run:
        assert run.line() == "ready\n"
        local = ssh_lab.descendants(run.proc.pid)
        masters = ssh_lab.ssh_masters(local)
        assert len(masters) == 1 and len(local) >= 2, [ssh_lab.cmdline(p) for p in local]
        if what == "remote sshd":
            lab.drop_connections()
        else:
            os.kill(masters[0], signal.SIGKILL)
        started = time.monotonic()
        assert run.finish(timeout=20) == 255
        assert time.monotonic() - started < 10
        assert "SSH connection to" in run.stderr and "was lost" in run.stderr
    # nothing left here: no ssh client, no control socket (the proxy went with egressd itself)
    time.sleep(0.2)
    assert not [pid for pid in local if ssh_lab.cmdline(pid)], "local processes left running"
    assert list(workdir.iterdir()) == []
    # on the remote, the session's reaper ended the command and removed the session directory
    wait_for(lambda: not sleepers(tag), "the remote command to end after SSH dropped", timeout=20)
    assert lab.remote_tmp is not None
    wait_for(lambda: not list(lab.remote_tmp.iterdir()), "the remote session directory to go")


def test_relay_egressd_killed_takes_its_ssh_and_the_port_along(
    lab: SshLab, policy: Path, names: DnsServer, request: pytest.FixtureRequest
) -> None:
    """SIGKILL to egressd: its ssh master and session go too, the remote session ends and its
    port closes, and the control socket's private directory here is removed (nothing is left
    in TMPDIR)."""
    request.addfinalizer(lab.kill_sessions)
    workdir = Path(tempfile.mkdtemp(prefix="eg-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(workdir, ignore_errors=True))
    script = 'printf "%s\\n" "$HTTP_PROXY"; exec sleep 60'
    argv = ssh_argv(lab, relay_options(policy, names), ["sh", "-c", script])
    with Running(argv, env={**os.environ, "TMPDIR": str(workdir)}) as run:
        port = int(run.line().strip().rpartition(":")[2])
        local = ssh_lab.descendants(run.proc.pid)
        assert ssh_lab.ssh_masters(local), local
        assert lab.in_remote(lambda: listening(port))
        assert [p.name.startswith("egressd-ssh-") for p in workdir.iterdir()] == [True]
        run.proc.kill()
        run.proc.wait()
        wait_for(
            lambda: not [pid for pid in local if ssh_lab.cmdline(pid)],
            "egressd's ssh processes to end after it was killed",
            timeout=20,
        )
        wait_for(
            lambda: not lab.in_remote(lambda: listening(port)),
            "the remote port to close after egressd was killed",
            timeout=20,
        )
        assert list(workdir.iterdir()) == []


def test_relay_forward_refused_is_fatal_before_the_command_runs(
    lab: SshLab, policy: Path, names: DnsServer, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    result = egressd_ssh(
        lab,
        relay_options(policy, names),
        ["touch", str(marker)],
        destination=f"ssh://root@{ssh_lab.REMOTE}:{ssh_lab.NO_FORWARDING_PORT}",
    )
    assert result.returncode == 2, result.stderr
    assert b"remote forward" in result.stderr and b"failed" in result.stderr, result.stderr
    assert b"AllowStreamLocalForwarding" in result.stderr
    assert not marker.exists()


def test_relay_port_is_on_the_remotes_loopback_even_with_gateway_ports(
    lab: SshLab, policy: Path, names: DnsServer, internet: EchoHTTPServer
) -> None:
    """sshd with GatewayPorts yes binds TCP forwards on every address; the port the command connects
    to is the guard's own, on 127.0.0.1, and sshd's end of the relay is a Unix socket: no other host
    reaches the proxy whatever sshd_config says."""
    listeners = "cat /proc/net/tcp /proc/net/tcp6"
    script = f'printf "%s\\n" "$HTTP_PROXY"; {listeners}; exec {shlex.join(probe(f"up=http://up.test:{internet.port}/gw"))}'
    result = egressd_ssh(
        lab,
        relay_options(policy, names),
        ["sh", "-c", script],
        destination=f"ssh://root@{ssh_lab.REMOTE}:{ssh_lab.GATEWAY_PORTS_PORT}",
    )
    assert result.returncode == 0, result.stderr
    url, *table = result.stdout.decode().splitlines()
    assert json.loads(table.pop())["status"] == 200
    port = int(url.rpartition(":")[2])
    listening = _listening_sockets("\n".join(table))
    assert ("127.0.0.1", port) in listening
    sshd = {
        (ssh_lab.REMOTE, p)
        for p in (ssh_lab.SSH_PORT, ssh_lab.NO_FORWARDING_PORT, ssh_lab.GATEWAY_PORTS_PORT)
    }
    assert {entry for entry in listening if entry[0] != "127.0.0.1"} <= sshd, listening


def _listening_sockets(proc_net_tcp: str) -> set[tuple[str, int]]:
    """(address, port) of the listening sockets in /proc/net/tcp{,6} text."""
    found = set()
    for line in proc_net_tcp.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[3] == "0A" and ":" in fields[1]:
            address, _, port = fields[1].partition(":")
            raw = bytes.fromhex(address)
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.add((str(ipaddress.ip_address(words)), int(port, 16)))
    return found


def test_config_files_cannot_forward_the_agent(
    lab: SshLab, policy: Path, names: DnsServer, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """ForwardAgent/ForwardX11 in an ssh config file do not reach the session: egressd forces them off.

    The system-wide ssh_config is replaced in a private mount namespace (this machine's own
    ~/.ssh is left alone); a real ssh-agent runs for the session to be offered.
    """
    config = tmp_path / "ssh_config"
    config.write_text("Host *\n    ForwardAgent yes\n    ForwardX11 yes\n    ForwardX11Trusted yes\n")
    socket_path = tmp_path / "agent.sock"
    started = subprocess.run(
        ["ssh-agent", "-s", "-a", str(socket_path)], capture_output=True, text=True, check=True
    )
    agent_pid = int(started.stdout.split("SSH_AGENT_PID=", 1)[1].split(";", 1)[0])
    request.addfinalizer(lambda: os.kill(agent_pid, signal.SIGTERM))
    with_config = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
    with_config += ['mount --bind "$1" /etc/ssh/ssh_config && shift && exec "$@"', "sh", str(config)]
    script = 'echo "agent=${SSH_AUTH_SOCK:-none}"'
    done = subprocess.run(
        [*with_config, *ssh_argv(lab, relay_options(policy, names), ["sh", "-c", script])],
        capture_output=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
        env={**os.environ, "SSH_AUTH_SOCK": str(socket_path), "DISPLAY": ":0"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"agent=none\n"


def test_connect_failure_exits_255_without_running(
    lab: SshLab, policy: Path, names: DnsServer, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    result = egressd_ssh(
        lab,
        relay_options(policy, names),
        ["touch", str(marker)],
        destination=f"ssh://root@{ssh_lab.REMOTE}:2299",
    )
    assert result.returncode == 255
    assert b"could not connect to" in result.stderr
    assert not marker.exists()


# -- remote egress mode ----------------------------------------------------------------------------
def remote_options(policy: Path, dns: DnsServer, *extra: str) -> list[str]:
    return [
        "--egress",
        "remote",
        "--remote-egressd",
        ssh_lab.remote_egressd(),
        "--policy",
        str(policy),
        "--nameserver",
        dns.nameserver,
        *extra,
    ]


def test_remote_egress_enforces_the_pushed_policy_and_follows_changes(
    lab: SshLab, remote_dns: DnsServer, routed: None, internet: EchoHTTPServer, policy: Path, tmp_path: Path
) -> None:
    audit = tmp_path / "audit.jsonl"
    url = f"http://up.test:{internet.port}"
    first = probe(f"up={url}/1", f"denied=http://denied.test:{internet.port}/")
    script = f"{shlex.join(first)}; read _go; exec {shlex.join(probe(f'again={url}/2'))}"
    options = remote_options(policy, remote_dns, "--trace", "--audit", str(audit))
    with Running(ssh_argv(lab, options, ["sh", "-c", script])) as run:
        up, denied = json.loads(run.line()), json.loads(run.line())
        assert up["status"] == 200
        # it left from the REMOTE (its direct link), not through the client
        assert peers(internet) == {ssh_lab.REMOTE_DIRECT}
        assert denied["status"] == 403 and denied["reason"] == "denylist"
        assert "(pushed over SSH)" in denied["body"] and str(policy) in denied["body"]
        policy.write_text(POLICY_UP_DENIED)
        run.wait_stderr("applied the policy from")
        run.send(b"go\n")
        again = json.loads(run.line())
        assert again["status"] == 403 and again["reason"] == "denylist"
        assert run.finish() == 0, run.stderr
    assert [r["path"] for r in internet.requests] == ["/1"]
    records = audit_records(audit)
    decisions = [r for r in records if r["event"] == "decision" and r["host"] == "up.test"]
    assert {r["remote"] for r in records} == {lab.destination}
    assert [d["decision"] for d in decisions if d.get("path") in ("/1", "/2")] == ["allow", "deny"]
    assert any(r["event"] == "reload" for r in records)


def test_remote_egress_tls_inspection_happens_on_the_remote(
    lab: SshLab,
    remote_dns: DnsServer,
    routed: None,
    internet_tls: EchoHTTPSServer,
    ca_file: Path,
    tmp_path: Path,
) -> None:
    """--upstream-ca travels to the remote agent, which intercepts with its own CA."""
    policy = tmp_path / "inspect.yaml"
    policy.write_text(POLICY_INSPECT)
    base = f"https://up.test:{internet_tls.port}"
    write = "-w '%{http_code} %header{x-egressd-reason}\\n'"
    script = f"curl -sS -o /dev/null {write} {base}/ok && curl -sS -o /dev/null {write} {base}/no"
    options = remote_options(policy, remote_dns, "--upstream-ca", str(ca_file))
    result = egressd_ssh(lab, options, ["sh", "-c", script])
    assert result.returncode == 0, result.stderr
    ok, refused = result.stdout.decode().splitlines()
    assert ok.split()[0] == "200"
    assert refused.split()[0] == "403" and refused.split()[1] != ""
    assert [r["path"] for r in internet_tls.requests] == ["/ok"]
    assert peers(internet_tls) == {ssh_lab.REMOTE_DIRECT}


def test_remote_egress_hangs_up_the_command_when_ssh_drops(
    lab: SshLab, remote_dns: DnsServer, policy: Path
) -> None:
    script = f"echo ready; exec sleep 61.{os.getpid()}"
    with Running(ssh_argv(lab, remote_options(policy, remote_dns), ["sh", "-c", script])) as run:
        assert run.line() == "ready\n"
        wait_for(lambda: sleepers(f"61.{os.getpid()}"), "the remote command to start")
        lab.drop_connections()
        assert run.finish(timeout=20) == 255
        assert "was lost" in run.stderr
    wait_for(lambda: not sleepers(f"61.{os.getpid()}"), "the remote command to be hung up after SSH dropped")


def test_remote_egress_never_carries_secrets(lab: SshLab, remote_dns: DnsServer, tmp_path: Path) -> None:
    """The remote agent's egressd gets the policy without `secrets:`: no value leaves this machine,
    and the remote command gets no placeholder either (said once on stderr)."""
    policy = tmp_path / "secret.yaml"
    policy.write_text(SECRET_POLICY)
    env = {**os.environ, "SSH_TEST_UPKEY": "sk-remote-value-91ab"}
    command = ["sh", "-c", 'printf "[%s]\\n" "${UPKEY-unset}"']
    result = egressd_ssh(lab, remote_options(policy, remote_dns), command, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"[unset]\n"
    assert b"secrets stay on this machine" in result.stderr
    assert b"sk-remote-value-91ab" not in result.stdout + result.stderr


def test_remote_egress_exit_status_and_signal_are_exact(
    lab: SshLab, remote_dns: DnsServer, policy: Path
) -> None:
    result = egressd_ssh(lab, remote_options(policy, remote_dns), ["sh", "-c", "exit 5"])
    assert result.returncode == 5, result.stderr
    with Running(
        ssh_argv(lab, remote_options(policy, remote_dns), ["sh", "-c", "echo ready; exec sleep 60"])
    ) as run:
        assert run.line() == "ready\n"
        run.proc.send_signal(signal.SIGTERM)
        assert run.finish() == -signal.SIGTERM


def test_remote_egress_sandbox_leaves_the_proxy_as_the_only_way_out(
    lab: SshLab, remote_dns: DnsServer, routed: None, internet: EchoHTTPServer, policy: Path, tmp_path: Path
) -> None:
    """--sandbox: CMD runs in bubblewrap on the remote; the remote's own route is gone for it, the
    remote egressd's proxy still decides, and the remote home is read-only while --rw paths are not.

    The probe runs with the remote egressd's own interpreter: the sandbox shows that read-only,
    while root's `python3` here is a pyenv shim in its home, which the sandbox masks."""
    url = f"http://up.test:{internet.port}"
    requests = probe(
        f"up={url}/boxed",
        f"denied=http://denied.test:{internet.port}/",
        f"direct:direct=http://{INTERNET}:{internet.port}/direct",
        python=sys.executable,
    )
    writable = tmp_path / "rw"
    writable.mkdir()
    planted = Path(pwd.getpwuid(os.getuid()).pw_dir) / f"egressd-test-{os.getpid()}"  # the remote's home
    script = (
        'echo "sandbox=${EGRESSD_SANDBOX:-none}"; '
        f"touch {planted.name} 2>/dev/null && echo home-writable; "
        f"touch {writable}/made && echo rw-writable; exec {shlex.join(requests)}"
    )
    options = remote_options(policy, remote_dns, "--sandbox", "--rw", str(writable))
    try:
        result = egressd_ssh(lab, options, ["sh", "-c", script])
        assert not planted.exists()
    finally:
        planted.unlink(missing_ok=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.decode().splitlines()
    assert lines[:2] == ["sandbox=bubblewrap", "rw-writable"], lines
    out = results(result.stdout)
    assert out["up"]["status"] == 200
    assert out["denied"]["status"] == 403 and out["denied"]["reason"] == "denylist"
    assert out["direct"]["status"] is None  # no network in the sandbox but the proxy
    assert [r["path"] for r in internet.requests] == ["/boxed"]
    assert peers(internet) == {ssh_lab.REMOTE_DIRECT}
    assert (writable / "made").exists()
    # without --sandbox the same request has the remote's own route
    unboxed = egressd_ssh(lab, remote_options(policy, remote_dns), probe(requests[-1]))
    assert results(unboxed.stdout)["direct"]["status"] == 200, unboxed.stderr


def test_remote_egress_sandbox_ends_when_ssh_drops(
    lab: SshLab, remote_dns: DnsServer, policy: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """--sandbox and SSH drops: the sandbox and what the command detached inside it end."""
    request.addfinalizer(lab.kill_sessions)
    tag = f"65.{os.getpid()}"
    marker = tmp_path / "marker"
    loop = f"sleep {tag} & while :; do echo x >> {marker}; sleep 0.1; done"
    script = f"setsid sh -c {shlex.quote(loop)} </dev/null >/dev/null 2>&1 & echo ready; exec sleep {tag}"
    options = remote_options(policy, remote_dns, "--sandbox", "--rw", str(tmp_path))
    with Running(ssh_argv(lab, options, ["sh", "-c", script])) as run:
        assert run.line() == "ready\n"
        wait_for(lambda: len(sleepers(tag)) == 2 and marker.exists(), "the command and its detached child")
        lab.drop_connections()
        assert run.finish(timeout=20) == 255
    wait_for(lambda: not sleepers(tag), "the sandboxed processes to end after SSH dropped", timeout=20)
    size = marker.stat().st_size
    time.sleep(0.3)
    assert marker.stat().st_size == size


def test_remote_egress_without_egressd_there_stops_before_running(
    lab: SshLab, policy: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    result = egressd_ssh(
        lab,
        ["--egress", "remote", "--remote-egressd", "/nonexistent/bin/egressd", "--policy", str(policy)],
        ["touch", str(marker)],
    )
    assert result.returncode == 2
    assert b"egressd is not installed on" in result.stderr
    assert b"--remote-egressd" in result.stderr
    assert not marker.exists()


# -- lifetimes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("what", ["remote sshd", "local ssh"])
@pytest.mark.parametrize("mode", ["relay", "remote egress"])
def test_ssh_drop_ends_what_the_command_detached(
    lab: SshLab,
    policy: Path,
    names: DnsServer,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    mode: str,
    what: str,
) -> None:
    """A child detached with setsid and one with a double fork: both end when SSH drops.

    They hold the proxy credentials; left running, a released forward port could be bound by
    another user of the remote host and receive their requests.
    """
    request.addfinalizer(lab.kill_sessions)
    marker, pids = tmp_path / "marker", tmp_path / "pids"
    loop = f"echo $$ >> {pids}; while :; do echo x >> {marker}; sleep 0.1; done"
    quiet = "</dev/null >/dev/null 2>&1"
    script = (
        f"setsid sh -c {shlex.quote(loop)} {quiet} & ( sh -c {shlex.quote(loop)} {quiet} & ); "
        f"echo ready; exec sleep 64.{os.getpid()}"
    )
    if mode == "relay":
        options = relay_options(policy, names)
    else:
        options = remote_options(policy, request.getfixturevalue("remote_dns"))
    with Running(ssh_argv(lab, options, ["sh", "-c", script])) as run:
        assert run.line() == "ready\n"
        wait_for(lambda: pids.exists() and len(pids.read_text().split()) == 2, "both detached children")
        detached = [int(pid) for pid in pids.read_text().split()]
        assert all(ssh_lab.cmdline(pid) for pid in detached)
        if what == "remote sshd":
            lab.drop_connections()
        else:
            [master] = ssh_lab.ssh_masters(ssh_lab.descendants(run.proc.pid))
            os.kill(master, signal.SIGKILL)
        assert run.finish(timeout=20) == 255
    wait_for(
        lambda: not [pid for pid in detached if ssh_lab.cmdline(pid)],
        "the detached children to end after SSH dropped",
        timeout=20,
    )
    wait_for(lambda: not sleepers(f"64.{os.getpid()}"), "the command to end after SSH dropped")
    size = marker.stat().st_size
    time.sleep(0.3)
    assert marker.stat().st_size == size  # nobody writes it any more


# -- small helpers -------------------------------------------------------------------------------
def _on_terminal(argv: Sequence[str], wait_for: bytes, keys: bytes) -> tuple[bytes, int]:
    """Run argv as the foreground job of a fresh terminal; type `keys` once `wait_for` appeared."""
    master, slave = os.openpty()
    proc = subprocess.Popen(["setsid", "--ctty", *argv], stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    output = b""
    typed = False
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    block = os.read(master, 4096)
                except OSError:  # EIO: every process holding the terminal is gone
                    block = b""
                if not block:
                    break
                output += block
            if not typed and wait_for in output:
                os.write(master, keys)
                typed = True
        return output, proc.wait(20)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
