"""The audit file's writer: whole lines, in order, and never a stalled proxy.

A record is written on the proxy's event-loop thread before the decision it records is acted upon.
A regular file takes a write at once or refuses it at once (a full disk), so the caller writes it
itself: one write() per record, in the kernel (safe from a crash of egressd) before anything is
done on it. A line a full disk took only part of is cut off again, so the file never holds a torn
line. A pipe (a FIFO, a log shipper) can stop reading: the descriptor is non-blocking, and what the
pipe does not take waits in a queue of at most `max_queue_bytes` that a thread writes as the reader
reads, in order. What can be neither written nor queued is lost: counted exactly (`lost`), reported
on stderr at most once a minute, and counted in an `audit_dropped` record once writing works again;
meanwhile `writable` is False, which is when `audit.on_failure: refuse` refuses new work.

The same thread follows rotation: once a second it compares the path's device and inode with the
open file's and reopens the path when they differ (moved, deleted, replaced); `reopen()` (SIGHUP)
asks for it at once. The file is opened for appending, so `copytruncate` works too.
"""

from __future__ import annotations

import errno
import math
import os
import select
import stat
import threading
import time
from collections import deque
from collections.abc import Callable

from egressd.platform.log import Logger

logger = Logger(__name__)

TICK = 1.0  # how often the path is compared with the open file (and stderr may be told)
RETRY = 0.25  # how often a sink that failed is tried again; how long one wait for a pipe lasts
REPORT_EVERY = 60.0  # stderr hears about lost records at most this often
CHUNK = 64 * 1024  # the most one write to a regular file carries
CLOSE_WAIT = 2.0  # at exit, how long queued records may take to reach a slow reader
# errors that the descriptor itself cannot recover from: a new one is opened for the next try
_REOPEN = frozenset({errno.EPIPE, errno.EBADF, errno.ENXIO, errno.ESTALE})

CountLine = Callable[[int, float, str], bytes]  # (records lost, when the first was, why) -> a line


