"""`egressd ssh` as users run it: not root on either end, with another user of the remote as attacker.

Three fresh users per run (unique names: other worktrees' runs never share them): the CLIENT runs
`egressd ssh` here, the REMOTE user is who it logs in as, and the ATTACKER is another user of the
remote host, who races in a tight loop to bind every port the remote command connects to, and
records whatever reaches it. Nothing that carries the command's traffic or credentials may reach
the attacker — whether egressd is killed with SIGKILL, its ssh is killed, the network drops, or
the remote egressd dies — and nothing of the run may be left on either end.

Needs root: it creates the users (useradd) and the lab's named network namespaces (see
tests/support/ssh_lab.py); the clients and remote commands themselves run as the unprivileged
users.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import ssh_lab
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD
from tests.support.ssh_lab import SshLab
from tests.support.ssh_session import POLICY, Running, listening, wait_for
from tests.support.unprivileged import User, unprivileged_user
from tests.support.upstreams import EchoHTTPServer

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.needs_root(
        "creates the users (useradd) and the lab's named network namespaces; the clients and the "
        "remote commands themselves run as those ordinary users"
    ),
]
pytest_plugins = ("tests.support.ssh_fixtures",)

# Sessions run at once per attack; each is one "run" of the attack. The remote-egress variants of
# the cuts are heavier (an egressd on both ends per session) and run fewer at once.
RUNS = 20
RUNS_REMOTE = 10
# Upper bounds only (a loaded machine is slow): a session's start, a client's end, a remote tree's end
START, END, GONE = 300, 120, 180

TOKEN = "Bearer sk-victim-credential-3f9a"

# The remote command: requests through its proxy variables in a loop, SIGHUP ignored (a job that
# ignores the hang-up is the hard case), once in the foreground and once detached with setsid.
# Prints its proxy ports first, then "ready" after its first answered request.
REQUESTER = r"""
import os, signal, sys, time, urllib.request
signal.signal(signal.SIGHUP, signal.SIG_IGN)
proxy = os.environ["HTTP_PROXY"]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy}))
request = urllib.request.Request(sys.argv[1], headers={"Authorization": sys.argv[2]})
ready = sys.argv[3] == "announce"
while True:
    try:
        with opener.open(request, timeout=2) as response:
            response.read()
        if ready:
            print("ready", flush=True)
            ready = False
    except Exception:
        pass
    time.sleep(0.05)
"""

# The attacker: binds each port the moment it can (127.0.0.1 and the wildcard, SO_REUSEADDR and
# SO_REUSEPORT), accepts, and prints one JSON line per port bound and per connection received.
ATTACKER = r"""
import json, select, socket, sys, time
ports = [int(p) for p in sys.argv[1].split(",")]
held = {}
def say(**event):
    print(json.dumps(event), flush=True)
while True:
    for port in ports:
        if port in held:
            continue
        for host in ("127.0.0.1", "0.0.0.0"):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                sock.bind((host, port))
                sock.listen(64)
            except OSError:
                sock.close()
                continue
            held[port] = sock
            say(event="bound", port=port, host=host)
            break
    ready = select.select(list(held.values()), [], [], 0.001)[0] if held else []
    if not held:
        time.sleep(0.001)
    for sock in ready:
        conn, _ = sock.accept()
        conn.settimeout(1)
        try:
            data = conn.recv(65536)
        except OSError:
            data = b""
        say(event="request", port=sock.getsockname()[1], data=data.decode("latin-1"))
        conn.close()
