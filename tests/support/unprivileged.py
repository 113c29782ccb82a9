"""A real user who is not root, with a real home, to run egressd as users do.

Why: the sandbox's promises (what it hides, what stays read-only) must hold for a user without
root, whose home is a real one outside /tmp. Run as root, `unprivileged_user()` creates a fresh
user with `useradd -m` (a unique name, so parallel runs never share one), lets it search the
directories on the way to this interpreter (an ACL entry for that user only, removed afterwards:
pyenv under /root is not searchable by others) and removes both at the end. Run by a user who is
not root already, it is that user, with a fresh home under /var/tmp (outside the sandbox's private
/tmp) named in HOME.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


def real_root() -> bool:
    """Root on the host, not uid 0 mapped from another user in a user namespace."""
    if os.geteuid() != 0:
        return False
    try:
        first = Path("/proc/self/uid_map").read_text().split()
    except OSError:
        return True
    return first[:3] == ["0", "0", "4294967295"]


@dataclass
class User:
    name: str
    home: Path
    uid: int
    gid: int
    switch: bool  # run commands through runuser (the test runs as root)
    granted: list[str] = field(default_factory=list)  # directories given an ACL entry for the user

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """A login-like environment: this user's HOME, USER and LOGNAME, the test's PATH."""
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home),
            "USER": self.name,
            "LOGNAME": self.name,
            "LANG": "C.UTF-8",
        }
        env.update(extra or {})
        return env

    def argv(self, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        """`argv` run as this user with exactly `env`."""
        if not self.switch:
            return list(argv)
        return ["runuser", "-u", self.name, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv]

    def exec(self, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        """`argv` run as this user with exactly `env`, in place: its pid is the caller's child's
        (runuser stays as a parent; a test that signals the process itself needs this)."""
        if not self.switch:
            return list(argv)
        ids = [f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups"]
        return ["setpriv", *ids, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv]

    def processes(self) -> list[int]:
        """The pids of this user's processes."""
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if entry.stat().st_uid == self.uid:
                        found.append(int(entry.name))
        return found

    def run(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[str, str] | None = None,
        timeout: float = 90,
    ) -> subprocess.CompletedProcess[bytes]:
        full = self.env(env)
        return subprocess.run(self.argv(argv, full), cwd=cwd, env=full, capture_output=True, timeout=timeout)

    def popen(
        self, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        full = self.env(env)
        return subprocess.Popen(
            self.argv(argv, full), cwd=cwd, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )

    def write(self, relative: str, text: str, mode: int = 0o600) -> Path:
        """A file in the home, the user's own (its directories too)."""
        path = self.home / relative
        self.mkdir(str(path.parent.relative_to(self.home)))
        path.write_text(text)
        path.chmod(mode)
        self.own(path)
        return path

    def mkdir(self, relative: str) -> Path:
        path = self.home / relative
        path.mkdir(parents=True, exist_ok=True)
        current = path
        while current != self.home:
            self.own(current)
            current = current.parent
        return path

    def own(self, path: Path) -> None:
        if self.switch:
            os.lchown(path, self.uid, self.gid)


def _unsearchable_dirs(path: str) -> list[str]:
    """Directories on the way to `path` that others may not search (x for other)."""
    found = []
    current = os.path.dirname(os.path.realpath(path))
    while True:
        with contextlib.suppress(OSError):
            if not os.stat(current).st_mode & 0o001:
                found.append(current)
        if current == "/":
            return found
        current = os.path.dirname(current)


@contextlib.contextmanager
def unprivileged_user() -> Iterator[User]:
    if not real_root():
        home = Path(tempfile.mkdtemp(prefix="egressd-home-", dir="/var/tmp"))
        try:
            yield User(pwd.getpwuid(os.getuid()).pw_name, home, os.getuid(), os.getgid(), switch=False)
        finally:
            shutil.rmtree(home, ignore_errors=True)
        return
    name = f"egh{secrets.token_hex(5)}"
    # password "*": none to log in with, yet not a locked account (sshd refuses a locked one's keys)
    subprocess.run(["useradd", "-m", "-s", "/bin/sh", "-p", "*", name], check=True, capture_output=True)
    info = pwd.getpwnam(name)
    user = User(name, Path(info.pw_dir), info.pw_uid, info.pw_gid, switch=True)
    try:
        for directory in [*_unsearchable_dirs(sys.executable), *_unsearchable_dirs(__file__)]:
            subprocess.run(["setfacl", "-m", f"u:{name}:x", directory], check=True, capture_output=True)
            user.granted.append(directory)
        yield user
    finally:
        for directory in user.granted:
            subprocess.run(["setfacl", "-x", f"u:{name}", directory], capture_output=True)
        subprocess.run(["userdel", "-r", "-f", name], capture_output=True)
