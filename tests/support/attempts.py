"""Timing without exact timings: the connect attempts an audit record lists, and waiting for a
condition with a deadline instead of sleeping for a guessed time.

egressd writes a timed-out attempt as `HOST:PORT: timed out after 1s`, the wait rounded to three
significant digits. Tests bound the number (it proves the address was given up after about
connect_timeout), never compare it. A test that must wait for something (a request to reach the
upstream, an audit record to be written) polls for it with `wait_until`: a busy machine only makes
the wait longer, never the test wrong.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

_TIMED_OUT = re.compile(r"(?P<where>.+): timed out after (?P<seconds>\d+(?:\.\d+)?)s")


def timed_out_after(attempt: str, where: str) -> float:
    """The seconds an attempt record says `where` (HOST:PORT) was waited for."""
    match = _TIMED_OUT.fullmatch(attempt)
    assert match is not None and match["where"] == where, (attempt, where)
    return float(match["seconds"])


def gave_up_after(attempt: str, where: str, timeout: float) -> bool:
    """The attempt at `where` timed out after about `timeout` seconds (not much before, nor after)."""
    return 0.9 * timeout <= timed_out_after(attempt, where) < timeout + 0.5


def wait_until[T](condition: Callable[[], T], what: str, timeout: float = 20, step: float = 0.05) -> T:
    """Poll `condition` until it returns something true (returned); fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(step)