"""


@dataclass(frozen=True)
class Users:
    client: User
    remote: User
    attacker: User


@pytest.fixture(scope="module")
def users(lab: SshLab) -> Iterator[Users]:
    with unprivileged_user() as client, unprivileged_user() as remote, unprivileged_user() as attacker:
        remote.home.chmod(0o700)
        lab.allow_login(remote)
        yield Users(client, remote, attacker)


@pytest.fixture
def workdir(users: Users) -> Iterator[Path]:
    """The client user's own directory for this test: its policy, TMPDIR (short: the control
    socket lives there) and whatever else the test gives it."""
    path = Path(tempfile.mkdtemp(prefix="egu-", dir="/tmp"))
    users.client.own(path)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def policy(workdir: Path, users: Users) -> Path:
    path = workdir / "policy.yaml"
    path.write_text(POLICY)
    users.client.own(path)
    return path


def client_argv(
    lab: SshLab, users: Users, workdir: Path, options: Sequence[str], command: Sequence[str]
) -> list[str]:
    """`egressd ssh` run as the client user, in place (the pid is egressd's), with TMPDIR=workdir."""
    argv = [*EGRESSD, "ssh", *options, *lab.client_options(users.client)]
    argv += [lab.destination_of(users.remote), "--", *command]
    return users.client.exec(argv, client_env(users, workdir))


def client_env(users: Users, workdir: Path) -> dict[str, str]:
    return users.client.env({"TMPDIR": str(workdir)})


def run_client(
    lab: SshLab, users: Users, workdir: Path, options: Sequence[str], command: Sequence[str]
) -> subprocess.CompletedProcess[bytes]:
    argv = client_argv(lab, users, workdir, options, command)
    return subprocess.run(
        argv, env=client_env(users, workdir), capture_output=True, timeout=90, stdin=subprocess.DEVNULL
    )


def remote_processes(users: Users) -> list[int]:
    """The remote user's processes: its sessions run nothing else."""
    return users.remote.processes()


def ports_of(proxy_url: str) -> int:
    return int(proxy_url.strip().rpartition(":")[2])


class Attacker:
    """The attacker's process in the remote namespace, racing for `ports`."""

    def __init__(self, lab: SshLab, user: User, ports: Sequence[int], unused: Sequence[int]) -> None:
        self.unused = list(unused)
        self.proc = lab.run_as(
            user,
            "python3",
            "-c",
            ATTACKER,
            ",".join(map(str, ports)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

    def stop(self) -> list[dict[str, object]]:
        self.proc.terminate()
        out, err = self.proc.communicate(timeout=20)
        assert self.proc.returncode in (0, -signal.SIGTERM), err
        return [json.loads(line) for line in out.decode().splitlines()]

    def check_after(self, ends: Callable[[], None], users: Users) -> None:
        """Race on while `ends()` waits for the clients and until the remote user's processes are
        gone, and a little longer (the freed ports are the attacker's then: anything left of a run
        would call); then nothing may have reached the attacker. That is checked first: a leak is
        the worse failure, and a run that never ends leaks the longest."""
        failure: Exception | None = None
        try:
            ends()
            wait_remote_gone(users, timeout=GONE)
            time.sleep(0.5)
        except (AssertionError, subprocess.TimeoutExpired) as exc:
            failure = exc
        finally:
            events = self.stop()
        received = [event for event in events if event["event"] == "request"]
        assert received == [], f"the attacker received {len(received)} connections: {received[:3]}"
        if failure is not None:
            raise failure
        # and it was racing all along: the unused ports (no connection ever made to them, so no
        # TIME_WAIT keeps them for a minute) it had once they were freed
        bound = {event["port"] for event in events if event["event"] == "bound"}
        assert bound >= set(self.unused), f"the attacker never bound {sorted(set(self.unused) - bound)}"


@contextmanager
def sessions(
    lab: SshLab, users: Users, workdir: Path, options: Sequence[str], url: str, count: int
) -> Iterator[list[tuple[Running, list[int]]]]:
    """`count` clients at once, each running REQUESTER in the foreground and detached; yields
    each client with the remote ports its command connects to, once all of them are answered."""
    script = (
        'printf "%s %s\\n" "$HTTP_PROXY" "$EGRESSD_SOCKS_PROXY"; '
        f"setsid python3 -c {shlex.quote(REQUESTER)} {url} {shlex.quote(TOKEN)} quiet "
        "</dev/null >/dev/null 2>&1 & "
        f"exec python3 -c {shlex.quote(REQUESTER)} {url} {shlex.quote(TOKEN)} announce"
    )
    with ExitStack() as stack:
        runs = []
        for _ in range(count):
            argv = client_argv(lab, users, workdir, options, ["sh", "-c", script])
            runs.append(stack.enter_context(Running(argv, env=client_env(users, workdir))))
        started = []
        for run in runs:
            http, socks = run.line(timeout=START).split()
            assert run.line(timeout=START) == "ready\n", run.stderr
            started.append((run, [ports_of(http), ports_of(socks)]))
        yield started


def wait_remote_gone(users: Users, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while left := remote_processes(users):
        if time.monotonic() > deadline:
            names = [" ".join(ssh_lab.cmdline(pid))[:80] for pid in left]
            raise AssertionError(f"the remote user's processes did not end: {names}")
        time.sleep(0.05)


# -- the port the command connects to is never another user's, and nothing is left ------------------
def _kill_egressd(runs: list[tuple[Running, list[int]]], lab: SshLab) -> None:
    for run, _ in runs:
        run.proc.kill()


def _kill_ssh(runs: list[tuple[Running, list[int]]], lab: SshLab) -> None:
    for run, _ in runs:
        [master] = ssh_lab.ssh_masters(ssh_lab.descendants(run.proc.pid))
        os.kill(master, signal.SIGKILL)


def _drop_network(runs: list[tuple[Running, list[int]]], lab: SshLab) -> None:
    """The link goes down: each client notices (ServerAlive) and exits; the remote's sshd does
    not, and the commands run on, cut off, for as long as the network is down (the attacker races
    meanwhile). The network comes back: sshd hears that the client's end is gone, and the guards
    end their sessions."""
    lab.link_down()
    for run, _ in runs:
        assert run.proc.wait(timeout=END) == 255, run.stderr
    # back soon: TCP's retransmission back-off decides when sshd hears of it
    lab.link_up()


@pytest.mark.parametrize(
    "disrupt",
    [_kill_egressd, _kill_ssh, _drop_network],
    ids=["kill -9 egressd", "kill -9 ssh", "network drop"],
)
@pytest.mark.parametrize("mode", ["relay", "remote egress", "remote egress --sandbox"])
def test_port_is_never_another_users_and_nothing_is_left(
    lab: SshLab,
    users: Users,
    workdir: Path,
    policy: Path,
    names: DnsServer,
    internet: EchoHTTPServer,
    mode: str,
    disrupt: Callable[[list[tuple[Running, list[int]]], SshLab], None],
    request: pytest.FixtureRequest,
) -> None:
    """RUNS sessions at once (RUNS_REMOTE in remote-egress mode); each command keeps requesting
    through its proxy port, ignoring SIGHUP, one copy detached. The run is cut; the attacker,
    racing to bind every one of those ports from before the cut, receives nothing, and nothing of
    any run is left afterwards, on either end. (In the sandbox the proxy's port is in the
    command's own network namespace, out of the attacker's reach anyway: there what counts is that
    nothing is left.)"""
    request.addfinalizer(lab.link_up)
    if mode == "relay":
        options = ["--policy", str(policy), "--nameserver", names.nameserver]
    else:
        request.getfixturevalue("routed")
        remote_dns = request.getfixturevalue("remote_dns")
        options = ["--egress", "remote", "--remote-egressd", ssh_lab.remote_egressd()]
        options += ["--policy", str(policy), "--nameserver", remote_dns.nameserver]
        options += ["--sandbox"] if mode.endswith("--sandbox") else []
    options += ["--ssh-option", "ServerAliveInterval=1", "--ssh-option", "ServerAliveCountMax=2"]
    url = f"http://up.test:{internet.port}/victim"
    count = RUNS if mode == "relay" else RUNS_REMOTE
    with sessions(lab, users, workdir, options, url, count) as runs:
        ports = [port for _, pair in runs for port in pair]
        attacker = Attacker(lab, users.attacker, ports, [socks for _, (_, socks) in runs])
        time.sleep(0.3)  # racing (and failing: the ports are held) before the cut
        served = len(internet.requests)
        disrupt(runs, lab)

        def ends() -> None:
            for run, _ in runs:
                returncode = run.proc.wait(timeout=END)
                if disrupt is not _kill_egressd:
                    assert returncode == 255, run.stderr
                    assert "was lost" in run.stderr, run.stderr

        attacker.check_after(ends, users)
    assert served >= count  # every command was being answered until the cut
    assert all(TOKEN in r["headers"].get("authorization", "") for r in internet.requests)
    # nothing left on the client either: no ssh, no control directory
    wait_for(lambda: not users.client.processes(), "the client user's processes to end", timeout=END)
    left = {path: sorted(os.listdir(path)) for path in workdir.glob("egressd-ssh-*")}
    assert not left, (left, [run.stderr for run, _ in runs if run.stderr])
    assert lab.remote_tmp is not None
    assert not [p for p in lab.remote_tmp.iterdir() if p.owner() == users.remote.name]


def test_unprivileged_relay_and_remote_egress_work_end_to_end(
    lab: SshLab,
    users: Users,
    workdir: Path,
    policy: Path,
    names: DnsServer,
    remote_dns: DnsServer,
    routed: None,
    internet: EchoHTTPServer,
) -> None:
    """The basics, as ordinary users on both ends: a request through each mode is decided and
    answered, and the remote command runs as the remote user."""
    url = f"http://up.test:{internet.port}"
    command = ["sh", "-c", f'id -un; curl -sS -o /dev/null -w "%{{http_code}}\\n" {url}/$1', "sh"]
    relay_options = ["--policy", str(policy), "--nameserver", names.nameserver]
    relay = run_client(lab, users, workdir, relay_options, [*command, "r"])
    assert relay.returncode == 0, relay.stderr
    assert relay.stdout.decode().split() == [users.remote.name, "200"]
    remote = ["--egress", "remote", "--remote-egressd", ssh_lab.remote_egressd()]
    remote += ["--policy", str(policy), "--nameserver", remote_dns.nameserver, "--trace"]
    egress = run_client(lab, users, workdir, remote, [*command, "e"])
    assert egress.returncode == 0, egress.stderr
    assert egress.stdout.decode().split() == [users.remote.name, "200"]
    assert sorted(r["path"] for r in internet.requests) == ["/e", "/r"]
    # the end of a --trace run is quiet: the agent's policy channel closes without an error
    assert b"policy channel failed" not in egress.stderr, egress.stderr


# -- remote egress: the agent's death ends the run, and its ports are never another user's -----------
def test_remote_egress_agent_killed_ends_the_command_and_keeps_its_ports(
    lab: SshLab,
    users: Users,
    workdir: Path,
    policy: Path,
    remote_dns: DnsServer,
    routed: None,
    internet: EchoHTTPServer,
) -> None:
    """SIGKILL to each remote `egressd remote-agent run` (as the OOM killer or a crash would end
    it): the command dies with it, the guard ends what it detached, the client says so and exits,
    and the attacker racing for the proxy's ports receives nothing."""
    options = ["--egress", "remote", "--remote-egressd", ssh_lab.remote_egressd()]
    options += ["--policy", str(policy), "--nameserver", remote_dns.nameserver]
    url = f"http://up.test:{internet.port}/victim"
    with sessions(lab, users, workdir, options, url, RUNS) as runs:
        ports = [port for _, pair in runs for port in pair]
        agents = [
            pid for pid in remote_processes(users) if ssh_lab.cmdline(pid)[3:5] == ["remote-agent", "run"]
        ]
        assert len(agents) == RUNS, [ssh_lab.cmdline(pid) for pid in remote_processes(users)]
        attacker = Attacker(lab, users.attacker, ports, [socks for _, (_, socks) in runs])
        time.sleep(0.3)
        served = len(internet.requests)
        for pid in agents:
            os.kill(pid, signal.SIGKILL)

        def ends() -> None:
            for run, _ in runs:
                assert run.proc.wait(timeout=END) == 255, run.stderr
                assert "ended without saying how the command ended" in run.stderr, run.stderr

        attacker.check_after(ends, users)
    assert served >= RUNS
    wait_for(lambda: not users.client.processes(), "the client user's processes to end", timeout=END)
    assert not list(workdir.glob("egressd-ssh-*"))
    assert lab.remote_tmp is not None
    assert not [p for p in lab.remote_tmp.iterdir() if p.owner() == users.remote.name]


# -- no forward but egressd's own ------------------------------------------------------------------
CONNECTS = r"""
import socket, sys
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=3).close()
    print("open", flush=True)
except OSError:
    print("closed", flush=True)
"""


@pytest.mark.parametrize("kind", ["RemoteForward", "LocalForward", "DynamicForward"])
def test_forwards_in_the_users_ssh_config_are_not_opened(
    lab: SshLab, users: Users, workdir: Path, policy: Path, names: DnsServer, kind: str
) -> None:
    """A forward in the client user's ~/.ssh/config would be a path the policy never decides (a
    RemoteForward to this machine's loopback service, which the relay refuses as loopback_disabled).
    The master and every multiplexed client clear them: none is open while the command runs."""
    service = EchoHTTPServer("127.0.0.1", name="client-loopback-service").start()
    try:
        port = _free_port()
        spec = {
            "RemoteForward": f"127.0.0.1:{port} 127.0.0.1:{service.port}",
            "LocalForward": f"127.0.0.1:{port} 127.0.0.1:22",
            "DynamicForward": f"127.0.0.1:{port}",
        }[kind]
        config = users.client.home / ".ssh" / "config"
        lab.client_options(users.client)  # creates ~/.ssh
        config.write_text(f"Host *\n    {kind} {spec}\n")
        users.client.own(config)
        script = f"python3 -c {shlex.quote(CONNECTS)} {port}; read _done"
        options = ["--policy", str(policy), "--nameserver", names.nameserver]
        argv = client_argv(lab, users, workdir, options, ["sh", "-c", script])
        with Running(argv, env=client_env(users, workdir)) as run:
            assert run.line() == "closed\n", run.stderr  # nothing on the remote's side
            assert not listening(port)  # nor on this side
            run.send(b"done\n")
            assert run.finish() == 0, run.stderr
        assert service.requests == []
    finally:
        service.stop()
        (users.client.home / ".ssh" / "config").unlink(missing_ok=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- a compromised remote does not steer the client ------------------------------------------------
FAKE_EGRESSD = r"""
import json, sys, time
CONTROL = "\x1b]0;owned\x07\x1b[2J\x1b[31m\u202e"
args = sys.argv[1:]
broken = args[:1] == ["broken"]
args = args[1:] if broken else args
if args == ["--version"]:
    if broken:
        sys.stderr.write(CONTROL + "no egressd here\n")
        sys.exit(1)
    print("egressd 9.9.9 (fake)")
elif args[:2] == ["remote-agent", "feed"]:
    print(json.dumps({"type": "listening"}), flush=True)
    seq = json.loads(sys.stdin.readline())["seq"]
    print(json.dumps({"type": "rejected", "seq": seq, "error": CONTROL + "refused"}), flush=True)
    print(json.dumps({"type": "exit", "returncode": -19}), flush=True)  # SIGSTOP
    sys.stdin.read()
elif args[:2] == ["remote-agent", "guard"]:
    time.sleep(1)
    sys.exit(3)
"""


@pytest.mark.parametrize("variant", ["speaks", "broken"])
def test_a_compromised_remote_cannot_stop_the_client_or_drive_its_terminal(
    lab: SshLab, users: Users, workdir: Path, policy: Path, variant: str
) -> None:
    """The remote egressd is the remote's: a compromised one reports SIGSTOP as the command's
    status (egressd would stop itself) and writes escape sequences in what egressd prints. Only
    0-255 and terminating signals are taken; what the remote sends is printed with its control
    characters escaped."""
    fake = users.remote.home / "fake_egressd.py"
    fake.write_text(FAKE_EGRESSD)
    users.remote.own(fake)
    remote = f"python3 {fake}" + (" broken" if variant == "broken" else "")
    options = ["--egress", "remote", "--remote-egressd", remote, "--policy", str(policy)]
    done = run_client(lab, users, workdir, options, ["true"])  # a stopped client would time out here
    stderr = done.stderr.decode(errors="replace")
    assert not any(ch in stderr for ch in "\x1b\x07\u202e"), stderr
    if variant == "broken":
        assert done.returncode == 2, stderr
        assert "egressd is not installed on" in stderr and "\\x1b]0;owned" in stderr, stderr
    else:
        assert done.returncode == 3, stderr  # the session's own status, not the reported SIGSTOP
        assert "refused the policy" in stderr and "\\x1b[31m" in stderr, stderr
        assert "reported an exit status egressd does not take (-19)" in stderr, stderr


def test_relay_without_python3_on_the_remote_runs_nothing(
    lab: SshLab, users: Users, workdir: Path, policy: Path, names: DnsServer, tmp_path: Path
) -> None:
    """The guard needs the remote's python3: without it, egressd says so and runs nothing (the
    command would connect to a port nobody holds when the session ends)."""
    tools = users.remote.home / "bin"
    tools.mkdir()
    for tool in ("sh", "cat", "mktemp", "rm", "printf", "touch", "kill", "sleep"):
        found = shutil.which(tool)
        if found:
            (tools / tool).symlink_to(found)
    environment = users.remote.home / ".ssh" / "environment"
    environment.write_text(f"PATH={tools}\n")
    for path in (tools, environment):
        users.remote.own(path)
    marker = users.remote.home / "ran"
    try:
        options = ["--policy", str(policy), "--nameserver", names.nameserver]
        done = run_client(lab, users, workdir, options, ["touch", str(marker)])
    finally:
        environment.unlink()
        shutil.rmtree(tools)
    assert done.returncode == 2, done.stderr
    assert b"relay mode needs python3" in done.stderr and b"--egress remote" in done.stderr
    assert not marker.exists()


# -- the remote sandbox masks the remote home, as the local sandbox masks yours ---------------------------
def test_remote_sandbox_masks_the_remote_home(
    lab: SshLab, users: Users, workdir: Path, policy: Path, remote_dns: DnsServer, tmp_path: Path
) -> None:
    """`egressd ssh --egress remote --sandbox` as an ordinary user: the command starts in the
    remote home, which is empty but for the harmless configuration and what --show names (all
    read-only); --rw paths are writable, --hide hides one more path."""
    home = users.remote.home
    users.remote.write(".bash_history", "export TOKEN=secret-history\n")
    users.remote.write(".gitconfig", "[user]\n\tname = remote\n", 0o644)
    users.remote.write("notes.txt", "shown notes\n")
    project = users.remote.mkdir("project")
    users.remote.write("project/private.key", "project secret\n")
    script = (
        'pwd; ls -A; cat .bash_history 2>/dev/null || echo "history hidden"; cat notes.txt; '
        "cat project/private.key 2>/dev/null || echo 'key hidden'; "
        "touch planted 2>/dev/null && echo planted || echo 'home read-only'; "
        "touch project/made && echo 'project writable'"
    )
    options = ["--egress", "remote", "--remote-egressd", ssh_lab.remote_egressd()]
    options += ["--policy", str(policy), "--nameserver", remote_dns.nameserver, "--sandbox"]
    options += ["--rw", str(project), "--show", "~/notes.txt", "--hide", str(project / "private.key")]
    done = run_client(lab, users, workdir, options, ["sh", "-c", script])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.decode().splitlines()
    assert lines[0] == str(home)
    assert lines[1:] == [
        ".gitconfig", "notes.txt", "project", "history hidden", "shown notes", "key hidden", "home read-only",
        "project writable",
    ], lines  # fmt: skip
    assert (project / "made").exists() and not (home / "planted").exists()
