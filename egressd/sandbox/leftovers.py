"""What a Seatbelt run leaves running (a daemon that called setsid, a double fork), found and ended.

macOS has no PID namespace to take every process of the run down with it, and a process group is
left by one `setsid()`. What no process can leave is its sandbox: every process of the run, however
it detached, runs under the run's profile, and that profile alone denies reading the run's mark
(seatbelt.run_marker) while allowing a path next to it. egressd asks the kernel that question
about every process (`sandbox_check`), and ends those whose answers are this run's.

An unsandboxed process may read both paths, another egressd run the mark of this one too, and an
app's own sandbox neither: only this run's profile answers "mark denied, neighbour allowed".
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Callable

from egressd.sandbox.seatbelt import MARKER_ROOT

SANDBOX_FILTER_PATH = 1
NEIGHBOUR = f"{MARKER_ROOT}/-"  # a name no token takes (tokens are hex)
MAX_PIDS = 1 << 16


def is_this_run(denies: Callable[[str], bool | None], marker: str) -> bool:
    """Whether a process is one of this run's: its sandbox denies reading `marker` and allows the
    neighbour path (`denies(path)`: True denied, False allowed, None unknown)."""
    return denies(marker) is True and denies(NEIGHBOUR) is False


def _libraries() -> tuple[ctypes.CDLL, ctypes.CDLL] | None:
    if sys.platform != "darwin":
        return None
    try:
        system = ctypes.CDLL(ctypes.util.find_library("System") or "/usr/lib/libSystem.B.dylib")
        proc = ctypes.CDLL(ctypes.util.find_library("proc") or "/usr/lib/libSystem.B.dylib")
    except OSError:
        return None
    return system, proc


def end_leftovers(marker: str) -> int:
    """Kill (SIGKILL) every process this run's profile confines, other than egressd; the number
    ended. Does nothing where Seatbelt is not (Linux: the sandbox's PID namespace ends them)."""
    libraries = _libraries()
    if libraries is None:
        return 0
    system, proc = libraries
    check = system.sandbox_check
    # variadic: the path goes after the declared arguments (ctypes passes it as a variadic one)
    check.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    check.restype = ctypes.c_int
    flags = SANDBOX_FILTER_PATH
    with contextlib.suppress(ValueError):
        flags |= ctypes.c_int.in_dll(system, "SANDBOX_CHECK_NO_REPORT").value
    pids = (ctypes.c_int * MAX_PIDS)()
    count = proc.proc_listallpids(pids, ctypes.sizeof(pids))
    ended = 0
    for pid in pids[: max(count, 0)]:
        if pid <= 1 or pid == os.getpid():
            continue

        def denies(path: str, pid: int = pid) -> bool | None:
            answer = check(pid, b"file-read-data", flags, ctypes.c_char_p(path.encode()))
            return None if answer < 0 else answer == 1

        if is_this_run(denies, marker):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                ended += 1
    return ended
