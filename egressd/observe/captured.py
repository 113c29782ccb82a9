"""Which programs ignored the proxy variables: their connections were captured (exec, mcp run,
acp, sandbox) and decided like any other, but a user should learn which tools do.

One stderr line the first time a program's connection is captured, and at exit one summary naming
every such program with its count. The program is the one holding the client's socket in the
child's network namespace (the identity step looks it up for every captured connection). `--quiet`
turns both off. An observer of the pipeline's events, like the refusal report.
"""

from __future__ import annotations

import os
from typing import TextIO

from egressd.admission.events import Decided, Event
from egressd.observe.lines import StderrReport

MAX_PROGRAMS = 100  # named in the summary; a child running a thousand binaries does not grow egressd
UNKNOWN = "a program egressd could not name"


def _printable(text: str) -> str:
    """A program's name is the child's to choose: it must not drive the user's terminal."""
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def _once_per_connection(event: Decided) -> bool:
    """The one record of each captured connection: its refusal (stage connect), or its upstream
    connection's (stage connection, opened or not), which is an allowed tunnel's only record."""
    return event.stage == "connection" or (event.stage == "connect" and not event.allowed)


class CapturedReport(StderrReport):
    """Counts of captured connections per program, told once each and summed up at exit."""

    def __init__(self, stream: TextIO, *, lines: bool = True) -> None:
        super().__init__(stream, lines=lines)
        self._programs: dict[str, int] = {}
        self._others = 0

    def observe(self, event: Event) -> None:
        """A captured connection's decision: its program counted, and told the first time."""
        if type(event) is not Decided:
            return
        assert isinstance(event, Decided)
        if not event.captured or not _once_per_connection(event):
            return
        name = _printable(os.path.basename(event.exe)) if event.exe else UNKNOWN
        with self._lock:
            seen = self._programs.get(name)
            if seen is None and len(self._programs) >= MAX_PROGRAMS:
                self._others += 1
                return
            self._programs[name] = (seen or 0) + 1
        if seen is None and self._lines:
            pid = f" (pid {event.pid})" if event.pid else ""
            self._write(
                f"egressd: {name}{pid} ignores the proxy variables: its connections are captured and "
                "decided like any other"
            )

    def summary(self) -> str | None:
        """`egressd: captured 4 connections of programs that ignore the proxy variables: node (3),
        curl (1)`, or None when nothing was captured."""
        with self._lock:
            programs = dict(self._programs)
            others = self._others
        total = sum(programs.values()) + others
        if not total:
            return None
        named = ", ".join(f"{name} ({count})" for name, count in programs.items())
        more = f" and {others} of other programs" if others else ""
        return (
            f"egressd: captured {total} connection{'s' if total != 1 else ''} of programs that ignore "
            f"the proxy variables (decided like any other): {named}{more}"
        )
