"""The loggers of the modules a wrapped command's start imports, made on their first message.

Those modules log only when something fails; the logging package (with traceback and string,
~3 ms of CPU) loads with that first message instead of delaying every child's start.
"""

from __future__ import annotations

from typing import Any


class Logger:
    """`logging.getLogger(name)`, looked up at each call: `logger.exception(...)` as usual."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attr: str) -> Any:
        import logging

        return getattr(logging.getLogger(self.name), attr)
