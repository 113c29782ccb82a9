"""Where the control sockets live, and the checks that keep them the user's alone.

The run directory is `EGRESSD_HOME/run` when EGRESSD_HOME is set (an isolated egressd, tests),
else `$XDG_RUNTIME_DIR/egressd`, else `~/.config/egressd/run`. It must be a real directory (no
symlink) owned by the user with no access for group or others (0700): anyone who can open a
socket there can approve the child's asks and grant it targets. A directory that fails the check
is never used — egressd runs without its control API rather than serve it where others can reach.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
from collections.abc import Mapping
from pathlib import Path

from egressd.platform.exits import alive  # not egressd.child.process: `exec --attach` imports this module

SUFFIX = ".sock"


class RunDirError(Exception):
    """The run directory is unsafe or cannot be made; the message says why and how to fix it."""


def run_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("EGRESSD_HOME"):
        return Path(env["EGRESSD_HOME"]) / "run"
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "egressd"
    base = Path(env["XDG_CONFIG_HOME"]) if env.get("XDG_CONFIG_HOME") else Path.home() / ".config"
    return base / "egressd" / "run"


def ensure_run_dir(path: Path) -> Path:
    """Create the run directory (0700) if missing, then check it."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise RunDirError(f"cannot create {path}: {exc.strerror or exc}") from exc
    return check_run_dir(path)


def check_run_dir(path: Path) -> Path:
    """The directory is a real directory of this user, mode 0700 (no group/other bits)."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise RunDirError(f"{path}: {exc.strerror or exc}") from exc
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise RunDirError(f"{path} is not a directory (a symlink or a file is never used)")
    if info.st_uid != os.geteuid():
        raise RunDirError(f"{path} belongs to uid {info.st_uid}, not to you (uid {os.geteuid()})")
    if info.st_mode & 0o077:
        mode = stat.S_IMODE(info.st_mode)
        raise RunDirError(f"{path} has mode {mode:04o}; it must be 0700 (chmod 700 {path})")
    return path


def socket_path(directory: Path, pid: int | None = None) -> Path:
    return directory / f"{os.getpid() if pid is None else pid}{SUFFIX}"


def listen(path: Path) -> socket.socket:
    """A listening Unix socket at `path`, mode 0600 (the 0700 directory guards the moment before
    the chmod). A leftover of this pid is removed first: only a dead egressd could have left it."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, 0o600)
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


class Found:
    """A live instance: its pid and control socket. (A plain class: `exec --attach` imports this
    module, and dataclasses or typing would cost it more than the rest of its start.)"""

    __slots__ = ("path", "pid")

    def __init__(self, pid: int, path: Path) -> None:
        self.pid = pid
        self.path = path


def instances(directory: Path) -> list[Found]:
    """The live instances with a socket in `directory`; stale sockets (their pid is gone, or
    nothing listens) are removed."""
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        stem = name.removesuffix(SUFFIX)
        if not name.endswith(SUFFIX) or not stem.isdigit():
            continue
        path = directory / name
        pid = int(stem)
        if alive(pid) and _listening(path):
            found.append(Found(pid, path))
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    return sorted(found, key=lambda f: f.pid)


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        try:
            sock.connect(str(path))
        except OSError as exc:
            return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK)
    return True
