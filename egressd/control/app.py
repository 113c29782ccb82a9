"""The control API's endpoints (aiohttp), imported with its first client (egressd.control.site).

Asks are answered through the AskBroker and grants added to the GrantStore; live streams are
newline-delimited JSON fed through bounded queues (a slow reader loses lines and is told how many;
it never slows the proxy). Every peer must be this user (SO_PEERCRED). The metrics' answer is also
the `--metrics HOST:PORT` port's (`metrics_app`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import ipaddress
import json
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web

from egressd.admission.asks import AskBroker, AskError
from egressd.admission.events import Asked, Closed, Decided, Event, EventBus, Resolved
from egressd.admission.grants import DEFAULT_TTL, GrantError, GrantStore
from egressd.control.children import ChildError, Children
from egressd.platform.listeners import OwnAddresses, register
from egressd.policy.reasons import Reason
from egressd.policy.schema import PolicyError, Reader
from egressd.tools.policy_edit import LISTS, PolicyEditor

QUEUE_LINES = 1000  # per stream reader: beyond it, lines are dropped and counted
_BODY = Reader("request body")
_PID_MAX = 2**31 - 1  # a pid_t
KEEPALIVE = 5.0  # a follower that went away is noticed (and stops counting as an approver) by then


def event_json(event: Event) -> dict[str, Any]:
    """One event as a JSON object; the query of a path redacted as in the audit."""
    if isinstance(event, Decided):
        fields = event._asdict()
        fields["event"] = "decision"
        # the word every surface uses: allowed, refused, or failed (the network's, not the policy's)
        fields["outcome"] = "allowed" if event.allowed else Reason.of(event.reason).outcome
    elif isinstance(event, Closed):
        fields = event._asdict()
        fields["event"] = "closed"
        fields["duration"] = round(event.duration, 3)  # as the audit writes it
    elif isinstance(event, Resolved | Asked):  # the metrics' latencies: {seconds, outcome}
        fields = event._asdict()
        fields["event"] = "dns_lookup" if isinstance(event, Resolved) else "ask_wait"
    else:
        fields = {**event.fields, "event": event.kind}
    path = fields.get("path")
    if isinstance(path, str) and "?" in path:
        fields["path"] = path.split("?", 1)[0] + "?<redacted>"
    fields["time"] = round(time.time(), 3)
    return fields


class Handlers:
    def __init__(
        self,
        broker: AskBroker,
        grants: GrantStore,
        events: EventBus,
        info: Callable[[], dict[str, Any]],
        stop: asyncio.Event,
        policy: Callable[[], dict[str, Any]] | None = None,
        edit_policy: PolicyEditor | None = None,
        metrics: Callable[[], bytes] | None = None,
        children: Children | None = None,
        watched: Callable[[], None] | None = None,
        own: OwnAddresses | None = None,
        recent: Callable[[], list[Event]] | None = None,
    ) -> None:
        self.own = own
        self.recent = recent
        self.children = children
        self.metrics = metrics
        self.watched = watched  # a watch stream attached: decisions should name their program
        self.broker = broker
        self.grants = grants
        self.events = events
        self.info = info
        self._stop = stop
        self.policy = policy
        self.edit_policy = edit_policy

    def app(self) -> web.Application:
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
                web.get("/v1/policy", self._policy),
                web.post("/v1/policy/rules", self._edit_rule),
                web.get("/metrics", self._metrics),
                web.get("/v1/children", self._children),
                web.post("/v1/children", self._attach),
                web.delete("/v1/children/{id}", self._detach),
                web.post("/v1/listeners", self._listener),
            ]
        )
        return app

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

    async def _metrics(self, request: web.Request) -> web.Response:
        """The Prometheus text format, the same registry as --metrics serves (docs/metrics.md)."""
        if self.metrics is None:
            return _error(404, "metrics are off")
        return await metrics_answer(self.metrics)

    async def _children(self, request: web.Request) -> web.Response:
        if self.children is None:
            return _error(404, "this egressd takes no attached children")
        return web.json_response({"children": self.children.list()})

    async def _attach(self, request: web.Request) -> web.Response:
        """`egressd exec --attach`: fresh credentials for the peer process, revoked when it exits
        (docs/control-api.md). The peer's pid comes from the socket (SO_PEERCRED), not the body."""
        if self.children is None:
            return _error(404, "this egressd takes no attached children")
        body = await _json_body(request, ("command", "profile", "pid"))
        if isinstance(body, web.Response):
            return body
        sock = request.transport.get_extra_info("socket") if request.transport else None
        pid = _peer_pid(sock)
        try:
            command = [_BODY.text(part, where) for where, part in _BODY.items(body.get("command"), "command")]
            profile = body.get("profile")
            if profile is not None:
                profile = _BODY.text(profile, "profile")
            if pid is None:
                if body.get("pid") is None:
                    return _error(400, "this system does not say who the peer is: give its pid")
                pid = _BODY.integer(body.get("pid"), "pid")
                if pid > _PID_MAX:
                    raise _BODY.fail("pid", f"must be a process id (at most {_PID_MAX})", pid)
        except PolicyError as exc:
            return _error(400, exc.located())
        try:
            child, answer = self.children.attach(pid, command, profile)
            self.children.watch(child)
        except ChildError as exc:
            return _error(exc.status, str(exc))
        return web.json_response(answer, status=201)

    async def _listener(self, request: web.Request) -> web.Response:
        """A listener of a process attached to this egressd (`egressd dashboard`): one of egressd's
        own addresses from now on, refused to its children as `self` (for the rest of the run: a
        registration only ever refuses more)."""
        if self.own is None:
            return _error(404, "this egressd registers no listeners")
        body = await _json_body(request, ("host", "port"))
        if isinstance(body, web.Response):
            return body
        try:
            host = _BODY.text(body.get("host"), "host")
            port = _BODY.port(body.get("port"), "port")
            try:
                ipaddress.ip_address(host)
            except ValueError:
                raise _BODY.fail("host", "must be an IP address", host) from None
        except PolicyError as exc:
            return _error(400, exc.located())
        register(self.own, [(host, port)])
        return web.json_response({"host": host, "port": port}, status=201)

    async def _detach(self, request: web.Request) -> web.Response:
        if self.children is None or not self.children.detach(request.match_info["id"]):
            return _error(404, f"no attached child {request.match_info['id']!r}")
        return web.json_response({"detached": request.match_info["id"]})

    async def _asks(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("peek") not in ("1", "true"):
            self.broker.polled()  # a reader of the list is taken to answer; a peek (the dashboard) is not
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
        body = await _json_body(request, ("answer", "by"))
        if isinstance(body, web.Response):
            return body
        try:
            kind = _BODY.text(body.get("answer"), "answer")
            by = _BODY.text(body.get("by"), "by", required=False) or "the control API"
        except PolicyError as exc:
            return _error(400, exc.located())
        try:
            reply = await asyncio.to_thread(self.broker.answer, request.match_info["id"], kind, by=by)
        except AskError as exc:
            return _error(exc.status, str(exc))
        return web.json_response(reply)

    async def _grants(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        return web.json_response({"grants": [g.to_json(now) for g in self.grants.list()]})

    async def _grant(self, request: web.Request) -> web.Response:
        body = await _json_body(request, ("target", "ttl", "once"))
        if isinstance(body, web.Response):
            return body
        try:
            target = _BODY.text(body.get("target"), "target")
            ttl = _BODY.positive(body.get("ttl"), "ttl", DEFAULT_TTL)
            if not _BODY.bool(body.get("once"), "once", True):
                return _error(400, "only one-shot grants (once: true) are made here; answer an ask with run")
        except PolicyError as exc:
            return _error(400, exc.located())
        try:
            grant = self.grants.add(target, once=True, ttl=float(ttl))
        except GrantError as exc:
            return _error(400, str(exc))
        return web.json_response(grant.to_json(), status=201)

    async def _revoke(self, request: web.Request) -> web.Response:
        if not self.grants.revoke(request.match_info["id"]):
            return _error(404, f"no grant {request.match_info['id']!r}")
        return web.json_response({"revoked": request.match_info["id"]})

    async def _policy(self, request: web.Request) -> web.Response:
        if self.policy is None:
            return _error(404, "this egressd shows no policy")
        return web.json_response(await asyncio.to_thread(self.policy))

    async def _edit_rule(self, request: web.Request) -> web.Response:
        """Add or remove one allow/deny rule of the policy file (validated, written atomically, the
        reload applying it), like a hand edit of the file."""
        body = await _json_body(request, ("op", "list", "rule"))
        if isinstance(body, web.Response):
            return body
        try:
            op = _BODY.choice(body.get("op", "add"), "op", ("add", "remove"))
            which = _BODY.choice(body.get("list"), "list", LISTS)
            rule = _BODY.text(body.get("rule"), "rule")
        except PolicyError as exc:
            return _error(400, exc.located())
        if self.edit_policy is None:
            return _error(409, "no policy file to edit (egressd runs without --policy FILE)")
        from egressd.tools.policy_edit import PolicyEditError

        try:
            done = await asyncio.to_thread(self.edit_policy, op, which, rule)
        except PolicyEditError as exc:
            return _error(400, str(exc))
        return web.json_response(
            {"done": done, "policy": await asyncio.to_thread(self.policy) if self.policy else None}
        )

    async def _events(self, request: web.Request) -> web.StreamResponse:
        """Every event from now on; with `backlog=N`, the last N decisions first (marked
        `"backlog": true`), so a reader that starts late sees what happened before it came."""
        try:
            backlog = max(0, int(request.query.get("backlog", "0")))
        except ValueError:
            return _error(400, "backlog must be a number of decisions")
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(QUEUE_LINES)
        observer = _EventHandOff(asyncio.get_running_loop(), queue)
        self.events.subscribe(observer)
        # read after subscribing: a decision made in between is in both, and the hand-off drops
        # it (by identity) — heard once, never lost
        earlier = self.recent()[-backlog:] if backlog and self.recent is not None else []
        observer.skip.update(id(event) for event in earlier)
        if self.watched is not None:
            self.watched()
        try:
            initial = [{**event_json(event), "backlog": True} for event in earlier]
            return await self._stream(request, queue, initial)
        finally:
            self.events.unsubscribe(observer)

    async def _stream(
        self, request: web.Request, queue: asyncio.Queue[dict[str, Any]], initial: list[dict[str, Any]]
    ) -> web.StreamResponse:
        """Newline-delimited JSON until the client goes away or egressd stops."""
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
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


async def metrics_answer(render: Callable[[], bytes]) -> web.Response:
    """A scrape: rendered in a worker thread (it formats every family, and its first one loads
    prometheus_client), so the proxy's loop goes on serving meanwhile."""

    def rendered() -> tuple[bytes, str]:
        from egressd.observe.metrics import content_type

        return render(), content_type()

    body, kind = await asyncio.to_thread(rendered)
    return web.Response(body=body, headers={"Content-Type": kind})


def metrics_app(render: Callable[[], bytes], token: str | None) -> web.Application:
    """`--metrics HOST:PORT`: the control API's metrics answer on a TCP port, on every path as
    prometheus_client's own server answers, compressed when the scraper asks. With `token`, only to
    `Authorization: Bearer TOKEN` (compared in constant time): on a network shared with the clients
    (the compose gateway), only whoever holds the token sees what they do."""
    expected = f"Bearer {token}".encode() if token is not None else None

    async def scrape(request: web.Request) -> web.Response:
        if expected is not None:
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, expected):
                challenge = {"WWW-Authenticate": 'Bearer realm="egressd metrics"'}
                return web.Response(status=401, headers=challenge)
        answer = await metrics_answer(render)
        answer.enable_compression()
        return answer

    app = web.Application()
    app.router.add_get("/{path:.*}", scrape)
    return app


def _offer(queue: asyncio.Queue[dict[str, Any]], item: dict[str, Any]) -> None:
    try:
        queue.put_nowait(item)
    except asyncio.QueueFull:
        queue.dropped = getattr(queue, "dropped", 0) + 1  # type: ignore[attr-defined]


class _EventHandOff:
    """A follower's observer: events to its stream in batches.

    An event only goes on a deque; the stream's queue is fed once per batch, after the callbacks
    of the loop iteration that emitted them (a busy proxy pays one hand-off for the events of a
    whole iteration, and each event is turned into JSON then, not while a connection waits). An
    event from another thread (an ask answered on the terminal) wakes the loop safely."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[dict[str, Any]]) -> None:
        self.loop, self.queue = loop, queue
        self.pending: collections.deque[Event] = collections.deque()
        self.scheduled = False
        self.skip: set[int] = set()  # ids of events the reader got already (the backlog)

    def __call__(self, event: Event) -> None:
        self.pending.append(event)
        if not self.scheduled:
            self.scheduled = True
            if _running_loop() is self.loop:
                self.loop.call_soon(self._drain)
                return
            with contextlib.suppress(RuntimeError):  # the loop has closed
                self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:  # on the loop
        self.scheduled = False  # first: an event appended from now on schedules the next drain
        while self.pending:
            event = self.pending.popleft()
            if self.skip and id(event) in self.skip:
                self.skip.discard(id(event))
                continue
            _offer(self.queue, event_json(event))


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # another thread's emit
        return None


def _line(item: dict[str, Any]) -> bytes:
    return (json.dumps(item, default=str, separators=(",", ":")) + "\n").encode()


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _json_body(request: web.Request, keys: Sequence[str]) -> dict[str, Any] | web.Response:
    """The body: a JSON object of `keys` only. Its fields are read with the policy's schema reader,
    so a field is checked, and its problem worded, as the same kind of entry in a policy file."""
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        return _error(400, "the body must be a JSON object")
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object")
    try:
        return _BODY.mapping(body, "", keys)
    except PolicyError as exc:
        return _error(400, exc.located())


def _peer_pid(sock: socket.socket | None) -> int | None:
    """The pid of the process at the other end (Linux SO_PEERCRED); None where it is not known."""
    peercred = getattr(socket, "SO_PEERCRED", None)
    if sock is None or sock.family != socket.AF_UNIX or peercred is None:
        return None
    raw = sock.getsockopt(socket.SOL_SOCKET, peercred, struct.calcsize("3i"))
    pid = struct.unpack("3i", raw)[0]
    return pid if pid > 0 else None


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
