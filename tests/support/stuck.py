"""What a process that did not end in time was doing: its tree's signal state and kernel waits,
and the Python stacks of its threads (faulthandler, when the process was started with
`PYTHONFAULTHANDLER=1`). A test that waits on a process says this on failure, so a rare hang
explains itself in the CI log."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

_STATUS_FIELDS = ("State", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")


def with_faulthandler(env: dict[str, str] | None = None) -> dict[str, str]:
    """An environment in which a Python process dumps every thread's stack on SIGABRT."""
    return {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        found.append(parent)
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{parent}/task").iterdir():
                with contextlib.suppress(OSError):
                    todo += [int(c) for c in (task / "children").read_text().split()]
    return found


def _describe(pid: int) -> str:
    proc = Path(f"/proc/{pid}")
    try:
        cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
        status = {
            key: value.strip()
            for key, _, value in (line.partition(":") for line in (proc / "status").read_text().splitlines())
        }
    except OSError as exc:
        return f"pid {pid}: gone ({exc.strerror})"
    lines = [f"pid {pid}: {cmdline}", "  " + " ".join(f"{k}={status.get(k, '?')}" for k in _STATUS_FIELDS)]
    with contextlib.suppress(OSError):
        for task in sorted(proc.joinpath("task").iterdir(), key=lambda p: int(p.name)):
            with contextlib.suppress(OSError):
                comm = (task / "comm").read_text().strip()
                wchan = (task / "wchan").read_text().strip()
                status_lines = (task / "status").read_text().splitlines()
                blocked = next((ln.split()[1] for ln in status_lines if ln.startswith("SigBlk")), "?")
                lines.append(f"  task {task.name} {comm} wchan={wchan} SigBlk={blocked}")
    return "\n".join(lines)


def explain(proc: subprocess.Popen[bytes], wait: float = 10.0) -> str:
    """The state of `proc`'s tree, then its Python stacks (SIGABRT; it is killed after)."""
    tree = "\n".join(_describe(pid) for pid in _descendants(proc.pid))
    with contextlib.suppress(OSError):
        os.kill(proc.pid, signal.SIGABRT)
    try:
        _, err = proc.communicate(timeout=wait)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    stacks = (err or b"").decode(errors="replace")[-8000:]
    return f"process tree:\n{tree}\nstderr and stacks:\n{stacks}"
