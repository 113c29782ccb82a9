"""The limits step: limits.requests_per_second / burst per child (token buckets),
limits.max_connections (upstream connections open at once) and egressd's own capacity, its file
descriptors (egressd.platform.descriptors: a client beyond it is answered `overloaded`).

The rate limit is taken before the decision, for refused targets as for allowed ones: probing what
the policy refuses is not free.
"""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING

from egressd.platform.descriptors import Descriptors, Room
from egressd.policy.reasons import Reason
from egressd.policy.refusal import Refusal

if TYPE_CHECKING:
    from egressd.admission.in_force import PolicyHolder
    from egressd.admission.state import ConnState


class Limits:
    def __init__(self, policies: PolicyHolder, descriptors: Descriptors | None = None) -> None:
        self.policies = policies
        self.buckets = TokenBuckets()
        self.upstreams: set[str] = set()  # ids of upstream connections open now
        self.descriptors = descriptors or Descriptors.measure()
        # descriptors taken besides client sockets: one per upstream connection, by its id
        self.held: dict[str, int] = {}
        self.held_total = 0

    def room_for_client(self, served: int, clients: int) -> Room:
        """Whether a new client is served, with `clients` client connections open, `served` of
        them within capacity."""
        return self.descriptors.for_client(served, clients, self.held_total)

    def hold(self, key: str, served: int) -> Refusal | None:
        """Take the descriptor of an upstream connection (`key`, once), with `served` clients
        within capacity, or the refusal when it does not fit (`release(key)` gives it back)."""
        if key in self.held:
            return None
        if not self.descriptors.fits(served, self.held_total, 1):
            return overloaded()
        self.held[key] = 1
        self.held_total += 1
        return None

    def release(self, key: str) -> None:
        self.held_total -= self.held.pop(key, 0)

    def rate(self, conn: ConnState) -> Refusal | None:
        """One request's token, per child: its token, or the connection when it has none."""
        limits = self.policies.now.policy.limits
        if limits.requests_per_second is None:
            return None
        wait = self.buckets.take(conn.client_key, limits.requests_per_second, limits.burst)
        if wait <= 0:
            return None
        return Refusal(
            Reason.RATE_LIMITED,
            f"more than {limits.requests_per_second:g} requests per second from this child "
            f"(limits.requests_per_second, burst {limits.burst or 'default'})",
            conn.host or "",
            conn.port,
            retry_after=max(1, math.ceil(wait)),
        )

    def connections(self) -> Refusal | None:
        """Another upstream connection would exceed limits.max_connections."""
        limit = self.policies.now.policy.limits.max_connections
        if limit is None or len(self.upstreams) < limit:
            return None
        detail = f"{limit} upstream connections are open (limits.max_connections)"
        return Refusal(Reason.CONNECTION_LIMIT, detail)


def overloaded(host: str = "", port: int | None = None) -> Refusal:
    """egressd is at its capacity of open connections (file descriptors): try again shortly."""
    detail = "egressd holds as many connections as its open-file limit allows (ulimit -n); try again"
    return Refusal(Reason.OVERLOADED, detail, host, port, retry_after=1)


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

    def forget(self, key: str) -> None:
        with self._lock:
            self._buckets.pop(key, None)


def _depth(rate: float, burst: int | None) -> float:
    """The bucket depth: limits.burst, or twice the rate (at least 1)."""
    return float(burst if burst is not None else max(1, math.ceil(2 * rate)))
