"""What the reports on stderr share: a line as it comes (unless --trace prints every decision
already), a summary when the child exits, and a lock so lines from the proxy's thread never mix."""

from __future__ import annotations

import contextlib
import threading
from typing import TextIO


class StderrReport:
    """A report whose summary() is printed once the child has exited."""

    def __init__(self, stream: TextIO, *, lines: bool = True) -> None:
        self._stream = stream
        self._lines = lines  # off when --trace already prints every decision
        self._lock = threading.Lock()

    def summary(self) -> str | None:
        raise NotImplementedError

    def print_summary(self) -> None:
        text = self.summary()
        if text is not None:
            self._write(text)

    def _write(self, line: str) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            self._stream.write(line + "\n")
            self._stream.flush()
