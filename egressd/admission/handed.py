"""The addresses egressd handed a sandboxed child's DNS, per name.

Inside the sandbox the capture's DNS responder asks egressd for a name; egressd decides it, resolves
it with its own resolver and keeps only what its address filter keeps (`Pipeline.addresses_for`).
The child gets those real addresses (an SSRF-guarded client sees what the name really is), and
connects to one of them. The bridge then asks the proxy for that name; the pin step takes the
addresses recorded here instead of resolving again, so the connection goes where the child was
told the name is, even when the name's DNS answers rotate (a CDN's do). A child that asks for a
name it never had resolved gets an ordinary resolution; one that forges a CONNECT gets at most the
addresses egressd itself resolved for that name.

Bounded: at most LIMIT names, each kept KEEP seconds after its last answer.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

from egressd.policy import IPAddress, Policy

LIMIT = 65536
KEEP = 300.0  # longer than the answer's TTL (60 s): clients that cache an answer still find it here
# The ports a name is decided on before its DNS answer: the ones every client uses, and each one a
# rule or the policy names. Allowed on none of them: the child gets a stand-in address, and the
# connection is decided by the name when it is made.
COMMON_PORTS = (443, 80)


class HandedOut:
    """name (canonical) -> the addresses handed out for it, newest answers last."""

    def __init__(self, limit: int = LIMIT, keep: float = KEEP) -> None:
        self.limit = limit
        self.keep = keep
        self._by_name: OrderedDict[str, tuple[float, tuple[IPAddress, ...]]] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._by_name)

    def record(self, name: str, addresses: Iterable[IPAddress], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._by_name.pop(name, None)
        self._by_name[name] = (now, tuple(addresses))
        while len(self._by_name) > self.limit:
            self._by_name.popitem(last=False)

    def get(self, name: str, now: float | None = None) -> tuple[IPAddress, ...] | None:
        found = self._by_name.get(name)
        if found is None:
            return None
        now = time.monotonic() if now is None else now
        if now - found[0] > self.keep:
            del self._by_name[name]
            return None
        return found[1]


def candidate_ports(policy: Policy) -> tuple[int, ...]:
    """The ports a name is decided on before it is resolved for a child's DNS."""
    ports = [*COMMON_PORTS, *policy.ports]
    for ruleset in (policy.allow, *(p.allow for p in policy.profiles.values() if p.allow is not None)):
        ports += [rule.port for rule in ruleset.rules if rule.port is not None]
    return tuple(dict.fromkeys(ports))
