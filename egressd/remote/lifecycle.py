"""One `egressd ssh` run from connecting to cleaning up, for either mode.

Whatever happens — the command ends, SSH drops, a set-up step fails, egressd is interrupted — the
mode's own parts are closed, the remote session directory is removed (while the connection still
stands), the master is stopped and the control socket removed: nothing is left running here.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence
from typing import Protocol

from egressd.child import process
from egressd.remote.connection import Interrupted, SshConnection, SshError
from egressd.remote.spawn import SpawnError
from egressd.remote.supervise import Outcome


class Mode(Protocol):
    directory: str | None

    def run(self, command: Sequence[str], catcher: process.SignalCatcher) -> Outcome: ...

    def close(self) -> None: ...


def run_over_ssh(
    make_mode: Callable[[SshConnection], Mode],
    connection: SshConnection,
    command: Sequence[str],
    catcher: process.SignalCatcher,
    say: Callable[[str], None],
) -> int:
    """Connect, run `command` in the mode, clean up; returns what egressd exits like."""
    mode: Mode | None = None
    try:
        connection.connect(catcher)
        mode = make_mode(connection)
        outcome = mode.run(command, catcher)
        if outcome.note:
            say(outcome.note)
        return outcome.returncode
    except Interrupted as exc:
        say(f"interrupted by {signal.Signals(exc.signo).name} while connecting to {connection.name}")
        return -exc.signo
    except SshError as exc:
        say(str(exc))
        return exc.exit_code
    except SpawnError as exc:
        say(str(exc))
        return 2
    finally:
        try:
            if mode is not None:
                mode.close()
        finally:
            connection.close(mode.directory if mode is not None else None)
