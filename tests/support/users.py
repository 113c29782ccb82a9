"""Unprivileged users for tests: created with their own home, removed with everything they ran.

Why: egressd's users are not root, and a second user of the same host is the attacker of the SSH
relay (it races to bind a freed port). Names carry the creating test process's pid, so parallel
runs in other worktrees never share a user, and the users of a run that died are removed by the
next one. Creating users needs root (`useradd`); the tests that use these say so.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from egressd.exits import alive

PREFIX = "egu"


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: Path

    def argv(self, *command: str) -> list[str]:
        """command run as this user (exec'd in place: the pid is the command's)."""
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups", "--", *command]

    def env(self, **extra: str) -> dict[str, str]:
        """A clean environment of this user's own (no variable of the test's root session)."""
        env = {
            "HOME": str(self.home),
            "USER": self.name,
            "LOGNAME": self.name,
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "LANG": "C.UTF-8",
        }
        env.update(extra)
        return env

    def chown(self, *paths: Path) -> None:
        for path in paths:
            os.chown(path, self.uid, self.gid)

    def processes(self) -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if entry.stat().st_uid == self.uid:
                        found.append(int(entry.name))
        return found


def kill_until_gone(processes: Callable[[], list[int]], rounds: int = 50) -> None:
    """SIGKILL what `processes()` lists until it lists nothing (a process may fork meanwhile)."""
    for _ in range(rounds):
        pids = processes()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=False, timeout=60)


def _remove(name: str) -> None:
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return
    user = User(name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir))
    kill_until_gone(user.processes)
    _traversal(user, grant=False)
    _run("userdel", "--remove", name)
    shutil.rmtree(user.home, ignore_errors=True)


def remove_stale() -> None:
    """Users of earlier test runs whose process is gone."""
    for entry in pwd.getpwall():
        rest = entry.pw_name.removeprefix(PREFIX)
        pid = rest.split("x", 1)[0]
        if entry.pw_name.startswith(PREFIX) and pid.isdigit() and not alive(int(pid)):
            _remove(entry.pw_name)


def _blocking_dirs(path: Path) -> list[Path]:
    """The directories on the way to path that other users cannot traverse (e.g. /root, where a
    pyenv interpreter lives)."""
    blocked = []
    for parent in reversed(path.parents):
        with contextlib.suppress(OSError):
            if not parent.stat().st_mode & 0o001:
                blocked.append(parent)
    return blocked


def _traversal(user: User, *, grant: bool) -> None:
    """Let the user reach this test's interpreter and code (search permission only, by ACL)."""
    paths = {Path(os.path.realpath(sys.executable)), Path(__file__).resolve()}
    for directory in {d for path in paths for d in _blocking_dirs(path)}:
        if grant:
            done = _run("setfacl", "-m", f"u:{user.uid}:x", str(directory))
            if done.returncode != 0:
                raise RuntimeError(f"cannot let {user.name} reach {directory}: {done.stderr.strip()}")
        else:
            _run("setfacl", "-x", f"u:{user.uid}", str(directory))


@contextlib.contextmanager
def created_users(roles: Sequence[str]) -> Iterator[dict[str, User]]:
    """One fresh user per role (home 0700, /bin/sh), all removed at the end."""
    if os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("setpriv") is None:
        raise RuntimeError("creating test users needs root, useradd and setpriv")
    remove_stale()
    made: dict[str, User] = {}
    try:
        for role in roles:
            name = f"{PREFIX}{os.getpid()}x{role}"[:32]
            _remove(name)
            # password "*": none to log in with, but not a locked account (sshd refuses those keys)
            done = _run("useradd", "-m", "-s", "/bin/sh", "-U", "-p", "*", name)
            if done.returncode != 0:
                raise RuntimeError(f"useradd {name}: {done.stderr.strip()}")
            entry = pwd.getpwnam(name)
            user = User(name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir))
            made[role] = user
            user.home.chmod(0o700)
            _traversal(user, grant=True)
        yield made
    finally:
        for user in made.values():
            _remove(user.name)
