"""The approver step: a decision that reaches `mode: ask` waits here for an answer.

An approver is anything with `async ask(decision, client, recheck) -> bool | Answer | Decision`;
egressd asks at most one (the ask broker, `admission/asks.py`, which fans a question out to the
control API, the terminal prompt and the dashboard). Without one, nobody can answer and the ask is
refused at once (`no_approver`). An `Answer` carries its own refusal reason (`no_approver`,
`ask_timeout`, `ask_refused`) so every approver's refusals read the same. `recheck` is the
pipeline's grants step for this request: an approver that learns of a grant made while the
request waits calls it, and answers with the decision it returns (a grant's admission).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from egressd.admission.state import ConnState
from egressd.platform.log import Logger
from egressd.policy import Decision
from egressd.policy.reasons import Reason

logger = Logger(__name__)


@dataclass(frozen=True, slots=True)
class Answer:
    """What an approver answered: approved, or refused with a reason code and a detail."""

    approved: bool
    reason: Reason = Reason.APPROVED
    detail: str = ""
    rule: str = "mode: ask (approved)"


NO_APPROVER = Answer(
    False, Reason.NO_APPROVER, "mode is 'ask' and no approver is connected to answer", "mode: ask"
)


# the grants step again for a waiting request: the decision a grant makes of it, or None
Recheck = Callable[[], Decision | None]


class Approver(Protocol):
    async def ask(
        self, decision: Decision, client: ConnState, recheck: Recheck | None = None
    ) -> bool | Answer | Decision: ...


async def answer(
    approver: Approver | None, decision: Decision, client: ConnState, recheck: Recheck | None = None
) -> Decision:
    """The decision after asking: approved (allowed), admitted by a grant made meanwhile, or
    refused (`no_approver`, `ask_timeout`, `ask_refused`)."""
    if approver is None:
        return _refused(decision, NO_APPROVER)
    try:
        got = await approver.ask(decision, client, recheck)
    except Exception:  # noqa: BLE001 - an approver that fails refuses
        logger.exception("approver failed")
        got = False
    if isinstance(got, Decision):
        return got
    if not isinstance(got, Answer):
        got = Answer(True) if got else Answer(False, Reason.ASK_REFUSED, "the approver refused", "mode: ask")
    if not got.approved:
        return _refused(decision, got)
    detail = got.detail or decision.detail
    return dataclasses.replace(
        decision, allowed=True, ask=False, reason=got.reason, rule=got.rule, detail=detail
    )


def _refused(decision: Decision, got: Answer) -> Decision:
    return Decision(
        allowed=False,
        reason=got.reason,
        rule=got.rule,
        target=decision.target,
        detail=got.detail,
        profile=decision.profile,
    )
