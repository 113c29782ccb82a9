"""Local ssh processes, started with egressd's ORIGINAL signal mask.

egressd blocks the forwarded signals in every thread (see `egressd.child.process`), and a blocked mask
survives fork and exec: an ssh started with subprocess would ignore the SIGTERM egressd stops it
with. posix_spawn sets the mask (and process group) for the new process without running Python
code after fork, which is also safe while the proxy thread runs.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

INHERIT: int | None = None
PIPE = -1
DEVNULL = -2

# Python ignores these at start-up; an ssh (or sh) child must get the default back.
_RESET = tuple(s for s in (getattr(signal, "SIGPIPE", None), getattr(signal, "SIGXFSZ", None)) if s)


# Runs in a fresh interpreter between spawn and exec (posix_spawn runs no code of ours there):
# argv = PARENT_PID SIGNAL IGNORED_SIGNALS REMOVE PROGRAM ARGS... The program gets SIGNAL when
# egressd dies, even of SIGKILL (PR_SET_PDEATHSIG survives exec; Linux); a parent already gone ends
# it. Python ignores SIGPIPE/SIGXFSZ at start-up: they are put back before exec. With REMOVE (a
# directory), the interpreter stays as the program's parent and removes REMOVE when it ends (a
# program that exits 0 and leaves something there forked away and still uses it), then exits
# like it; SIGTERM and SIGHUP it passes on.
_TETHER = """\
import os, shutil, signal, sys
parent, signo, remove, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[4], sys.argv[5:]
def tether(parent):
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signo)
    if os.getppid() != parent:
        os._exit(255)
def run():
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.stderr.write(f"egressd: {argv[0]}: {exc.strerror}\\n")
        sys.stderr.flush()
        os._exit(127 if isinstance(exc, FileNotFoundError) else 126)
tether(parent)
for name in ("SIGPIPE", "SIGXFSZ"):
    if hasattr(signal, name):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
for name in filter(None, sys.argv[3].split(",")):
    signal.signal(getattr(signal, "SIG" + name), signal.SIG_IGN)
if not remove:
    run()
child, pending = [0], []
def forward(got, frame):
    if child[0]:
        try:
            os.kill(child[0], got)
        except OSError:
            pass
    else:
        pending.append(got)
for got in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(got, forward)
shim = os.getpid()
pid = os.fork()
if pid == 0:
    for got in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(got, signal.SIG_DFL)
    tether(shim)
    run()
child[0] = pid
for got in pending:
    forward(got, None)
status = 0
try:
    status = os.waitpid(pid, 0)[1]
finally:
    if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and os.listdir(remove)):
        shutil.rmtree(remove, ignore_errors=True)
if os.WIFSIGNALED(status):
    signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
    os.kill(os.getpid(), os.WTERMSIG(status))
