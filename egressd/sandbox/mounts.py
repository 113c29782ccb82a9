"""What the sandbox may write: the working directory, `--rw` paths; `--ro` paths stay read-only.

Paths are checked and made canonical here (they must exist; symlinks resolved, so the path the
child sees is the one that was checked), then ordered parents first so the most specific path
wins whatever order the options came in: `--rw .` with `--ro ./.git` leaves `.git` read-only.
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


def plan_mounts(workdir: str, rw: Sequence[str], ro: Sequence[str]) -> tuple[Mount, ...]:
    """The working directory (writable) plus `--rw` and `--ro`, checked and ordered."""
    if os.path.realpath(workdir) == "/":
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
    cwd = os.path.realpath(workdir)
    if cwd not in chosen:  # an explicit --ro of the working directory wins over the default
        chosen[cwd] = Mount(cwd, True)
    return order(chosen.values())
