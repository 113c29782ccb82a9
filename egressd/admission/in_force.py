"""The snapshot admission decides by: one immutable value a reload swaps whole."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from egressd.admission.secrets import NO_SECRETS, SecretBook
from egressd.policy import Policy

if TYPE_CHECKING:
    from egressd.admission.tokens import TokenTable  # the gateway's only: loaded with its token file


@dataclass(frozen=True, slots=True)
class InForce:
    """Everything a reload changes, as one immutable value: the policy, its secrets with their
    values, and the gateway's token table. A reload builds a new one and swaps it in one assignment,
    and an admission reads it once: a request never meets the new policy with the old secrets (a
    secret's hosts and its value change together), whichever thread swaps and whenever."""

    policy: Policy
    secrets: SecretBook = NO_SECRETS
    tokens: TokenTable | None = None
    # whether any secret is in force: read by every admission and record, a plain attribute where
    # the book's truth is a call to its __bool__
    has_secrets: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "has_secrets", bool(self.secrets))


class PolicyHolder:
    """What admission decides by (`now`), swapped whole."""

    def __init__(self, now: InForce | Policy) -> None:
        self.now = now if isinstance(now, InForce) else InForce(now)

    def get(self) -> Policy:
        """The policy in force (a connection's own path reads `now.policy`: the same, without a call)."""
        return self.now.policy

    def set(self, now: InForce | Policy) -> None:
        """Put `now` in force (a bare policy keeps the secrets and tokens in force): one reference
        swapped, so a reader has the old snapshot or the new one, never half of each."""
        self.now = now if isinstance(now, InForce) else dataclasses.replace(self.now, policy=now)
