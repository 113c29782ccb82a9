"""The remote session's guard (egressd/remote/reaper.py), run here as the remote runs it.

In relay mode the remote's own python3 runs it (`python3 -I -S reaper.py DIR CMD...`); in remote
egress mode `egressd remote-agent guard`. No sshd is needed: a plain parent process stands in for
sshd's session process, and a Unix socket server for sshd's end of the reverse forward.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressd.remote import reaper, scripts
from tests.support.ssh_session import wait_for

PYTHON3 = shutil.which("python3") or sys.executable


@pytest.fixture
def session(tmp_path: Path) -> Path:
    """A session directory as SETUP makes it (short: Unix sockets live inside)."""
    directory = Path(os.path.realpath(tmp_path)) / "egressd-ssh.t"
    if len(str(directory)) > 60:
        directory = Path(f"/tmp/egressd-ssh.t{os.getpid()}")
    directory.mkdir(mode=0o700)
    (directory / scripts.REAPER_NAME).write_bytes(Path(reaper.__file__).read_bytes())
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def guard_argv(directory: Path, *command: str) -> list[str]:
    return [PYTHON3, "-I", "-S", str(directory / scripts.REAPER_NAME), str(directory), *command]


def write_plan(directory: Path, plan: str) -> None:
    path = directory / scripts.PLAN_NAME
    path.write_text(plan)
    path.chmod(0o600)


class _Answer(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        self.server.connections += 1  # type: ignore[attr-defined]
        self.wfile.write(b"got " + self.rfile.readline())


class UnixEcho(socketserver.ThreadingUnixStreamServer):
    """sshd's end of the reverse forward: a Unix socket that answers each line with `got LINE`."""

    daemon_threads = True

    def __init__(self, path: Path) -> None:
        super().__init__(str(path), _Answer)
        self.connections = 0
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()


@pytest.fixture
def echo(session: Path) -> Iterator[UnixEcho]:
    server = UnixEcho(session / "http.sock")
    yield server
    server.close()


CLIENT = r"""
import os, socket, sys
port = int(os.environ["HTTP_PROXY"].rpartition(":")[2])
with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
    conn.sendall(b"hello\n")
    print(conn.makefile().readline().strip(), os.environ["HTTP_PROXY"].partition("@")[0],
          os.environ.get("http_proxy", "unset"), os.environ["SSL_CERT_FILE"], flush=True)
sys.exit(7)
"""


def test_guard_relays_its_own_port_to_the_forward_and_passes_the_status(
    session: Path, echo: UnixEcho
) -> None:
    """The command's proxy variables name the guard's loopback port (filled in where the plan
    marks it), the guard relays each connection to the Unix socket, and the command's exit status
    is the session's. The session directory is gone when the guard is."""
    plan = scripts.session_plan(
        {"HTTP_PROXY": f"http://u:tok@127.0.0.1:{reaper.port_mark('http')}"},
        {"SSL_CERT_FILE": "ca.pem"},
        listen=[{"name": "http", "host": "127.0.0.1", "port": 0, "relay": "http.sock"}],
    )
    write_plan(session, plan)
    env = {**os.environ, "http_proxy": "http://inherited:1"}
    done = subprocess.run(
        guard_argv(session, PYTHON3, "-c", CLIENT), capture_output=True, text=True, timeout=30, env=env
    )
    assert done.returncode == 7, done.stderr
    assert done.stdout.split() == ["got", "hello", "http://u:tok", "unset", f"{session}/ca.pem"]
    assert echo.connections == 1
    assert not session.exists()  # the plan (the credentials) with it


