"""Plain (absolute-form) HTTP/1 proxy requests, served entirely in egressd's front.

Every request a child sends as `METHOD http://host/path` is read through `egressd.wire.http1` (the
strict head guard, then one parse of the head; bodies framed by h11's readers), admitted
(credentials, limits, the one decision, the Host check, audit) and forwarded over a pinned upstream
connection, whose responses are read the same way. Nothing is handed to mitmproxy: one reader means
one idea of where a message ends. One coroutine per client connection serves its requests in order
(pipelined ones wait, unparsed, until the answer before them is out); the request body streams up
while the response streams down, each side paused at HIGH_WATER so a huge upload through a slow
upstream (or the reverse) is never buffered. Upstream connections are kept per canonical target for
the next request of the same client connection; an allowed WebSocket upgrade becomes a byte relay
(egressd.front.relay) after the upstream's 101.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

from egressd.admission.pipeline import Admitted, Attempt
from egressd.front.relay import HIGH_WATER, Pipe, Tunnel
from egressd.policy.reasons import Reason
from egressd.refusal import Refusal
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
    upstream_headers,
)
from egressd.wire.http_fields import hostport
from egressd.wire.placeholders import PlaceholderFound, PlaceholderStream, ValueMask

if TYPE_CHECKING:
    from egressd.admission.pipeline import Pipeline
    from egressd.admission.state import ConnState

logger = logging.getLogger(__name__)

MAX_IDLE_UPSTREAMS = 8  # kept-alive upstream connections per client connection (one per target)
LOST_MID_RESPONSE = "server closed the connection before the response ended"
# the answer to a request or tunnel still waiting for it when its client's token is removed
REVOKED = Refusal(
    Reason.PROXY_AUTH_REQUIRED,
    "this client's token was removed from the gateway's token file while the request was in progress",
)
Key = tuple[str, int]


class _Inbox:
    """Events parsed from one transport, waiting for the coroutine; reading pauses at HIGH_WATER."""

    def __init__(self) -> None:
        self.events: collections.deque[Event] = collections.deque()
        self.error: WireError | None = None
        self.closed = False  # no more events will come
        self.size = 0  # body bytes waiting
        self.waiter: asyncio.Future[None] | None = None
        self.transport: asyncio.Transport | None = None
        self.paused = False

    def put(self, events: list[Event], backlog: int = 0) -> None:
        for event in events:
            if isinstance(event, Body):
                self.size += len(event.data)
            self.events.append(event)
        if self.size + backlog > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def parse(self, parse: Callable[[], list[Event]], backlog: Callable[[], int] | None = None) -> None:
        """Queue what parse() read; a WireError ends this side (raised to the reader in order)."""
        try:
            self.put(parse(), backlog() if backlog is not None else 0)
        except WireError as exc:
            self.fail(exc)

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
        if self.paused and self.size <= HIGH_WATER // 2 and self.transport is not None:
            self.paused = False
            if not self.transport.is_closing():
                self.transport.resume_reading()
        return event


class _Writable:
    """drain(): wait while the transport's write buffer is above its high-water mark."""

    def __init__(self) -> None:
        self.writable = asyncio.Event()
        self.writable.set()

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    async def drain(self) -> None:
        if not self.writable.is_set():
            await self.writable.wait()


