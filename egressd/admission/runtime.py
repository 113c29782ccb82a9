"""Shared state of one running proxy: policy, gatekeeper, credentials, audit and live connections."""

from __future__ import annotations

import itertools
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from egressd.admission.changes import Changes
from egressd.admission.credentials import CredentialStore, ProxyCredentials
from egressd.admission.gate import Gatekeeper, PolicyHolder
from egressd.admission.limits import TokenBuckets
from egressd.admission.pinning import ConnectFailure, connect_protocol
from egressd.admission.redirects import RedirectMemory
from egressd.refusal import Refusal

if TYPE_CHECKING:
    import asyncio

    from egressd.admission.gate import Admission
    from egressd.observe.audit import AuditLog
    from egressd.policy import Decision


logger = logging.getLogger(__name__)


@dataclass
class ConnState:
    """What egressd knows about one client connection."""

    conn_id: str
    peer: str
    started: float = field(default_factory=time.monotonic)
    creds: ProxyCredentials | None = None
    host: str | None = None
    port: int | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    admissions: dict[str, Admission] = field(default_factory=dict)  # by server connection id
    request_admitted: set[tuple[str, int]] = field(default_factory=set)  # plain-HTTP targets decided
    intercept: set[tuple[str, int]] = field(default_factory=set)  # tunnels to TLS-intercept
    head_seen: bool = False  # a request head / CONNECT / SOCKS request arrived (header_timeout)
    tunnel: bool = False  # an admitted CONNECT / SOCKS5 tunnel: its set-up authenticated what is inside
    # credentials the listener grants: only the child can reach it (the sandbox's credential-free
    # port); a request without Proxy-Authorization counts as the child's, a wrong one is refused
    implicit: ProxyCredentials | None = None

    @property
    def profile(self) -> str | None:
        return self.creds.profile if self.creds else None

    @property
    def client_name(self) -> str | None:
        return self.creds.username if self.creds else None

    def client_key(self, connection_id: str) -> str:
        """Whose limits and redirect memory apply: the child's token, or this connection's id."""
        return self.creds.token if self.creds is not None else connection_id


