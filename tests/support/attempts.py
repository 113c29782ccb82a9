"""Reading the connect attempts an audit record lists, without asserting exact timings.

egressd writes a timed-out attempt as `HOST:PORT: timed out after 1s`, the wait rounded to three
significant digits; a wait the native front measured reads `1.01s` on a busy machine. Tests bound
the number (it proves the address was given up after about connect_timeout), never compare it.
"""

from __future__ import annotations

import re

_TIMED_OUT = re.compile(r"(?P<where>.+): timed out after (?P<seconds>\d+(?:\.\d+)?)s")


def timed_out_after(attempt: str, where: str) -> float:
    """The seconds an attempt record says `where` (HOST:PORT) was waited for."""
    match = _TIMED_OUT.fullmatch(attempt)
    assert match is not None and match["where"] == where, (attempt, where)
    return float(match["seconds"])


def gave_up_after(attempt: str, where: str, timeout: float) -> bool:
    """The attempt at `where` timed out after about `timeout` seconds (not much before, nor after)."""
    return 0.9 * timeout <= timed_out_after(attempt, where) < timeout + 0.5
