"""The descriptor budget: who is served, who is answered `overloaded`, and the raised soft limit."""

from __future__ import annotations

import errno
import shutil
import subprocess
import sys

import pytest

from egressd.platform.descriptors import Descriptors, out_of_descriptors

BUDGET = Descriptors(limit=256, budget=160, reserve=64)


@pytest.mark.parametrize(
    ("served", "clients", "held", "room"),
    [
        (0, 0, 0, "serve"),
        (79, 79, 0, "serve"),  # clients take at most half the budget: each needs an upstream too
        (80, 80, 0, "answer"),
        (40, 40, 119, "serve"),
        (40, 40, 120, "answer"),  # the budget is full of upstream connections
        (40, 120, 60, "serve"),  # clients waiting for their answer do not count against it
        (80, 80, 111, "answer"),
        (80, 80, 112, "answer_now"),  # and half the reserve is gone as well
        (40, 192, 0, "answer_now"),
    ],
)
def test_room_for_a_client(served: int, clients: int, held: int, room: str) -> None:
    assert BUDGET.for_client(served, clients, held) == room


@pytest.mark.parametrize(
    ("clients", "held", "more", "fits"),
    [(0, 0, 1, True), (80, 79, 1, True), (80, 80, 1, False), (80, 78, 2, True), (80, 79, 2, False)],
)
def test_upstream_descriptors_fit_the_budget(clients: int, held: int, more: int, fits: bool) -> None:
    assert BUDGET.fits(clients, held, more) is fits


def test_a_small_limit_keeps_a_budget() -> None:
    """prlimit 64: a reserve of a quarter, not 64 (else nothing would ever be served)."""
    code = (
        "from egressd.platform.descriptors import Descriptors; "
        "d = Descriptors.measure(); print(d.reserve, d.budget)"
    )
    out = _under_prlimit(64, 64, code)
    reserve, budget = map(int, out.split())
    assert reserve == 16 and budget > 0


def test_out_of_descriptors_is_found_in_the_causes() -> None:
    try:
        try:
            raise OSError(errno.EMFILE, "Too many open files")
        except OSError as exc:
            raise RuntimeError("could not start") from exc
    except RuntimeError as wrapped:
        assert out_of_descriptors(wrapped)
    assert not out_of_descriptors(OSError(errno.ECONNREFUSED, "refused"))
    assert not out_of_descriptors(None)


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    code = (
        "import resource; from egressd.platform.descriptors import raise_soft_limit; "
        "print(raise_soft_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    assert _under_prlimit(256, 4096, code).split() == ["4096", "4096"]
    assert _under_prlimit(256, 256, code).split() == ["256", "256"]  # nothing to raise to


def _under_prlimit(soft: int, hard: int, code: str) -> str:
    prlimit = shutil.which("prlimit")
    assert prlimit is not None, "prlimit (util-linux) is needed"
    result = subprocess.run(
        [prlimit, f"--nofile={soft}:{hard}", "--", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout
