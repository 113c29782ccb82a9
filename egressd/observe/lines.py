"""What the reports on stderr share: a line as it comes (unless --trace prints every decision
already), a summary when the child exits, and a lock so lines from the proxy's thread never mix."""

from __future__ import annotations

import abc
import contextlib
import threading
from typing import TextIO


class StderrReport(abc.ABC):
    """A report whose summary() is printed once the child has exited."""

    def __init__(self, stream: TextIO, *, lines: bool = True) -> None:
        self._stream = stream
        self._lines = lines  # off when --trace already prints every decision
        self._lock = threading.Lock()

    @abc.abstractmethod
    def summary(self) -> str | None:
        """The text printed once the child has exited, or None for nothing."""

    def print_summary(self) -> None:
        text = self.summary()
        if text is not None:
            self._write(text)

    def _write(self, line: str) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            self._stream.write(line + "\n")
            self._stream.flush()
