"""Wait for the remote session; deliver signals to the remote command; notice SSH dropping.

Signals: the remote command is not in egressd's process group, so every forwarded signal egressd
receives — from kill(2) or from the terminal (Ctrl-C while no pty was requested) — is delivered
to it over the connection (`kill -s SIG PID` on the remote). SIGWINCH goes to the local ssh
client instead, which passes window changes to a remote pty itself.

Exit status: OpenSSH reports a remote command killed by a signal as 255, like its own errors.
When egressd delivered signal N and the session then ends with 255, the command almost surely
died of N, and egressd dies of N, as `exec` would. Remote egress mode knows the exact status
(the remote agent reports it) and uses that instead.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass

from egressd.child import process
from egressd.remote.connection import SshConnection, describe_status
from egressd.remote.spawn import Child

SSH_FAILURE = 255
# Signals whose default action ends a process: what a remote command can have died of, and so
# what egressd may die of in turn. Not SIGSTOP, SIGTSTP, SIGCONT, SIGCHLD, ... (a remote that
# reported those would stop or confuse this end), nor real-time signals.
TERMINATING_SIGNALS: frozenset[int] = frozenset(
    int(getattr(signal, name))
    for name in (
        "SIGHUP", "SIGINT", "SIGQUIT", "SIGILL", "SIGTRAP", "SIGABRT", "SIGBUS", "SIGFPE", "SIGKILL",
        "SIGUSR1", "SIGSEGV", "SIGUSR2", "SIGPIPE", "SIGALRM", "SIGTERM", "SIGXCPU", "SIGXFSZ",
        "SIGVTALRM", "SIGPROF", "SIGSYS",
    )
    if hasattr(signal, name)
)  # fmt: skip


def accepted_status(value: object) -> int | None:
    """A remote-reported exit status egressd may exit like: 0-255, or minus a terminating signal."""
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    if 0 <= value <= 255 or -value in TERMINATING_SIGNALS:
        return value
    return None


# how long the master may take to exit after its session client reported 255 (a drop)
_DROP_GRACE = 1.0


@dataclass(frozen=True)
class Outcome:
    returncode: int  # what egressd exits like (negative: die of that signal)
    lost: bool = False  # the SSH connection went away under the session
    note: str | None = None  # something to tell the user


def supervise(
    session: Child,
    connection: SshConnection,
    directory: str,
    catcher: process.SignalCatcher,
    *,
    exit_report: Callable[[float], int | None] | None = None,
) -> Outcome:
    """Block until the session ends or the connection drops."""
    delivered: int | None = None
    while (rc := session.poll()) is None:
        if not connection.alive():
            if session.wait(3.0) is None:
                session.stop(grace=1.0)
            return _lost(connection)
        got = catcher.wait(0.25)
        if got is None or got.signo == signal.SIGCHLD:
            continue
        if got.signo == signal.SIGWINCH:
            session.send_signal(signal.SIGWINCH)
            continue
        connection.signal_remote(directory, got.signo)
        delivered = got.signo
    master = connection.master
    if rc == SSH_FAILURE and master is not None and master.wait(_DROP_GRACE) is not None:
        return _lost(connection)
    if exit_report is not None:
        reported = exit_report(2.0)
        if reported is not None:
            return Outcome(reported)
        if rc == SSH_FAILURE:  # the guard died like the agent did: of a signal, with no report
            return Outcome(
                SSH_FAILURE,
                note=f"egressd on {connection.name} ended without saying how the command ended (it was "
                "killed or crashed); the command and everything it started there were ended",
            )
    if rc < 0:
        return Outcome(SSH_FAILURE, note=f"the local ssh client of the session was {describe_status(rc)}")
    if rc == SSH_FAILURE and delivered is not None:
        return Outcome(-delivered)
    return Outcome(rc)


def _lost(connection: SshConnection) -> Outcome:
    status = connection.master.returncode if connection.master is not None else None
    how = f"; ssh {describe_status(status)}" if status is not None else ""
    return Outcome(
        SSH_FAILURE,
        lost=True,
        note=f"the SSH connection to {connection.name} was lost{how}; the remote command was cut off",
    )