def test_guard_runs_nothing_without_a_plan(session: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    done = subprocess.run(guard_argv(session, "touch", str(marker)), capture_output=True, timeout=30)
    assert done.returncode == 2
    assert b"cannot start the session" in done.stderr
    assert not marker.exists()


# A command that holds on: ignores SIGHUP, detaches a copy with setsid, and marks a file while alive.
STUBBORN = r"""
import os, signal, sys, time
signal.signal(signal.SIGHUP, signal.SIG_IGN)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        with open(sys.argv[2], "w") as out:
            out.write(str(os.getpid()))
        while True:
            with open(sys.argv[1], "a") as out:
                out.write("x")
            time.sleep(0.05)
    os._exit(0)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_guard_holds_the_port_until_the_tree_is_gone_when_the_session_ends(
    session: Path, echo: UnixEcho, tmp_path: Path
) -> None:
    """sshd's session process dies (SIGKILL here): the guard hears it (its parent-death signal),
    stops relaying, and hangs up the tree — a detached child that ignores SIGHUP included, killed
    after the grace. The port stays the guard's until nothing of the tree is left."""
    marker, detached = tmp_path / "alive", tmp_path / "detached"
    write_plan(
        session,
        scripts.session_plan(
            {"HTTP_PROXY": f"http://u:t@127.0.0.1:{reaper.port_mark('http')}"},
            listen=[{"name": "http", "host": "127.0.0.1", "port": 0, "relay": "http.sock"}],
        ),
    )
    # the stand-in for sshd's session process: the guard is its child
    parent = subprocess.Popen(
        [
            "sh",
            "-c",
            'printf "%s\\n" "$$"; "$@"; sleep 60',
            "sh",
            *guard_argv(session, PYTHON3, "-c", STUBBORN, str(marker), str(detached)),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        parent.stdout.readline()
        assert parent.stdout.readline() == "ready\n"
        wait_for(lambda: marker.exists() and marker.stat().st_size > 0, "the detached child")
        guard = _guard_pid(session)
        tree = [int((session / scripts.PID_NAME).read_text()), int(detached.read_text())]
        port = _listening_port(guard)
        assert not _bindable(port)
        parent.kill()
        parent.wait()
        ended = time.monotonic()
        while any(_alive(pid) for pid in tree):
            assert not _bindable(port), "the port was free while the guard's tree still ran"
            assert time.monotonic() - ended < reaper.HANGUP_GRACE + 10
            time.sleep(0.01)
        wait_for(lambda: not _alive(guard), "the guard to exit")
        assert _bindable(port)
        size = marker.stat().st_size
        time.sleep(0.3)
        assert marker.stat().st_size == size  # the detached child is gone too
        assert not session.exists()  # the session directory went with it
    finally:
        parent.kill()


def test_guard_hands_its_sockets_to_the_agent_and_outlives_it(session: Path, tmp_path: Path) -> None:
    """Remote egress: the guard binds the proxy's ports and hands them to its child (LISTEN_FDS);
    when that child is killed, the ports stay held until what it left behind has ended, and the
    guard dies like the child did."""
    write_plan(
        session,
        scripts.session_plan(
            listen=[
                {"name": "http", "host": "127.0.0.1", "port": 0},
                {"name": "socks", "host": "127.0.0.1", "port": 0},
            ]
        ),
    )
    agent = r"""
import os, socket, subprocess, sys
names = os.environ["LISTEN_FDNAMES"].split(":")
ports = [socket.socket(fileno=3 + i).getsockname()[1] for i in range(int(os.environ["LISTEN_FDS"]))]
assert os.environ["LISTEN_PID"] == str(os.getpid())
loop = "trap '' HUP; while :; do sleep 0.05; done"
left = subprocess.Popen(["sh", "-c", loop], start_new_session=True)
print(left.pid, " ".join(f"{n}={p}" for n, p in zip(names, ports)), flush=True)
sys.stdin.read()
"""
    proc = subprocess.Popen(
        guard_argv(session, PYTHON3, "-c", agent), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        left, *items = proc.stdout.readline().split()
        ports = dict(item.split("=") for item in items)
        assert set(ports) == {"http", "socks"}
        child = int((session / scripts.PID_NAME).read_text())
        os.kill(child, signal.SIGKILL)  # the agent dies; what it left behind holds no socket
        while _alive(int(left)):
            assert not any(_bindable(int(p)) for p in ports.values())
            time.sleep(0.01)
        assert proc.wait(10) == -signal.SIGKILL
        assert all(_bindable(int(p)) for p in ports.values())
    finally:
        proc.kill()


def test_the_command_dies_with_its_guard(session: Path, tmp_path: Path) -> None:
    write_plan(session, json.dumps({"listen": []}))
    proc = subprocess.Popen(guard_argv(session, "sleep", "60"))
    try:
        wait_for(lambda: (session / scripts.PID_NAME).exists(), "the command to start")
        command = int((session / scripts.PID_NAME).read_text())
        proc.kill()
        proc.wait()
        wait_for(lambda: not _alive(command), "the command to die with the guard", timeout=5)
    finally:
        proc.kill()


def _guard_pid(session: Path) -> int:
    command = int((session / scripts.PID_NAME).read_text())
    stat = Path(f"/proc/{command}/stat").read_text()
    return int(stat.rpartition(")")[2].split()[1])


def _listening_port(pid: int) -> int:
    """The TCP port the process listens on (from its fds and /proc/net/tcp)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:
            return int(fields[1].rpartition(":")[2], 16)
    raise AssertionError("the guard listens on no TCP port")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"
