"""The control API server: HTTP + JSON on the user's Unix socket, in its own thread and loop.

Its own thread, so the proxy's loop pays nothing for it: it reads the pipeline's state, answers
asks through the AskBroker (thread-safe) and adds grants to the GrantStore (thread-safe). Live
streams (`/v1/events`, `/v1/asks?follow=1`) are newline-delimited JSON fed from the event bus and
the broker through bounded queues: a slow reader loses lines (it is told how many), never slows
the proxy. Every connection's peer must be this user (SO_PEERCRED), on top of the 0700 directory
and the 0600 socket. Endpoints: docs/control-api.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from egressd.admission.asks import AskBroker, AskError
from egressd.admission.events import Closed, Decided, Event, EventBus
from egressd.admission.grants import GrantError, GrantStore

logger = logging.getLogger(__name__)

QUEUE_LINES = 1000  # per stream reader: beyond it, lines are dropped and counted
KEEPALIVE = 5.0  # a follower that went away is noticed (and stops counting as an approver) by then


class Counts:
    """Decisions seen on the bus (for `ps`): a few integer additions on the proxy's thread."""

    def __init__(self) -> None:
        self.decisions = self.allowed = self.refused = 0

    def observe(self, event: Event) -> None:
        if isinstance(event, Decided) and event.stage != "connection":
            self.decisions += 1
            if event.allowed:
                self.allowed += 1
            else:
                self.refused += 1


