"""mitmproxy addon: authenticate the child, decide every CONNECT, request and upstream connection.

A thin adapter from mitmproxy hooks to the gatekeeper (egressd.admission.gate), which calls the one
decision function. `server_connect` is the choke point: every upstream connection, whatever front end
asked for it (CONNECT, plain HTTP, SOCKS5), is decided and pinned there, and the connect hook
(egressd.admission.pinning) refuses any connection it did not pin.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from mitmproxy import connection, http
from mitmproxy.addonmanager import Loader
from mitmproxy.proxy import server_hooks
from mitmproxy.proxy.layers.modes import Socks5AuthData

from egressd.admission import faults
from egressd.admission.gate import decision_refusal
from egressd.admission.http_rules import (
    audit_http_event,
    audit_response_cut,
    connection_problem,
    hop_by_hop_names,
    host_header_mismatch,
)
from egressd.admission.pinning import current_pin
from egressd.admission.runtime import ConnState, Runtime
from egressd.inspect import response_limit
from egressd.inspect.connections import close_client
from egressd.inspect.error_pages import refusal_response
from egressd.refusal import EGRESSD_HEADERS, Refusal, failure_message, parse_failure

logger = logging.getLogger(__name__)

_REFUSED = "egressd_refused"


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
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    # -- options -----------------------------------------------------------------------------
    def load(self, loader: Loader) -> None:
        from mitmproxy import ctx

        # mitmproxy's SOCKS5 layer asks for user/password only when this option is set; egressd
        # checks the credentials itself (socks5_auth below), so the option may not exist yet.
        if "proxyauth" not in ctx.options:
            loader.add_option("proxyauth", str | None, None, "egressd: SOCKS5 credentials required")

    # -- connections -------------------------------------------------------------------------
    def client_connected(self, client: connection.Client) -> None:
        if self.rt.draining:
            client.error = "egressd is shutting down"
            return
        self.rt.open_conn(client.id, _peer(client))
        timeout = self.rt.policies.get().limits.header_timeout
        asyncio.get_running_loop().call_later(timeout, self._header_deadline, client.id, timeout)

    def _header_deadline(self, client_id: str, timeout: float) -> None:
        """Slow or silent clients (Slowloris) are cut when no request head arrived in time."""
        state = self.rt.conn(client_id)
        if state is None or state.head_seen:
            return
        if close_client(client_id):
            self.rt.audit_header_timeout(state, timeout)

    def client_disconnected(self, client: connection.Client) -> None:
        state = self.rt.close_conn(client.id)
        if state is not None:
            self.rt.audit_closed(state)

    def _state(self, client: connection.Client) -> ConnState:
        state = self.rt.conn(client.id)
        if state is None:  # a stock mitmdump may have loaded us after the client connected
            state = self.rt.open_conn(client.id, _peer(client))
        return state

    # -- authentication ----------------------------------------------------------------------
    def _authenticate(self, flow: http.HTTPFlow, state: ConnState) -> bool:
        return self.rt.authenticate(state, flow.request.headers.get("proxy-authorization"))

    def socks5_auth(self, data: Socks5AuthData) -> None:
        creds = self.rt.credentials.check(data.username, data.password)
        state = self._state(data.client_conn)
        if creds is not None:
            state.creds = creds
            data.valid = True
        elif not self.rt.require_auth:
            data.valid = True
        state.tunnel = True  # requests mitmproxy reads inside carry no credentials of their own

    # -- CONNECT -----------------------------------------------------------------------------
    @fail_closed
    def http_connect(self, flow: http.HTTPFlow) -> None:
        state = self._state(flow.client_conn)
        state.head_seen = True
        faults.maybe_fail("hook")
        if not self._authenticate(flow, state):
            self._refuse(flow, state, Refusal("proxy_auth_required", "missing or wrong proxy credentials"))
            return
        flow.request.headers.pop("proxy-authorization", None)
        decision = self.rt.decide(
            state,
            flow.client_conn.id,
            flow.request.host,
            flow.request.port,
            scheme="connect",
            method="CONNECT",
            opens=True,
        )
        if isinstance(decision, Refusal):
            self._refuse(flow, state, decision)  # a limit, before anything is decided
            return
        if not decision.allowed or (decision.needs_inspection and not self.rt.inspection):
            admission_refusal = decision_refusal(decision)
            self._audit_decision(state, flow, decision, admission_refusal)
            self._refuse(flow, state, admission_refusal)
            return
        assert decision.target is not None
        state.tunnel = True  # the requests inside were authenticated by this CONNECT
        # every later step and the connection use the canonical spelling
        flow.request.host = decision.target.host.text
        if self.rt.wants_inspection(decision, _client_key(flow, state)):
            state.intercept.add((flow.request.host, flow.request.port))

    def http_connect_error(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get(_REFUSED):
            return
        failure = parse_failure(flow.server_conn.error or "") or parse_failure(
            flow.response.text if flow.response else ""
        )
        host, port = flow.request.host, flow.request.port
        if failure is None:
            refusal = Refusal("connect_error", flow.server_conn.error or "connection failed", host, port)
        else:
            refusal = _failure_refusal(failure, host, port, self._state(flow.client_conn), flow.server_conn)
        flow.response = refusal_response(refusal)
        flow.metadata[_REFUSED] = True

    # -- plain HTTP --------------------------------------------------------------------------
    @fail_closed
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        state = self._state(flow.client_conn)
        state.head_seen = True
        faults.maybe_fail("hook")
        if not self._authenticate(flow, state):
            self._refuse(flow, state, Refusal("proxy_auth_required", "missing or wrong proxy credentials"))
            return
        request = flow.request
        decision = self.rt.decide(
            state,
            flow.client_conn.id,
            request.host,
            request.port,
            scheme=request.scheme,
            method=request.method,
            path=request.path,
        )
        if isinstance(decision, Refusal):
            self._refuse(flow, state, decision)  # a limit, before anything is decided
            return
        refusal = None
        if not decision.allowed or decision.needs_inspection:
            refusal = decision_refusal(decision)
        elif (problem := connection_problem(request.headers.get("connection", ""))) is not None:
            refusal = Refusal("bad_request", problem, decision.target.host.text, decision.target.port)
        elif (mismatch := host_header_mismatch(request.headers.get_all("host"), decision.target)) is not None:
            refusal = Refusal("host_mismatch", mismatch, decision.target.host.text, decision.target.port)
        elif _is_upgrade(request) and not self.rt.policies.get().websocket:
            refusal = Refusal(
                "websocket",
                "protocol upgrades (WebSocket) are off in this policy (websocket: false)",
                decision.target.host.text,
                decision.target.port,
            )
        self._audit_decision(state, flow, decision, refusal)
        if refusal is not None:
            self._refuse(flow, state, refusal)
            return
        assert decision.target is not None
        request.host = decision.target.host.text
        # the connection this request opens is admitted for its host; paths were checked just now
        state.request_admitted.add((request.host, request.port))
        _strip_hop_by_hop(request.headers, keep_upgrade=_is_upgrade(request))
        self._strip_credentials_after_redirect(flow, state)

    def _strip_credentials_after_redirect(self, flow: http.HTTPFlow, state: ConnState) -> None:
        """The follow-up of a redirect to another origin carries none of the credential headers."""
        origin = self.rt.redirects.take(_client_key(flow, state), flow.request.url)
        if origin is None:
            return
        names = self.rt.policies.get().credentials.strip_on_host_change
        stripped = [name for name in names if name in flow.request.headers]
        for name in stripped:
            flow.request.headers.pop(name, None)
        request = flow.request
        audit_http_event(
            self.rt,
            state,
            "credentials_stripped",
            redirected_from=origin,
            host=request.host,
            port=request.port,
            stripped=stripped,
        )

    @fail_closed
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get(_REFUSED) or flow.response is None:
            return
        response = flow.response
        for name in EGRESSD_HEADERS:
            response.headers.pop(name, None)
        state = self._state(flow.client_conn)
        location = response.headers.get("location")
        if 300 <= response.status_code < 400 and location:
            self.rt.redirects.remember(_client_key(flow, state), flow.request.url, location)
        limit = self.rt.policies.get().limits.max_response_bytes
        if limit is not None:
            response_limit.apply(flow, limit, self._on_response_cut(flow, state, limit))

    def _on_response_cut(self, flow: http.HTTPFlow, state: ConnState, limit: int) -> Callable[[int], None]:
        def cut(seen: int) -> None:
            request = flow.request
            audit_response_cut(self.rt, state, request.host, request.port, request.path, limit, seen)

        return cut

    def error(self, flow: http.HTTPFlow) -> None:
        logger.debug("flow error: %s", flow.error)

    # -- the choke point: every upstream connection --------------------------------------------
    @fail_closed
    async def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        current_pin.set(None)
        state = self._state(data.client)
        state.head_seen = True
        address = data.server.address
        if address is None:
            data.server.error = failure_message("invalid_target", "no destination")
            return
        # a SOCKS5 connect is a request of its own; a CONNECT's or a request's hook took its token
        socks = data.client.proxy_mode.type_name == "socks5"
        decision = self.rt.decide(state, data.client.id, address[0], address[1], rate=socks, opens=True)
        if isinstance(decision, Refusal):
            data.server.error = failure_message(decision.reason, decision.detail)
            return
        if decision.allowed and decision.needs_inspection and decision.target is not None:
            # paths are decided per request: plain HTTP already was; a tunnel is intercepted. Both
            # sets hold the canonical target (the tunnel guard sees the pinned, canonical address),
            # never the client's spelling (a SOCKS5 `API.TEST` must be intercepted like `api.test`)
            canonical = (decision.target.host.text, decision.target.port)
            if canonical in state.request_admitted:
                decision = dataclasses.replace(decision, needs_inspection=False)
            elif self.rt.inspection:
                state.intercept.add(canonical)
                decision = dataclasses.replace(decision, needs_inspection=False)
        admission = await self.rt.gate.admit(decision)
        if admission.pin is None:
            assert admission.refusal is not None
            self.rt.audit_connection(state, admission, None)
            data.server.error = failure_message(admission.refusal.reason, admission.refusal.detail)
            state.admissions[data.server.id] = admission
            return
        # the connect hook compares the address it is asked for with the pin
        data.server.address = (admission.pin.host, admission.pin.port)
        state.admissions[data.server.id] = admission
        current_pin.set(admission.pin)

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        state = self._state(data.client)
        admission = state.admissions.get(data.server.id)
        if admission is not None:
            self.rt.upstreams.add(data.server.id)
            self.rt.audit_connection(state, admission, None)

    def server_disconnected(self, data: server_hooks.ServerConnectionHookData) -> None:
        # runs after client_disconnected when the client went first: keyed by the server connection
        self.rt.upstreams.discard(data.server.id)
        state = self.rt.conn(data.client.id)
        if state is not None:
            state.admissions.pop(data.server.id, None)

    def server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        state = self._state(data.client)
        admission = state.admissions.get(data.server.id)
        if admission is not None and admission.pin is not None:
            self.rt.audit_connection(
                state, admission, admission.pin.failure or ("connect_error", str(data.server.error))
            )

    # -- faults ------------------------------------------------------------------------------
    def internal_error(self, hook: str, argument: Any, exc: BaseException) -> None:
        """A bug while deciding refuses (never allows) and is audited."""
        refusal = self.rt.internal_error(hook, exc)
        if isinstance(argument, http.HTTPFlow):
            argument.metadata[_REFUSED] = True
            argument.response = refusal_response(refusal)
        elif isinstance(argument, server_hooks.ServerConnectionHookData):
            current_pin.set(None)
            argument.server.error = failure_message(refusal.reason, refusal.detail)

    # -- helpers -----------------------------------------------------------------------------
    def _refuse(self, flow: http.HTTPFlow, state: ConnState, refusal: Refusal) -> None:
        flow.metadata[_REFUSED] = True
        flow.request.stream = False  # a refused request is answered, never streamed upstream
        flow.response = refusal_response(refusal)

    def _audit_decision(
        self, state: ConnState, flow: http.HTTPFlow, decision: Any, refusal: Refusal | None
    ) -> None:
        connect = flow.request.method == "CONNECT"
        self.rt.audit_decision(
            state,
            decision,
            refusal,
            stage="connect" if connect else "request",
            method=flow.request.method,
            scheme=None if connect else flow.request.scheme,
            path=None if connect else flow.request.path,
            host=flow.request.host,
            port=flow.request.port,
        )


def _client_key(flow: http.HTTPFlow, state: ConnState) -> str:
    """Redirects are remembered per child (its token), whatever connection the follow-up uses."""
    return state.client_key(flow.client_conn.id)


def _failure_refusal(
    failure: tuple[str, str], host: str, port: int, state: ConnState, server: connection.Server
) -> Refusal:
    reason, detail = failure
    admission = state.admissions.get(server.id)
    rule = admission.decision.rule if admission is not None else None
    return Refusal(reason, detail, host, port, rule)


def _is_upgrade(request: http.Request) -> bool:
    return "upgrade" in request.headers.get("connection", "").lower() and "upgrade" in request.headers


def _strip_hop_by_hop(headers: http.Headers, *, keep_upgrade: bool) -> None:
    for name in hop_by_hop_names(headers.get("connection", ""), keep_upgrade=keep_upgrade):
        headers.pop(name, None)
