"""mitmproxy addon: the connections egressd's front handed over, and every request inside them.

mitmproxy serves only connections the front registered (egressd.inspect.handoffs): tunnels the
admission pipeline already admitted and pinned for inspection, whose CONNECT must name what was
admitted. Each request inside is admitted by the same pipeline (`Pipeline.admit`, stage "inner"),
and every upstream connection goes to the tunnel's pin, never resolved here (the connect hook in
egressd.inspect.patches refuses anything else).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable, Iterable
from typing import Any

from mitmproxy import connection, http
from mitmproxy.proxy import server_hooks

from egressd.admission.pinning import current_pin
from egressd.admission.pipeline import Admitted, Attempt, Pipeline
from egressd.admission.state import ConnState
from egressd.inspect import response_limit
from egressd.inspect.connections import close_client, close_server
from egressd.inspect.error_pages import refusal_response
from egressd.inspect.handoffs import Handoff, Handoffs
from egressd.refusal import Refusal, failure_message, parse_failure
from egressd.wire.http_fields import hop_by_hop_names, upgrade_protocols
from egressd.wire.placeholders import PlaceholderFound, PlaceholderStream, ValueMask
from egressd.wire.refusal import EGRESSD_HEADERS

logger = logging.getLogger(__name__)

_REFUSED = "egressd_refused"
_MASK = "egressd_mask"
_SCAN = "egressd_scan"
_PATH = "egressd_child_path"
_UPGRADE = "egressd_upgrade"
# request bodies up to this size are read whole before going upstream (mitmproxy's own threshold,
# stream_large_bodies in egressd.proxy): a placeholder in one is answered 403, nothing sent
BUFFERED_BODY = 256 * 1024
# failures of an exchange whose upstream connection was open (the connect's own are recorded there)
_UPSTREAM_FAILURES = frozenset({"upstream_timeout", "upstream_protocol_error"})


def _peer(client: connection.Client) -> str:
    host, port, *_ = client.peername or ("?", 0)
    return f"{host}:{port}"


def fail_closed(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Any exception in a deciding hook becomes a refusal with reason internal_error."""
    if inspect.iscoroutinefunction(hook):

        @functools.wraps(hook)
        async def guarded_async(self: PolicyGate, argument: Any) -> None:
            try:
                await hook(self, argument)
            except Exception as exc:  # noqa: BLE001 - fail closed
                self.internal_error(hook.__name__, argument, exc)

        return guarded_async

    @functools.wraps(hook)
    def guarded(self: PolicyGate, argument: Any) -> None:
        try:
            hook(self, argument)
        except Exception as exc:  # noqa: BLE001 - fail closed
            self.internal_error(hook.__name__, argument, exc)

    return guarded


