"""A tunnel admitted for inspection, as the embedded mitmproxy's handler of it carries it.

The record the front hands over with the client's connection (egressd.inspect.engine), that
mitmproxy's client connection carries (egressd.inspect.handler.TunnelClient), and that the addons
and patches read and write: what the pipeline admitted, and what failed the exchange in progress.
Nothing of mitmproxy is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from egressd.policy.reasons import Reason
from egressd.policy.refusal import Refusal

if TYPE_CHECKING:
    from egressd.admission.pipeline import Admitted
    from egressd.admission.state import ConnState

# how far the client's stream is read ahead of mitmproxy (asyncio's default, as mitmproxy's own)
STREAM_LIMIT = 1 << 16


class TunnelOwner(Protocol):
    """The front's client connection a tunnel came from: it answers in the client's protocol and
    writes the connection's closed record when the tunnel ends."""

    def established_answer(self, bound: tuple[str, int] | None) -> bytes: ...

    def refusal_answer(self, refusal: Refusal) -> bytes: ...

    def finish(self) -> None: ...


@dataclass(eq=False)
class InspectedTunnel:
    """A tunnel admitted for inspection, as mitmproxy's handler of it carries it."""

    conn: ConnState
    admitted: Admitted  # admitted for inspection, and pinned
    owner: TunnelOwner
    # the upstream connections the policy addon admitted for it, by mitmproxy's server id
    connections: dict[str, Admitted] = field(default_factory=dict)
    # what failed the exchange in progress (a connect, the upstream's answer): the first failure
    # of an exchange is the one the client is told and the audit records
    failure: Refusal | None = None
    # bytes to the client count from the tunnel's answer on, as a relayed tunnel's do
    counting: bool = False

    def refusal(self, reason: Reason, detail: str) -> Refusal:
        admitted = self.admitted
        return Refusal(reason, detail, admitted.host, admitted.port, admitted.decision.rule)

    def fail(self, refusal: Refusal) -> Refusal:
        """Record what failed the exchange in progress, unless something failed it first."""
        if self.failure is None:
            self.failure = refusal
        return self.failure

    def take_failure(self) -> Refusal | None:
        failure, self.failure = self.failure, None
        return failure
