"""The resolve, filter and pin steps: an allowed decision becomes the addresses its connection may use.

A name is resolved once (dnspython, with the policy's deadline; concurrent lookups of one name
share one query), every address is classified by the pure filter, and what survives — at most 4 —
is the Pin: the only addresses this connection will ever try. Nothing is resolved again.

The resolver is loaded at start in a thread of its own (egressd.net.loader); a lookup that comes
before the load is done waits for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence

from egressd.admission.decide import refusal_for
from egressd.admission.limits import overloaded
from egressd.net import loader
from egressd.net.parent_proxy import parent_for
from egressd.net.pinning import Pin
from egressd.platform.descriptors import out_of_descriptors
from egressd.policy import Decision, IPAddress, Policy, filter_addresses, resolution_refusal
from egressd.policy.reasons import Reason
from egressd.policy.refusal import Refusal

# The outcome of resolving one allowed decision: (decision, pin, refusal, resolved, lookup) — the
# allowed decision or the refusal the addresses made of it; the pin, or the refusal and why; the
# addresses resolved; the DNS lookup this pin waited for, if any: (seconds, ok | dns_error |
# dns_timeout). A plain tuple: made for every tunnel and unpacked at once by the pipeline, which a
# named tuple's class makes and unpacks by their generic paths.
Pinned = tuple[Decision, Pin | None, Refusal | None, tuple[IPAddress, ...], tuple[float, str] | None]


async def pin(decision: Decision, policy: Policy, known: Sequence[IPAddress] | None = None) -> Pinned:
    """`known`: the addresses a sandboxed child's DNS was given for this name (handed.py): taken
    instead of a new lookup, and filtered as one would be."""
    target = decision.target
    assert decision.allowed and target is not None
    lookup: tuple[float, str] | None = None
    if decision.needs_resolution and known is not None:
        addresses = list(known)
        kept, verdicts = filter_addresses(decision, addresses, policy)
        if not kept:
            refused = resolution_refusal(decision, verdicts)
            return refused, None, refusal_for(refused), tuple(addresses), None
        resolved = tuple(addresses)
    elif decision.needs_resolution:
        resolver = loader.loaded()
        if resolver is None:
            try:
                resolver = await asyncio.wrap_future(loader.load_resolver())
            except Exception as exc:
                if not out_of_descriptors(exc):
                    raise
                refusal = overloaded(target.host.text, target.port)
                return decision, None, refusal, (), (0.0, refusal.reason)
        assert target.host.name is not None
        started = time.monotonic()
        try:
            addresses = await resolver.resolve(
                target.host.name, policy.resolver.nameservers, policy.limits.dns_timeout
            )
        except resolver.ResolveError as e:
            lookup = (time.monotonic() - started, e.reason)
            refusal = Refusal(e.reason, e.detail, target.host.text, target.port)
            return decision, None, refusal, (), lookup
        lookup = (time.monotonic() - started, "ok")
        kept, verdicts = filter_addresses(decision, addresses, policy)
        if not kept:
            refused = resolution_refusal(decision, verdicts)
            # the addresses go with the refusal: its hint names a rule for each
            refusal = dataclasses.replace(refusal_for(refused), addresses=tuple(map(str, addresses)))
            return refused, None, refusal, tuple(addresses), lookup
        resolved = tuple(addresses)
    else:
        kept = resolved = decision.addresses  # an IP literal's: a tuple already, copied by nobody
        if not kept:
            refused = Decision(
                allowed=False,
                reason=Reason.INTERNAL_ERROR,
                rule=decision.rule,
                target=target,
                detail="allowed decision without an address",
            )
            return refused, None, refusal_for(refused), (), None
    # by position, per tunnel: host, port, addresses, connect_timeout, connected, attempts, via
    via = parent_for(policy, target)
    found = Pin(target.host.text, target.port, tuple(kept), policy.limits.connect_timeout, None, [], via)
    return decision, found, None, resolved, lookup
