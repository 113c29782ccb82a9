"""Replacing a user's file atomically: written beside it, checked, renamed over it.

Why one helper: egressd edits files other programs read while they run (a policy file the watcher
reloads, an MCP client's configuration); a reader must see the old file or the new one, never
half of one, and the file keeps its permissions (it may hold tokens).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def replace_atomically(path: Path, text: str, *, check: Callable[[str], None] | None = None) -> None:
    """Replace `path` by `text` with one rename; `check(temporary path)` may refuse by raising,
    and then `path` is unchanged."""
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o644  # a new file (`egressd provider add` creating a policy)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix or ".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        if check is not None:
            check(temp)
        os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
