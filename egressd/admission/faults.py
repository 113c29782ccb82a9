"""Fault injection for the fail-closed tests: EGRESSD_FAULT_INJECTION=point[,point...].

Points: `decide` (the decision function raises), `hook` (an addon hook raises before deciding).
Unset in normal use; a real fault and an injected one take the same path to `internal_error`.
"""

from __future__ import annotations

import os

_POINTS = frozenset(p.strip() for p in os.environ.get("EGRESSD_FAULT_INJECTION", "").split(",") if p.strip())


class InjectedFault(RuntimeError):
    pass


def maybe_fail(point: str) -> None:
    if point in _POINTS:
        raise InjectedFault(f"injected fault at {point}")
