"""The decide step: the one pure decision (`egressd.policy.decide`) for a target as a client wrote
it, never raising — an unparseable target or a bug refuses."""

from __future__ import annotations

import dataclasses
import ipaddress

from egressd.admission.in_force import PolicyHolder
from egressd.platform.log import Logger
from egressd.policy import Client, Decision, IPAddress, Mode, Policy, Program, decide_written
from egressd.policy.reasons import Reason
from egressd.policy.refusal import Refusal

logger = Logger(__name__)


# a key of the decisions remembered: what the client wrote, and who asks
_Asked = tuple[str, int, str | None, str | None, str | None, str | None, Program | None]
REMEMBERED = 4096  # decisions remembered for one policy at most (then forgotten all at once)
REMEMBERED_TEXT = 512  # host and path of one remembered decision, in characters at most


class Decider:
    """The decide step, with the last decisions of the policy in force remembered.

    `decide_written` is a pure function of what the client wrote, who asks, the policy and egressd's
    own addresses. A child asks the same few targets again and again, and deciding is the costliest
    pure step of an admission, so the answers are remembered by those inputs exactly as written (a spelling is
    its own key, whose decision carries the canonical target) and all forgotten when the policy or
    the own addresses change. Decisions are frozen; a bug's refusal (internal_error) is never kept;
    a decision as another mode would make it (a grant's question) is not either."""

    def __init__(self, policies: PolicyHolder) -> None:
        self.policies = policies
        self.self_addresses: tuple[tuple[IPAddress, int], ...] = ()
        self._remembered: dict[_Asked, Decision] = {}
        self._remembered_for: tuple[Policy, tuple[tuple[IPAddress, int], ...]] | None = None

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
        policy: Policy | None = None,
    ) -> Decision:
        """`mode`: decide as if the policy had this mode (a grant asks what `ask` would answer);
        `policy`: the one an admission read with its secrets (default: the one in force now)."""
        policy = policy if policy is not None else self.policies.get()
        remember = mode is None or mode == policy.mode
        if not remember:
            policy = dataclasses.replace(policy, mode=mode)
        try:
            if not remember:
                return self._decide(host, port, profile, scheme, method, path, program, policy)
            own = self.self_addresses
            if (
                self._remembered_for is None
                or self._remembered_for[0] is not policy
                or self._remembered_for[1] is not own
            ):
                self._remembered, self._remembered_for = {}, (policy, own)
            remembered = self._remembered
            key = (host, port, profile, scheme, method, path, program)
            decision = remembered.get(key)
            if decision is None:
                decision = self._decide(host, port, profile, scheme, method, path, program, policy)
                short = len(host) + len(path or "") <= REMEMBERED_TEXT
                if decision.reason is not Reason.INTERNAL_ERROR and short:
                    if len(remembered) >= REMEMBERED:
                        remembered.clear()
                    remembered[key] = decision
            return decision
        except Exception as e:  # noqa: BLE001 - fail closed on any bug
            logger.exception("decision failed")
            return Decision(False, Reason.INTERNAL_ERROR, None, None, detail=repr(e))

    def _decide(
        self,
        host: str,
        port: int,
        profile: str | None,
        scheme: str | None,
        method: str | None,
        path: str | None,
        program: Program | None,
        policy: Policy,
    ) -> Decision:
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


def refusal_for(decision: Decision) -> Refusal:
    """The refusal a client gets for a refused decision."""
    target = decision.target
    return Refusal(
        reason=decision.reason,
        detail=decision.detail,
        host=target.host.text if target is not None else "",
        port=target.port if target is not None else None,
        rule=decision.rule,
        profile=decision.profile,
    )


def needs_inspection_refusal(decision: Decision) -> Refusal:
    """An allowed host whose rules name paths or methods, where egressd cannot see them."""
    target = decision.target
    return Refusal(
        Reason.NEEDS_INSPECTION,
        "this host is admitted only for some paths or methods, which needs TLS inspection",
        target.host.text if target else "",
        target.port if target else None,
        decision.rule,
    )
