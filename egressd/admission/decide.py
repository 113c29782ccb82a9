"""The decide step: the one pure decision (`egressd.policy.decide`) for a target as a client wrote
it, never raising — an unparseable target or a bug refuses."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging

from egressd.admission import faults
from egressd.admission.state import PolicyHolder
from egressd.policy import Client, Decision, IPAddress, Mode, Program, decide_written
from egressd.refusal import Refusal

logger = logging.getLogger(__name__)


class Decider:
    def __init__(self, policies: PolicyHolder) -> None:
        self.policies = policies
        self.self_addresses: tuple[tuple[IPAddress, int], ...] = ()

    def add_self_address(self, host: str, port: int) -> None:
        """egressd's own listeners: a connection to one is refused (`self`)."""
        address = (ipaddress.ip_address(host), port)
        if address not in self.self_addresses:
            self.self_addresses = (*self.self_addresses, address)

    def decide(
        self,
        host: str,
        port: int,
        profile: str | None,
        *,
        scheme: str | None = None,
        method: str | None = None,
        path: str | None = None,
        mode: Mode | None = None,
        program: Program | None = None,
    ) -> Decision:
        """`mode`: decide as if the policy had this mode (a grant asks what `ask` would answer)."""
        policy = self.policies.get()
        if mode is not None and mode != policy.mode:
            policy = dataclasses.replace(policy, mode=mode)
        try:
            faults.maybe_fail("decide")
            return decide_written(
                host,
                port,
                Client(profile, program),
                policy,
                scheme=scheme,
                path=path,
                method=method,
                self_addresses=self.self_addresses,
            )
        except Exception as e:  # noqa: BLE001 - fail closed on any bug
            logger.exception("decision failed")
            return Decision(allowed=False, reason="internal_error", rule=None, target=None, detail=repr(e))


def refusal_for(decision: Decision) -> Refusal:
    """The refusal a client gets for a refused decision."""
    target = decision.target
    return Refusal(
        reason=decision.reason,
        detail=decision.detail,
        host=target.host.text if target is not None else "",
        port=target.port if target is not None else None,
        rule=decision.rule,
    )


def needs_inspection_refusal(decision: Decision) -> Refusal:
    """An allowed host whose rules name paths or methods, where egressd cannot see them."""
    target = decision.target
    return Refusal(
        "needs_inspection",
        "this host is admitted only for some paths or methods, which needs TLS inspection",
        target.host.text if target else "",
        target.port if target else None,
        decision.rule,
    )
