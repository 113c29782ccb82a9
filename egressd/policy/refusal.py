"""A refusal as every step and front hands it on: the reason (a typed `Reason`), what was refused,
and where it is read (`HintContext`).

The meaning of each reason is in its registry (egressd.policy.reasons); what a client and a person
read of a refusal is rendered in one place (egressd.wire.refusal). No I/O and no mitmproxy import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from egressd.policy.reasons import Kind, Reason


@dataclass(frozen=True)
class HintContext:
    """Where a refusal is read, so its hint names what its reader can change: the egressd command
    that runs the child as the user typed it (`exec`, `sandbox`, `acp`, `mcp run`, `run`, `ssh`),
    whether that is a gateway's (`run --gateway`: its clients are other machines), and the policy
    file the session watches (absolute; None with the built-in policy, a preset or flags only).
    Fixed when the session starts; the pipeline stamps it on the refusals it answers and the session
    hands it to every observer that words one (egressd.wire.refusal renders them all)."""

    command: str = "exec"
    gateway: bool = False
    policy_file: str | None = None


@dataclass(frozen=True)
class Refusal:
    """What was refused and why, ready to be rendered for any protocol (egressd.wire.refusal).

    `reason` is a `Reason` (a code that is not one raises ValueError here); `profile` the child's
    profile, `addresses` what its name resolved to (resolved_forbidden), `context` where it is
    read (the hint's), all for the hint."""

    reason: Reason
    detail: str
    host: str = ""
    port: int | None = None
    rule: str | None = None
    retry_after: int | None = None  # seconds, for 429 and overloaded answers
    profile: str | None = None
    addresses: tuple[str, ...] = ()
    context: HintContext | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if type(self.reason) is not Reason:
            object.__setattr__(self, "reason", Reason.of(self.reason))

    @property
    def is_policy(self) -> bool:
        return self.reason.kind is Kind.POLICY

    @property
    def is_network_failure(self) -> bool:
        return self.reason.kind is Kind.FAILURE

    @property
    def status(self) -> int:
        return self.reason.status

    @property
    def target(self) -> str:
        if not self.host:
            return "the target"
        if self.port is None:
            return self.host
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

