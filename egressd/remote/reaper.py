"""End everything a remote command started — detached or not — when its session ends.

Why: when SSH drops, sshd only closes the command's pipes. A command (or a child it detached with
setsid or a double fork) lives on with the proxy credentials but no egressd in control: in relay
mode the released forward port can then be bound by another user of the remote host, who
receives its requests. Process groups and sessions do not hold such children; a child subreaper
(Linux) does: every orphan below it is re-parented to it, so its descendants are the whole tree.

Used twice: imported by `egressd remote-agent` (remote egress mode), and run as a script by the
remote's own python3 in relay mode (`python3 -I -S reaper.py DIR CMD...`, uploaded into the session
directory). So this file uses the standard library only, and Python 3.7 syntax at most.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
HANGUP_GRACE = 5.0
PID_NAME = "pid"


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Orphans below this process come to it instead of init (Linux); False where unsupported."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def _parents() -> dict[int, list[int]] | None:
    """parent pid -> live (non-zombie) children, from /proc; None without /proc."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    children: dict[int, list[int]] = {}
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                fields = stat.read().rpartition(b")")[2].split()
        except OSError:
            continue
        if len(fields) > 1 and fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(name))
    return children


def descendants(root: int) -> list[int] | None:
    """Every live process below root; None when the platform cannot tell (no /proc)."""
    children = _parents()
    if children is None:
        return None
    found: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def reap() -> list[tuple[int, int]]:
    """Collect every exited child: (pid, wait status) pairs."""
    done = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done.append((pid, status))


def exit_code(status: int) -> int:
    """os.waitstatus_to_exitcode, which Python < 3.9 lacks."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _signal_all(pids: list[int], signo: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signo)


def end_tree(
    root: int, group: int | None = None, grace: float = HANGUP_GRACE, *, collect: bool = True
) -> list[tuple[int, int]]:
    """SIGHUP every process below root, SIGKILL what is left after `grace` s; reap them all.

    Killing repeats until nothing is left: a process forked meanwhile is re-parented to the
    subreaper and found by the next round. Without /proc, the command's process `group` only
    gets SIGHUP (the caller must handle SIGHUP itself).
    Returns the wait statuses reaped on the way (the command's may be among them); with
    `collect=False` nothing is reaped (another thread waits for its child itself).
    """
    gather = reap if collect else (lambda: [])
    reaped = gather()
    pids = descendants(root)
    if pids is None:
        # no /proc: the hang-up a terminal would send, to the command's group (this one's too)
        if group is not None:
            for signo in (signal.SIGHUP, signal.SIGCONT):
                with contextlib.suppress(OSError):
                    os.killpg(group, signo)
            time.sleep(min(grace, 1.0))
        return reaped + gather()
    if not pids:
        return reaped
    _signal_all(pids, signal.SIGHUP)
    _signal_all(pids, signal.SIGCONT)
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        reaped += gather()
        pids = descendants(root) or []
    for _ in range(1000):
        if not pids:
            break
        _signal_all(pids, signal.SIGKILL)
        time.sleep(0.01)
        reaped += gather()
        pids = descendants(root) or []
    return reaped + gather()


def _die_like(code: int) -> None:
    """Exit with the command's status; die of its signal (sshd then reports that signal)."""
    if code < 0:
        signo = -code
        with contextlib.suppress(OSError, ValueError):
            signal.signal(signo, signal.SIG_DFL)
        os.kill(os.getpid(), signo)
        time.sleep(1.0)
        os._exit(128 + signo)
    os._exit(code)


def guard(directory: str, command: list[str]) -> None:
    """Relay mode on the remote: run command; when the SSH session ends, end all it started.

    The session's end is seen as the death of sshd's session process, this process's parent
    (PR_SET_PDEATHSIG delivers SIGHUP then, and a changed parent pid is checked besides), or as
    SIGHUP/SIGTERM. The guard lets go of stdin/stdout/stderr once the command runs, so the
    command's end-of-file on them reaches the client as before.
    """
    parent = os.getppid()
    become_subreaper()
    stops: list[int] = []

    def stop(signo: int, frame: object) -> None:
        stops.append(signo)

    for signo in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(signo, stop)
    for signo in (signal.SIGINT, signal.SIGQUIT):
        # a terminal sends these to the whole foreground group: they are for the command
        signal.signal(signo, lambda signo, frame: None)
    _prctl(PR_SET_PDEATHSIG, signal.SIGHUP)
    if os.getppid() != parent:
        stops.append(signal.SIGHUP)
    pid = os.fork()
    if pid == 0:
        for name in ("SIGPIPE", "SIGXFSZ"):  # ignored by Python; an ignored signal survives exec
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), signal.SIG_DFL)
        try:
            os.execvp(command[0], command)
        except OSError as exc:
            sys.stderr.write(f"{command[0]}: {exc.strerror}\n")
            sys.stderr.flush()
            os._exit(127 if isinstance(exc, FileNotFoundError) else 126)
    group = os.getpgrp()
    record = os.path.join(directory, PID_NAME)
    with open(record + ".new", "w") as out:
        out.write(f"{pid}\n")
    os.replace(record + ".new", record)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    code: int | None = None
    while code is None:
        for done, status in reap():
            if done == pid:
                code = exit_code(status)
        if code is not None:
            break
        if stops or os.getppid() != parent:
            end_tree(os.getpid(), group)
            try:
                import shutil

                shutil.rmtree(directory)
            except OSError:
                pass
            os._exit(255)
        time.sleep(0.1)
    end_tree(os.getpid(), group, grace=1.0)
    _die_like(code)


if __name__ == "__main__":
    guard(sys.argv[1], sys.argv[2:])
