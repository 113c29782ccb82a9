"""Change notices for what a decision depends on besides the request: the policy, the issued
credentials, the redirect memory and egressd's own addresses.

The native tunnel front serves a CONNECT head again only while none of these changed since Python
decided it; every holder of such state calls `changed()` after each change.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Changes:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    def watch(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._callbacks.append(callback)

    def unwatch(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

    def changed(self) -> None:
        with self._lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            callback()