sys.exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 255)
"""


def tethered(
    argv: Sequence[str], ignore: Sequence[str] = (), *, signo: int = signal.SIGTERM, remove: str | None = None
) -> list[str]:
    """argv run so that it gets `signo` when egressd dies (Linux), with `ignore` (INT, QUIT) ignored;
    `remove`: a directory removed when argv ends, whoever ends it.

    Why: the ssh master holds the reverse forward; if it outlived a SIGKILLed egressd, it would
    carry the remote command's requests to a proxy port nobody holds any more. And the control
    socket's private directory would be left behind.
    """
    return [
        sys.executable,
        "-I",
        "-S",
        "-c",
        _TETHER,
        str(os.getpid()),
        str(int(signo)),
        ",".join(ignore),
        remove or "",
        *argv,
    ]


class SpawnError(OSError):
    """A program could not be started at all (not installed, not executable)."""


@dataclass(frozen=True)
class Completed:
    returncode: int | None  # None: killed after the timeout
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class Child:
    """One spawned process; our ends of its pipes (if any) are plain fds."""

    def __init__(
        self, pid: int, argv: Sequence[str], stdin: int | None, stdout: int | None, stderr: int | None
    ) -> None:
        self.pid = pid
        self.argv = list(argv)
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    done, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:
                    self.returncode = -signal.SIGKILL  # reaped elsewhere: treat as gone
                    return self.returncode
                if done == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit status, or None if still running after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.005
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return self.returncode

    def send_signal(self, signo: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signo)

    def stop(self, grace: float = 5.0) -> int:
        """SIGTERM, then SIGKILL after `grace` seconds; returns the exit status."""
        self.send_signal(signal.SIGTERM)
        if self.wait(grace) is None:
            self.send_signal(signal.SIGKILL)
        rc = self.wait()
        assert rc is not None
        self.close_pipes()
        return rc

    def close_pipes(self) -> None:
        for name in ("stdin", "stdout", "stderr"):
            fd = getattr(self, name)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, None)


class Spawner:
    """Starts processes with a given signal mask (egressd's mask before it blocked signals)."""

    def __init__(self, sigmask: Iterable[int] = ()) -> None:
        self.sigmask = frozenset(sigmask)

    def spawn(
        self,
        argv: Sequence[str],
        *,
        stdin: int | None = INHERIT,
        stdout: int | None = INHERIT,
        stderr: int | None = INHERIT,
        new_group: bool = False,
        ignore: Sequence[str] = (),
        tether: bool = False,
        remove: str | None = None,
    ) -> Child:
        """Start argv; `ignore` names signals (INT, QUIT) the process starts with ignored;
        `tether`: the process dies with egressd, and `remove` goes when it ends (see `tethered`)."""
        if tether:
            argv = tethered(argv, ignore, remove=remove)
        elif ignore:
            # an ignored disposition survives exec; `trap ''` sets it without touching egressd's own
            argv = ["sh", "-c", f"trap '' {' '.join(ignore)}; exec \"$@\"", "sh", *argv]
        actions: list[tuple[int, ...] | tuple[int, int, str, int, int]] = []
        ours: list[int | None] = [None, None, None]
        theirs: list[int] = []
        try:
            for fd, how in enumerate((stdin, stdout, stderr)):
                if how == PIPE:
                    read_end, write_end = os.pipe()
                    child_end, our_end = (read_end, write_end) if fd == 0 else (write_end, read_end)
                    ours[fd] = our_end
                    theirs.append(child_end)
                    actions.append((os.POSIX_SPAWN_DUP2, child_end, fd))
                elif how == DEVNULL:
                    actions.append((os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0))
                elif how is not None:
                    actions.append((os.POSIX_SPAWN_DUP2, how, fd))
            try:
                group = {"setpgroup": 0} if new_group else {}
                pid = os.posix_spawnp(
                    argv[0],
                    list(argv),
                    dict(os.environ),
                    file_actions=actions,
                    setsigmask=self.sigmask,
                    setsigdef=_RESET,
                    **group,
                )
            except OSError as exc:
                raise SpawnError(exc.errno, f"cannot run {argv[0]}: {exc.strerror}") from exc
        except BaseException:
            for fd in ours:
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        return Child(pid, argv, *ours)

    def run(self, argv: Sequence[str], *, input: bytes | None = None, timeout: float = 30.0) -> Completed:  # noqa: A002
        """Run to completion in its own process group, capturing stdout and stderr."""
        child = self.spawn(
            argv, stdin=PIPE if input is not None else DEVNULL, stdout=PIPE, stderr=PIPE, new_group=True
        )
        deadline = time.monotonic() + timeout
        out, err = _communicate(child, input or b"", deadline)
        rc = child.wait(max(0.1, deadline - time.monotonic())) if out is not None else None
        if rc is None:
            child.send_signal(signal.SIGKILL)
            child.wait()
        child.close_pipes()
        return Completed(rc, (out or b"").decode(errors="replace"), (err or b"").decode(errors="replace"))


def _communicate(child: Child, data: bytes, deadline: float) -> tuple[bytes | None, bytes]:
    """Feed stdin, read stdout/stderr to EOF; (None, stderr) when the deadline passed first."""
    chunks: dict[int, list[bytes]] = {}
    with selectors.DefaultSelector() as sel:
        if child.stdin is not None:
            if data:
                os.set_blocking(child.stdin, False)
                sel.register(child.stdin, selectors.EVENT_WRITE)
            else:
                os.close(child.stdin)
                child.stdin = None
        for fd in (child.stdout, child.stderr):
            if fd is not None:
                chunks[fd] = []
                sel.register(fd, selectors.EVENT_READ)
        view = memoryview(data)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return None, b"".join(chunks.get(child.stderr or -1, []))
            for key, _ in sel.select(left):
                fd = int(key.fd)
                if fd == child.stdin:
                    try:
                        view = view[os.write(fd, view[:65536]) :]
                    except BrokenPipeError:
                        view = view[:0]
                    if not view:
                        sel.unregister(fd)
                        os.close(fd)
                        child.stdin = None
                    continue
                block = os.read(fd, 65536)
                if block:
                    chunks[fd].append(block)
                else:
                    sel.unregister(fd)
    out = b"".join(chunks.get(child.stdout, [])) if child.stdout is not None else b""
    err = b"".join(chunks.get(child.stderr, [])) if child.stderr is not None else b""
    return out, err