class Runtime:
    def __init__(
        self,
        policies: PolicyHolder,
        *,
        credentials: CredentialStore | None = None,
        audit: AuditLog | None = None,
        require_auth: bool = True,
    ) -> None:
        self.policies = policies
        self.gate = Gatekeeper(policies)
        self.credentials = credentials or CredentialStore()
        self.audit = audit
        self.require_auth = require_auth
        self.draining = False
        self.changes = Changes()  # of this runtime's own state that decisions read (inspection)
        self._inspection = False
        self.redirects = RedirectMemory()
        self.buckets = TokenBuckets()
        self.upstreams: set[str] = set()  # ids of upstream connections open now (limits.max_connections)
        self.conns: dict[str, ConnState] = {}
        self._lock = threading.Lock()
        # connection ids for the audit log: a random prefix per proxy and a counter (a uuid4 per
        # connection was 2% of a tunnel's set-up)
        self._id_prefix = secrets.token_hex(3)
        self._ids = itertools.count(1)
        # a connection handed to the embedded mitmproxy from a credential-free listener: its
        # credentials, by the address mitmproxy sees the connection come from ("host:port")
        self.handed_off: dict[str, ProxyCredentials] = {}

    @property
    def inspection(self) -> bool:
        """TLS inspection is available (CA ready, TLS addon loaded); off with --no-inspect."""
        return self._inspection

    @inspection.setter
    def inspection(self, on: bool) -> None:
        self._inspection = on
        self.changes.changed()  # tunnels decided without it may now need inspecting

    def new_conn_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids):06x}"

    def watch_decisions(self, callback: Callable[[], None]) -> None:
        """Call back after any change that can alter a decision besides the request itself."""
        for changes in self._decision_inputs():
            changes.watch(callback)

    def unwatch_decisions(self, callback: Callable[[], None]) -> None:
        for changes in self._decision_inputs():
            changes.unwatch(callback)

    def _decision_inputs(self) -> tuple[Changes, ...]:
        return (
            self.policies.changes,
            self.credentials.changes,
            self.redirects.changes,
            self.gate.changes,
            self.changes,
        )

    def open_conn(self, client_id: str, peer: str) -> ConnState:
        state = ConnState(conn_id=self.new_conn_id(), peer=peer, implicit=self.handed_off.get(peer))
        with self._lock:
            self.conns[client_id] = state
        return state

    def conn(self, client_id: str) -> ConnState | None:
        return self.conns.get(client_id)

    def close_conn(self, client_id: str) -> ConnState | None:
        with self._lock:
            return self.conns.pop(client_id, None)

    def active(self) -> int:
        return len(self.conns)

    def authenticate(self, state: ConnState, header: str | None) -> bool:
        """Whether a proxy request (plain HTTP or CONNECT) with this Proxy-Authorization value may go
        on, on every path. Each request is checked on its own: an earlier request on a kept-alive
        connection authenticates nothing (paths that disagreed on that answered 407 on one, 200 on
        another). Requests inside a tunnel carry none: its CONNECT or SOCKS5 handshake counts."""
        if state.tunnel:
            return state.creds is not None or not self.require_auth
        if header is None and state.implicit is not None:
            state.creds = state.implicit
            return self.credentials.valid(state.implicit)
        state.creds = self.credentials.check_basic(header) if header is not None else None
        if header is not None and state.creds is None:
            return False  # wrong credentials are refused even where none are required
        return state.creds is not None or not self.require_auth

    # -- limits (every front end: HTTP proxy, SOCKS5, the fast tunnel path) ----------------------
    def rate_limit(self, state: ConnState, fallback_key: str) -> Refusal | None:
        """limits.requests_per_second per child: its token, or the connection when it has none."""
        limits = self.policies.get().limits
        if limits.requests_per_second is None:
            return None
        wait = self.buckets.take(state.client_key(fallback_key), limits.requests_per_second, limits.burst)
        if wait <= 0:
            return None
        return Refusal(
            "rate_limited",
            f"more than {limits.requests_per_second:g} requests per second from this child "
            f"(limits.requests_per_second, burst {limits.burst or 'default'})",
            state.host or "",
            state.port,
            retry_after=max(1, math.ceil(wait)),
        )

    def connection_limit(self) -> Refusal | None:
        limit = self.policies.get().limits.max_connections
        if limit is None or len(self.upstreams) < limit:
            return None
        return Refusal("connection_limit", f"{limit} upstream connections are open (limits.max_connections)")

    def decide(
        self,
        state: ConnState,
        fallback_key: str,
        host: str,
        port: int,
        *,
        scheme: str | None = None,
        method: str | None = None,
        path: str | None = None,
        rate: bool = True,
        opens: bool = False,
    ) -> Decision | Refusal:
        """The limits, then the one decision: the step every front awaits for a CONNECT, a request
        or a SOCKS5 connect (the front, the mitmproxy hooks). Limits come first so that refused
        targets cost a child its rate like allowed ones: probing what the policy refuses is not free.

        `rate`: this request takes a token (False where an earlier hook of the same request took
        it); `opens`: it opens an upstream connection now (limits.max_connections). On a decision,
        state.host/port name the canonical target."""
        limited = (self.rate_limit(state, fallback_key) if rate else None) or (
            self.connection_limit() if opens else None
        )
        if limited is not None:
            return limited
        decision = self.gate.decide(host, port, state.profile, scheme=scheme, method=method, path=path)
        if decision.target is not None:
            state.host, state.port = decision.target.host.text, decision.target.port
        return decision

    def refund_rate(self, state: ConnState, fallback_key: str) -> None:
        """Give back the token `decide` took, for a request handed on to a front that takes its own
        (the lean path hands tunnels to inspect to mitmproxy, which limits and decides them again)."""
        limits = self.policies.get().limits
        if limits.requests_per_second is not None:
            self.buckets.refund(state.client_key(fallback_key), limits.requests_per_second, limits.burst)

    def wants_inspection(self, decision: Decision, client_key: str) -> bool:
        """Intercept an allowed tunnel (either tunnel path): hosts only a path/method rule admits,
        hosts the policy marks `inspect`, and the target of a redirect this child was sent."""
        target = decision.target
        if not self.inspection or target is None:
            return False
        if decision.needs_inspection or self.policies.get().inspect.match(target.host, target.port):
            return True
        return self.redirects.expects(client_key, "https", target.host.text, target.port)

    # -- audit records -----------------------------------------------------------------------------
    def audit_decision(
        self,
        state: ConnState,
        decision: Decision,
        refusal: Refusal | None,
        *,
        stage: str,
        method: str | None,
        scheme: str | None,
        path: str | None,
        host: str,
        port: int,
    ) -> None:
        """The record of a decision made before any connection (a CONNECT or a request)."""
        if self.audit is None:
            return
        target = decision.target
        self.audit.decision(
            conn=state.conn_id,
            client=state.client_name,
            profile=state.profile,
            stage=stage,
            method=method,
            scheme=scheme,
            host=target.host.text if target else host,
            port=target.port if target else port,
            path=path,
            decision="deny" if refusal else "allow",
            reason=refusal.reason if refusal else decision.reason,
            rule=decision.rule,
            detail=refusal.detail if refusal else decision.detail,
            resolved=[],
            connected=None,
        )

    async def connect_admitted(
        self,
        state: ConnState,
        decision: Decision,
        protocol: asyncio.BaseProtocol,
    ) -> Admission | Refusal:
        """Admit an allowed decision (resolution, pinning) and connect `protocol` to the pinned
        address; the connection record is written here either way."""
        admission = await self.gate.admit(decision)
        pin = admission.pin
        if pin is None:
            assert admission.refusal is not None
            self.audit_connection(state, admission, None)
            return admission.refusal
        try:
            await connect_protocol(pin, protocol)
        except ConnectFailure as failure:
            self.audit_connection(state, admission, (failure.reason, failure.detail))
            return Refusal(failure.reason, failure.detail, pin.host, pin.port, decision.rule)
        self.audit_connection(state, admission, None)
        return admission

    def audit_connection(
        self, state: ConnState, admission: Admission, failure: tuple[str, str] | None
    ) -> None:
        """The decision record of one upstream connection, with resolved and connected addresses."""
        if self.audit is None:
            return
        decision = admission.decision
        target = decision.target
        pin = admission.pin
        refusal = admission.refusal
        allowed = pin is not None and failure is None
        if refusal is not None:
            reason, detail = refusal.reason, refusal.detail
        elif failure is not None:
            reason, detail = failure
        else:
            reason, detail = decision.reason, decision.detail
        self.audit.decision(
            conn=state.conn_id,
            client=state.client_name,
            profile=state.profile,
            stage="connection",
            method=None,
            scheme=None,
            host=target.host.text if target else state.host,
            port=target.port if target else state.port,
            path=None,
            decision="allow" if allowed else "deny",
            reason=reason,
            rule=decision.rule,
            detail=detail,
            resolved=[str(a) for a in admission.resolved],
            connected=f"{pin.connected[0]}:{pin.connected[1]}" if pin and pin.connected else None,
            attempts=list(pin.attempts) if pin is not None and pin.attempts else None,
        )

    def internal_error(self, hook: str, exc: BaseException) -> Refusal:
        """A bug while deciding, on any path: logged, audited, and answered by a refusal (never an allow)."""
        logger.error("egressd internal error in %s: %r", hook, exc, exc_info=exc)
        refusal = Refusal("internal_error", f"{hook}: {type(exc).__name__}: {exc}")
        if self.audit is not None:
            self.audit.event(
                "internal_error", hook=hook, decision="deny", reason="internal_error", detail=refusal.detail
            )
        return refusal

    def audit_header_timeout(self, state: ConnState, timeout: float) -> None:
        """The record of a client cut for not finishing its request head in time, on any path."""
        if self.audit is not None:
            detail = f"no request within {timeout:g}s"
            self.audit.event("header_timeout", conn=state.conn_id, peer=state.peer, detail=detail)

    def audit_early_refusal(
        self,
        state: ConnState | None,
        host: str | None,
        port: int | None,
        reason: str,
        detail: str,
        *,
        stage: str,
        method: str | None = None,
        scheme: str | None = None,
        path: str | None = None,
    ) -> None:
        """The record of a refusal no decision made, on any path: a tunnel closed after its TLS
        ClientHello (SNI check, stage "tls"), a request head no parser may read (stage "request";
        its method, scheme and path when its request line could be read)."""
        if self.audit is not None:
            self.audit.decision(
                conn=state.conn_id if state else None,
                client=state.client_name if state else None,
                profile=state.profile if state else None,
                stage=stage,
                method=method,
                scheme=scheme,
                host=host,
                port=port,
                path=path,
                decision="deny",
                reason=reason,
                rule=None,
                detail=detail,
                resolved=[],
                connected=None,
            )
        logger.info("refused (%s) %s:%s: %s", stage, host if host is not None else "?", port or "?", detail)

    def audit_closed(self, state: ConnState) -> None:
        if state.host is None or self.audit is None:
            return
        self.audit.closed(
            conn=state.conn_id,
            client=state.client_name,
            host=state.host,
            port=state.port,
            bytes_up=state.bytes_up,
            bytes_down=state.bytes_down,
            duration=round(time.monotonic() - state.started, 3),
        )
