"""What the sandbox may write: the working directory, `--rw` paths; `--ro` paths stay read-only.

Paths are checked and made canonical here (they must exist; symlinks resolved, so the path the
child sees is the one that was checked), then ordered parents first so the most specific path
wins whatever order the options came in: `--rw .` with `--ro ./.git` leaves `.git` read-only.

Nothing writable may be a system directory, hold one, or lie in one that holds code or
configuration others run (`/etc`, `/usr`, ...); nor be the user's home or hold it (the child would
plant `~/.bashrc` lines or `authorized_keys`) unless `--rw-home` says so.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class MountError(ValueError):
    """A path option that cannot be honoured; the message names the option and the path."""


@dataclass(frozen=True)
class Mount:
    """One host path shown at the same path inside the sandbox."""

    path: str
    writable: bool


# Writable in none of these, nor in any directory that holds one.
SYSTEM_DIRS: tuple[str, ...] = (
    "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/opt", "/proc",
    "/run", "/sbin", "/srv", "/sys", "/usr", "/var",
)  # fmt: skip
# Nor inside these: code and configuration that other programs run.
SYSTEM_TREES: tuple[str, ...] = (
    "/bin", "/boot", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/sbin", "/usr",
)  # fmt: skip


def within(path: str, top: str) -> bool:
    """`path` is `top` or lies below it (canonical paths)."""
    return path == top or top == "/" or path.startswith(top.rstrip("/") + "/")


def _check_writable(option: str, path: str, home: str | None, rw_home: bool) -> None:
    for system in SYSTEM_DIRS:
        if within(system, path):
            raise MountError(
                f"{option} {path}: the system directory {system} would be writable in the sandbox; "
                "name a project directory instead (cd into it, or --rw a subdirectory)"
            )
    for tree in SYSTEM_TREES:
        if within(path, tree):
            raise MountError(
                f"{option} {path}: it lies in {tree}, which holds code and configuration other programs "
                "run; name a project directory instead"
            )
    if home and within(home, path) and not rw_home:
        raise MountError(
            f"{option} {path}: the home directory {home} would be writable in the sandbox, where the "
            "child could plant start-up files (~/.bashrc, ~/.ssh/authorized_keys); run from a project "
            "directory (or --rw a subdirectory), or give --rw-home if you mean it"
        )


def _canonical(option: str, path: str) -> str:
    full = os.path.realpath(os.path.abspath(os.path.expanduser(path)))
    if not os.path.exists(full):
        raise MountError(f"{option} {path}: no such file or directory (create it first, or drop the option)")
    if full == "/":
        raise MountError(
            f"{option} {path}: the whole file system cannot be {option[2:]}-mounted in the sandbox "
            "(it would undo the private /tmp, /run and /dev); name the directories the command needs"
        )
    return full


def depth(path: str) -> int:
    return 0 if path == "/" else path.rstrip("/").count("/")


def order(mounts: Iterable[Mount]) -> tuple[Mount, ...]:
    """Parents before children (stable): a later, deeper mount covers part of an earlier one."""
    return tuple(sorted(mounts, key=lambda m: depth(m.path)))


def plan_mounts(
    workdir: str | None,
    rw: Sequence[str],
    ro: Sequence[str],
    *,
    home: str | None = None,
    rw_home: bool = False,
) -> tuple[Mount, ...]:
    """The working directory (writable) plus `--rw` and `--ro`, checked and ordered.

    `home`: the user's home directory (canonical), which nothing writable may be or hold unless
    `rw_home`. `workdir` None: no working directory is mounted (a remote session's, which is the
    login's home: it stays masked).
    """
    if workdir is not None and os.path.realpath(workdir) == "/":
        raise MountError(
            "the working directory is /, which would make the whole file system writable in the "
            "sandbox; cd to the project directory first"
        )
    chosen: dict[str, Mount] = {}
    for option, paths, writable in (("--rw", rw, True), ("--ro", ro, False)):
        for path in paths:
            full = _canonical(option, path)
            previous = chosen.get(full)
            if previous is not None and previous.writable != writable:
                raise MountError(f"{full} is given both as --rw and --ro; choose one")
            chosen[full] = Mount(full, writable)
    cwd = os.path.realpath(workdir) if workdir is not None else None
    if cwd is not None and cwd not in chosen:  # an explicit --ro of the working directory wins
        chosen[cwd] = Mount(cwd, True)
    for mount in chosen.values():
        if mount.writable:
            option = "the working directory" if mount.path == cwd and cwd not in map(_real, rw) else "--rw"
            _check_writable(option, mount.path, home, rw_home)
    return order(chosen.values())


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(os.path.expanduser(path)))