def event_json(event: Event) -> dict[str, Any]:
    """One event as a JSON object; the query of a path redacted as in the audit."""
    if isinstance(event, Decided):
        fields = dataclasses.asdict(event)
        fields["event"] = "decision"
    elif isinstance(event, Closed):
        fields = dataclasses.asdict(event)
        fields["event"] = "closed"
    else:
        fields = {**event.fields, "event": event.kind}
    path = fields.get("path")
    if isinstance(path, str) and "?" in path:
        fields["path"] = path.split("?", 1)[0] + "?<redacted>"
    fields["time"] = round(time.time(), 3)
    return fields


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
    ) -> None:
        self.path = path
        self.broker = broker
        self.grants = grants
        self.events = events
        self.info = info
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    # -- life cycle ------------------------------------------------------------------------------
    def start(self, sock: socket.socket) -> None:
        """Serve on an already listening socket (paths.listen); raises if the server cannot start."""
        self._sock = sock
        self._thread = threading.Thread(target=self._main, name="egressd-control", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise RuntimeError(f"control API: {self._error}") from self._error

    def stop(self) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and self._thread is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported to start() or logged
            if not self._ready.is_set():
                self._error = exc
                self._ready.set()
            else:
                logger.exception("control API failed")

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        app = web.Application(middlewares=[self._same_user])
        app.add_routes(
            [
                web.get("/v1/info", self._info),
                web.get("/v1/asks", self._asks),
                web.post("/v1/asks/{id}", self._answer),
                web.get("/v1/grants", self._grants),
                web.post("/v1/grants", self._grant),
                web.delete("/v1/grants/{id}", self._revoke),
                web.get("/v1/events", self._events),
            ]
        )
        runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=1)
        await runner.setup()
        assert self._sock is not None
        site = web.SockSite(runner, self._sock)
        await site.start()
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()

    # -- the peer --------------------------------------------------------------------------------
    @web.middleware
    async def _same_user(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Only this user's processes: the directory and the socket mode say so, the peer's
        credentials prove it (a socket passed to another process by mistake stays useless)."""
        sock = request.transport.get_extra_info("socket") if request.transport else None
        uid = _peer_uid(sock)
        if uid is None or uid != os.geteuid():
            return _error(403, "the control API serves its own user only")
        return await handler(request)

    # -- endpoints -------------------------------------------------------------------------------
    async def _info(self, request: web.Request) -> web.Response:
        return web.json_response(self.info())

    async def _asks(self, request: web.Request) -> web.StreamResponse:
        self.broker.polled()
        if request.query.get("follow") not in ("1", "true"):
            return web.json_response({"asks": [self.broker.describe(p) for p in self.broker.pending()]})
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(QUEUE_LINES)
        loop = asyncio.get_running_loop()

        def listener(kind: str, info: dict[str, object]) -> None:
            loop.call_soon_threadsafe(_offer, queue, {**info, "event": kind})

        # attached before the current list is read: an ask made in between is heard twice, never lost
        detach = self.broker.attach(listener, approver=True)
        try:
            initial = [{**self.broker.describe(p), "event": "ask"} for p in self.broker.pending()]
            return await self._stream(request, queue, initial)
        finally:
            detach()

    async def _answer(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if isinstance(body, web.Response):
            return body
        kind = body.get("answer")
        by = body.get("by") if isinstance(body.get("by"), str) else "the control API"
        if not isinstance(kind, str):
            return _error(400, 'expected {"answer": "once|run|always|deny|deny-always"}')
        try:
            reply = await asyncio.to_thread(self.broker.answer, request.match_info["id"], kind, by=by)
        except AskError as exc:
            return _error(exc.status, str(exc))
        return web.json_response(reply)

    async def _grants(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        return web.json_response({"grants": [g.to_json(now) for g in self.grants.list()]})

    async def _grant(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if isinstance(body, web.Response):
            return body
        target, ttl, once = body.get("target"), body.get("ttl", 300), body.get("once", True)
        if not isinstance(target, str):
            return _error(400, 'expected {"target": "HOST[:PORT] or URL", "ttl": SECONDS, "once": true}')
        if once is not True:
            return _error(400, "only one-shot grants (once: true) are made here; answer an ask with run")
        if isinstance(ttl, bool) or not isinstance(ttl, int | float):
            return _error(400, "ttl must be a number of seconds")
        try:
            grant = self.grants.add(target, once=True, ttl=float(ttl))
        except GrantError as exc:
            return _error(400, str(exc))
        return web.json_response(grant.to_json(), status=201)

    async def _revoke(self, request: web.Request) -> web.Response:
        if not self.grants.revoke(request.match_info["id"]):
            return _error(404, f"no grant {request.match_info['id']!r}")
        return web.json_response({"revoked": request.match_info["id"]})

    async def _events(self, request: web.Request) -> web.StreamResponse:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(QUEUE_LINES)
        loop = asyncio.get_running_loop()

        def observer(event: Event) -> None:
            loop.call_soon_threadsafe(_offer_event, queue, event)

        self.events.subscribe(observer)
        try:
            return await self._stream(request, queue, [])
        finally:
            self.events.unsubscribe(observer)

    async def _stream(
        self, request: web.Request, queue: asyncio.Queue[dict[str, Any]], initial: list[dict[str, Any]]
    ) -> web.StreamResponse:
        """Newline-delimited JSON until the client goes away or egressd stops."""
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        assert self._stop is not None
        stopping = asyncio.ensure_future(self._stop.wait())
        try:
            for item in initial:
                await response.write(_line(item))
            while not self._stop.is_set():
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait(
                    {getter, stopping}, timeout=KEEPALIVE, return_when="FIRST_COMPLETED"
                )
                if getter not in done:
                    getter.cancel()
                    if stopping in done:
                        break
                    await response.write(_line({"event": "keepalive"}))
                    continue
                item = getter.result()
                dropped = getattr(queue, "dropped", 0)
                if dropped:
                    queue.dropped = 0  # type: ignore[attr-defined]
                    await response.write(_line({"event": "dropped", "count": dropped}))
                await response.write(_line(item))
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            stopping.cancel()
        return response


def _offer(queue: asyncio.Queue[dict[str, Any]], item: dict[str, Any]) -> None:
    try:
        queue.put_nowait(item)
    except asyncio.QueueFull:
        queue.dropped = getattr(queue, "dropped", 0) + 1  # type: ignore[attr-defined]


def _offer_event(queue: asyncio.Queue[dict[str, Any]], event: Event) -> None:
    """On the control loop: the event is turned into JSON here, not on the proxy's thread."""
    _offer(queue, event_json(event))


def _line(item: dict[str, Any]) -> bytes:
    return (json.dumps(item, default=str, separators=(",", ":")) + "\n").encode()


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _json_body(request: web.Request) -> dict[str, Any] | web.Response:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        return _error(400, "the body must be a JSON object")
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object")
    return body


def _peer_uid(sock: socket.socket | None) -> int | None:
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    peercred = getattr(socket, "SO_PEERCRED", None)
    if peercred is not None:
        raw = sock.getsockopt(socket.SOL_SOCKET, peercred, struct.calcsize("3i"))
        return struct.unpack("3i", raw)[1]
    try:  # macOS, BSD
        uid, _gid = os.getpeereid(sock.fileno())  # type: ignore[attr-defined]
        return int(uid)
    except (AttributeError, OSError):
        return None
