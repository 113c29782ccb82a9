"""What a shell says when a command cannot start (127, 126), the signals egressd passes on, and
whether a process is alive.

Kept apart from process.py (which imports it) so the sandbox's launcher,
which starts before every sandboxed command, and `egressd exec --attach`, which starts before every
attached child, import only these few lines.
"""

from __future__ import annotations

import errno
import os
import signal
import sys

FORWARDED_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGWINCH,
)

EXIT_NOT_FOUND = 127
EXIT_CANNOT_RUN = 126


def alive(pid: int) -> bool:
    """Whether a process with this pid exists (ours or another user's: EPERM means it does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exec_failure(argv0: str, exc: OSError) -> int:
    """Report why the command could not start, like a shell would; return 127 or 126."""
    import shutil  # here: the paths that never fail to start need not import it

    if exc.errno == errno.ENOENT:
        exists = os.path.exists(argv0) if "/" in argv0 else shutil.which(argv0) is not None
        if exists:
            msg, code = "bad interpreter (No such file or directory)", EXIT_NOT_FOUND
        elif "/" in argv0:
            msg, code = "No such file or directory", EXIT_NOT_FOUND
        else:
            msg, code = "command not found", EXIT_NOT_FOUND
    else:
        msg, code = exc.strerror or str(exc), EXIT_CANNOT_RUN
    sys.stderr.write(f"egressd: {argv0}: {msg}\n")
    sys.stderr.flush()
    return code
