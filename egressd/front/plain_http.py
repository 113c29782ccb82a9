"""Plain (absolute-form) HTTP/1 proxy requests, served entirely in egressd's front.

Every request a child sends as `METHOD http://host/path` is read through `egressd.wire.http1` (the
strict head guard, then one parse of the head; bodies framed by h11's readers), admitted
(credentials, limits, the one decision, the Host check, audit) and forwarded over a pinned upstream
connection, whose responses are read the same way. Nothing is handed to mitmproxy: one reader means
one idea of where a message ends.

Requests are served in order, one exchange at a time (a pipelined request waits, unparsed, until
the answer before it is out). The exchange is driven by the protocols' callbacks: the child's head
is read where it arrives, the request goes out once admitted and connected (those two steps, and a
request body streamed up, run in a task of the exchange's own), and the upstream's response is
written to the child from the upstream's reads, with no queue between them. Each side is paused at
HIGH_WATER (a slow child stops the upstream's reads; a body waits for the upstream to drain), so
a huge transfer either way is never buffered. Upstream connections are kept between exchanges in
the front's pool (IdleUpstreams) for the next request of the same child to the same target; an
allowed WebSocket upgrade becomes a byte relay (egressd.front.relay) after the upstream's 101.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import operator
import time
from typing import TYPE_CHECKING, Protocol, cast

from egressd.admission.pipeline import Admitted, Attempt, UpstreamKey
from egressd.front.relay import HIGH_WATER, Pipe, Tunnel
from egressd.policy.reasons import Reason
from egressd.policy.refusal import Refusal
from egressd.wire.http1 import (
    TEXT_ENCODING,
    Body,
    ClientSide,
    End,
    Event,
    RequestHead,
    ResponseHead,
    ServerSide,
    Switched,
    WireError,
)
from egressd.wire.http_fields import hostport
from egressd.wire.placeholders import PlaceholderFound, PlaceholderStream, ValueMask

if TYPE_CHECKING:
    from egressd.admission.pipeline import Pipeline
    from egressd.admission.state import ConnState
    from egressd.net.pinning import Pin

logger = logging.getLogger(__name__)

POOL_SIZE = 64  # kept-alive upstream connections between exchanges, for every client together
POOL_IDLE = 30.0  # seconds one is kept unused (the front's sweep closes it after)
LOST_MID_RESPONSE = "server closed the connection before the response ended"
# the answer to a request or tunnel still waiting for it when its client's token is removed
REVOKED = Refusal(
    Reason.PROXY_AUTH_REQUIRED,
    "this client's token was removed from the gateway's token file while the request was in progress",
)
Key = tuple[str, int]
_NO_MASK = ValueMask(())


class _Inbox:
    """A streamed request body's events, waiting for the task that sends them upstream; the
    child's reading pauses at HIGH_WATER."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.events: collections.deque[Event] = collections.deque()
        self.error: WireError | None = None
        self.closed = False  # no more events will come
        self.size = 0  # body bytes waiting
        self.waiter: asyncio.Future[None] | None = None
        self.transport = transport
        self.paused = False

    def put(self, events: list[Event], backlog: int = 0) -> None:
        for event in events:
            if isinstance(event, Body):
                self.size += len(event.data)
            self.events.append(event)
        if self.size + backlog > HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def fail(self, error: WireError | None) -> None:
        self.error = self.error or error
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self) -> Event | None:
        """The next event; None when the side closed without one. Raises the side's WireError."""
        while not self.events:
            if self.error is not None:
                raise self.error
            if self.closed:
                return None
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        event = self.events.popleft()
        if isinstance(event, Body):
            self.size -= len(event.data)
        if self.paused and self.size <= HIGH_WATER // 2:
            self.paused = False
            if not self.transport.is_closing():
                self.transport.resume_reading()
        return event


class User(Protocol):
    """Who an upstream connection tells what it read: the client connection it serves, or the pool
    while it waits between exchanges."""

    def from_upstream(self, upstream: Upstream, data: bytes) -> None: ...

    def upstream_ended(self, upstream: Upstream) -> None: ...

    def upstream_gone(self, upstream: Upstream) -> None: ...

    def upstream_timed_out(self, upstream: Upstream) -> None: ...


class Upstream(asyncio.Protocol):
    """One pinned upstream connection; its responses are read by egressd.wire.http1.ServerSide and
    handed to the client connection it serves, as they are read."""

    def __init__(self, user: User, key: UpstreamKey, state: object) -> None:
        self.client = user
        self.key = key
        self.state = state  # what the pipeline admitted and pinned it in (Pipeline.upstream_state)
        self.pin: Pin | None = None  # where it connected, for the record of each client it serves
        self.recorded_for = ""  # the client connection whose audit records it (Pipeline.reused)
        self.idle_since = 0.0
        self.wire = ServerSide()
        self.transport: asyncio.Transport | None = None
        self.server_id = ""
        self.broken = False  # ended or unusable: never carries another request
        self.head_due = False  # a request went out and its final response head has not come yet
        # timeouts.response, counting once the request ended: since when, and how long (the sweep)
        self.due: tuple[float, float] | None = None
        self.timed_out: float | None = None  # the timeout that ran out, when one did
        self.writable = asyncio.Event()
        self.writable.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(HIGH_WATER)  # the high-water mark, by position (as Pipe's)

    def expect_response(self, timeout: float) -> None:
        """The request is out: its response head is due within `timeout` (timeouts.response)."""
        self.answered()
        self.due = (time.monotonic(), timeout)

    def answered(self, *, final: bool = True) -> None:
        """A response head arrived (`final`: not an interim one) or the exchange ended."""
        self.head_due = self.head_due and not final
        self.due = None

    def overdue(self, now: float) -> None:
        """The front's sweep: no response head within timeouts.response ends the exchange."""
        due = self.due
        if due is not None and now - due[0] >= due[1]:
            self.due = None
            self.timed_out = due[1]
            self.client.upstream_timed_out(self)

    def data_received(self, data: bytes) -> None:
        self.client.from_upstream(self, data)

    def eof_received(self) -> bool:
        self.client.upstream_ended(self)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.answered()
        self.writable.set()
        if not self.broken:
            self.client.upstream_ended(self)
        self.client.upstream_gone(self)

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    async def drain(self) -> None:
        """Wait while the transport's write buffer is above its high-water mark."""
        if not self.writable.is_set():
            await self.writable.wait()

    def write(self, data: bytes) -> None:
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def reading(self, on: bool) -> None:
        """Read the server's answer, or wait (its child reads slower than it answers)."""
        transport = self.transport
        if transport is not None and not transport.is_closing():
            if on:
                transport.resume_reading()
            else:
                transport.pause_reading()

    @property
    def open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing() and not self.broken

    def close(self) -> None:
        self.broken = True
        if self.transport is not None:
            self.transport.close()


