"""The approver step: a decision that reaches `mode: ask` waits here for an answer.

An approver is anything with `async ask(decision, client) -> bool`; egressd asks at most one.
Without one, nobody can answer and the ask is refused at once (`no_approver`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

from egressd.admission.state import ConnState
from egressd.policy import Decision

logger = logging.getLogger(__name__)


class Approver(Protocol):
    async def ask(self, decision: Decision, client: ConnState) -> bool: ...


async def answer(approver: Approver | None, decision: Decision, client: ConnState) -> Decision:
    """The decision after asking: approved (allowed) or refused (`no_approver`, `ask_refused`)."""
    if approver is None:
        return _refused(decision, "no_approver", "mode is 'ask' and no approver is connected to answer")
    try:
        approved = bool(await approver.ask(decision, client))
    except Exception:  # noqa: BLE001 - an approver that fails refuses
        logger.exception("approver failed")
        approved = False
    if not approved:
        return _refused(decision, "ask_refused", "the approver refused")
    return dataclasses.replace(
        decision, allowed=True, ask=False, reason="approved", rule="mode: ask (approved)"
    )


def _refused(decision: Decision, reason: str, detail: str) -> Decision:
    return Decision(allowed=False, reason=reason, rule="mode: ask", target=decision.target, detail=detail)