class PolicyGate:
    def __init__(self, pipeline: Pipeline, handoffs: Handoffs) -> None:
        self.pipeline = pipeline
        self.handoffs = handoffs
        self._clients: dict[str, Handoff] = {}  # by mitmproxy's client id
        self._waiting: dict[str, asyncio.TimerHandle] = {}  # timeouts.response, by flow id

    # -- connections -------------------------------------------------------------------------
    def client_connected(self, client: connection.Client) -> None:
        handoff = self.handoffs.get(_peer(client))
        if handoff is None:
            # not from egressd's front: a child that found the engine's loopback port
            client.error = "egressd: not a connection egressd's front handed over"
            return
        self._clients[client.id] = handoff

    def client_disconnected(self, client: connection.Client) -> None:
        self._clients.pop(client.id, None)  # the front that handed it over writes its closed record

    def find(self, client: connection.Client) -> Handoff | None:
        return self._clients.get(client.id)

    def handoff(self, client: connection.Client) -> Handoff:
        handoff = self._clients.get(client.id)
        if handoff is None:
            raise RuntimeError("a connection egressd's front did not hand over")
        return handoff

    # -- CONNECT: already admitted by the front ------------------------------------------------
    @fail_closed
    def http_connect(self, flow: http.HTTPFlow) -> None:
        admitted = self.handoff(flow.client_conn).tunnel
        request = flow.request
        if (request.host, request.port) != (admitted.host, admitted.port):
            why = "a CONNECT that was not the one admitted"
            self._refuse(flow, Refusal("bad_request", why, request.host, request.port))

    def http_connect_error(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get(_REFUSED):
            return
        failure = parse_failure(flow.server_conn.error or "") or parse_failure(
            flow.response.text if flow.response else ""
        )
        host, port = flow.request.host, flow.request.port
        reason, detail = failure or ("connect_error", flow.server_conn.error or "connection failed")
        handoff = self._clients.get(flow.client_conn.id)
        rule = handoff.tunnel.decision.rule if handoff is not None else None
        flow.response = refusal_response(Refusal(reason, detail, host, port, rule))
        flow.metadata[_REFUSED] = True

    # -- requests ------------------------------------------------------------------------------
    @fail_closed
    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        handoff = self.handoff(flow.client_conn)
        request = flow.request
        tunnel = handoff.tunnel
        # inside the admitted tunnel: its target, whatever the request says (the request rules
        # refuse a Host header that names another)
        attempt = Attempt(
            "inner",
            tunnel.host,
            tunnel.port,
            scheme=request.scheme,
            method=_method(request),
            path=request.path,
            headers=list(request.headers.items(multi=True)),
        )
        admitted = await self.pipeline.admit(handoff.conn, attempt)
        if isinstance(admitted, Refusal):
            self._refuse(flow, admitted)
            return
        request.host = admitted.host
        self._apply_changes(flow, admitted, handoff)
        upgrade = upgrade_protocols(list(request.headers.items(multi=True))) is not None
        flow.metadata[_UPGRADE] = upgrade  # admitted by the request rules: a WebSocket handshake
        _strip_hop_by_hop(request.headers, keep_upgrade=upgrade)

    def _apply_changes(self, flow: http.HTTPFlow, admitted: Admitted, handoff: Handoff) -> None:
        """What the pipeline changed in the request: the credentials of a redirect's follow-up to
        another origin dropped, a secret's value swapped in, the body scanned for placeholders."""
        request, injection = flow.request, admitted.injection
        for name in admitted.strip:
            request.headers.pop(name, None)
        if injection.headers is not None:
            request.headers = http.Headers(
                [
                    (n.encode("utf-8", "surrogateescape"), v.encode("utf-8", "surrogateescape"))
                    for n, v in injection.headers
                ]
            )
        if injection.path is not None:
            flow.metadata[_PATH] = request.path  # records name the path as the child sent it
            request.path = injection.path
        if injection.body:
            length = request.headers.get("content-length", "")
            if (
                length.isdigit()
                and int(length) <= BUFFERED_BODY
                and "transfer-encoding" not in request.headers
            ):
                flow.metadata[_SCAN] = injection.body  # read whole, scanned in request(): a clean 403
            else:
                request.stream = _BodyScan(self.pipeline, handoff, flow, PlaceholderStream(injection.body))
        if injection.values:
            flow.metadata[_MASK] = ValueMask(injection.values)

    @fail_closed
    def request(self, flow: http.HTTPFlow) -> None:
        """A small body read whole (mitmproxy buffers what it does not stream): scanned for the
        placeholders its host may not get before anything of the request goes upstream. The
        request has ended: its response head is due within timeouts.response."""
        needles = flow.metadata.pop(_SCAN, None)
        if needles is not None and not flow.metadata.get(_REFUSED):
            name = needles.find(flow.request.raw_content or b"")
            if name is not None:
                handoff = self.handoff(flow.client_conn)
                self._refuse(flow, _secret_in_body(self.pipeline, handoff, flow, name))
        if not flow.metadata.get(_REFUSED) and flow.response is None:
            self._expect_response(flow, self.pipeline.policies.get().limits.response_timeout)

    # -- timeouts.response: the upstream must send its response head in time ---------------------
    def _expect_response(self, flow: http.HTTPFlow, timeout: float) -> None:
        self._answered(flow)
        loop = asyncio.get_running_loop()
        self._waiting[flow.id] = loop.call_later(timeout, self._no_response, flow, timeout)

    def _answered(self, flow: http.HTTPFlow) -> None:
        waiting = self._waiting.pop(flow.id, None)
        if waiting is not None:
            waiting.cancel()

    def _no_response(self, flow: http.HTTPFlow, timeout: float) -> None:
        """No response head in time: the upstream connection is closed with egressd's note on it,
        which mitmproxy's error answer then carries (egressd.inspect.patches, patch 4): a 504
        `upstream_timeout`, recorded by the error hook."""
        self._waiting.pop(flow.id, None)
        server = flow.server_conn
        if flow.response is not None or not flow.live or flow.error is not None:
            return
        if not server.connected:  # still connecting (bounded by connect_timeout): wait from then
            self._expect_response(flow, timeout)
            return
        detail = f"no response from the server within {timeout:g}s (timeouts.response)"
        server.error = failure_message("upstream_timeout", detail)
        close_server(flow.client_conn.id, server)

    @fail_closed
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self._answered(flow)
        if flow.metadata.get(_REFUSED) or flow.response is None:
            return
        response = flow.response
        for name in EGRESSD_HEADERS:
            response.headers.pop(name, None)
        conn = self.handoff(flow.client_conn).conn
        location = response.headers.get("location")
        if 300 <= response.status_code < 400 and location:
            self.pipeline.redirects.remember(conn.client_key, flow.request.url, location)
        limit = self.pipeline.policies.get().limits.max_response_bytes
        if limit is not None:
            response_limit.apply(flow, limit, self._on_response_cut(flow, conn, limit))
        mask = flow.metadata.get(_MASK)
        if mask is not None:  # a secret's value echoed back is masked (docs/secrets.md)
            response.data.reason = mask.mask(response.data.reason)
            response.headers = http.Headers(mask.fields(response.headers.fields))
            response.stream = _MaskedStream(response.stream, mask)

    @fail_closed
    def response(self, flow: http.HTTPFlow) -> None:
        """The last word before the response goes out: a 101 only for the WebSocket upgrade that
        was admitted (after it the connection is relayed undecided), and the trailers, read after
        the body (egressd.inspect.patches), masked like the head."""
        response = flow.response
        if response is None or flow.metadata.get(_REFUSED):
            return
        switched_to = response.headers.get("upgrade", "").strip().lower()
        if response.status_code == 101 and not (flow.metadata.get(_UPGRADE) and switched_to == "websocket"):
            flow.websocket = None
            why = "HTTP/1 protocol error: the server switched protocols (101) to no admitted WebSocket"
            self._refuse(flow, Refusal("connect_error", why, flow.request.host, flow.request.port))
            return
        mask = flow.metadata.get(_MASK)
        if mask is not None and response.trailers:
            response.trailers = http.Headers(mask.fields(response.trailers.fields))

    def _on_response_cut(self, flow: http.HTTPFlow, conn: ConnState, limit: int) -> Callable[[int], None]:
        def cut(seen: int) -> None:
            request = flow.request
            where = {"host": request.host, "port": request.port, "path": _child_path(flow)}
            self.pipeline.notice(conn, "response_cut", **where, limit=limit, bytes=seen)

        return cut

    def error(self, flow: http.HTTPFlow) -> None:
        """A flow that ended in an error: one the upstream caused is recorded as a failure
        (upstream_timeout, upstream_protocol_error: the marks of egressd.inspect.patches)."""
        self._answered(flow)
        logger.debug("flow error: %s", flow.error)
        failure = parse_failure(flow.error.msg if flow.error is not None else "")
        handoff = self._clients.get(flow.client_conn.id)
        if failure is None or handoff is None or failure[0] not in _UPSTREAM_FAILURES:
            return
        tunnel, (reason, detail) = handoff.tunnel, failure
        # the detail may quote what the server sent, and with it a secret's value it echoed
        self.pipeline.upstream_failed(
            handoff.conn, tunnel.host, tunnel.port, reason, self.pipeline.secrets.mask_text(detail)
        )

    # -- every upstream connection: to the pinned addresses only --------------------------------
    @fail_closed
    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        current_pin.set(None)
        handoff = self.handoff(data.client)
        address = data.server.address
        if address is None:
            data.server.error = failure_message("invalid_target", "no destination")
            return
        admitted = handoff.tunnel
        if (address[0], address[1]) != (admitted.host, admitted.port) or admitted.pin is None:
            where = f"{address[0]}:{address[1]}"
            data.server.error = failure_message("internal_error", f"{where} was not admitted")
            return
        # counted before mitmproxy takes a descriptor for it (a reconnect inside the tunnel, too)
        if (limited := self.pipeline.reserve_upstream(data.server.id)) is not None:
            data.server.error = failure_message(limited.reason, limited.detail)
            return
        if (unrecorded := self.pipeline.audit_refusal()) is not None:  # nothing opened that is not recorded
            data.server.error = failure_message(unrecorded.reason, unrecorded.detail)
            return
        # each connection to the tunnel's pin keeps its own attempts
        pin = dataclasses.replace(admitted.pin, connected=None, attempts=[], failure=None)
        connection = Admitted(admitted.decision, admitted.inspect, pin, admitted.resolved)
        data.server.address = (connection.pin.host, connection.pin.port)
        handoff.connections[data.server.id] = connection
        current_pin.set(connection.pin)

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        handoff = self._clients.get(data.client.id)
        connection = handoff.connections.get(data.server.id) if handoff is not None else None
        recorded = connection is None or handoff is None
        if not recorded and self.pipeline.connection_record(handoff.conn, connection, None) is not None:
            close_client(data.client.id)  # its record was not written: the tunnel ends here

    def server_disconnected(self, data: server_hooks.ServerConnectionHookData) -> None:
        self.pipeline.disconnected(data.server.id)
        handoff = self._clients.get(data.client.id)
        if handoff is not None:
            handoff.connections.pop(data.server.id, None)

    def server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        self.pipeline.disconnected(data.server.id)
        handoff = self._clients.get(data.client.id)
        connection = handoff.connections.get(data.server.id) if handoff is not None else None
        if connection is not None and handoff is not None and connection.pin is not None:
            failure = connection.pin.failure or ("connect_error", str(data.server.error))
            self.pipeline.connection_record(handoff.conn, connection, failure)

    # -- faults ------------------------------------------------------------------------------
    def internal_error(self, hook: str, argument: Any, exc: BaseException) -> None:
        """A bug while deciding refuses (never allows) and is recorded."""
        refusal = self.pipeline.internal_error(hook, exc)
        if isinstance(argument, http.HTTPFlow):
            argument.metadata[_REFUSED] = True
            argument.response = refusal_response(refusal)
        elif isinstance(argument, server_hooks.ServerConnectionHookData):
            current_pin.set(None)
            argument.server.error = failure_message(refusal.reason, refusal.detail)

    def _refuse(self, flow: http.HTTPFlow, refusal: Refusal) -> None:
        flow.metadata[_REFUSED] = True
        flow.request.stream = False  # a refused request is answered, never streamed upstream
        flow.response = refusal_response(refusal)


class _BodyScan:
    """A request body streamed through the placeholder scan (mitmproxy's request.stream hook): a
    find records the refusal and closes the client before any byte of the placeholder is sent."""

    def __init__(
        self, pipeline: Pipeline, handoff: Handoff, flow: http.HTTPFlow, scan: PlaceholderStream
    ) -> None:
        self.pipeline, self.handoff, self.flow, self.scan = pipeline, handoff, flow, scan
        self.refused = False

    def __call__(self, chunk: bytes) -> Iterable[bytes]:
        if self.refused:
            return []
        try:
            return [self.scan.feed(chunk) if chunk else self.scan.end()]
        except PlaceholderFound as found:
            self.refused = True
            _secret_in_body(self.pipeline, self.handoff, self.flow, found.name)
            close_client(self.flow.client_conn.id)
            return []


def _secret_in_body(pipeline: Pipeline, handoff: Handoff, flow: http.HTTPFlow, name: str) -> Refusal:
    """A body carried a placeholder its host may not get: recorded; the refusal to answer with."""
    request, tunnel = flow.request, handoff.tunnel
    refusal = pipeline.secret_refusal(tunnel.host, tunnel.port, name)
    where = {"method": _method(request), "scheme": request.scheme, "path": _child_path(flow)}
    pipeline.refused_early(
        handoff.conn, tunnel.host, tunnel.port, refusal.reason, refusal.detail, stage="inner", **where
    )
    return refusal


class _MaskedStream:
    """A response body streamed through the value mask, after whatever stream was set (the limit)."""

    def __init__(self, inner: Any, mask: ValueMask) -> None:
        self.inner = inner if callable(inner) else None
        self.mask = mask

    def __call__(self, chunk: bytes) -> Iterable[bytes]:
        pieces: Any = self.inner(chunk) if self.inner is not None else [chunk]
        if isinstance(pieces, bytes):
            pieces = [pieces]
        out = [self.mask.feed(piece) for piece in pieces if piece]
        if not chunk:  # the end of the body: flush what the mask held back
            out.append(self.mask.end())
        data = b"".join(out)
        return [data] if data else []


def _method(request: http.Request) -> str:
    """The method as the child sent it (mitmproxy's `request.method` is upper-cased; methods are
    case-sensitive, and what is forwarded is these bytes)."""
    return request.data.method.decode("utf-8", "surrogateescape")


def _child_path(flow: http.HTTPFlow) -> str:
    """The request's path as the child sent it: never with a secret's value egressd put in."""
    return str(flow.metadata.get(_PATH, flow.request.path))


def _strip_hop_by_hop(headers: http.Headers, *, keep_upgrade: bool) -> None:
    for name in hop_by_hop_names(headers.get("connection", ""), keep_upgrade=keep_upgrade):
        headers.pop(name, None)
