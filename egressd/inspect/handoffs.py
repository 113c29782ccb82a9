"""The connections egressd's front handed to the embedded mitmproxy, by the address they come from.

mitmproxy listens on loopback, where a child could reach it too. The front opens each hand-off from a
socket whose local address it registers here first, with the client's state and what the pipeline
admitted; mitmproxy's addons serve only connections found here, and refuse any other.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from egressd.admission.pipeline import Admitted
from egressd.admission.state import ConnState


@dataclass
class Handoff:
    conn: ConnState
    tunnel: Admitted  # admitted for inspection, and pinned
    # the upstream connections mitmproxy opened for it, by mitmproxy's server id
    connections: dict[str, Admitted] = field(default_factory=dict)


class Handoffs:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_peer: dict[str, Handoff] = {}

    def add(self, peer: str, handoff: Handoff) -> None:
        with self._lock:
            self._by_peer[peer] = handoff

    def get(self, peer: str) -> Handoff | None:
        with self._lock:
            return self._by_peer.get(peer)

    def remove(self, peer: str) -> None:
        with self._lock:
            self._by_peer.pop(peer, None)
