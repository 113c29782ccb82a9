"""A real full filesystem for tests: a small tmpfs mounted for one test, filled up on demand.

Why: a write fails with ENOSPC only on a filesystem that is really full, and a full disk is where
an audit log loses records. Mounting a tmpfs needs root (CAP_SYS_ADMIN in the mount namespace the
test shares with egressd); the tests that use it say so and are skipped without it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

__all__ = ["fill_up", "small_tmpfs"]


@contextlib.contextmanager
def small_tmpfs(path: Path, size: int) -> Iterator[Path]:
    """A tmpfs of `size` bytes at `path` (made here), unmounted afterwards."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=False)  # a file is still open in it


def fill_up(directory: Path) -> Path:
    """One file taking every free page of the filesystem at `directory`; unlink it to free them.
    The last page of a file already there keeps its free bytes: a write into it succeeds, the one
    that needs a new page is cut short, as on a real disk that runs full."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    page = b"\0" * 4096
    try:
        while True:
            os.write(fd, page)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
    return filler
