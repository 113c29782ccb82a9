"""mitmproxy addon: every request inside the tunnels egressd's front handed over, and every
upstream connection of theirs.

mitmproxy serves only tunnels the admission pipeline already admitted and pinned for inspection,
each carried by its client connection (egressd.inspect.engine). Each request inside is admitted by
the same pipeline (`Pipeline.admit`, stage "inner"); every upstream connection goes to the tunnel's
target and is opened by the pipeline's `connect` to the tunnel's pin (egressd.inspect.handler),
never resolved here. What fails an exchange is kept as a Refusal on the tunnel (`InspectedTunnel.fail`):
the error page says it and the error hook records it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable, Iterable
from typing import Any

from mitmproxy import http
from mitmproxy.proxy import server_hooks

from egressd.admission.pipeline import Admitted, Attempt, Pipeline
from egressd.admission.state import ConnState
from egressd.inspect import response_limit
from egressd.inspect.connections import close_server
from egressd.inspect.error_pages import refusal_response
from egressd.inspect.handler import tunnel_of
from egressd.inspect.inspected import InspectedTunnel
from egressd.policy.reasons import Reason
from egressd.policy.refusal import Refusal
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
# stream_large_bodies in egressd.session.proxy): a placeholder in one is answered 403, nothing sent
BUFFERED_BODY = 256 * 1024
# failures of an exchange whose upstream connection was open (the connect's own are recorded there)
_UPSTREAM_FAILURES = frozenset({Reason.UPSTREAM_TIMEOUT, Reason.UPSTREAM_PROTOCOL_ERROR})


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
    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self._waiting: dict[str, asyncio.TimerHandle] = {}  # timeouts.response, by flow id

    # -- requests ------------------------------------------------------------------------------
    @fail_closed
    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        tunnel = tunnel_of(flow.client_conn)
        tunnel.failure = None  # a new exchange: nothing has failed it yet
        request = flow.request
        # inside the admitted tunnel: its target, whatever the request says (the request rules
        # refuse a Host header that names another)
        attempt = Attempt(
            "inner",
            tunnel.admitted.host,
            tunnel.admitted.port,
            scheme=request.scheme,
            method=_method(request),
            path=request.path,
            headers=list(request.headers.items(multi=True)),
        )
        admitted = await self.pipeline.admit(tunnel.conn, attempt)
        if isinstance(admitted, Refusal):
            self._refuse(flow, admitted)
            return
        request.host = admitted.host
        self._apply_changes(flow, admitted, tunnel)
        upgrade = upgrade_protocols(list(request.headers.items(multi=True))) is not None
        flow.metadata[_UPGRADE] = upgrade  # admitted by the request rules: a WebSocket handshake
        _strip_hop_by_hop(request.headers, keep_upgrade=upgrade)

    def _apply_changes(self, flow: http.HTTPFlow, admitted: Admitted, tunnel: InspectedTunnel) -> None:
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
                request.stream = _BodyScan(self.pipeline, tunnel, flow, PlaceholderStream(injection.body))
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
                self._refuse(flow, _secret_in_body(self.pipeline, tunnel_of(flow.client_conn), flow, name))
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
        """No response head in time: the exchange fails with `upstream_timeout` and the upstream
        connection is closed; mitmproxy's error answer is then the 504 of that failure
        (egressd.inspect.patches), recorded by the error hook."""
        self._waiting.pop(flow.id, None)
        server = flow.server_conn
        if flow.response is not None or not flow.live or flow.error is not None:
            return
        if not server.connected:  # still connecting (bounded by connect_timeout): wait from then
            self._expect_response(flow, timeout)
            return
        detail = f"no response from the server within {timeout:g}s (timeouts.response)"
        tunnel = tunnel_of(flow.client_conn)
        tunnel.fail(tunnel.refusal(Reason.UPSTREAM_TIMEOUT, detail))
        close_server(flow.client_conn.id, server)

    @fail_closed
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self._answered(flow)
        if flow.metadata.get(_REFUSED) or flow.response is None:
            return
        response = flow.response
        for name in EGRESSD_HEADERS:
            response.headers.pop(name, None)
        conn = tunnel_of(flow.client_conn).conn
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
            self._refuse(flow, Refusal(Reason.CONNECT_ERROR, why, flow.request.host, flow.request.port))
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
        (upstream_timeout, upstream_protocol_error: kept on the tunnel by this addon and by
        egressd.inspect.patches)."""
        self._answered(flow)
        logger.debug("flow error: %s", flow.error)
        tunnel = tunnel_of(flow.client_conn)
        failure = tunnel.failure
        if failure is None or failure.reason not in _UPSTREAM_FAILURES:
            return
        # the detail may quote what the server sent, and with it a secret's value it echoed
        detail = self.pipeline.secrets.mask_text(failure.detail)
        self.pipeline.upstream_failed(
            tunnel.conn, tunnel.admitted.host, tunnel.admitted.port, failure.reason, detail
        )

    # -- every upstream connection: to the tunnel's target, at its pin ----------------------------
    @fail_closed
    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        """Admit the upstream connection mitmproxy is about to open: the tunnel's target (SNI
        included, whatever the client sent), at the tunnel's pin, where egressd's handler connects
        through the pipeline (which counts it against the limits and records it)."""
        tunnel = tunnel_of(data.client)
        admitted, server = tunnel.admitted, data.server
        address = server.address
        if (
            address is None
            or (address[0], address[1]) != (admitted.host, admitted.port)
            or admitted.pin is None
        ):
            where = "no destination" if address is None else f"{address[0]}:{address[1]}"
            server.error = tunnel.fail(
                tunnel.refusal(Reason.INTERNAL_ERROR, f"{where} was not admitted")
            ).detail
            return
        target = admitted.decision.target
        server.sni = admitted.host if target is not None and not target.host.is_ip else None
        # each connection to the tunnel's pin keeps its own attempts
        pin = dataclasses.replace(admitted.pin, connected=None, attempts=[])
        tunnel.connections[server.id] = Admitted(admitted.decision, admitted.inspect, pin, admitted.resolved)

    def server_disconnected(self, data: server_hooks.ServerConnectionHookData) -> None:
        self.pipeline.disconnected(data.server.id)
        tunnel_of(data.client).connections.pop(data.server.id, None)

    def server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        tunnel_of(data.client).connections.pop(data.server.id, None)

    # -- faults ------------------------------------------------------------------------------
    def internal_error(self, hook: str, argument: Any, exc: BaseException) -> None:
        """A bug while deciding refuses (never allows) and is recorded."""
        refusal = self.pipeline.internal_error(hook, exc)
        if isinstance(argument, http.HTTPFlow):
            argument.metadata[_REFUSED] = True
            argument.response = refusal_response(refusal)
        elif isinstance(argument, server_hooks.ServerConnectionHookData):
            tunnel = tunnel_of(argument.client)
            argument.server.error = tunnel.fail(tunnel.refusal(refusal.reason, refusal.detail)).detail

    def _refuse(self, flow: http.HTTPFlow, refusal: Refusal) -> None:
        flow.metadata[_REFUSED] = True
        flow.request.stream = False  # a refused request is answered, never streamed upstream
        flow.response = refusal_response(refusal)


