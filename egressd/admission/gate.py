"""The gatekeeper: the policy decision plus resolution and address filtering, for any front end.

HTTP CONNECT, plain HTTP, SOCKS5 (and later the sandbox bridge and SSH relay) all come here; the
decision itself is `egressd.policy.decide`, the one function. What this module adds is the I/O the
pure core must not do: DNS with a deadline, and turning the outcome into a Pin or a Refusal.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from egressd.admission import faults
from egressd.admission.changes import Changes
from egressd.admission.pinning import Pin
from egressd.admission.resolver import ResolveError, resolve
from egressd.policy import (
    Client,
    Decision,
    IPAddress,
    Policy,
    decide,
    filter_addresses,
    make_target,
    resolution_refusal,
)
from egressd.refusal import Refusal

logger = logging.getLogger(__name__)

# An approver answers mode=ask decisions; None means nobody can be asked (refuse).
Approver = Callable[[Decision], bool]


@dataclass
class Admission:
    """The outcome of admitting one upstream connection."""

    decision: Decision
    pin: Pin | None = None
    refusal: Refusal | None = None
    resolved: tuple[IPAddress, ...] = ()

    @property
    def allowed(self) -> bool:
        return self.pin is not None


class PolicyHolder:
    """The policy in force; swapped atomically on reload."""

    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self._lock = threading.Lock()
        self.changes = Changes()

    def get(self) -> Policy:
        return self._policy

    def set(self, policy: Policy) -> None:
        with self._lock:
            self._policy = policy
        self.changes.changed()


class Gatekeeper:
    def __init__(self, policies: PolicyHolder, approver: Approver | None = None) -> None:
        self.policies = policies
        self.approver = approver
        self.self_addresses: tuple[tuple[IPAddress, int], ...] = ()
        self.changes = Changes()

    def add_self_address(self, host: str, port: int) -> None:
        # a new tuple on change: decide() recognises the same tuple and reuses its checked copy
        address = (ipaddress.ip_address(host), port)
        if address not in self.self_addresses:
            self.self_addresses = (*self.self_addresses, address)
            self.changes.changed()

    def decide(
        self,
        host: str,
        port: int,
        profile: str | None,
        *,
        scheme: str | None = None,
        method: str | None = None,
        path: str | None = None,
    ) -> Decision:
        """The one decision, never raising: an unparseable target or an internal error refuses."""
        policy = self.policies.get()
        try:
            target = make_target(host, port, scheme=scheme, path=path, method=method)
        except ValueError as e:
            return Decision(allowed=False, reason="invalid_target", rule=None, target=None, detail=str(e))
        try:
            faults.maybe_fail("decide")
            decision = decide(target, Client(profile=profile), policy, self_addresses=self.self_addresses)
        except Exception as e:  # noqa: BLE001 - fail closed on any bug
            logger.exception("decision failed")
            return Decision(allowed=False, reason="internal_error", rule=None, target=target, detail=repr(e))
        if decision.ask:
            return self._ask(decision)
        return decision

    def _ask(self, decision: Decision) -> Decision:
        approved = False
        if self.approver is not None:
            try:
                approved = bool(self.approver(decision))
            except Exception:  # noqa: BLE001
                logger.exception("approver failed")
        if approved:
            return Decision(
                allowed=True,
                reason="approved",
                rule="mode: ask (approved)",
                target=decision.target,
                detail=decision.detail,
                needs_resolution=decision.target is not None and not decision.target.host.is_ip,
                addresses=decision.addresses,
            )
        return Decision(
            allowed=False,
            reason="no_approver",
            rule="mode: ask",
            target=decision.target,
            detail="mode is 'ask' and no approver is connected to answer",
        )

    async def admit(self, decision: Decision) -> Admission:
        """Resolve (once) and filter the addresses of an allowed decision into a Pin."""
        if not decision.allowed:
            return Admission(decision, refusal=refusal_for(decision))
        if decision.needs_inspection:
            refused = Decision(
                allowed=False,
                reason="needs_inspection",
                rule=decision.rule,
                target=decision.target,
                detail="this host is admitted only for some paths or methods, which needs TLS inspection",
            )
            return Admission(refused, refusal=refusal_for(refused))
        target = decision.target
        assert target is not None
        policy = self.policies.get()
        if decision.needs_resolution:
            assert target.host.name is not None
            nameservers = policy.resolver.nameservers
            try:
                addresses = await resolve(target.host.name, nameservers, policy.limits.dns_timeout)
            except ResolveError as e:
                return Admission(decision, refusal=Refusal(e.reason, e.detail, target.host.text, target.port))
            kept, verdicts = filter_addresses(decision, addresses, policy)
            if not kept:
                refused = resolution_refusal(decision, verdicts)
                return Admission(refused, refusal=refusal_for(refused), resolved=tuple(addresses))
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
                return Admission(refused, refusal=refusal_for(refused))
        pin = Pin(
            host=target.host.text,
            port=target.port,
            addresses=tuple(kept),
            connect_timeout=policy.limits.connect_timeout,
        )
        return Admission(decision, pin=pin, resolved=resolved)


def refusal_for(decision: Decision) -> Refusal:
    target = decision.target
    return Refusal(
        reason=decision.reason,
        detail=decision.detail,
        host=target.host.text if target is not None else "",
        port=target.port if target is not None else None,
        rule=decision.rule,
    )


def decision_refusal(decision: Decision) -> Refusal:
    """The refusal for a decision made before connecting (a policy refusal, or inspection needed)."""
    if decision.allowed and decision.needs_inspection:
        target = decision.target
        return Refusal(
            "needs_inspection",
            "this host is admitted only for some paths or methods, which needs TLS inspection",
            target.host.text if target else "",
            target.port if target else None,
            decision.rule,
        )
    return refusal_for(decision)
