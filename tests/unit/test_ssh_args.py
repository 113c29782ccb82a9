"""The pure parts of `egressd ssh`: DESTINATION parsing, ssh command lines, remote scripts, channel.

The ssh command lines are golden: option order is part of their meaning (OpenSSH keeps the first
value of an option), so a change here must be deliberate. The remote sh snippets are run for real
with the local /bin/sh (they are plain POSIX sh), without ssh.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from egressd.policy import load_policy
from egressd.remote import reaper, scripts
from egressd.remote.channel import ChannelError, decode, encode, policy_message, read_policy
from egressd.remote.connection import control_directory
from egressd.remote.destination import Destination, DestinationError, parse_destination
from egressd.remote.relay import exposed_listeners
from egressd.remote.sshargs import SshCommand, SshOptionError, check_ssh_option, option_name, requests_tty

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
        ("controlmaster=auto", "manages controlmaster itself"),
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


def test_requests_tty() -> None:
    assert requests_tty(["RequestTTY=yes"]) and requests_tty(["requesttty force"])
    assert not requests_tty(["RequestTTY=no"]) and not requests_tty(["Port=22"])


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


def test_control_argvs() -> None:
    cmd = _cmd(dest="box")
    mux = ["ssh", "-S", CP, "-o", "ControlMaster=no", "-a", "-x", *NO_AUTHORITY_OPTS]
    assert cmd.check() == [*mux, "-O", "check", "--", "box"]
    assert cmd.exit() == [*mux, "-O", "exit", "--", "box"]
    assert cmd.forward_remote("127.0.0.1", 8080) == [
        *mux,
        "-O",
        "forward",
        "-R",
        "127.0.0.1:0:127.0.0.1:8080",
        "--",
        "box",
    ]
    assert cmd.forward_remote("::1", 8080)[-3] == "127.0.0.1:0:[::1]:8080"


def test_session_and_helper_argvs() -> None:
    mux = ["ssh", "-S", CP, "-o", "ControlMaster=no", "-a", "-x", *NO_AUTHORITY_OPTS]
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


def test_setup_wrapper_kill_cleanup_round_trip(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path), "HTTP_PROXY": "http://inherited:1", "no_proxy": "*"}
    env_text = scripts.env_file(
        {"HTTP_PROXY": "http://u:t0k'en@127.0.0.1:4242", "NO_PROXY": ""}, {"SSL_CERT_FILE": "ca.pem"}
    )
    done = _sh(scripts.remote_command(scripts.SETUP), input=env_text.encode(), env=env)
    assert done.returncode == 0, done.stderr
    directory = scripts.parse_directory(done.stdout.decode())
    assert Path(directory).parent == tmp_path
    assert oct(Path(directory).stat().st_mode & 0o777) == "0o700"
    assert oct((Path(directory) / "env").stat().st_mode & 0o777) == "0o600"
    # the wrapper: pid recorded, environment taken (inherited proxy settings gone), env file deleted
    show = ["sh", "-c", 'echo "$$ $HTTP_PROXY|${no_proxy-unset}|$NO_PROXY|$SSL_CERT_FILE"']
    run = _sh(scripts.wrapped(directory, show), env=env)
    pid, rest = run.stdout.decode().strip().split(" ", 1)
    assert rest == f"http://u:t0k'en@127.0.0.1:4242|unset||{directory}/ca.pem"
    assert (Path(directory) / "pid").read_text().strip() == pid
    assert not (Path(directory) / "env").exists()
    # kill: the recorded pid gets the signal
    (Path(directory) / "env").write_text("")
    sleeper = subprocess.Popen(["sh", "-c", scripts.wrapped(directory, ["sleep", "30"])], env=env)
    try:
        for _ in range(100):
            if (Path(directory) / "pid").read_text().strip() == str(sleeper.pid):
                break
            subprocess.run(["sleep", "0.05"])
        assert _sh(scripts.kill_command(directory, "TERM")).returncode == 0
        assert sleeper.wait(10) == -15
    finally:
        sleeper.kill()
    assert _sh(scripts.cleanup_command(directory)).returncode == 0
    assert not Path(directory).exists()


def test_setup_removes_directories_of_sessions_that_are_gone(tmp_path: Path) -> None:
    """An SSH drop leaves a session directory behind; the next set-up removes it, and only it."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    dirs = {name: tmp_path / f"egressd-ssh.{name}" for name in ("gone", "live", "starting", "garbage")}
    for path in dirs.values():
        path.mkdir()
    (dirs["gone"] / "pid").write_text(f"{gone.pid}\n")
    (dirs["live"] / "pid").write_text(f"{os.getpid()}\n")
    (dirs["garbage"] / "pid").write_text("not a pid\n")
    done = _sh(scripts.remote_command(scripts.SETUP), env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    left = {p.name.removeprefix("egressd-ssh.") for p in tmp_path.iterdir()}
    assert {"live", "starting", "garbage"} <= left and "gone" not in left


def test_wrapper_refuses_to_run_without_its_environment(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "egressd-ssh.x").mkdir()
    done = _sh(scripts.wrapped(str(tmp_path / "egressd-ssh.x"), ["touch", str(marker)]))
    assert done.returncode != 0 and not marker.exists()


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


def test_env_file_quotes_and_unsets() -> None:
    text = scripts.env_file({"HTTP_PROXY": "http://a:b@127.0.0.1:1"})
    first, second = text.splitlines()
    assert first.startswith("unset ") and {"http_proxy", "HTTP_PROXY", "no_proxy", "NO_PROXY"} <= set(
        first.split()
    )
    assert shlex.split(second) == ["export", "HTTP_PROXY=http://a:b@127.0.0.1:1"]
    with pytest.raises(ValueError):
        scripts.env_file({"BAD NAME": "x"})
    with pytest.raises(ValueError):
        scripts.env_file({}, {"X": "../ca.pem"})


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


PROC_NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:A000 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1
   1: 00000000:A001 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2 1
   2: 020012C6:A002 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 3 1
   3: 0100007F:A003 0100007F:9000 01 00000000:00000000 00:00000000 00000000     0        0 4 1
  sl  local_address                         remote_address                        st
   0: 00000000000000000000000001000000:A004 00000000000000000000000000000000:0000 0A
   1: 0000000000000000FFFF00000100007F:A005 00000000000000000000000000000000:0000 0A
   2: 00000000000000000000000000000000:A006 00000000000000000000000000000000:0000 0A
"""


def test_exposed_listeners_reads_proc_net_tcp() -> None:
    """Loopback binds (127.0.0.1, ::1, ::ffff:127.0.0.1) are fine; a wildcard or LAN bind is not."""
    ports = range(0xA000, 0xA007)
    assert exposed_listeners(PROC_NET_TCP, ports) == ["0.0.0.0:40961", "198.18.0.2:40962", "[::]:40966"]
    assert exposed_listeners(PROC_NET_TCP, [0xA000, 0xA003, 0xA004, 0xA005]) == []


def test_relay_wrapper_runs_the_command_under_the_reaper(tmp_path: Path) -> None:
    """With python3: the command's pid is recorded, its status passes through, and a child it
    detached is ended when it exits. Without python3: it still runs, and stderr says what is lost."""
    directory = tmp_path / "egressd-ssh.x"
    directory.mkdir()
    (directory / "reaper.py").write_bytes(Path(reaper.__file__).read_bytes())
    pids = tmp_path / "pids"
    detach = f"setsid sh -c 'echo $$ >> {pids}; exec sleep 30' </dev/null >/dev/null 2>&1 &"
    command = ["sh", "-c", f'{detach} echo "$$"; while [ ! -s {pids} ]; do sleep 0.05; done; exit 3']
    (directory / "env").write_text("")
    done = _sh(scripts.relay_wrapped(str(directory), command))
    assert done.returncode == 3, done.stderr
    assert (directory / "pid").read_text().strip() == done.stdout.decode().strip()
    assert not Path(f"/proc/{pids.read_text().strip()}").exists()  # ended and reaped by the reaper
    # no python3 on PATH: the plain wrapper, with a warning
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "rm", "echo", "printf"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    (directory / "env").write_text("")
    done = _sh(scripts.relay_wrapped(str(directory), ["sh", "-c", "exit 4"]), env={"PATH": str(bin_dir)})
    assert done.returncode == 4
    assert b"no python3 here" in done.stderr