class _BodyScan:
    """A request body streamed through the placeholder scan (mitmproxy's request.stream hook): a
    find records the refusal and sends nothing more; `cut` then has egressd.inspect.patches end the
    exchange before the request's end reaches the server."""

    def __init__(
        self, pipeline: Pipeline, tunnel: InspectedTunnel, flow: http.HTTPFlow, scan: PlaceholderStream
    ) -> None:
        self.pipeline, self.tunnel, self.flow, self.scan = pipeline, tunnel, flow, scan
        self.cut = False

    def __call__(self, chunk: bytes) -> Iterable[bytes]:
        if self.cut:
            return []
        try:
            return [self.scan.feed(chunk) if chunk else self.scan.end()]
        except PlaceholderFound as found:
            self.cut = True
            _secret_in_body(self.pipeline, self.tunnel, self.flow, found.name)
            return []


def _secret_in_body(pipeline: Pipeline, tunnel: InspectedTunnel, flow: http.HTTPFlow, name: str) -> Refusal:
    """A body carried a placeholder its host may not get: recorded; the refusal to answer with."""
    request, target = flow.request, tunnel.admitted
    refusal = pipeline.secret_refusal(target.host, target.port, name)
    where = {"method": _method(request), "scheme": request.scheme, "path": _child_path(flow)}
    pipeline.refused_early(
        tunnel.conn, target.host, target.port, refusal.reason, refusal.detail, stage="inner", **where
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