def _open(path: str, *, wait: bool) -> int:
    """The path opened for appending, created private (records name hosts and paths).

    `wait`: a FIFO without a reader blocks the open until one comes (at start, as any writer of a
    FIFO does); otherwise the open fails (ENXIO) and is tried again later."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
    fd = os.open(path, flags if wait else flags | os.O_NONBLOCK, 0o600)
    os.set_blocking(fd, False)
    return fd


class LineSink:
    """Appends whole lines to a file, FIFO or other pipe; thread-safe; see the module docstring."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        count_line: CountLine,
        say: Callable[[str], None],
        max_queue_bytes: int = 4 * 1024 * 1024,
        on_failure: str = "refuse",
    ) -> None:
        self.path = os.fspath(path)
        self.max_queue_bytes = max_queue_bytes
        self.on_failure = on_failure  # only for what stderr says happens meanwhile
        self._count_line = count_line
        self._say = say
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._fd = _open(self.path, wait=True)
        self._regular = stat.S_ISREG(os.fstat(self._fd).st_mode)
        self._queue: deque[bytes] = deque()  # whole lines, but the first may be a line's rest
        self._queued = 0
        self._head_begun = False  # the first line's start was written already
        self._full = False  # a line did not fit in the queue; until the reader takes some again
        self._error: str | None = None  # why nothing can be written now
        self._stale = False  # the descriptor cannot recover (EPIPE...): open the path again
        self._reopen_asked = False
        self._closing = False
        self._closed = False
        self._close_by = math.inf
        self.lost = 0  # records not written, since the start
        self._dropped = 0  # ... since the last audit_dropped record
        self._dropped_since = 0.0
        self._drop_reason = ""
        self._reported: tuple[float, int, str] = (-math.inf, 0, "ok")  # when, lost then, state then
        self._thread = threading.Thread(target=self._run, name="egressd-audit", daemon=True)
        self._thread.start()

    # -- what the proxy asks -----------------------------------------------------------------------
    @property
    def writable(self) -> bool:
        """A record given now would be written (or queued): False while the sink fails or its
        queue is full."""
        return self._error is None and not self._full

    @property
    def queued(self) -> int:
        """Bytes waiting for a pipe's reader."""
        return self._queued

    @property
    def problem(self) -> str:
        """Why records cannot be written now ("" when they can)."""
        if self._error is not None:
            return f"{self.path}: {self._error}"
        if self._full:
            return f"{self.path} is not being read ({self._queued} bytes wait)"
        return ""

    def write(self, line: bytes) -> bool:
        """Write or queue one whole line; False when it is lost (and counted)."""
        with self._lock:
            if self._error is not None or self._closed:
                return self._lose(self._error or "the audit log is closed")
            if self._queue and self._queued + len(line) > self.max_queue_bytes:
                self._full = True
                return self._lose(f"{self.path} is not being read ({self._queued} bytes wait)")
            if self._dropped and not self._put_count():
                return self._lose(self._error or f"{self.path} is not being read ({self._queued} bytes wait)")
            return self._put(line) or self._lose(self._error or "write failed")

    def drop(self, why: str) -> None:
        """Count a record that never reached `write` (it could not be formatted)."""
        with self._lock:
            self._lose(why)

    def reopen(self) -> None:
        """Open the path again (SIGHUP, after the file was rotated); from any thread."""
        with self._lock:
            self._reopen_asked = True
            self._wake.notify()

    def close(self) -> None:
        """Write what waits (a reader that does not read gets CLOSE_WAIT seconds), then close."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._close_by = time.monotonic() + CLOSE_WAIT
            self._wake.notify()
        self._thread.join(CLOSE_WAIT + 5)
        with self._lock:
            if self._queue:
                self._lose_queue(f"{self.path} was not read before egressd stopped")
            if self._dropped and self._error is None:
                self._put_count()
            self._closed = True
            self._queue.clear()
            os.close(self._fd)
            self._report(force=True)

    # -- writing (the lock held) -------------------------------------------------------------------
    def _put(self, data: bytes) -> bool:
        """Write now, or queue behind what waits; a pipe's rest is queued. False: failed."""
        if self._queue:
            self._enqueue(data)
            return True
        try:
            written = self._write(data)
        except OSError as exc:
            self._fail(exc)
            return False
        if written < len(data):
            self._enqueue(data[written:])
            self._head_begun = written > 0
        return True

    def _put_count(self) -> bool:
        """The audit_dropped record of the records lost so far, before anything later."""
        line = self._count_line(self._dropped, self._dropped_since, self._drop_reason)
        if self._queue and self._queued + len(line) > self.max_queue_bytes:
            self._full = True
            return False
        if not self._put(line):
            return False
        self._dropped = 0
        return True

    def _write(self, data: bytes) -> int:
        """What the descriptor takes of data now. A regular file that takes part of it and then
        fails (a full disk) is cut back to where the line began: no torn line stays behind."""
        written = 0
        try:
            while written < len(data):
                written += os.write(self._fd, data[written:] if written else data)
        except BlockingIOError:
            pass
        except OSError:
            if written and self._regular:
                self._cut(written)
            raise
        return written

    def _cut(self, written: int) -> None:
        try:
            end = os.lseek(self._fd, 0, os.SEEK_CUR)
            if os.fstat(self._fd).st_size == end:  # nobody (copytruncate) changed it meanwhile
                os.ftruncate(self._fd, end - written)
        except OSError:
            pass

    def _enqueue(self, data: bytes) -> None:
        self._queue.append(data)
        self._queued += len(data)
        if len(self._queue) == 1:
            self._wake.notify()

    def _fail(self, exc: OSError) -> None:
        self._error = exc.strerror or str(exc)
        self._stale = exc.errno in _REOPEN
        self._wake.notify()

    def _lose(self, why: str) -> bool:
        if not self._dropped:
            self._dropped_since = time.time()
        self._dropped += 1
        self.lost += 1
        self._drop_reason = why
        if self._reported[2] == "ok":
            self._wake.notify()  # stderr hears of it now, not at the next tick
        return False

    def _lose_queue(self, why: str) -> None:
        for _ in range(len(self._queue)):
            self._lose(why)
        self._queue.clear()
        self._queued = 0
        self._full = False
        self._head_begun = False

    def _consume(self, written: int) -> None:
        if written:
            self._full = False
        while written:
            head = self._queue[0]
            if written >= len(head):
                self._queue.popleft()
                self._queued -= len(head)
                written -= len(head)
                self._head_begun = False
            else:
                self._queue[0] = head[written:]
                self._queued -= written
                written = 0
                self._head_begun = True

    # -- the thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                self._serve()
                return
            except Exception:  # noqa: BLE001 - a bug must not end the draining and the checks
                logger.exception("egressd: the audit writer failed; going on")
                time.sleep(RETRY)

    def _serve(self) -> None:
        due = time.monotonic() + TICK
        while True:
            with self._lock:
                if not (self._queue or self._reopen_asked or self._closing):
                    wait = RETRY if self._error is not None else due - time.monotonic()
                    self._wake.wait(max(wait, 0.0))
                closing = self._closing
            if self._queue:
                self._drain()
            now = time.monotonic()
            if self._reopen_asked or now >= due:
                self._follow_path()
                due = now + TICK
            if self._error is not None:
                self._retry()
            self._report()
            if closing and (not self._queue or time.monotonic() >= self._close_by or self._error):
                return

    def _drain(self) -> None:
        """One write of what waits, once the pipe can take some (a regular file: at once)."""
        with self._lock:
            if not self._queue or self._error is not None:
                return
            fd, regular = self._fd, self._regular
            chunk = _chunk(self._queue, CHUNK if regular else select.PIPE_BUF)
        if not regular:
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            if not poller.poll(RETRY * 1000):
                return
        with self._lock if regular else _NO_LOCK:
            # only this thread writes while the queue is not empty; a pipe is written unlocked
            try:
                written = self._write(chunk)
            except OSError as exc:
                failed: OSError | None = exc
            else:
                failed = None
        with self._lock:
            if failed is not None:
                self._fail(failed)
                self._lose_queue(self._error or "write failed")
                return
            self._consume(written)
            if self._dropped and self._queued < self.max_queue_bytes:
                self._put_count()

    def _follow_path(self) -> None:
        """Reopen the path when asked (SIGHUP) or when it names another file than the open one."""
        with self._lock:
            asked, self._reopen_asked = self._reopen_asked, False
            fd = self._fd
        if asked or self._moved(fd):
            self._reopen()

    def _moved(self, fd: int) -> bool:
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            return True
        except OSError:
            return False  # cannot tell (a directory not searchable now): keep writing
        opened = os.fstat(fd)
        return (named.st_dev, named.st_ino) != (opened.st_dev, opened.st_ino)

    def _reopen(self) -> bool:
        try:
            fd = _open(self.path, wait=False)
        except OSError as exc:
            with self._lock:
                self._error = f"cannot open it again: {exc.strerror or exc}"
                self._stale = True
                self._lose_queue(self._error)
            return False
        with self._lock:
            old, self._fd = self._fd, fd
            self._regular = stat.S_ISREG(os.fstat(fd).st_mode)
            self._stale = False
            if self._head_begun:  # a line begun in the old file is not finished in the new one
                head = self._queue.popleft()
                self._queued -= len(head)
                self._head_begun = False
                self._lose("its start went to the file before the rotation")
        os.close(old)
        return True

    def _retry(self) -> None:
        """Try a failed sink again with the record of what was lost meanwhile: written, the sink
        works again. A descriptor that cannot recover (the reader closed the FIFO) or a path that
        now names another file is opened again first."""
        with self._lock:
            if self._error is None:
                return
            stale, fd = self._stale, self._fd
        if (stale or self._moved(fd)) and not self._reopen():
            return
        with self._lock:
            self._error = None
            if self._dropped:
                self._put_count()  # fails again: _fail says why
        if self._error is None:
            self._report()

    def _state(self) -> str:
        if self._error is not None:
            return "failing"
        return "full" if self._full else "ok"

    def _report(self, *, force: bool = False) -> None:
        """A stderr line when records were lost or the state changed, at most once a minute."""
        with self._lock:
            state, lost, queued, error = self._state(), self.lost, self._queued, self._error
        at, lost_then, state_then = self._reported
        now = time.monotonic()
        if (lost == lost_then and state == state_then) or (now - at < REPORT_EVERY and not force):
            return
        self._reported = (now, lost, state)
        new = lost - lost_then
        counted = f"{new} records not written since the last report, {lost} in all"
        if self.on_failure == "refuse":
            meanwhile = "new connections and requests are refused (audit_unavailable) until it can be"
        else:
            meanwhile = "records are dropped and counted (audit.on_failure: continue)"
        if state == "failing":
            text = f"cannot write {self.path}: {error} ({counted}); {meanwhile}"
        elif state == "full":
            text = f"{self.path} is not being read ({queued} bytes wait; {counted}); {meanwhile}"
        else:
            text = f"writing {self.path} again; {counted} (audit_dropped records count them)"
        self._say(f"egressd: audit: {text}")


def _chunk(queue: deque[bytes], size: int) -> bytes:
    """The first lines of the queue, at least one, up to `size` bytes together: a pipe takes up to
    PIPE_BUF bytes whole or not at all, so a reader that stops never gets half a line."""
    parts: list[bytes] = []
    total = 0
    for line in queue:
        if parts and total + len(line) > size:
            break
        parts.append(line)
        total += len(line)
    return b"".join(parts)


class _Unlocked:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_LOCK = _Unlocked()
