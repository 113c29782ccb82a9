"""The resolve, filter and pin steps: an allowed decision becomes the addresses its connection may use.

A name is resolved once (dnspython, with the policy's deadline; concurrent lookups of one name
share one query), every address is classified by the pure filter, and what survives — at most 4 —
is the Pin: the only addresses this connection will ever try. Nothing is resolved again.

The resolver (dnspython, and what its lookups would import on first use) is loaded at start, in a
thread of its own while the child starts (`load_resolver`, from ProxyServer.start): an import at
the first lookup could meet a process out of file descriptors and fail, and it would hold up the
event loop. A lookup that comes before the load is done waits for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Sequence
from types import ModuleType
from typing import NamedTuple

from egressd.admission.decide import refusal_for
from egressd.admission.limits import overloaded
from egressd.net.parent_proxy import parent_for
from egressd.net.pinning import Pin
from egressd.platform.descriptors import out_of_descriptors
from egressd.policy import Decision, IPAddress, Policy, filter_addresses, resolution_refusal
from egressd.policy.reasons import Reason
from egressd.policy.refusal import Refusal


class Pinned(NamedTuple):
    """The outcome of resolving one allowed decision: a pin, or the refusal and why (a named
    tuple: made for every tunnel, and a frozen dataclass costs four times as much to make)."""

    decision: Decision  # the allowed decision, or the refusal the addresses made of it
    pin: Pin | None
    refusal: Refusal | None
    resolved: tuple[IPAddress, ...]
    # the DNS lookup this pin waited for, if any: (seconds, ok | dns_error | dns_timeout)
    lookup: tuple[float, str] | None = None


_resolver: ModuleType | None = None  # egressd.net.dns, once loaded
_loading: concurrent.futures.Future[ModuleType] | None = None
_load_lock = threading.Lock()


def load_resolver() -> concurrent.futures.Future[ModuleType]:
    """Load the resolver in a thread of its own, once (again after a load that failed)."""
    global _loading
    with _load_lock:
        if _loading is None or (_loading.done() and _loading.exception() is not None):
            _loading = concurrent.futures.Future()
            threading.Thread(target=_load, args=(_loading,), name="egressd-load", daemon=True).start()
        return _loading


def _load(done: concurrent.futures.Future[ModuleType]) -> None:
    global _resolver
    try:
        from egressd.net import dns as resolver

        resolver.load()
    except BaseException as exc:  # noqa: BLE001 - handed to the lookups that wait
        done.set_exception(exc)
        return
    _resolver = resolver
    done.set_result(resolver)


async def resolver_module() -> ModuleType:
    """The resolver module, once loaded (waits for the load started at start)."""
    return _resolver if _resolver is not None else await asyncio.wrap_future(load_resolver())


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
            return Pinned(refused, None, refusal_for(refused), tuple(addresses))
        resolved = tuple(addresses)
    elif decision.needs_resolution:
        resolver = _resolver
        if resolver is None:
            try:
                resolver = await asyncio.wrap_future(load_resolver())
            except Exception as exc:
                if not out_of_descriptors(exc):
                    raise
                refusal = overloaded(target.host.text, target.port)
                return Pinned(decision, None, refusal, (), (0.0, refusal.reason))
        assert target.host.name is not None
        started = time.monotonic()
        try:
            addresses = await resolver.resolve(
                target.host.name, policy.resolver.nameservers, policy.limits.dns_timeout
            )
        except resolver.ResolveError as e:
            lookup = (time.monotonic() - started, e.reason)
            refusal = Refusal(e.reason, e.detail, target.host.text, target.port)
            return Pinned(decision, None, refusal, (), lookup)
        lookup = (time.monotonic() - started, "ok")
        kept, verdicts = filter_addresses(decision, addresses, policy)
        if not kept:
            refused = resolution_refusal(decision, verdicts)
            # the addresses go with the refusal: its hint names a rule for each
            refusal = dataclasses.replace(refusal_for(refused), addresses=tuple(map(str, addresses)))
            return Pinned(refused, None, refusal, tuple(addresses), lookup)
        resolved = tuple(addresses)
    else:
        kept = list(decision.addresses)
        resolved = tuple(kept)
        if not kept:
            refused = Decision(
                allowed=False,
                reason=Reason.INTERNAL_ERROR,
                rule=decision.rule,
                target=target,
                detail="allowed decision without an address",
            )
            return Pinned(refused, None, refusal_for(refused), ())
    # by position, per tunnel: host, port, addresses, connect_timeout, connected, attempts, via
    via = parent_for(policy, target)
    found = Pin(target.host.text, target.port, tuple(kept), policy.limits.connect_timeout, None, [], via)
    return Pinned(decision, found, None, resolved, lookup)
