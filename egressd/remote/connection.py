"""One SSH connection: an OpenSSH control master plus the multiplexed commands egressd needs.

Why a master: the remote forward can only be opened into the session directory once that exists
on the remote, and several short commands (set-up, upload, signal delivery) run before and beside
the user's session. The master authenticates once (keys, agents, ~/.ssh/config, prompts on the
terminal all work as with plain ssh); the forward, the set-up, the user's session and signal
delivery then run as fast multiplexed clients over it.

The master runs in egressd's process group (so it can prompt on the terminal) with SIGINT and
SIGQUIT ignored: Ctrl-C is for the remote command, and egressd delivers it there itself. It is
tethered to egressd (it gets SIGTERM when egressd dies, even of SIGKILL, on Linux): with it go the
reverse forward and every multiplexed session, which ends the remote session (its guard then ends
the command's tree), and the control socket's directory is removed when it ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from egressd.child import process
from egressd.remote import scripts
from egressd.remote.spawn import DEVNULL, Child, Completed, Spawner
from egressd.remote.sshargs import SshCommand

HELPER_TIMEOUT = 30.0


# sun_path holds 104 bytes on macOS (108 on Linux); ssh binds "<ControlPath>.<16 random chars>" first.
_SOCKET_PATH_MAX = 103
_SSH_SUFFIX = 17


def control_directory(base: str | None = None) -> str:
    """A private directory for the control socket: in TMPDIR, or /tmp when TMPDIR is too deep."""
    base = base or tempfile.gettempdir()
    # "<base>/egressd-ssh-XXXXXXXX/ctl" plus ssh's suffix must fit a Unix socket address
    if len(os.fsencode(base)) + len("/egressd-ssh-XXXXXXXX/ctl") + _SSH_SUFFIX > _SOCKET_PATH_MAX:
        base = "/tmp"
    return tempfile.mkdtemp(prefix="egressd-ssh-", dir=base)


class SshError(Exception):
    """The connection or one of its set-up steps failed; `exit_code` is what egressd exits with."""

    def __init__(self, message: str, exit_code: int = 255) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Interrupted(Exception):
    """A stop signal arrived while connecting."""

    def __init__(self, signo: int) -> None:
        super().__init__(signal.Signals(signo).name)
        self.signo = signo


def remote_text(text: str) -> str:
    """Text the remote host sent, fit for this terminal: one line, control characters escaped
    (a compromised remote must not drive the user's terminal with escape sequences)."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in " ".join(text.split()))


def _first_line(text: str) -> str:
    """The last non-empty line of the remote's stderr (the one that says why), made printable."""
    lines = [line for line in text.splitlines() if line.strip()]
    return remote_text(lines[-1]) if lines else ""


class SshConnection:
    """Open with connect(); every other method needs the master running."""

    def __init__(
        self,
        destination_text: str,
        make_command: Callable[[str], SshCommand],
        spawner: Spawner,
    ) -> None:
        self.name = destination_text
        self._workdir = control_directory()
        self.control_path = str(Path(self._workdir) / "ctl")
        self.ssh = make_command(self.control_path)
        self.spawner = spawner
        self.master: Child | None = None
        self._pending: list[threading.Thread] = []

    # -- the master --------------------------------------------------------------------------
    def connect(self, catcher: process.SignalCatcher) -> None:
        """Start the master and wait until it accepts multiplexed clients."""
        self.master = self.spawner.spawn(
            self.ssh.master(),
            stdin=DEVNULL,
            stdout=DEVNULL,
            ignore=("INT", "QUIT"),
            tether=True,
            remove=self._workdir,
        )
        stops = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT}
        while True:
            rc = self.master.poll()
            if rc is not None:
                raise SshError(f"could not connect to {self.name} (ssh exited with status {rc})")
            if os.path.exists(self.control_path) and self.spawner.run(self.ssh.check(), timeout=10).ok:
                return
            got = catcher.wait(0.05)
            if got is not None and got.signo in stops:
                raise Interrupted(got.signo)

    def alive(self) -> bool:
        return self.master is not None and self.master.poll() is None

    # -- multiplexed commands ------------------------------------------------------------------
    def forward_sockets(self, forwards: Sequence[tuple[str, str, int]]) -> None:
        """Reverse forwards from Unix sockets on the remote (path, in a private directory) to
        (host, port) here; SshError (exit 2) when sshd refuses them."""
        try:
            argv = self.ssh.forward_sockets(forwards)
        except ValueError as exc:
            raise SshError(f"the remote forward on {self.name} failed: {exc}", exit_code=2) from exc
        done = self.spawner.run(argv, timeout=HELPER_TIMEOUT)
        if not done.ok:
            why = _first_line(done.stderr) or f"ssh exited with status {done.returncode}"
            raise SshError(
                f"the remote forward on {self.name} failed: {why} (the server must allow "
                "forwarding to Unix sockets: AllowStreamLocalForwarding yes or remote, the default). "
                "--egress remote needs no forward. Nothing was run.",
                exit_code=2,
            )

    def helper(
        self, remote_command: str, *, input: bytes | None = None, timeout: float = HELPER_TIMEOUT
    ) -> Completed:  # noqa: A002
        return self.spawner.run(self.ssh.helper(remote_command), input=input, timeout=timeout)

    def make_directory(self, env_text: str) -> str:
        """A private directory on the remote, holding the env file for the wrapper."""
        done = self.helper(scripts.remote_command(scripts.SETUP), input=env_text.encode())
        if not done.ok:
            why = _first_line(done.stderr) or f"status {done.returncode}"
            raise SshError(f"cannot prepare the session on {self.name}: {why}", exit_code=2)
        try:
            return scripts.parse_directory(done.stdout)
        except ValueError as exc:
            raise SshError(f"cannot prepare the session on {self.name}: {exc}", exit_code=2) from exc

    def start(
        self,
        remote_command: str,
        *,
        stdin: int | None = None,
        stdout: int | None = None,
        new_group: bool = True,
    ) -> Child:
        return self.spawner.spawn(
            self.ssh.session(remote_command), stdin=stdin, stdout=stdout, new_group=new_group
        )

    def start_helper(self, remote_command: str, *, stdin: int | None, stdout: int | None) -> Child:
        """A long-lived helper (the policy feed): its own process group, never a tty."""
        return self.spawner.spawn(self.ssh.helper(remote_command), stdin=stdin, stdout=stdout, new_group=True)

    def signal_remote(self, directory: str, signo: int) -> None:
        """Deliver a signal to the remote command, in the background (a round trip takes ~0.1 s)."""
        name = signal.Signals(signo).name.removeprefix("SIG")
        worker = threading.Thread(
            target=self.helper,
            args=(scripts.kill_command(directory, name),),
            kwargs={"timeout": 10.0},
            name=f"egressd-ssh-signal-{name}",
            daemon=True,
        )
        self._pending.append(worker)
        worker.start()

    def settle(self, timeout: float = 5.0) -> None:
        """Wait for signal deliveries still on their way (before the master goes)."""
        for worker in self._pending:
            worker.join(timeout)
        self._pending.clear()

    # -- shutting down -----------------------------------------------------------------------
    def close(self, directory: str | None = None) -> None:
        """Remove the remote directory, stop the master, remove the control socket. Idempotent."""
        self.settle()
        if directory is not None and self.alive():
            self.helper(scripts.cleanup_command(directory), timeout=5.0)
        if self.master is not None:
            self.master.stop(grace=3.0)
        if os.path.exists(self.control_path):
            # a master that forked away (ForkAfterAuthentication in a config file) still listens here
            self.spawner.run(self.ssh.exit(), timeout=5.0)
        shutil.rmtree(self._workdir, ignore_errors=True)


def describe_status(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"
