"""Watch the files egressd reads while it runs, and hand every good new version on whole.

One watcher serves every such file: the policy (with the policies merged into it and the files its
secrets and parent proxy credentials are read from) and the gateway's token file. Polling (stat and
a digest of the content) instead of inotify: it works on every platform, through symlink swaps
(Kubernetes ConfigMaps) and editors' rename-on-save, and these files are small.

A file is applied whole or not at all:
- a load parses exactly the bytes that were read and hashed (`egressd.platform.files.Snapshot`), each file
  read once: never a second read that may catch the file half rewritten;
- a changed file is applied once it has held still across one poll: the same signature (mtime,
  size, inode) and digest on two consecutive looks. A file being rewritten in place is not applied
  half-way; a writer that stops longer than a poll in the middle of a file is the one case no
  reader can tell from a finished file, which is why files should be replaced by a rename;
- the first load and a forced one (SIGHUP, an edit egressd made itself) take files last modified
  longer than QUIET ago at once, and otherwise look again QUIET later; a file still changing then
  is left to the polls (the first load waits up to START_WAIT for it);
- a version that does not load is reported once and the last good one stays in force: a typo must
  never open or close everything.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from egressd.platform.files import Snapshot

if TYPE_CHECKING:
    import asyncio

POLL = 0.5  # seconds between two looks at the files
QUIET = 0.1  # a forced load's second look comes this long after the first
START_WAIT = 5.0  # the first load waits at most this long for its files to hold still


class UnsettledError(Exception):
    """The files kept changing while the first load read them (being written, and not by a rename)."""


# Plain classes: a poll's result, read once and dropped (a dataclass would only add start-up time).
class _Changed[T]:
    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value = value


class _Failed:
    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


class FileWatcher[T]:
    """Builds T from files with `load(snapshot)` and hands each new good one to `on_change`; a
    version that fails to load goes to `on_error` (once). `load` reads every file it needs through
    the snapshot it is given: those files are the ones watched.

    It runs as a task of the loop that awaits `watch()` (the proxy's, in a session), which is where
    both callbacks are called; `start()` gives it a thread and loop of its own instead."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        load: Callable[[Snapshot], T],
        on_change: Callable[[T], None],
        on_error: Callable[[str], None],
        *,
        interval: float = POLL,
        quiet: float = QUIET,
        name: str = "egressd-watch",
    ) -> None:
        self.path = Path(path)  # the main file (the others are found by loading it)
        self.loader = load
        self.on_change = on_change
        self.on_error = on_error
        self.interval = interval
        self.quiet = quiet
        self.name = name
        self._files: tuple[Path, ...] = (self.path,)  # what the last load read
        self._seen: object = None  # the files' signatures and digests at the last look
        self._done: object = None  # the contents last applied or reported broken
        self._last_error: str | None = None
        self._forced = False
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    # -- public --------------------------------------------------------------------------------
    def load(self) -> T:
        """The first load: from files that hold still (waiting up to START_WAIT); raises what
        `load` raises, OSError, or UnsettledError."""
        deadline = time.monotonic() + START_WAIT
        while True:
            files = Snapshot.of(self._files)
            error: Exception | None = None
            try:
                result = self.loader(files)
            except Exception as exc:  # reported once the files are known to be whole
                error = exc
            self._files = tuple(files.used) or (self.path,)
            if self._held_still(files):
                break
            if time.monotonic() > deadline:
                raise UnsettledError(
                    f"{self.path}: still changing after {START_WAIT:g} s; replace it atomically (rename)"
                )
        self._seen, self._done = files.state(self._files), files.contents(self._files)
        if error is not None:
            raise error
        self._last_error = None
        return result

    async def watch(self) -> None:
        """Look every `interval` until stop(). Each look — reading the files, and loading a changed
        version (parsing, a secret's command) — runs in a worker thread, so the loop never waits on
        a file; what it finds is handed on here, on the loop."""
        import asyncio  # loaded with the loop that runs this

        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval)
            self._wake.clear()
            if self._stop.is_set():
                break
            force, self._forced = self._forced, False
            try:
                found = await asyncio.to_thread(self._poll, force)
            except Exception as exc:  # the watcher must outlive any surprise
                found = self._report(f"{self.path}: {exc}", force=True)
            self._hand_on(found)

    def start(self) -> FileWatcher[T]:
        """Watch on a thread and loop of its own (where no other loop runs)."""
        import asyncio

        self._thread = threading.Thread(target=asyncio.run, args=(self.watch(),), name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake_up()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def trigger(self) -> None:
        """Reload at once even if the files look unchanged (SIGHUP, an edit egressd made); from any
        thread."""
        self._forced = True
        self._wake_up()

    def poll(self, force: bool = False) -> bool:
        """Look once, here and now; True if a new version was handed to on_change."""
        return self._hand_on(self._poll(force))

    # -- internals -----------------------------------------------------------------------------
    def _wake_up(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(wake.set)

    def _hand_on(self, found: _Changed[T] | _Failed | None) -> bool:
        if isinstance(found, _Failed):
            with contextlib.suppress(Exception):
                self.on_error(found.message)
            return False
        if found is None:
            return False
        try:
            self.on_change(found.value)
        except Exception as exc:
            return self._hand_on(self._report(f"applying {self.path} failed: {exc}", force=True))
        return True

    def _poll(self, force: bool) -> _Changed[T] | _Failed | None:
        look = Snapshot.of(self._files)
        state = look.state()
        if not force and look.contents() == self._done:
            self._seen = state  # unchanged, or only touched
            return None
        if state != self._seen:
            self._seen = state
            # changed since the last look: maybe being written; wait for it to hold still
            if not force or not self._held_still(look):
                self._forced = self._forced or force  # a forced load waits for the polls
                return None
        return self._apply(look, force)

    def _held_still(self, files: Snapshot) -> bool:
        """The files were last modified longer than `quiet` ago, or read the same `quiet` later."""
        if files.settled(self.quiet):
            return True
        if self._stop.wait(self.quiet):
            return False
        return Snapshot.of(files.versions).state() == files.state()

    def _apply(self, look: Snapshot, force: bool) -> _Changed[T] | _Failed | None:
        looked = set(self._files)
        try:
            result = self.loader(look)
        except Exception as exc:
            self._files = tuple(look.used) or (self.path,)
            self._seen, self._done = look.state(self._files), look.contents(self._files)
            return self._report(self._message(exc), force)
        self._files = tuple(look.used) or (self.path,)
        self._seen = look.state(self._files)
        if not looked.issuperset(self._files):
            # this version reads files the look had not seen: applied once they too held still
            self._forced = self._forced or force
            return None
        self._done, self._last_error = look.contents(self._files), None
        return _Changed(result)

    def _message(self, exc: Exception) -> str:
        if isinstance(exc, OSError):
            return f"{exc.filename or self.path}: cannot read: {exc.strerror or exc}"
        return str(exc) or type(exc).__name__

    def _report(self, message: str, force: bool) -> _Failed | None:
        """The failure to hand on, unless it is the one reported last (each is told once)."""
        if message == self._last_error and not force:
            return None
        self._last_error = message
        return _Failed(message)
