"""The event loops egressd runs on (EGRESSD_UVLOOP=0 selects asyncio's own), for pytest-asyncio.

An async test runs on asyncio's loop; one marked `ON_EVERY_LOOP` runs once on each loop (the
`pytest_asyncio_loop_factories` hook in tests/conftest.py hands these factories to pytest-asyncio).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import uvloop

LOOP_FACTORIES: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "uvloop": uvloop.new_event_loop,
    "asyncio": asyncio.new_event_loop,
}
DEFAULT_LOOP = {"asyncio": asyncio.new_event_loop}

ON_EVERY_LOOP = pytest.mark.asyncio(loop_factories=list(LOOP_FACTORIES))
