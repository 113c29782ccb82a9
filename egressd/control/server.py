"""The control API server: HTTP + JSON on the user's Unix socket, on the proxy's event loop.

The endpoints (`app.py`) read the pipeline's state, answer asks through the AskBroker and add grants
to the GrantStore. Every connection's peer must be this user (SO_PEERCRED), on top of the 0700
directory and the 0600 socket. Endpoints: docs/control-api.md.
"""

from __future__ import annotations

import collections
import contextlib
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from egressd.admission.asks import AskBroker
from egressd.admission.events import Decided, Event, EventBus, Told
from egressd.admission.grants import GrantStore
from egressd.platform.log import Logger

if TYPE_CHECKING:
    import asyncio

    from aiohttp import web

    from egressd.control.children import Children
    from egressd.control.site import LazySite
    from egressd.platform.listeners import OwnAddresses
    from egressd.tools.policy_edit import PolicyEditor

logger = Logger(__name__)

MAX_CLIENTS = 256  # per-child counters kept; beyond it the rest are counted under "other"
RECENT = 200  # decisions kept for a follower that starts late (the dashboard's backlog)


class Counts:
    """Decisions seen on the bus (for `ps` and the dashboard's per-child counters): a few integer
    additions on the proxy's thread. Children are a handful per egressd; the table is bounded all
    the same, so a child minting names cannot grow it. The last RECENT decisions it counts are kept
    as they came (a deque append), so a page opened late shows what its counters count."""

    def __init__(self) -> None:
        self.decisions = self.allowed = self.refused = 0
        self.by_client: dict[str, list[int]] = {}  # client -> [allowed, refused]
        self.recent: collections.deque[Decided] = collections.deque(maxlen=RECENT)
        self.told = Told()  # an allowed tunnel is counted once, by its connection's record

    def observe(self, event: Event) -> None:
        if type(event) is not Decided:
            return
        allowed = event.allowed  # read once: a named tuple's field is the generic attribute lookup
        if self.told.first(event.conn, event.stage, allowed):
            self.recent.append(event)
            self.decisions += 1
            name = event.client or "-"
            row = self.by_client.get(name)
            if row is None:
                if len(self.by_client) >= MAX_CLIENTS:
                    name = "other"
                row = self.by_client.setdefault(name, [0, 0])
            if allowed:
                self.allowed += 1
                row[0] += 1
            else:
                self.refused += 1
                row[1] += 1

    def clients(self) -> dict[str, dict[str, int]]:
        return {name: {"allowed": a, "refused": r} for name, (a, r) in list(self.by_client.items())}


class ControlServer:
    """Serve the control API for one session on `path` until stop()."""

    def __init__(
        self,
        path: Path,
        *,
        broker: AskBroker,
        grants: GrantStore,
        events: EventBus,
        info: Callable[[], dict[str, Any]],
        policy: Callable[[], dict[str, Any]] | None = None,
        edit_policy: PolicyEditor | None = None,
        metrics: Callable[[], bytes] | None = None,
        children: Children | None = None,
        watched: Callable[[], None] | None = None,
        own: OwnAddresses | None = None,
        recent: Callable[[], list[Event]] | None = None,
    ) -> None:
        self.path = path
        self.recent = recent  # GET /v1/events?backlog=N: the last decisions first
        self.own = own  # POST /v1/listeners: a listener of `egressd dashboard` is egressd's own
        self.children = children  # POST /v1/children: exec --attach
        self.watched = watched
        self.policy = policy
        self.edit_policy = edit_policy
        self.metrics = metrics  # GET /metrics: the Prometheus text (egressd.observe.metrics)
        self.broker = broker
        self.grants = grants
        self.events = events
        self.info = info
        self._site: LazySite | None = None

    async def start(self, sock: socket.socket) -> None:
        """Serve on an already listening socket (paths.listen), on the running loop, from its first
        client on (egressd.control.site)."""
        from egressd.control.site import LazySite  # on the proxy's loop, as it starts

        self._site = LazySite(sock, self._app, imports=("egressd.control.app",), name="control API")
        await self._site.start()

    async def stop(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        if self._site is not None:
            await self._site.stop()

    def _app(self, stopping: asyncio.Event) -> web.Application:
        from egressd.control.app import Handlers

        return Handlers(
            self.broker,
            self.grants,
            self.events,
            self.info,
            stopping,
            self.policy,
            self.edit_policy,
            self.metrics,
            self.children,
            self.watched,
            self.own,
            self.recent,
        ).app()
