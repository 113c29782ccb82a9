"""The user's files egressd reads while it runs, and the ones it replaces.

Reading (`Snapshot`): a file may be caught half written by an editor or a script that rewrites it in
place, so a reload reads every file it needs exactly once, parses those very bytes, and keeps what
identifies each one (stat and digest) so the watcher can tell whether the file held still
(egressd.platform.reload). Writing (`replace_atomically`): egressd edits files other programs read while
they run (a policy file the watcher reloads, an MCP client's configuration); a reader must see the
old file or the new one, never half of one, and the file keeps its permissions (it may hold tokens).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

# what reads a file's bytes for a loader: a watcher's Snapshot.read, else Path.read_bytes
ReadBytes = Callable[[Path], bytes]
Signature = tuple[int, int, int, int]  # (mtime_ns, size, inode, device)


@dataclass(frozen=True)
class Version:
    """One read of one file: what identifies it and what it held, or why it could not be read."""

    signature: Signature | None
    digest: bytes | None
    errno: int | None = None
    whole: bool = True  # nothing about the file changed while it was read

    def settled(self, quiet: float, now_ns: int) -> bool:
        """Read in one piece and last modified at least `quiet` seconds ago: no writer is at it."""
        return self.signature is not None and self.whole and now_ns - self.signature[0] >= quiet * 1e9


class Snapshot:
    """Every file one load reads, each read once: what the loader parses is what was checked."""

    def __init__(self) -> None:
        self._data: dict[Path, bytes | OSError] = {}
        self.versions: dict[Path, Version] = {}
        self.used: dict[Path, None] = {}  # the files a loader asked for, in order

    @classmethod
    def of(cls, paths: Iterable[Path]) -> Snapshot:
        """Read these files now (a loader then finds them read)."""
        snapshot = cls()
        for path in paths:
            snapshot._look(Path(path))
        return snapshot

    def read(self, path: Path) -> bytes:
        """The file's bytes as this snapshot read them (read now if it has not); raises the
        OSError reading it raised."""
        path = Path(path)
        if path not in self._data:
            self._look(path)
        self.used[path] = None
        data = self._data[path]
        if isinstance(data, OSError):
            raise OSError(data.errno, data.strerror, data.filename)
        return data

    def state(self, paths: Iterable[Path] | None = None) -> tuple[tuple[str, Version], ...]:
        """What identifies these files (default: every file read): equal states, unchanged files."""
        chosen = self.versions if paths is None else paths
        return tuple(sorted((str(p), self.versions[p]) for p in chosen if p in self.versions))

    def contents(self, paths: Iterable[Path] | None = None) -> tuple[tuple[str, bytes | int | None], ...]:
        """What these files hold: equal contents, nothing to reload (a file only touched)."""
        return tuple((p, v.digest if v.digest is not None else v.errno) for p, v in self.state(paths))

    def settled(self, quiet: float) -> bool:
        now = time.time_ns()
        return all(v.settled(quiet, now) for v in self.versions.values())

    def _look(self, path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            self._data[path] = exc
            self.versions[path] = Version(None, None, exc.errno)
            return
        try:
            before = os.fstat(fd)
            chunks = []
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
            after = os.fstat(fd)
        except OSError as exc:
            self._data[path] = exc
            self.versions[path] = Version(None, None, exc.errno)
            return
        finally:
            os.close(fd)
        data = b"".join(chunks)
        whole = before.st_mtime_ns == after.st_mtime_ns and before.st_size == after.st_size == len(data)
        signature = (after.st_mtime_ns, after.st_size, after.st_ino, after.st_dev)
        self._data[path] = data
        self.versions[path] = Version(signature, hashlib.sha256(data).digest(), whole=whole)


def replace_atomically(
    path: Path,
    data: str | bytes,
    *,
    mode: int | None = None,
    check: Callable[[str], None] | None = None,
    durable: bool = True,
) -> None:
    """Replace `path` by `data` (text is written as UTF-8) with one rename; `check(temporary path)`
    may refuse by raising, and then `path` is unchanged. `mode`: the file's permissions (default:
    the file's own, 0644 for a new file); the temporary file is 0600 until it is complete, so a
    private file is never readable by others, not even for a moment. `durable`: on disk before the
    rename (fsync); False only for a file that a crash of the machine may leave empty or lost at
    no cost."""
    if mode is None:
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o644  # a new file (`egressd provider add` creating a policy)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix or ".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        if check is not None:
            check(temp)
        os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