class Upstream(_Writable, asyncio.Protocol):
    """One pinned upstream connection; its responses are read by h11 (egressd.wire.http1.ServerSide)."""

    def __init__(self, client: PlainClient, key: Key) -> None:
        _Writable.__init__(self)
        self.client = client
        self.key = key
        self.wire = ServerSide()
        self.inbox = _Inbox()
        self.transport: asyncio.Transport | None = None
        self.server_id = ""
        self.head_due = False  # a request went out and its final response head has not come yet
        self.waiting: asyncio.TimerHandle | None = None  # timeouts.response, counting once the request ended
        self.timed_out: float | None = None  # the timeout that ran out, when one did

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=HIGH_WATER)
        self.inbox.transport = self.transport

    def expect_response(self, timeout: float) -> None:
        """The request is out: its response head is due within `timeout` (timeouts.response)."""
        self.answered()
        self.waiting = asyncio.get_running_loop().call_later(timeout, self._no_response, timeout)

    def answered(self, *, final: bool = True) -> None:
        """A response head arrived (`final`: not an interim one) or the exchange ended."""
        self.head_due = self.head_due and not final
        if self.waiting is not None:
            self.waiting.cancel()
            self.waiting = None

    def _no_response(self, timeout: float) -> None:
        self.waiting = None
        if self.inbox.events:  # the head came in this very turn of the loop: it is read next
            return
        self.timed_out = timeout
        self.inbox.fail(None)
        self.close()

    def data_received(self, data: bytes) -> None:
        self.client.count_down(len(data))
        self.inbox.parse(lambda: self.wire.receive(data))

    def eof_received(self) -> bool:
        self.inbox.parse(self.wire.receive_eof)
        self.inbox.fail(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.answered()
        if not self.inbox.closed and self.wire.in_head is False and not self.wire.fed_eof:
            self.eof_received()
        self.inbox.fail(None)
        self.writable.set()
        self.client.upstream_gone(self)

    def write(self, data: bytes) -> None:
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    @property
    def open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing() and not self.inbox.closed

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


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


class PlainClient(_Writable, asyncio.Protocol):
    """The child's connection after its first plain-HTTP request head: serves its requests in order."""

    def __init__(self, front: Owner, pending: bytes) -> None:
        _Writable.__init__(self)
        assert front.state is not None and front.transport is not None
        self.front = front
        self.pipeline: Pipeline = front.pipeline
        self.state: ConnState = front.state
        self.transport: asyncio.Transport = front.transport
        self.wire = ClientSide()
        self.inbox = _Inbox()
        self.inbox.transport = self.transport
        self.pending = pending
        self.out: list[bytes] = []
        self.idle: dict[Key, Upstream] = {}  # kept-alive upstream connections by canonical target
        self.busy: Upstream | None = None  # the one carrying the current exchange
        self.body_failed: WireError | None = None  # the current request's body broke
        self.requests = 0
        self.phase = "head"  # head | exchange | relay | closed
        self.answering = False  # the current exchange's response has started going to the child
        self.limit = self.pipeline.policies.get().limits.max_response_bytes
        self.last_active = time.monotonic()
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None

    # -- the client connection ---------------------------------------------------------------
    def start(self) -> None:
        limits = self.pipeline.policies.get().limits
        left = limits.header_timeout - (time.monotonic() - self.state.started)
        self.timer = asyncio.get_running_loop().call_later(max(0.0, left), self._watch)
        self.task = asyncio.get_running_loop().create_task(self._serve())
        pending, self.pending = self.pending, b""
        self.data_received(pending)

    def _watch(self) -> None:
        """limits.header_timeout for the first head, limits.idle_timeout after it."""
        if self.phase in ("closed", "relay"):
            return
        limits = self.pipeline.policies.get().limits
        now = time.monotonic()
        if self.requests == 0 and self.phase == "head":
            left = limits.header_timeout - (now - self.state.started)
            if left <= 0:
                self.pipeline.header_timeout(self.state, limits.header_timeout)
                self.close()
                return
        else:
            left = limits.idle_timeout - (now - self.last_active)
            if left <= 0:
                self.close()
                return
        self.timer = asyncio.get_running_loop().call_later(left, self._watch)

    def data_received(self, data: bytes) -> None:
        self.state.bytes_up += len(data)
        self.last_active = time.monotonic()
        self._parse(data)

    def _parse(self, data: bytes) -> None:
        self.inbox.parse(lambda: self.wire.receive(data), lambda: self.wire.buffered)

    def eof_received(self) -> bool:
        self.inbox.parse(self.wire.receive_eof)
        self.inbox.fail(None)
        return True  # the answers to requests read in full still go out; then the connection closes

    def connection_lost(self, exc: Exception | None) -> None:
        if self.phase == "relay":
            return
        self.phase = "closed"
        if self.timer is not None:
            self.timer.cancel()
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self.writable.set()
        self._drop_upstreams()
        self.front.finish()

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

    # -- the requests, in order ------------------------------------------------------------------
    async def _serve(self) -> None:
        try:
            while await self._one_request():
                if not self.wire.next_request():
                    break
                self.phase = "head"
                self._parse(b"")  # a pipelined request already read
            if self.phase != "relay":
                self.close()
        except asyncio.CancelledError:
            raise
        except WireError as exc:
            self._refuse_unreadable(exc)
        except Exception as exc:  # noqa: BLE001 - fail closed
            self.internal_error(exc)

    async def _one_request(self) -> bool:
        """One exchange; False when the connection ends after it."""
        self.flush()
        head = await self.inbox.get()
        if head is None:
            return False
        assert isinstance(head, RequestHead)
        self.phase = "exchange"
        self.answering = False
        self.requests += 1
        admitted = await self._admit(head)
        if isinstance(admitted, Refusal):
            self._refuse(admitted)
            return False
        key = (admitted.host, admitted.port)
        url = request_url(key, head.path)
        upstream = self.idle.pop(key, None)
        if upstream is None or not upstream.open:
            if upstream is not None:
                self._forget(upstream)
            opened = await self._open(admitted, key)
            if isinstance(opened, Refusal):
                self._refuse(opened)
                return False
            upstream = opened
        self.busy = upstream
        upstream.head_due = True
        out = _as_sent(head, admitted)
        sent = upstream.wire.request(out, upstream_headers(out, key[0], key[1], set(admitted.strip)))
        sending: asyncio.Task[None] | None = None
        if self.inbox.events and isinstance(self.inbox.events[0], End):  # no body: no task for it
            self.inbox.events.popleft()
            upstream.write(sent + upstream.wire.end())
            upstream.expect_response(self.pipeline.policies.get().limits.response_timeout)
        else:
            upstream.write(sent)
            scan = PlaceholderStream(admitted.injection.body) if admitted.injection.body else None
            sending = asyncio.get_running_loop().create_task(self._send_body(upstream, head, scan))
        try:
            mask = ValueMask(admitted.injection.values)
            outcome = await self._relay_response(upstream, head, key, url, mask)
        finally:
            upstream.answered()
            if sending is not None and not sending.done():
                sending.cancel()
        self.busy = None
        if outcome == "relay":
            return False
        body_sent = sending is None or (
            sending.done() and not sending.cancelled() and sending.exception() is None
        )
        if outcome == "done" and body_sent and upstream.wire.reusable() and upstream.open:
            self._keep(upstream)
        else:
            self._forget(upstream)
        return outcome == "done" and body_sent

    async def _send_body(self, upstream: Upstream, head: RequestHead, scan: PlaceholderStream | None) -> None:
        """The request body, streamed: never more than HIGH_WATER waits on either side. With `scan`,
        the secrets' placeholders it must not carry are looked for across chunks; a find refuses the
        request before any byte of the placeholder is sent (the upstream is closed mid-body)."""
        try:
            try:
                while True:
                    event = await self.inbox.get()
                    if isinstance(event, Body):
                        data = event.data if scan is None else scan.feed(event.data)
                        upstream.write(upstream.wire.body(data))
                        await upstream.drain()
                    elif isinstance(event, End):
                        if scan is not None:
                            upstream.write(upstream.wire.body(scan.end()))
                        upstream.write(upstream.wire.end())
                        if upstream.head_due:  # an answer that came before the body ended is not waited for
                            upstream.expect_response(self.pipeline.policies.get().limits.response_timeout)
                        return
                    else:
                        raise WireError("the connection ended inside a request body")
            except PlaceholderFound as found:
                refusal = self.pipeline.secret_refusal(head.host, head.port, found.name)
                raise WireError(refusal.detail, refusal.status, reason=refusal.reason, head=head) from None
        except WireError as exc:
            self.body_error(upstream, exc)
            raise

    def body_error(self, upstream: Upstream, exc: WireError) -> None:
        """A broken request body: the upstream never gets the rest (it closes), the child its 400."""
        self.body_failed = exc
        upstream.inbox.fail(exc)
        upstream.close()

    async def _relay_response(
        self, upstream: Upstream, request: RequestHead, key: Key, url: str, mask: ValueMask
    ) -> str:
        """The upstream's answer to the child: "done", "closed" (both sides end) or "relay". With
        `mask`, a secret's value the upstream echoes is masked in every part of the answer: the
        status lines and fields of interim (1xx) and final heads, the body, the trailers."""
        started, seen = False, 0
        while True:
            if not upstream.inbox.events:
                self.flush()
            try:
                event = await upstream.inbox.get()
            except WireError as exc:
                return self._upstream_broke(upstream, started, exc.detail, request)
            if event is None:
                return self._upstream_broke(upstream, started, LOST_MID_RESPONSE, request)
            if isinstance(event, ResponseHead):
                upstream.answered(final=event.status >= 200 or event.status == 101)
                if event.status < 200:
                    switched_to = [v.strip().lower() for v in event.values("upgrade")]
                    if event.status == 101 and not (request.upgrade and switched_to == ["websocket"]):
                        # the relay after a 101 is undecided: only the WebSocket that was admitted
                        why = "101 to no admitted WebSocket upgrade"
                        return self._upstream_broke(upstream, started, why, request)
                    started = self.answering = True
                    self.write(self.wire.interim(masked_head(mask, event)))
                    if event.status != 101 and not upstream.wire.sending:  # the final head is still due
                        upstream.expect_response(self.pipeline.policies.get().limits.response_timeout)
                    continue
                length = event.values("content-length")
                if self.limit is not None and length and length[0].isdigit() and int(length[0]) > self.limit:
                    self._audit_cut(key, request.path, int(length[0]))
                    self._refuse(too_large_refusal(key, int(length[0]), self.limit))
                    return "closed"
                if 300 <= event.status < 400 and (location := event.values("location")):
                    self.pipeline.redirects.remember(self.state.client_key, url, location[0])
                started = self.answering = True
                self.write(self.wire.response(masked_head(mask, event)))
            elif isinstance(event, Body):
                seen += len(event.data)
                if self.limit is not None and seen > self.limit:
                    self._audit_cut(key, request.path, seen)  # cut visibly: no last chunk
                    self.close()
                    return "closed"
                data = mask.feed(event.data) if mask else event.data
                if data:
                    self.write(self.wire.body(data))
                if len(self.out) > 16 or not self.writable.is_set():
                    self.flush()
                    await self.drain()
            elif isinstance(event, End):
                if mask and (rest := mask.end()):
                    self.write(self.wire.body(rest))
                self.write(self.wire.end(mask.text_fields(event.trailers, TEXT_ENCODING)))
                self.flush()
                return "done"
            elif isinstance(event, Switched):
                self._become_relay(upstream, event.rest)
                return "relay"

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

    async def _open(self, admitted: Admitted, key: Key) -> Upstream | Refusal:
        """A new upstream connection to the addresses the pipeline pins for this request."""
        upstream = Upstream(self, key)
        upstream.server_id = f"{self.state.conn_id}-up{self.requests}"
        refusal = await self.pipeline.connect(self.state, admitted, upstream, upstream.server_id)
        return upstream if refusal is None else refusal

    def _audit_cut(self, key: Key, path: str, seen: int) -> None:
        assert self.limit is not None
        where = {"host": key[0], "port": key[1], "path": path}
        self.pipeline.notice(self.state, "response_cut", **where, limit=self.limit, bytes=seen)

    # -- upstream connections ------------------------------------------------------------------------
    def _keep(self, upstream: Upstream) -> None:
        if len(self.idle) >= MAX_IDLE_UPSTREAMS:
            oldest = next(iter(self.idle))
            self._forget(self.idle.pop(oldest))
        self.idle[upstream.key] = upstream

    def _forget(self, upstream: Upstream) -> None:
        self.pipeline.disconnected(upstream.server_id)
        upstream.close()

    def upstream_gone(self, upstream: Upstream) -> None:
        """An upstream connection closed: a kept-alive one leaves the pool."""
        self.pipeline.disconnected(upstream.server_id)
        if self.idle.get(upstream.key) is upstream:
            del self.idle[upstream.key]

    def _drop_upstreams(self) -> None:
        for upstream in [*self.idle.values(), *([self.busy] if self.busy is not None else [])]:
            self._forget(upstream)
        self.idle.clear()
        self.busy = None

    def _upstream_broke(self, upstream: Upstream, started: bool, why: str, request: RequestHead) -> str:
        """The upstream failed the exchange: no response head within timeouts.response (504
        upstream_timeout) or an answer that is not HTTP/1, a half response among them (502
        upstream_protocol_error). Recorded as a failure; answered while nothing of the response
        went out, else both sides close (a visible truncation, never a guess). `why` may quote the
        response: every secret's value in it is masked before the child or a record sees it."""
        why = self.pipeline.secrets.mask_text(why)
        self._forget(upstream)
        error = self.body_failed
        if error is not None and upstream.inbox.error is error:  # the child's body broke, not the server
            self._refuse_unreadable(error)
            return "closed"
        if upstream.timed_out is not None:
            failure = Refusal(
                Reason.UPSTREAM_TIMEOUT,
                f"no response from the server within {upstream.timed_out:g}s (timeouts.response)",
                *upstream.key,
            )
        else:
            failure = Refusal(Reason.UPSTREAM_PROTOCOL_ERROR, f"HTTP/1 protocol error: {why}", *upstream.key)
        logger.info("closing plain-HTTP exchange with %s:%s: %s", *upstream.key, failure.detail)
        self.pipeline.upstream_failed(self.state, *upstream.key, failure.reason, failure.detail)
        if started:
            self.close()
        else:
            self._refuse(failure)
        return "closed"

    def _become_relay(self, upstream: Upstream, rest: bytes) -> None:
        """After the upstream's 101: both connections become one byte relay (egressd.front.relay)."""
        assert upstream.transport is not None
        self.flush()
        self.phase = "relay"
        if self.timer is not None:
            self.timer.cancel()
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
        if self.busy is None and self.phase != "relay":
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