class IdleUpstreams:
    """Kept-alive upstream connections between exchanges, shared by every client connection of one
    child: a child that opens a connection per request (`Connection: close`) gets the upstream
    connection its last request left open. Each is kept under Pipeline.upstream_key (the child's
    credential, the canonical target, what its pin depends on) with the state the pipeline admitted
    and pinned it in (the policy, egressd's own addresses, the credentials issued): it is taken
    again only for a request of the same child the pipeline has just admitted to the same target,
    pinned the same way, in the same state — a reload, a token revoked or issued, another child,
    another rule's licence: a new connection. At most POOL_SIZE are kept (the oldest goes
    first), each for POOL_IDLE seconds (the front's sweep); one that speaks or closes while kept is
    let go."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.kept: dict[UpstreamKey, list[Upstream]] = {}
        self.count = 0

    def take(self, key: UpstreamKey) -> Upstream | None:
        kept = self.kept.get(key)
        if not kept:
            return None
        state = self.pipeline.upstream_state()
        while kept:
            upstream = kept.pop()
            self.count -= 1
            if upstream.open and _same(upstream.state, state):
                if not kept:
                    del self.kept[key]
                return upstream
            self._let_go(upstream)
        del self.kept[key]
        return None

    def put(self, upstream: Upstream) -> None:
        if self.count >= POOL_SIZE:
            oldest = min((u for kept in self.kept.values() for u in kept), key=lambda u: u.idle_since)
            self._remove(oldest)
            self._let_go(oldest)
        upstream.client = self
        upstream.idle_since = time.monotonic()
        upstream.reading(True)  # kept, it is read: a server that speaks unasked is let go
        self.kept.setdefault(upstream.key, []).append(upstream)
        self.count += 1

    def sweep(self, now: float) -> None:
        """Let go of those kept POOL_IDLE seconds, and of those kept in another state."""
        state = self.pipeline.upstream_state()
        for upstream in [u for kept in self.kept.values() for u in kept]:
            if upstream.idle_since < now - POOL_IDLE or not _same(upstream.state, state):
                self._remove(upstream)
                self._let_go(upstream)

    def close(self) -> None:
        for upstream in [u for kept in self.kept.values() for u in kept]:
            self._let_go(upstream)
        self.kept.clear()
        self.count = 0

    def _remove(self, upstream: Upstream) -> None:
        kept = self.kept.get(upstream.key)
        if kept is not None and upstream in kept:
            kept.remove(upstream)
            self.count -= 1
            if not kept:
                del self.kept[upstream.key]

    def _let_go(self, upstream: Upstream) -> None:
        self.pipeline.disconnected(upstream.server_id)
        upstream.close()

    # -- what a kept connection does -------------------------------------------------------------
    def from_upstream(self, upstream: Upstream, data: bytes) -> None:
        self._remove(upstream)  # bytes nobody asked for: it is not used again
        self._let_go(upstream)

    def upstream_ended(self, upstream: Upstream) -> None:
        self._remove(upstream)
        self._let_go(upstream)

    def upstream_gone(self, upstream: Upstream) -> None:
        self._remove(upstream)
        self.pipeline.disconnected(upstream.server_id)

    def upstream_timed_out(self, upstream: Upstream) -> None:
        return None


def _same(state: object, now: object) -> bool:
    """Two states of Pipeline.upstream_state: the same objects, one by one."""
    assert isinstance(state, tuple) and isinstance(now, tuple)
    return len(state) == len(now) and all(map(operator.is_, state, now))  # in C: no generator's frame


class Owner(Protocol):
    """The client connection whose requests this path serves (egressd.front.tunnel.FrontProtocol):
    it took the connection first, and takes it back as a relay after an upgrade."""

    pipeline: Pipeline
    state: ConnState | None
    transport: asyncio.Transport | None
    tunnel: Tunnel
    server_id: str | None
    stage: str

    def finish(self) -> None: ...

    def _refuse(self, refusal: Refusal) -> None: ...


class PlainClient(asyncio.Protocol):
    """The child's connection after its first plain-HTTP request head: serves its requests in order."""

    def __init__(self, front: Owner, pending: bytes, pool: IdleUpstreams) -> None:
        assert front.state is not None and front.transport is not None
        self.front = front
        self.pool = pool
        self.pipeline: Pipeline = front.pipeline
        self.state: ConnState = front.state
        self.transport: asyncio.Transport = front.transport
        self.wire = ClientSide()
        self.pending = pending
        self.out: list[bytes] = []
        self.requests = 0
        self.phase = "head"  # head | exchange | relay | closed
        self.eof = False  # the child ended its side
        self.backlog_paused = False  # reading paused: too much of a pipelined request waits
        self.write_paused = False  # the child reads slower than its answer comes: the upstream waits
        self.limit = self.pipeline.policies.get().limits.max_response_bytes
        self.last_active = time.monotonic()
        # the current exchange
        self.task: asyncio.Task[None] | None = None  # its admission, connect and streamed body
        self.request: RequestHead | None = None
        self.inbox: _Inbox | None = None  # its body, when it has one
        self.body_sent = False  # ... and all of it went upstream
        self.body_failed: WireError | None = None  # ... or it broke
        self.busy: Upstream | None = None  # the upstream connection carrying it
        self.answering = False  # its response has started going to the child
        self.key: Key = ("", 0)
        self.mask = _NO_MASK
        self.seen = 0  # response body bytes

    # -- the client connection ---------------------------------------------------------------
    def start(self) -> None:
        pending, self.pending = self.pending, b""
        self.data_received(pending)

    def sweep(self, now: float, header_timeout: float, idle_timeout: float) -> None:
        """The front's sweep, once a second: limits.header_timeout for the first head,
        limits.idle_timeout after it, timeouts.response for the exchange's answer."""
        if self.phase in ("closed", "relay"):
            return
        if self.requests == 0 and self.phase == "head":
            if now - self.state.started >= header_timeout:
                self.pipeline.header_timeout(self.state, header_timeout)
                self.close()
                return
        elif now - self.last_active >= idle_timeout:
            self.close()
            return
        if self.busy is not None:
            self.busy.overdue(now)

    def data_received(self, data: bytes) -> None:
        self.state.bytes_up += len(data)
        self.last_active = time.monotonic()
        self._read(data)

    def _read(self, data: bytes) -> None:
        """Bytes from the child (b"": those read already): the current request's events."""
        try:
            events = self.wire.receive(data)
        except WireError as exc:
            self._unreadable(exc)
            return
        if events:
            self._events(events)
        elif self.phase == "exchange" and self.wire.buffered > HIGH_WATER and not self.backlog_paused:
            self.backlog_paused = True  # a pipelined request waits, and not more than this of it
            self.transport.pause_reading()

    def _unreadable(self, exc: WireError) -> None:
        """A request, or its body, no reader may take: a body's break is the sender's to answer."""
        if self.inbox is not None:
            self.inbox.fail(exc)
        elif self.phase == "head":
            self._refuse_unreadable(exc)

    def _events(self, events: list[Event]) -> None:
        head = events[0]
        if not isinstance(head, RequestHead):  # more of the current request's body
            if self.inbox is not None:
                self.inbox.put(events, self.wire.buffered)
            return
        rest = events[1:]
        bodiless = len(rest) == 1 and isinstance(rest[0], End)
        self.phase = "exchange"
        self.answering = self.body_sent = False
        self.body_failed = None
        self.requests += 1
        self.request = head
        if not bodiless:
            self.inbox = _Inbox(self.transport)
            if self.eof:
                self.inbox.fail(None)
            self.inbox.put(rest, self.wire.buffered)
        self.task = asyncio.get_running_loop().create_task(self._admit_and_send(head))

    def eof_received(self) -> bool:
        self.eof = True
        try:
            events = self.wire.receive_eof()
        except WireError as exc:
            self._unreadable(exc)
            return True
        if events:
            self._events(events)
        if self.inbox is not None:
            self.inbox.fail(None)
        if self.phase == "head":
            self.close()
        return True  # the answers to requests read in full still go out; then the connection closes

    def connection_lost(self, exc: Exception | None) -> None:
        if self.phase == "relay":
            return
        self.phase = "closed"
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self._drop_upstreams()
        self.front.finish()

    def pause_writing(self) -> None:
        """The child reads slower than the upstream answers: the upstream waits."""
        self.write_paused = True
        if self.busy is not None:
            self.busy.reading(False)

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.busy is not None:
            self.busy.reading(True)

    def write(self, data: bytes) -> None:
        """Queued until flush(): one send per batch of upstream events, not one per piece."""
        if data:
            self.out.append(data)

    def flush(self) -> None:
        if self.out:
            data = b"".join(self.out)
            self.out.clear()
            if not self.transport.is_closing():
                self.transport.write(data)

    def close(self) -> None:
        self.flush()
        self.phase = "closed" if self.phase != "relay" else self.phase
        self.transport.close()

    def revoke(self) -> None:
        """The client's credentials were revoked: an exchange whose response has not started is
        answered 407 (never closed without an answer), one under way is cut, an idle connection
        closes."""
        if self.phase == "exchange" and not self.answering:
            if self.task is not None and not self.task.done():
                self.task.cancel()
            self._refuse(REVOKED)
        elif self.phase != "closed":
            self._drop_upstreams()
            self.close()

    def count_down(self, n: int) -> None:
        self.state.bytes_down += n
        self.last_active = time.monotonic()

    # -- one exchange ----------------------------------------------------------------------------
    async def _admit_and_send(self, head: RequestHead) -> None:
        """The request's admission and its upstream connection (the steps that may wait), then the
        request, and its body streamed up. A bug refuses (fail closed)."""
        try:
            state = self.pipeline.upstream_state()  # a connection opened now is pinned in it
            admitted = await self._admit(head)
            if isinstance(admitted, Refusal):
                self._refuse(admitted)
                return
            key = (admitted.host, admitted.port)
            pool_key = self.pipeline.upstream_key(self.state, admitted)
            upstream = self.pool.take(pool_key)
            if upstream is not None and upstream.recorded_for != self.state.conn_id:
                assert upstream.pin is not None
                unrecorded = self.pipeline.reused(self.state, admitted, upstream.pin)
                if unrecorded is not None:
                    self._forget(upstream)
                    self._refuse(unrecorded)
                    return
                upstream.recorded_for = self.state.conn_id
            if upstream is None:
                opened = await self._open(admitted, pool_key, state)
                if isinstance(opened, Refusal):
                    self._refuse(opened)
                    return
                upstream = opened
            scan = self._send(head, admitted, key, upstream)
            if not upstream.open:  # it closed before the request went out
                self._upstream_broke(upstream, LOST_MID_RESPONSE)
                return
            if self.inbox is not None:
                await self._send_body(upstream, head, self.inbox, scan)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - fail closed
            self.internal_error(exc)

    def _send(
        self, head: RequestHead, admitted: Admitted, key: Key, upstream: Upstream
    ) -> PlaceholderStream | None:
        """The request head to `upstream` (and its end, when it has no body); the scan of a body
        for the placeholders it must not carry, when there is one."""
        self.busy = upstream
        upstream.client = self
        if self.write_paused:
            upstream.reading(False)
        self.key = key
        self.mask = ValueMask(admitted.injection.values) if admitted.injection.values else _NO_MASK
        self.seen = 0
        upstream.head_due = True
        out = _as_sent(head, admitted)
        sent = upstream.wire.request_to(out, key[0], key[1], admitted.strip)
        if self.inbox is None:
            upstream.write(sent + upstream.wire.end())
            upstream.expect_response(self.pipeline.policies.get().limits.response_timeout)
            return None
        upstream.write(sent)
        return PlaceholderStream(admitted.injection.body) if admitted.injection.body else None

    async def _send_body(
        self, upstream: Upstream, head: RequestHead, inbox: _Inbox, scan: PlaceholderStream | None
    ) -> None:
        """The request body, streamed: never more than HIGH_WATER waits on either side. With `scan`,
        the secrets' placeholders it must not carry are looked for across chunks; a find refuses the
        request before any byte of the placeholder is sent (the upstream is closed mid-body)."""
        try:
            try:
                while True:
                    event = await inbox.get()
                    if isinstance(event, Body):
                        data = event.data if scan is None else scan.feed(event.data)
                        upstream.write(upstream.wire.body(data))
                        await upstream.drain()
                    elif isinstance(event, End):
                        if scan is not None:
                            upstream.write(upstream.wire.body(scan.end()))
                        upstream.write(upstream.wire.end())
                        self.body_sent = True
                        if upstream.head_due:  # an answer that came before the body ended is not waited for
                            upstream.expect_response(self.pipeline.policies.get().limits.response_timeout)
                        return
                    else:
                        raise WireError("the connection ended inside a request body")
            except PlaceholderFound as found:
                refusal = self.pipeline.secret_refusal(head.host, head.port, found.name)
                raise WireError(refusal.detail, refusal.status, reason=refusal.reason, head=head) from None
        except WireError as exc:
            self.body_failed = exc  # the upstream never gets the rest (it closes), the child its 400
            if upstream is self.busy:
                self._upstream_broke(upstream, exc.detail)

    def from_upstream(self, upstream: Upstream, data: bytes) -> None:
        """What the upstream sent: the response, written to the child as it is read."""
        self.count_down(len(data))
        try:
            events = upstream.wire.receive(data)
        except WireError as exc:
            if upstream is self.busy:
                self._upstream_broke(upstream, exc.detail)
            else:  # an idle one that speaks unasked is not used again
                upstream.close()
            return
        if upstream is self.busy:
            self._response(upstream, events)

    def upstream_ended(self, upstream: Upstream) -> None:
        """The upstream ended its side (or its connection): the end of a close-delimited body, or
        a response cut short."""
        if upstream.broken:
            return
        upstream.broken = True
        if upstream is not self.busy:
            return
        try:
            events = upstream.wire.receive_eof()
        except WireError as exc:
            self._upstream_broke(upstream, exc.detail)
            return
        self._response(upstream, events)
        if upstream is self.busy:  # the response did not end with it
            self._upstream_broke(upstream, LOST_MID_RESPONSE)

    def upstream_timed_out(self, upstream: Upstream) -> None:
        if upstream is self.busy:
            self._upstream_broke(upstream, "no response within timeouts.response")

    def _response(self, upstream: Upstream, events: list[Event]) -> None:
        try:
            for event in events:
                if self._response_event(upstream, event):
                    return
            self.flush()
        except Exception as exc:  # noqa: BLE001 - fail closed
            self.internal_error(exc)

    def _response_event(self, upstream: Upstream, event: Event) -> bool:
        """One event of the upstream's answer to the child; True when the exchange is over. With
        a mask, a secret's value the upstream echoes is masked in every part of the answer: the
        status lines and fields of interim (1xx) and final heads, the body, the trailers."""
        request = self.request
        assert request is not None
        mask = self.mask
        if isinstance(event, ResponseHead):
            upstream.answered(final=event.status >= 200 or event.status == 101)
            if event.status < 200:
                switched_to = [v.strip().lower() for v in event.values("upgrade")]
                if event.status == 101 and not (request.upgrade and switched_to == ["websocket"]):
                    # the relay after a 101 is undecided: only the WebSocket that was admitted
                    self._upstream_broke(upstream, "101 to no admitted WebSocket upgrade")
                    return True
                self.answering = True
                self.write(self.wire.interim(masked_head(mask, event)))
                if event.status != 101 and not upstream.wire.sending:  # the final head is still due
                    upstream.expect_response(self.pipeline.policies.get().limits.response_timeout)
                return False
            length = event.values("content-length")
            if self.limit is not None and length and length[0].isdigit() and int(length[0]) > self.limit:
                self._audit_cut(request.path, int(length[0]))
                self._refuse(too_large_refusal(self.key, int(length[0]), self.limit))
                return True
            if 300 <= event.status < 400 and (location := event.values("location")):
                self.pipeline.redirects.remember(
                    self.state.client_key, request_url(self.key, request.path), location[0]
                )
            self.answering = True
            self.write(self.wire.response(masked_head(mask, event)))
        elif isinstance(event, Body):
            self.seen += len(event.data)
            if self.limit is not None and self.seen > self.limit:
                self._audit_cut(request.path, self.seen)  # cut visibly: no last chunk
                self._exchange_over(upstream, done=False)
                return True
            data = mask.feed(event.data) if mask else event.data
            if data:
                self.write(self.wire.body(data))
            if len(self.out) > 16:
                self.flush()
        elif isinstance(event, End):
            if mask and (rest := mask.end()):
                self.write(self.wire.body(rest))
            self.write(self.wire.end(mask.text_fields(event.trailers, TEXT_ENCODING)))
            self.flush()
            self._exchange_over(upstream, done=True)
            return True
        elif isinstance(event, Switched):
            self._become_relay(upstream, event.rest)
            return True
        return False

    def _exchange_over(self, upstream: Upstream, *, done: bool) -> None:
        """The response ended (`done`) or was cut: the upstream is kept or let go, and the next
        request is read — unless the request's body did not all go up (it is cut with the answer
        that came before it ended) or the exchange ends the connection."""
        upstream.answered()
        body_sent = self.inbox is None or self.body_sent
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self.busy = None
        self.inbox = None
        if done and body_sent and upstream.wire.reusable() and upstream.open:
            self.pool.put(upstream)
        else:
            self._forget(upstream)
        if not (done and body_sent and self.wire.next_request()):
            self.close()
            return
        self.phase = "head"
        self.request = None
        self._read(b"")  # a pipelined request already read
        if self.backlog_paused and self.wire.buffered <= HIGH_WATER // 2 and self.phase != "closed":
            self.backlog_paused = False
            self.transport.resume_reading()
        if self.phase == "head" and self.eof:
            self.close()

    # -- admission: the steps around the one decision ------------------------------------------------
    async def _admit(self, request: RequestHead) -> Admitted | Refusal:
        """The request through the admission pipeline, as every front's requests go (credentials,
        limits, the decision, the request rules, the records)."""
        authorization = request.values("proxy-authorization")
        attempt = Attempt(
            "request",
            request.host,
            request.port,
            scheme="http",
            method=request.method,
            path=request.path,
            credentials=authorization[0] if authorization else None,
            headers=request.headers,
        )
        return await self.pipeline.admit(self.state, attempt)

    async def _open(self, admitted: Admitted, key: UpstreamKey, state: object) -> Upstream | Refusal:
        """A new upstream connection to the addresses the pipeline pins for this request."""
        upstream = Upstream(self, key, state)
        upstream.server_id = f"{self.state.conn_id}-up{self.requests}"
        refusal = await self.pipeline.connect(self.state, admitted, upstream, upstream.server_id)
        upstream.pin, upstream.recorded_for = admitted.pin, self.state.conn_id
        return upstream if refusal is None else refusal

    def _audit_cut(self, path: str, seen: int) -> None:
        assert self.limit is not None
        where = {"host": self.key[0], "port": self.key[1], "path": path}
        self.pipeline.notice(self.state, "response_cut", **where, limit=self.limit, bytes=seen)

    # -- upstream connections ------------------------------------------------------------------------
    def _forget(self, upstream: Upstream) -> None:
        self.pipeline.disconnected(upstream.server_id)
        upstream.close()

    def upstream_gone(self, upstream: Upstream) -> None:
        """An upstream connection closed: one that carried the exchange ended it before its
        response did."""
        self.pipeline.disconnected(upstream.server_id)
        if upstream is self.busy:
            self._upstream_broke(upstream, LOST_MID_RESPONSE)

    def _drop_upstreams(self) -> None:
        if self.busy is not None:
            self._forget(self.busy)
        self.busy = None

    def _upstream_broke(self, upstream: Upstream, why: str) -> None:
        """The upstream failed the exchange: no response head within timeouts.response (504
        upstream_timeout) or an answer that is not HTTP/1, a half response among them (502
        upstream_protocol_error). Recorded as a failure; answered while nothing of the response
        went out, else both sides close (a visible truncation, never a guess). `why` may quote the
        response: every secret's value in it is masked before the child or a record sees it. A
        request body that broke is answered as the child's fault instead (400, or the secrets'
        refusal)."""
        why = self.pipeline.secrets.mask_text(why)
        self.busy = None
        self._forget(upstream)
        if self.task is not None and not self.task.done() and self.task is not asyncio.current_task():
            self.task.cancel()
        error = self.body_failed
        if error is not None:
            if self.answering:
                self.close()
            else:
                self._refuse_unreadable(error)
            return
        if upstream.timed_out is not None:
            failure = Refusal(
                Reason.UPSTREAM_TIMEOUT,
                f"no response from the server within {upstream.timed_out:g}s (timeouts.response)",
                *self.key,
            )
        else:
            failure = Refusal(Reason.UPSTREAM_PROTOCOL_ERROR, f"HTTP/1 protocol error: {why}", *self.key)
        logger.info("closing plain-HTTP exchange with %s:%s: %s", *self.key, failure.detail)
        self.pipeline.upstream_failed(self.state, *self.key, failure.reason, failure.detail)
        if self.answering:
            self.close()
        else:
            self._refuse(failure)

    def _become_relay(self, upstream: Upstream, rest: bytes) -> None:
        """After the upstream's 101: both connections become one byte relay (egressd.front.relay)."""
        assert upstream.transport is not None
        self.flush()
        self.phase = "relay"
        self.busy = None
        front = self.front
        pipe = Pipe(front.tunnel, upstream=True)
        upstream.transport.set_protocol(pipe)
        pipe.connection_made(upstream.transport)
        front.server_id = upstream.server_id
        front.stage = "relay"
        self.transport.set_protocol(cast(Pipe, front))
        pipe.attach(cast(Pipe, front))
        early = self.wire.trailing()
        if early:
            upstream.transport.write(early)
        if rest:
            self.transport.write(rest)
        self.transport.resume_reading()
        upstream.transport.resume_reading()

    # -- endings -------------------------------------------------------------------------------
    def _refuse(self, refusal: Refusal) -> None:
        self.flush()
        self.phase = "closed"
        self._drop_upstreams()
        self.front._refuse(refusal)

    def _refuse_unreadable(self, exc: WireError) -> None:
        """A request no reader may take: 400 (431 for a huge head), recorded before any decision."""
        head = exc.head
        where = (head.host, head.port) if head is not None else (None, None)
        self.pipeline.refused_early(
            self.state,
            *where,
            exc.reason,
            exc.detail,
            stage="request",
            method=head.method if head is not None else None,
            scheme=head.scheme if head is not None else None,
            path=head.path if head is not None else None,
        )
        self._refuse(
            Refusal(exc.reason, exc.detail, *where) if head is not None else Refusal(exc.reason, exc.detail)
        )

    def internal_error(self, exc: BaseException) -> None:
        """A bug here refuses (never forwards) and is audited, like fail_closed in the addons."""
        refusal = self.pipeline.internal_error("plain_http", exc)
        if not self.answering and self.phase != "relay":
            self._refuse(refusal)
        else:
            self._drop_upstreams()
            self.close()


def _as_sent(head: RequestHead, admitted: Admitted) -> RequestHead:
    """The request as it goes upstream: with what the secrets step changed (headers, path)."""
    injection = admitted.injection
    if injection.headers is None and injection.path is None:
        return head
    headers = list(injection.headers) if injection.headers is not None else head.headers
    return dataclasses.replace(head, headers=headers, path=injection.path or head.path)


def masked_head(mask: ValueMask, head: ResponseHead) -> ResponseHead:
    """A response head with the values masked in its reason phrase and its fields."""
    if not mask:
        return head
    reason = mask.text(head.reason, TEXT_ENCODING)
    return dataclasses.replace(head, reason=reason, headers=mask.text_fields(head.headers, TEXT_ENCODING))


def request_url(key: Key, path: str) -> str:
    """The URL a request is remembered by (redirect memory)."""
    return f"http://{hostport(*key)}{path}"


def too_large_refusal(key: Key, length: int, limit: int) -> Refusal:
    """egressd's 502 for a Content-Length over limits.max_response_bytes (before any body)."""
    detail = f"the response is {length} bytes; limits.max_response_bytes is {limit}"
    return Refusal(Reason.RESPONSE_TOO_LARGE, detail, *key)
