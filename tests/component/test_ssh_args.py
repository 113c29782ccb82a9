"""The pure parts of `egressd ssh`: DESTINATION parsing, ssh command lines, remote scripts, channel.

The ssh command lines are golden: option order is part of their meaning (OpenSSH keeps the first
value of an option), so a change here must be deliberate. The remote sh snippets are run for real
with the local /bin/sh (they are plain POSIX sh), without ssh.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressd.policy import load_policy
from egressd.remote import scripts
from egressd.remote.channel import ChannelError, LineChannel, decode, encode, policy_message, read_policy
from egressd.remote.connection import control_directory
from egressd.remote.destination import Destination, DestinationError, parse_destination
from egressd.remote.sshargs import SshCommand, SshOptionError, check_ssh_option, option_name
from egressd.remote.supervise import accepted_status

CP = "/tmp/egressd-ssh-x/ctl"


# -- DESTINATION -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("build-box", Destination("build-box")),
        ("dev@10.0.0.5", Destination("10.0.0.5", "dev")),
        ("a@b@host", Destination("host", "a@b")),
        ("root@::1", Destination("::1", "root")),
        ("ssh://host", Destination("host")),
        ("ssh://ci@runner:2222", Destination("runner", "ci", 2222)),
        ("SSH://ci@runner:2222/", Destination("runner", "ci", 2222)),
        ("ssh://[2001:db8::1]:22", Destination("2001:db8::1", None, 22)),
        ("ssh://me@[2001:db8::1]", Destination("2001:db8::1", "me")),
        ("ssh://us%40er@h", Destination("h", "us@er")),
    ],
)
def test_destination_forms(text: str, expected: Destination) -> None:
    assert parse_destination(text) == expected


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty host"),
        ("-oProxyCommand=x", "must not start with '-'"),
        ("user@-oProxyCommand=x", "must not start with '-'"),
        ("-u@host", "must not start with '-'"),
        ("@host", "empty user"),
        ("host name", "whitespace"),
        ("host\n", "whitespace"),
        ("ssh://host:0", "port must be 1-65535"),
        ("ssh://host:70000", "port must be 1-65535"),
        ("ssh://host:22/path", "no path"),
        ("ssh://host?x=1", "no path"),
        ("ssh://2001:db8::1", "brackets"),
        ("ssh://[2001:db8::1", "unclosed"),
        ("ssh://[::1]x", "unexpected"),
        ("ssh://", "empty host"),
    ],
)
def test_destination_refusals(text: str, why: str) -> None:
    with pytest.raises(DestinationError, match=why.replace("(", r"\(")):
        parse_destination(text)


def test_destination_display_and_args() -> None:
    d = parse_destination("ssh://ci@[2001:db8::1]:2222")
    assert d.target == "ci@2001:db8::1"
    assert d.port_args == ["-p", "2222"]
    assert str(d) == "ssh://ci@[2001:db8::1]:2222"
    assert str(parse_destination("dev@box")) == "dev@box"


# -- --ssh-option --------------------------------------------------------------------------------
def test_ssh_options_checked() -> None:
    assert check_ssh_option("Port=2222") == "Port=2222"
    assert check_ssh_option("IdentityFile ~/.ssh/id") == "IdentityFile ~/.ssh/id"
    assert option_name("ServerAliveInterval=5") == "serveraliveinterval"
    assert check_ssh_option("ForwardAgent=no") == "ForwardAgent=no"  # off is what egressd forces anyway
    for bad, why in [
        ("Port", "expected KEY=VALUE"),
        ("-oPort=1", "expected KEY=VALUE"),
        ("ControlPath=/tmp/x", "manages ControlPath itself"),
        ("controlmaster=auto", "manages ControlMaster itself"),
        ('"RemoteForward" 1 2:3', "manages RemoteForward itself"),
        ("RemoteForward=1 2", "manages RemoteForward"),
        ("ForkAfterAuthentication yes", "manages"),
        ("Port=1\nProxyCommand=x", "line break"),
        ("ForwardAgent=yes", "never forwards the ssh agent"),
        ("forwardagent /tmp/agent.sock", "never forwards"),
        ("ForwardX11 yes", "never forwards"),
        ("ForwardX11Trusted=yes", "never forwards"),
        ("Tunnel=point-to-point", "never forwards"),
    ]:
        with pytest.raises(SshOptionError, match=why):
            check_ssh_option(bad)


# -- ssh command lines (golden) --------------------------------------------------------------------
NO_AUTHORITY_OPTS = [
    "-o", "ForwardAgent=no", "-o", "ForwardX11=no", "-o", "ForwardX11Trusted=no", "-o", "Tunnel=no",
]  # fmt: skip


def _cmd(*options: str, dest: str = "ssh://ci@runner:2222") -> SshCommand:
    return SshCommand(parse_destination(dest), CP, options)


def test_master_argv_forced_then_user_then_defaults() -> None:
    assert _cmd("Port=1", "ServerAliveInterval=5").master() == [
        "ssh", "-n", "-N", "-S", CP, "-a", "-x",
        "-o", "ControlMaster=yes", "-o", "ControlPersist=no",
        "-o", "ExitOnForwardFailure=yes", "-o", "ClearAllForwardings=yes",
        *NO_AUTHORITY_OPTS,
        "-o", "Port=1", "-o", "ServerAliveInterval=5",
        "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4", "-o", "ConnectTimeout=30",
        "-p", "2222", "--", "ci@runner",
    ]  # fmt: skip


MUX = [
    "ssh", "-S", CP, "-o", "ControlMaster=no", "-o", "ClearAllForwardings=yes", "-a", "-x",
    *NO_AUTHORITY_OPTS,
]  # fmt: skip


def test_control_argvs() -> None:
    cmd = _cmd(dest="box")
    assert cmd.check() == [*MUX, "-O", "check", "--", "box"]
    assert cmd.exit() == [*MUX, "-O", "exit", "--", "box"]
    # the one client that must not clear forwards (its own -R) reads no config file instead
    forwards = [("/tmp/d/http.sock", "127.0.0.1", 8080), ("/tmp/d/socks.sock", "::1", 1080)]
    assert cmd.forward_sockets(forwards) == [
        "ssh", "-F", "none", "-S", CP, "-o", "ControlMaster=no", "-O", "forward",
        "-R", "/tmp/d/http.sock:127.0.0.1:8080", "-R", "/tmp/d/socks.sock:[::1]:1080", "--", "box",
    ]  # fmt: skip
    for bad in ("/tmp/a:b/http.sock", "/tmp/a b/http.sock"):
        with pytest.raises(ValueError):
            cmd.forward_sockets([(bad, "127.0.0.1", 1)])


def test_session_and_helper_argvs() -> None:
    mux = MUX
    plain = _cmd("Port=1", dest="box")
    assert plain.session("CMD") == [*mux, "-T", "-e", "none", "-o", "Port=1", "--", "box", "CMD"]
    tty = _cmd("RequestTTY=yes", dest="box")
    assert tty.session("CMD") == [*mux, "-o", "RequestTTY=yes", "--", "box", "CMD"]
    # egressd's own helpers never get a tty, whatever the user asked for
    assert tty.helper("X") == [*mux, "-T", "-e", "none", "-o", "LogLevel=ERROR", "--", "box", "X"]


def test_control_directory_falls_back_to_tmp_when_tmpdir_is_too_deep(tmp_path: Path) -> None:
    short = tempfile.mkdtemp(prefix="e", dir="/tmp")
    deep = tmp_path / ("d" * 80)
    deep.mkdir()
    try:
        for base, parent in ((short, short), (str(deep), "/tmp")):
            made = control_directory(base)
            os.rmdir(made)
            assert os.path.dirname(made) == parent
            assert len(os.path.join(made, "ctl")) + 17 <= 103
    finally:
        os.rmdir(short)


# -- remote scripts, run with the local sh -------------------------------------------------------------
def _sh(
    line: str, *, input: bytes = b"", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:  # noqa: A002
    """Run a remote command line the way sshd does: `$SHELL -c LINE`."""
    return subprocess.run(["sh", "-c", line], input=input, capture_output=True, env=env, timeout=30)


def test_remote_command_is_one_shell_safe_line() -> None:
    line = scripts.remote_command('printf "%s|" "$@"', "a b", "it's", "$HOME", "; rm -rf /")
    assert "\n" not in line
    assert _sh(line).stdout == b"a b|it's|$HOME|; rm -rf /|"
    with pytest.raises(ValueError):
        scripts.remote_command("echo 'quoted'")


@pytest.fixture
def remote_tmp() -> Iterator[Path]:
    """A remote TMPDIR short enough for the session's sockets (SETUP passes a deeper one over)."""
    path = Path(tempfile.mkdtemp(prefix="egt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_setup_kill_cleanup_round_trip(remote_tmp: Path) -> None:
    env = {**os.environ, "TMPDIR": str(remote_tmp)}
    plan = scripts.session_plan({"HTTP_PROXY": "http://u:t@127.0.0.1:1"})
    done = _sh(scripts.remote_command(scripts.SETUP), input=plan.encode(), env=env)
    assert done.returncode == 0, done.stderr
    directory = scripts.parse_directory(done.stdout.decode())
    assert Path(directory).parent == remote_tmp
    assert oct(Path(directory).stat().st_mode & 0o777) == "0o700"
    assert oct((Path(directory) / "env").stat().st_mode & 0o777) == "0o600"
    assert (Path(directory) / "env").read_text() == plan
    # kill: the pid the guard recorded gets the signal
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        (Path(directory) / "pid").write_text(f"{sleeper.pid}\n")
        assert _sh(scripts.kill_command(directory, "TERM")).returncode == 0
        assert sleeper.wait(10) == -15
    finally:
        sleeper.kill()
    assert _sh(scripts.cleanup_command(directory)).returncode == 0
    assert not Path(directory).exists()


def test_setup_passes_over_a_tmpdir_too_deep_for_sockets(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 70)
    deep.mkdir()
    done = _sh(scripts.remote_command(scripts.SETUP), env={**os.environ, "TMPDIR": str(deep)})
    assert done.returncode == 0, done.stderr
    directory = scripts.parse_directory(done.stdout.decode())
    try:
        assert Path(directory).parent == Path("/tmp")
    finally:
        shutil.rmtree(directory)


def test_setup_removes_directories_of_sessions_that_are_gone(remote_tmp: Path) -> None:
    """An SSH drop leaves a session directory behind; the next set-up removes it, and only it."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    dirs = {name: remote_tmp / f"egressd-ssh.{name}" for name in ("gone", "live", "starting", "garbage")}
    for path in dirs.values():
        path.mkdir()
    (dirs["gone"] / "pid").write_text(f"{gone.pid}\n")
    (dirs["live"] / "pid").write_text(f"{os.getpid()}\n")
    (dirs["garbage"] / "pid").write_text("not a pid\n")
    done = _sh(scripts.remote_command(scripts.SETUP), env={**os.environ, "TMPDIR": str(remote_tmp)})
    assert done.returncode == 0, done.stderr
    left = {p.name.removeprefix("egressd-ssh.") for p in remote_tmp.iterdir()}
    assert {"live", "starting", "garbage"} <= left and "gone" not in left


@pytest.mark.parametrize(
    "output",
    ["", "/tmp/x\n", "relative/egressd-ssh.abc\n", "/tmp/egressd-ssh.\n", "/tmp/../etc/egressd-ssh.a\n",
     "/tmp/egressd-ssh.a b\n"],
)  # fmt: skip
def test_parse_directory_refuses_surprises(output: str) -> None:
    with pytest.raises(ValueError):
        scripts.parse_directory(output)


def test_parse_directory_skips_shell_noise() -> None:
    assert scripts.parse_directory("Welcome!\n/tmp/egressd-ssh.AbC123\n") == "/tmp/egressd-ssh.AbC123"


def test_session_plan_unsets_sets_and_names_files() -> None:
    plan = json.loads(
        scripts.session_plan(
            {"HTTP_PROXY": "http://a:b@127.0.0.1:\0http\0"},
            {"SSL_CERT_FILE": "ca.pem"},
            listen=[{"name": "http", "host": "127.0.0.1", "port": 0, "relay": "http.sock"}],
        )
    )
    assert {"http_proxy", "HTTP_PROXY", "no_proxy", "NO_PROXY"} <= set(plan["unset"])
    assert plan["set"] == {"HTTP_PROXY": "http://a:b@127.0.0.1:\0http\0"}
    assert plan["files"] == {"SSL_CERT_FILE": "ca.pem"}
    assert plan["listen"] == [{"name": "http", "host": "127.0.0.1", "port": 0, "relay": "http.sock"}]
    assert json.loads(scripts.session_plan(listen=[])) == {"listen": []}
    with pytest.raises(ValueError):
        scripts.session_plan({"BAD NAME": "x"})
    with pytest.raises(ValueError):
        scripts.session_plan({}, {"X": "../ca.pem"})


# -- the policy channel --------------------------------------------------------------------------------
def test_policy_round_trips_over_the_channel(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "version: 1\nmode: enforce\n"
        "allow: [up.test, '198.18.0.0/30', {host: api.test, paths: [/v1], methods: [GET]}]\n"
        "deny: [denied.test]\nloopback: {allow: false, ports: [8080]}\n"
        "resolver: {nameservers: ['127.0.0.1:5353']}\nprofiles: {narrow: {allow: [up.test]}}\n"
    )
    policy = load_policy(path)
    message = decode(encode(policy_message(policy, 7)))
    assert message["seq"] == 7
    received = read_policy(message)
    assert received == policy
    assert received.source == f"{path} (pushed over SSH)"
    # pushed again from the remote's point of view: the suffix is not repeated
    assert read_policy(policy_message(received, 8)).source == received.source


def test_channel_refuses_garbage() -> None:
    for line in (b"not json", b"[1]", b'{"no": "type"}'):
        with pytest.raises(ChannelError):
            decode(line)


def test_channel_closed_by_this_end_ends_a_waiting_receive_quietly() -> None:
    """The agent closes the channel while its listener thread waits in receive(): that is the end
    of the channel (None), never an error (`policy channel failed: Bad file descriptor`)."""
    for _ in range(300):
        mine, theirs = socket.socketpair()
        channel = LineChannel(mine)
        outcome: list[object] = []

        def listen(channel: LineChannel = channel, outcome: list[object] = outcome) -> None:
            try:
                outcome.append(channel.receive())
            except (OSError, ChannelError) as exc:
                outcome.append(exc)

        thread = threading.Thread(target=listen)
        thread.start()
        channel.close()
        thread.join(5)
        theirs.close()
        assert outcome == [None]


@pytest.mark.parametrize(
    ("reported", "accepted"),
    [
        (0, 0), (3, 3), (255, 255), (-signal.SIGTERM, -signal.SIGTERM), (-signal.SIGKILL, -signal.SIGKILL),
        (-signal.SIGSEGV, -signal.SIGSEGV), (-signal.SIGPIPE, -signal.SIGPIPE),
        (-signal.SIGSTOP, None), (-signal.SIGTSTP, None), (-signal.SIGTTIN, None), (-signal.SIGCONT, None),
        (-signal.SIGCHLD, None), (-signal.SIGWINCH, None), (-signal.SIGRTMIN, None), (-0, 0), (256, None),
        (-256, None), (10**30, None), (True, None), (1.0, None), ("0", None), (None, None), ([0], None),
    ],
)  # fmt: skip
def test_remote_exit_status_taken_only_when_ordinary(reported: object, accepted: int | None) -> None:
    """What egressd exits like (and so what it may do to itself) when the remote reports it."""
    assert accepted_status(reported) == accepted
