"""What everyday commands expect to find inside the sandbox, and how egressd provides it.

- A virtual environment under `/tmp` or `/run` (the one `$VIRTUAL_ENV` names, or the one the
  command's program lives in) would vanish inside (`python: not found`): it is shown read-only.
  Any other program the command names there cannot be found inside: egressd says so, and how
  to show it.
- pyenv's shims directory: `pyenv rehash` (run by pyenv after every `pip install`) rewrites it,
  and fails when it is read-only ("cannot rehash: ... isn't writable", and pip's exit status with
  it). Inside it is private and writable, filled with links to the host's shims (shown read-only
  in the private /tmp): the child's shims never reach the user's, and nothing is copied.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, Sequence

from egressd.sandbox.bwrap import privately_empty
from egressd.sandbox.mounts import Mount

SHIMS_VIEW = "/tmp/.egressd-pyenv-shims"  # beside the private caches (run.PRIVATE_CACHE)


def _venv_root(program: str) -> str | None:
    """The virtual environment `program` (…/bin/NAME) belongs to, if it belongs to one."""
    root = os.path.dirname(os.path.dirname(program))
    return root if os.path.isfile(os.path.join(root, "pyvenv.cfg")) else None


def command_paths(
    command: Sequence[str], env: Mapping[str, str], mounts: Sequence[Mount], warn: Callable[[str], None]
) -> tuple[str, ...]:
    """Virtual environments to show read-only, so the command finds its interpreter; a warning
    for any other program it names that the sandbox's own /tmp or /run would hide."""
    shown: list[str] = []
    venv = env.get("VIRTUAL_ENV", "")
    if os.path.isabs(venv) and os.path.isfile(os.path.join(venv, "pyvenv.cfg")):
        shown.append(os.path.realpath(venv))
    program = shutil.which(command[0], path=env.get("PATH")) if command else None
    if program is not None:
        program = os.path.abspath(program)
        root = _venv_root(program)
        if root is not None:
            shown.append(os.path.realpath(root))
        elif privately_empty(os.path.realpath(program), mounts):
            directory = os.path.dirname(program)
            warn(
                f"{command[0]} is {program}, in the sandbox's own empty /tmp or /run: it will not be "
                f"found inside; --ro {directory} shows it"
            )
    return tuple(dict.fromkeys(path for path in shown if privately_empty(path, mounts)))


def pyenv_shims(env: Mapping[str, str]) -> str | None:
    """pyenv's shims directory, when the child's PATH uses it."""
    root = env.get("PYENV_ROOT") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".pyenv")
    shims = os.path.realpath(os.path.join(root, "shims"))
    on_path = {os.path.realpath(p) for p in env.get("PATH", "").split(os.pathsep) if p}
    return shims if shims in on_path and os.path.isdir(shims) else None


def private_views(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """(directory, read-only view of it) for each directory the child must be able to write
    privately: pyenv's shims."""
    shims = pyenv_shims(env)
    return ((shims, SHIMS_VIEW),) if shims is not None else ()
