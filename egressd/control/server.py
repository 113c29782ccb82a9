"""The control API server: HTTP + JSON on the user's Unix socket, in its own thread and loop.

Its own thread, so the proxy's loop pays nothing for it: the endpoints (`app.py`) read the
pipeline's state, answer asks through the AskBroker and add grants to the GrantStore, both
thread-safe. Every connection's peer must be this user (SO_PEERCRED), on top of the 0700 directory
and the 0600 socket. Endpoints: docs/control-api.md.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import select
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from egressd.admission.asks import AskBroker
from egressd.admission.events import Decided, Event, EventBus
from egressd.admission.grants import GrantStore

if TYPE_CHECKING:
    from egressd.control.children import Children
    from egressd.listeners import OwnAddresses
    from egressd.policy_edit import PolicyEditor

logger = logging.getLogger(__name__)

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

    def observe(self, event: Event) -> None:
        if isinstance(event, Decided) and event.stage != "connection":
            self.recent.append(event)
            self.decisions += 1
            name = event.client or "-"
            row = self.by_client.get(name)
            if row is None:
                if len(self.by_client) >= MAX_CLIENTS:
                    name = "other"
                row = self.by_client.setdefault(name, [0, 0])
            if event.allowed:
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
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # a pipe whose write end stop() closes: it wakes the thread still waiting for a first client
        self._wake_r: int | None = None
        self._wake_w: int | None = None
        self._first = threading.Event()  # a first client came: the thread imports aiohttp and serves

    # -- life cycle ------------------------------------------------------------------------------
    def start(self, sock: socket.socket) -> None:
        """Serve on an already listening socket (paths.listen). Returns at once: the server's thread
        waits for a first client, then imports aiohttp (~0.25 s of CPU) and serves; the client
        waits in the socket's backlog meanwhile. So a run nobody talks to (a CI job, `exec --
        true`) never pays the import, and a child's start never competes with it for the CPU."""
        self._sock = sock
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._main, name="egressd-control", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()  # a server still importing aiohttp stops as soon as it is done
        if self._wake_w is not None:
            os.close(self._wake_w)  # a server still waiting for its first client stops now
            self._wake_w = None
            if self._thread is not None and not self._first.is_set():
                self._thread.join(timeout=5)  # out of select() before its socket is closed below
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and self._thread is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        if self._sock is not None:
            self._sock.close()

    def _first_client(self) -> bool:
        """Block (without the GIL) until a client connects to the socket (True) or stop() (False)."""
        assert self._sock is not None and self._wake_r is not None
        try:
            ready, _, _ = select.select([self._sock, self._wake_r], [], [])
        finally:
            os.close(self._wake_r)
        if self._sock not in ready or self._stopping.is_set():
            return False
        self._first.set()
        return True

    def _main(self) -> None:
        try:
            if self._first_client():
                asyncio.run(self._serve())
        except BaseException:  # noqa: BLE001 - the proxy runs on without its control API
            logger.exception("egressd: the control API failed")

    async def _serve(self) -> None:
        from aiohttp import web  # here, not at import: see start()

        from egressd.control.app import Handlers

        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        if self._stopping.is_set():
            return

        app = Handlers(
            self.broker,
            self.grants,
            self.events,
            self.info,
            self._stop,
            self.policy,
            self.edit_policy,
            self.metrics,
            self.children,
            self.watched,
            self.own,
            self.recent,
        ).app()
        runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=1)
        await runner.setup()
        assert self._sock is not None
        site = web.SockSite(runner, self._sock)
        await site.start()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()
