"""Per-child request rate limiting (token buckets) for limits.requests_per_second / limits.burst."""

from __future__ import annotations

import math
import threading
import time


class TokenBuckets:
    """One bucket per child key; take() answers 0 when allowed, else the seconds until a token."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}

    def take(self, key: str, rate: float, burst: int | None) -> float:
        depth = _depth(rate, burst)
        now = time.monotonic()
        with self._lock:
            tokens, last = self._buckets.get(key, (depth, now))
            tokens = min(depth, tokens + (now - last) * rate)
            if tokens >= 1:
                self._buckets[key] = (tokens - 1, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1 - tokens) / rate

    def refund(self, key: str, rate: float, burst: int | None) -> None:
        """Give back one token taken by take() (never above the bucket's depth)."""
        depth = _depth(rate, burst)
        with self._lock:
            entry = self._buckets.get(key)
            if entry is not None:
                self._buckets[key] = (min(depth, entry[0] + 1), entry[1])

    def forget(self, key: str) -> None:
        with self._lock:
            self._buckets.pop(key, None)


def _depth(rate: float, burst: int | None) -> float:
    """The bucket depth: limits.burst, or twice the rate (at least 1)."""
    return float(burst if burst is not None else max(1, math.ceil(2 * rate)))
