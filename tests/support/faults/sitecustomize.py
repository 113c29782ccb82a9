"""Fault injection for the fail-closed tests, from outside egressd's code.

An egressd process started with this directory on PYTHONPATH and EGRESSD_TEST_FAULT set imports
this module before anything else (Python's `site`), and it makes one step raise as a bug would:
`decide` (the decision function, inside the decider) or `hook` (the admission pipeline, before
any step). A real fault and an injected one take the same path to `internal_error`, and egressd
itself carries no switch for it.
"""

from __future__ import annotations

import os

_POINT = os.environ.get("EGRESSD_TEST_FAULT", "")


class InjectedFault(RuntimeError):
    pass


def _raise(*_args: object, **_kwargs: object) -> None:
    raise InjectedFault(f"injected fault at {_POINT}")


async def _raise_async(*_args: object, **_kwargs: object) -> None:
    _raise()


if _POINT == "decide":
    from egressd.admission.decide import Decider

    Decider._decide = _raise  # type: ignore[method-assign]
elif _POINT == "hook":
    from egressd.admission.pipeline import Pipeline

    Pipeline._admit = _raise_async  # type: ignore[method-assign]
elif _POINT:
    raise SystemExit(f"EGRESSD_TEST_FAULT={_POINT!r}: no such point (decide, hook)")
