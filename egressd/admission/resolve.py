"""The resolve, filter and pin steps: an allowed decision becomes the addresses its connection may use.

A name is resolved once (dnspython, with the policy's deadline; concurrent lookups of one name
share one query), every address is classified by the pure filter, and what survives — at most 4 —
is the Pin: the only addresses this connection will ever try. Nothing is resolved again. dnspython
is imported with the first name to resolve: a child that reaches none (`egressd exec -- true`, or
only IP literals) never loads it.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from egressd.admission.decide import refusal_for
from egressd.admission.pinning import Pin
from egressd.admission.upstream import parent_for
from egressd.policy import Decision, IPAddress, Policy, filter_addresses, resolution_refusal
from egressd.refusal import Refusal


class Pinned(NamedTuple):
    """The outcome of resolving one allowed decision: a pin, or the refusal and why (a named
    tuple: made for every tunnel, and a frozen dataclass costs four times as much to make)."""

    decision: Decision  # the allowed decision, or the refusal the addresses made of it
    pin: Pin | None
    refusal: Refusal | None
    resolved: tuple[IPAddress, ...]
    # the DNS lookup this pin waited for, if any: (seconds, ok | dns_error | dns_timeout)
    lookup: tuple[float, str] | None = None


async def pin(decision: Decision, policy: Policy) -> Pinned:
    target = decision.target
    assert decision.allowed and target is not None
    lookup: tuple[float, str] | None = None
    if decision.needs_resolution:
        from egressd.admission.resolver import ResolveError, resolve

        assert target.host.name is not None
        started = time.monotonic()
        try:
            addresses = await resolve(
                target.host.name, policy.resolver.nameservers, policy.limits.dns_timeout
            )
        except ResolveError as e:
            lookup = (time.monotonic() - started, e.reason)
            refusal = Refusal(e.reason, e.detail, target.host.text, target.port)
            return Pinned(decision, None, refusal, (), lookup)
        lookup = (time.monotonic() - started, "ok")
        kept, verdicts = filter_addresses(decision, addresses, policy)
        if not kept:
            refused = resolution_refusal(decision, verdicts)
            return Pinned(refused, None, refusal_for(refused), tuple(addresses), lookup)
        resolved = tuple(addresses)
    else:
        kept = list(decision.addresses)
        resolved = tuple(kept)
        if not kept:
            refused = Decision(
                allowed=False,
                reason="internal_error",
                rule=decision.rule,
                target=target,
                detail="allowed decision without an address",
            )
            return Pinned(refused, None, refusal_for(refused), ())
    found = Pin(
        host=target.host.text,
        port=target.port,
        addresses=tuple(kept),
        connect_timeout=policy.limits.connect_timeout,
        via=parent_for(policy, target),
    )
    return Pinned(decision, found, None, resolved, lookup)
