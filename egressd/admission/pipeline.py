"""The one admission pipeline: every CONNECT, SOCKS5 connect and HTTP request, whichever front read
it, is admitted here and nowhere else.

`await pipeline.admit(conn, attempt)` runs the steps in one fixed order —
credentials → limits → decide → approver → request rules → inspection choice → resolve → filter →
pin — and answers an `Admitted` or a `Refusal`. `await pipeline.connect(...)` opens the upstream
connection to the pinned addresses only. Every step is its own module in this package; the fronts
(`egressd/front/`) and the mitmproxy addons (`addons/`) only read bytes, call these two, and write
what they answer. What happened is emitted on `pipeline.events` (decisions, connections opened and
closed with their bytes, refusals no decision made, notices); the audit log and the trace subscribe.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import operator
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from egressd.admission import approver as approvals
from egressd.admission import resolve as resolution
from egressd.admission.credentials import CredentialStore, Presented, ProxyCredentials, authenticate
from egressd.admission.decide import Decider, needs_inspection_refusal, refusal_for
from egressd.admission.events import (
    Asked,
    Closed,
    Decided,
    EventBus,
    Notice,
    Recorder,
    Resolved,
    Stage,
    built_from,
)
from egressd.admission.grants import GrantStore
from egressd.admission.handed import HandedOut, candidate_ports
from egressd.admission.http_rules import request_refusal
from egressd.admission.identity import identify
from egressd.admission.in_force import InForce, PolicyHolder
from egressd.admission.limits import Limits, overloaded
from egressd.admission.redirects import RedirectMemory
from egressd.admission.secrets import NO_INJECTION, Injection, SecretBook
from egressd.admission.secrets import refusal as secret_refusal
from egressd.admission.state import ConnState
from egressd.net import loader
from egressd.net.pinning import ConnectFailure, Pin, address_text, connect_protocol
from egressd.policy import (
    AddressClass,
    Decision,
    IPAddress,
    Target,
    canonical_host,
    classify,
    filter_addresses,
    join_host_port,
)
from egressd.policy.reasons import Reason
from egressd.policy.refusal import HintContext, Refusal

if TYPE_CHECKING:
    from egressd.admission.approver import Approver
    from egressd.platform.diag import Diag

logger = logging.getLogger(__name__)

AUTH_REFUSAL = Refusal(Reason.PROXY_AUTH_REQUIRED, "missing or wrong proxy credentials")
REMEMBERED_ASKS = 16  # requests remembered per connection (then forgotten all at once)
REMEMBERED_REQUEST = 4096  # characters of path and fields of a request remembered, at most
Epoch = tuple[object, ...]
UpstreamKey = tuple[object, ...]  # what a kept upstream connection may be reused for (upstream_key)
RequestKey = tuple[object, ...]  # an HTTP request as admission reads it: stage, credentials, target, fields


class Remembered(NamedTuple):
    """What an HTTP request on one connection was answered, and in which state: allowed by the
    policy alone (never by a grant or an approval, which answer once), with no redirect to follow."""

    epoch: Epoch
    creds: ProxyCredentials | None
    decision: Decision
    url: str
    changes: tuple[frozenset[str], Injection]


def _same(a: Epoch, b: Epoch) -> bool:
    """Two states of _epoch or upstream_state: the same objects, one by one."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def request_url(attempt: Attempt, target: Target) -> str:
    """The URL of an HTTP request as the redirect memory knows it."""
    authority = join_host_port(target.host.text, target.port)
    return f"{attempt.scheme or 'http'}://{authority}{attempt.path or '/'}"


class Attempt(NamedTuple):
    """A client's attempt to reach a target, as the front read it and the client wrote it: what the
    front asks admission for (not ask mode's question to a person: egressd.admission.asks).

    stage: "connect" (HTTP CONNECT), "socks" (SOCKS5 connect), "request" (an absolute-form HTTP
    request) or "inner" (a request inside an admitted, inspected tunnel: the tunnel's connection is
    already pinned, so nothing is resolved).

    A named tuple, as the events are: immutable, and built for every request without a frozen
    dataclass's per-field __setattr__."""

    stage: Stage
    host: str
    port: int
    scheme: str | None = None
    method: str | None = None
    path: str | None = None
    credentials: Presented = None
    headers: Sequence[tuple[str, str]] | None = None  # an HTTP request's, for the request rules


@dataclass(slots=True)
class Admitted:
    """An allowed attempt: its decision, whether its tunnel is inspected, and where it may connect."""

    decision: Decision
    inspect: bool = False
    pin: Pin | None = None  # None for "inner" requests
    resolved: tuple[IPAddress, ...] = ()
    # an HTTP request's: the headers the front drops (a redirect to another origin) and what the
    # secrets step changes (egressd.admission.secrets)
    strip: frozenset[str] = frozenset()
    injection: Injection = NO_INJECTION

    @property
    def host(self) -> str:
        assert self.decision.target is not None
        return self.decision.target.host.text

    @property
    def port(self) -> int:
        assert self.decision.target is not None
        return self.decision.target.port


@dataclass(slots=True)
class Connections:
    """The client connections open now, by the id the front gave them. With slots: a field with a
    default is otherwise also a class attribute, and `served`, read and written per connection,
    would take the generic attribute lookup."""

    open: dict[str, ConnState] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    served: int = 0  # of them, those within egressd's capacity (the others are answered overloaded)


# Refusals of a name that hold for every connection to it: its DNS question gets no address. Any
# other (an exe rule, a grant, an approver could still allow it) gets a stand-in address.
NO_ANSWER_REASONS = frozenset(
    {Reason.NOT_ALLOWLISTED, Reason.DENYLIST, Reason.MODE_OFF, Reason.PROFILE, Reason.PORT}
)


class Pipeline:
    def __init__(
        self,
        policies: PolicyHolder,
        *,
        credentials: CredentialStore | None = None,
        audit: Recorder | None = None,
        approver: Approver | None = None,
        grants: GrantStore | None = None,
        identify: bool = False,
        decider: Decider | None = None,
        events: EventBus | None = None,
    ) -> None:
        """`decider`, `grants`, `events`, `credentials`: made by the caller before the pipeline is
        (the proxy hands them to its session before it loads the pipeline: session/proxy.py); a
        given `events` has its observers, the audit among them, subscribed already."""
        self.policies = policies
        self.credentials = credentials or CredentialStore()
        self.decider = decider if decider is not None else Decider(policies)
        self.limits = Limits(policies)
        self.approver = approver
        self.grants = grants if grants is not None else GrantStore()
        self.redirects = RedirectMemory()
        self.handed = HandedOut()  # the addresses sandboxed children's DNS was given, per name
        # the audit log: under audit.on_failure: refuse, nothing is acted upon that it did not take
        self.audit = audit
        if events is None:
            events = EventBus()
            if audit is not None:
                events.subscribe(audit.observe)
        self.events = events
        self.inspection = False  # TLS inspection available (CA ready); off with --no-inspect
        # where the refusals it answers are read (the session's command, policy file, gateway): their
        # hints name what that reader can change
        self.context = HintContext()
        # look up every connection's program (pid, exe in the audit), not only where a rule needs it
        self.identify = identify
        # the pid of the child each token was issued to: its process tree is searched first
        self.children: dict[str, int] = {}
        self.draining = False
        self._conns = Connections()
        # connection ids for the audit log: a random prefix per proxy and a counter
        self._id_prefix = secrets.token_hex(3)
        self._ids = itertools.count(1)

    @property
    def secrets(self) -> SecretBook:
        """The secrets in force now (an admission reads them with its policy, from one snapshot)."""
        return self.policies.now.secrets

    # -- client connections ------------------------------------------------------------------------
    def open_conn(
        self,
        peer: str,
        implicit: ProxyCredentials | None = None,
        *,
        ends: tuple[tuple[str, int], tuple[str, int]] | None = None,
        tree_only: bool = False,
        diag: Diag | None = None,
    ) -> ConnState:
        """A client connection accepted; `ends`: (client, server) addresses of its socket (for the
        owner lookup), in the network namespace `diag` asks when it is another's; `tree_only`: the
        listener admits only the process tree of the child its implicit credentials belong to."""
        conn_id = "%s%06x" % (self._id_prefix, next(self._ids))  # noqa: UP031 - a format spec is parsed per call
        state = ConnState(conn_id, peer, implicit, ends, tree_only, diag)
        conns = self._conns
        # the lock taken and given back by hand, here and in close_conn: `with` looks up and binds
        # the lock's __enter__ and __exit__ each time
        conns.lock.acquire()
        try:
            state.room = self.limits.room_for_client(conns.served, len(conns.open))
            if state.room == "serve":  # counted by an int's add: an int plus a bool is the generic one
                conns.served += 1
            conns.open[state.conn_id] = state
        finally:
            conns.lock.release()
        return state

    def close_conn(self, state: ConnState) -> None:
        """The client connection ended: forgotten, and its closed record emitted (once)."""
        conns = self._conns
        conns.lock.acquire()
        try:
            known = conns.open.pop(state.conn_id, None) is not None
            if known and state.room == "serve":
                conns.served -= 1
        finally:
            conns.lock.release()
        if known and state.host is not None:
            # every field by position, and the duration as measured: what writes it as text rounds it
            self.events.emit(
                built_from(
                    Closed,
                    (
                        state.conn_id,
                        state.client_name,
                        state.host,
                        state.port,
                        state.bytes_up,
                        state.bytes_down,
                        time.monotonic() - state.started,
                    ),
                )
            )

    def active(self) -> int:
        return len(self._conns.open)

    def open_connections(self) -> list[ConnState]:
        """A snapshot of the client connections open now (metrics read it when scraped)."""
        with self._conns.lock:
            return list(self._conns.open.values())

    def revoke(self, creds: ProxyCredentials) -> None:
        """These credentials admit nothing more, and what was kept for them goes: a token is issued
        per child (every attached child has its own), so anything kept per token must be dropped
        here or it grows with every child started."""
        self.credentials.revoke(creds)
        self.children.pop(creds.token, None)  # an attached child's pid, if it was one
        self.limits.buckets.forget(creds.token)

    # -- admission ---------------------------------------------------------------------------------
    async def admit(self, conn: ConnState, attempt: Attempt) -> Admitted | Refusal:
        """The steps, in order; never raises (a bug refuses with internal_error)."""
        try:
            answer = await self._admit(conn, attempt)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - fail closed
            return self.internal_error(f"admit ({attempt.stage})", exc)
        return self._in_context(answer) if type(answer) is Refusal else answer

    def _in_context(self, refusal: Refusal) -> Refusal:
        """The refusal with where it is read, for its hint: every front renders it the same."""
        if refusal.context is self.context:
            return refusal
        return dataclasses.replace(refusal, context=self.context)

    async def _admit(self, conn: ConnState, attempt: Attempt) -> Admitted | Refusal:
        # a named tuple's fields read once each (every read is the generic attribute lookup)
        stage, credentials = attempt.stage, attempt.credentials
        if stage == "inner" and not conn.tunnel:
            return self.internal_error("admit", RuntimeError("a request inside a tunnel nobody admitted"))
        # an HTTP request this connection asked before, in the same state: the same answer (from
        # a connection's second request on: most connections that ask once ask once)
        asked = remembered = None
        if stage in ("request", "inner"):
            if conn.remembered is None:
                conn.remembered = {}
            else:
                asked, remembered = self._recall(conn, attempt)
        # 1. credentials (the child-only listener's: the program holding the socket is the child's)
        if remembered is not None:
            conn.creds = remembered.creds
        else:
            if conn.tree_only and credentials is None and conn.implicit is not None:
                root = self.children.get(conn.implicit.token)
                if root is not None:  # not yet started: nobody is the child yet (407)
                    identify(conn, root, tree_only=True)
            if not authenticate(self.credentials, conn, credentials):
                refusal = self._auth_refusal(conn)
                # credentials that are wrong, revoked or another's, and an outsider on the child-only
                # listener, are recorded; none at all on a listener that wants them is the challenge
                # a client that authenticates only when asked (the JVM) answers next: not recorded
                if credentials is None and not conn.tree_only:
                    return refusal
                return self._refused_unread(conn, attempt, refusal)
        # 1a. nothing new while the audit cannot take its records (audit.on_failure: refuse)
        if self.audit is not None and not self.audit.writable and (refused := self.audit_refusal()):
            return self._refused_unread(conn, attempt, refused)
        # 1b. accepted beyond egressd's capacity: answered (never dropped), before any lookup
        if conn.room != "serve":
            return self.overloaded(conn, attempt)
        # 1c. identity: who holds the socket, when a rule or the audit needs it (once per connection;
        # awaited only then: most admissions wait for nothing)
        # every captured connection too: the program that ignored the proxy variables is named
        if conn.identity is None and (
            self.identify or conn.captured or self.policies.now.policy.needs_program
        ):
            await self._identify(conn)
        program = conn.identity.program if conn.identity is not None else None
        # 2. limits, before anything is decided: refused targets cost a child its rate too
        tunnel = stage in ("connect", "socks")
        limited = self.limits.rate(conn) or (self.limits.connections() if tunnel else None)
        if limited is not None:
            return limited
        if remembered is not None:
            return self._admit_remembered(conn, attempt, remembered)
        # 3. the decision; every later step uses its canonical target, never the client's spelling.
        # From here on, one version of the policy and its secrets: a reload swaps a new snapshot in
        # whole, and this admission goes on with the one it read
        now = self.policies.now
        secrets = now.secrets
        decision = self.decider.decide(
            attempt.host,
            attempt.port,
            conn.profile,
            scheme=attempt.scheme,
            method=attempt.method,
            path=attempt.path,
            program=program,
            policy=now.policy,
        )
        if decision.target is not None:
            conn.host, conn.port = decision.target.host.text, decision.target.port
        # 3a. a secret's placeholder in the host name (to leak it through DNS or a wildcard rule):
        # refused before anyone is asked and before anything resolves it
        target = decision.target
        if (
            now.has_secrets
            and target is not None
            and (name := secrets.needles.find(attempt.host)) is not None
        ):
            refusal = secret_refusal(name, "host name", target.host, target.port, secrets.spec(name))
            redact = secrets.needles.redact
            refusal = dataclasses.replace(refusal, host=redact(refusal.host), detail=redact(refusal.detail))
            conn.host = refusal.host  # the closed record names it too
            self._decided(conn, attempt, decision, refusal)
            return refusal
        decided = decision  # what the policy alone answered (a grant's or an approval's answer is not kept)
        # 3b. grants: the user's consent widens what the mode refused or would ask about, nothing else
        # (what the decision answered first: a store's truth is a Python call, per admission)
        if (decision.ask or decision.reason is Reason.NOT_ALLOWLISTED) and (self.grants or conn.granted):
            decision = self._granted(conn, attempt, decision)
        # 4. the approver (mode: ask waits here)
        if decision.ask:
            waited_from = time.monotonic()
            recheck = self._rechecker(conn, attempt, decision)
            decision = await approvals.answer(self.approver, decision, conn, recheck)
            if self.events.observed:
                self.events.emit(Asked(time.monotonic() - waited_from, decision.reason))
            if decision.allowed and tunnel and decision.target is not None:
                # approved for this connection: its requests, if inspected, are not asked again
                conn.granted = (decision.target.host.text, decision.target.port)
        # 5. the request rules, and the choice to inspect; then the secrets step (requests only)
        refusal, inspect = self._judge(conn, attempt, decision, now)
        changes: tuple[frozenset[str], Injection] | None = None
        if refusal is None and not tunnel and decision.target is not None:
            url = request_url(attempt, decision.target)
            origin = self.redirects.take(conn.client_key, url)
            changes_or_refusal = self._request_changes(conn, attempt, decision.target, url, origin, now)
            if isinstance(changes_or_refusal, Refusal):
                refusal = changes_or_refusal
            else:
                changes = changes_or_refusal
                if asked is not None and decision is decided and origin is None:
                    self._remember(conn, asked, decision, url, changes, now)
        refusal = self._recorded(conn, attempt, decision, refusal)
        if refusal is not None:
            return refusal
        if not tunnel:
            # resolved when a connection is opened for it (connect)
            strip, injection = changes if changes is not None else (frozenset(), NO_INJECTION)
            return Admitted(decision, strip=strip, injection=injection)
        # 6. resolve, filter, pin: a tunnel's answer (200, SOCKS5 reply) waits for its addresses
        admitted = Admitted(decision, inspect)
        refusal = await self._pin(conn, admitted)
        if refusal is not None:
            return refusal
        conn.tunnel = True  # what the tunnel carries was authenticated by its set-up
        return admitted

    def _recorded(
        self, conn: ConnState, attempt: Attempt, decision: Decision, refusal: Refusal | None
    ) -> Refusal | None:
        """The decision's record; the refusal to answer (an allow whose record the audit log did not
        take is refused instead). A tunnel allowed by mode: learn is recorded as such at once (with
        the reason enforce would give), so the audit keeps it even when no upstream connection
        follows; an allowed tunnel's record is its connection's."""
        if refusal is not None or attempt.stage in ("request", "inner") or decision.would_be is not None:
            unrecorded = self._decided(conn, attempt, decision, refusal)
            if unrecorded is not None:  # the allow's record was not written: refused instead
                host, port = (conn.host, conn.port) if conn.host is not None else (attempt.host, attempt.port)
                refusal = dataclasses.replace(unrecorded, host=host, port=port)
                self._decided(conn, attempt, decision, refusal)
        return refusal

    # -- what a connection asked before --------------------------------------------------------------
    def _epoch(self, conn: ConnState, now: InForce | None = None) -> Epoch:
        """Everything an HTTP request's answer depends on besides the request itself: what is in
        force (`now`: the policy, its secrets, a gateway's tokens; default: the one in force now),
        egressd's own addresses, the credentials issued (a token revoked), and who holds the
        connection."""
        return (
            now if now is not None else self.policies.now,
            self.decider.self_addresses,
            self.credentials.state,
            conn.identity,
        )

    def upstream_state(self) -> Epoch:
        """What an upstream connection's admission and pin depend on besides its request: the
        policy, egressd's own addresses, the credentials issued. A kept-alive connection is reused
        only in the same state (egressd.front.plain_http.IdleUpstreams)."""
        return (self.policies.get(), self.decider.self_addresses, self.credentials.state)

    @staticmethod
    def upstream_key(conn: ConnState, admitted: Admitted) -> UpstreamKey:
        """Whose an upstream connection is and what its pin depends on besides upstream_state: the
        child's credential, the canonical target, and every part of the decision the address
        filter reads (the child's profile, the private-address licence of the rule that allowed it,
        an IP literal's addresses). A kept-alive connection is reused only under the same key: a
        request allowed by another rule (another path, method or program) is pinned afresh."""
        decision = admitted.decision
        return (
            conn.client_key,
            admitted.host,
            admitted.port,
            decision.profile,
            decision.private_ok,
            decision.needs_resolution,
            decision.addresses,
        )

    def _recall(self, conn: ConnState, attempt: Attempt) -> tuple[RequestKey | None, Remembered | None]:
        """(the request as remembered, what was answered to it on this connection in the same
        state, or None). Only short requests are remembered; a request without credentials on the
        child-only listener never is (who holds its socket is asked each time)."""
        if conn.tree_only and attempt.credentials is None:
            return None, None
        headers = tuple(attempt.headers or ())
        # the sizes summed and the states compared in C: no generator's frame per request
        size = len(attempt.path or "") + sum(map(len, itertools.chain.from_iterable(headers)))
        if size > REMEMBERED_REQUEST:
            return None, None
        a = attempt
        asked = (a.stage, a.credentials, a.host, a.port, a.scheme, a.method, a.path, headers)
        entry = conn.remembered.get(asked) if conn.remembered is not None else None
        if entry is None or not _same(entry.epoch, self._epoch(conn)):
            return asked, None
        return asked, entry

    def _remember(
        self,
        conn: ConnState,
        asked: RequestKey,
        decision: Decision,
        url: str,
        changes: tuple[frozenset[str], Injection],
        now: InForce,
    ) -> None:
        """An allowed request's answer, for the same request on this connection (at most
        REMEMBERED_ASKS of them): what the policy alone allowed, with no redirect to follow, under
        the snapshot `now` it was decided by."""
        remembered = conn.remembered
        assert remembered is not None
        if len(remembered) >= REMEMBERED_ASKS:
            remembered.clear()
        remembered[asked] = Remembered(self._epoch(conn, now), conn.creds, decision, url, changes)

    def _admit_remembered(
        self, conn: ConnState, attempt: Attempt, remembered: Remembered
    ) -> Admitted | Refusal:
        """The steps after the limits for a request answered before on this connection in the same
        state: its decision and changes, the redirect memory asked again (a redirect to this URL
        since then strips its credentials), its own record."""
        decision = remembered.decision
        target = decision.target
        assert target is not None
        conn.host, conn.port = target.host.text, target.port
        refusal: Refusal | None = None
        changes = remembered.changes
        origin = self.redirects.take(conn.client_key, remembered.url)
        if origin is not None:
            now = remembered.epoch[0]  # the snapshot its decision and changes were made with
            assert isinstance(now, InForce)
            fresh = self._request_changes(conn, attempt, target, remembered.url, origin, now)
            if isinstance(fresh, Refusal):
                refusal = fresh
            else:
                changes = fresh
        refusal = self._recorded(conn, attempt, decision, refusal)
        if refusal is not None:
            return refusal
        return Admitted(decision, strip=changes[0], injection=changes[1])

    def audit_refusal(self) -> Refusal | None:
        """While the audit log cannot take a record (a full disk, a reader that stopped reading),
        under `audit.on_failure: refuse`: the refusal of new work. Anything else: None."""
        audit = self.audit
        if audit is None or audit.writable:
            return None
        return self._unrecordable(audit, "egressd cannot write its audit log")

    def _unrecordable(self, audit: Recorder, what: str) -> Refusal | None:
        if self.policies.get().audit.on_failure != "refuse":
            return None
        why = f" ({audit.problem})" if audit.problem else ""
        detail = f"{what}{why} and refuses what it cannot record (audit.on_failure: refuse)"
        return Refusal(Reason.AUDIT_UNAVAILABLE, detail)

    def _refused_unread(self, conn: ConnState, attempt: Attempt, refusal: Refusal) -> Refusal:
        """An attempt refused before the policy read it (its credentials, or an audit that cannot
        record it), recorded; a refusal whose record cannot be written is still a refusal."""
        refusal = dataclasses.replace(refusal, host=attempt.host, port=attempt.port)
        request = attempt.stage in ("request", "inner")
        self._refusal_record(
            conn,
            attempt.stage,
            self._recorded_path(attempt.host),
            attempt.port,
            refusal.reason,
            refusal.detail,
            attempt.method,
            attempt.scheme if request else None,
            self._recorded_path(attempt.path) if request else None,
        )
        return refusal

    async def addresses_for(self, name: str, profile: str | None) -> tuple[IPAddress, ...] | None:
        """The real addresses to answer a sandboxed child's DNS question with; () for none (the
        policy refuses the name: recorded, stage "dns"); None for a stand-in, decided by the name
        when a connection is made (a name only a person, a grant or the program could allow).

        Decided before anything is resolved, as a CONNECT is (a name the policy does not allow is
        never looked up: no DNS channel out), on the ports a client would use
        (handed.candidate_ports); then resolved and filtered by egressd's own resolver and address
        filter, and recorded, so the connection goes to these addresses.
        """
        now = self.policies.now
        policy = now.policy
        if now.has_secrets and now.secrets.needles.find(name) is not None:
            why = "the name holds a secret's placeholder"
            return self._refused_name(name, Reason.SECRET_EXFILTRATION, why)
        ports = candidate_ports(policy)
        decisions = [self.decider.decide(name, port, profile, policy=policy) for port in ports]
        allowed = next((d for d in decisions if d.allowed and not d.ask and d.needs_resolution), None)
        if allowed is None:
            refused = decisions[0]
            final = all(d.reason in NO_ANSWER_REASONS for d in decisions) and not self.grants
            return self._refused_name(name, refused.reason, refused.detail) if final else None
        assert allowed.target is not None and allowed.target.host.name is not None
        canonical = allowed.target.host.name
        resolver = await loader.resolver_module()
        started = time.monotonic()
        try:
            addresses = await resolver.resolve(
                canonical, policy.resolver.nameservers, policy.limits.dns_timeout
            )
        except resolver.ResolveError as exc:
            if self.events.observed:
                self.events.emit(Resolved(time.monotonic() - started, exc.reason))
            return None  # the connection's own lookup reports it, with its reason
        if self.events.observed:
            self.events.emit(Resolved(time.monotonic() - started, "ok"))
        kept, _ = filter_addresses(allowed, addresses, policy)
        if not kept:
            return None
        self.handed.record(canonical, kept)
        return tuple(kept)

    def _refused_name(self, name: str, reason: Reason, detail: str) -> tuple[IPAddress, ...]:
        self.refused_early(None, self._recorded_path(name), None, reason, detail, stage="dns")
        return ()

    def _rechecker(
        self, conn: ConnState, attempt: Attempt, asked_about: Decision
    ) -> Callable[[], Decision | None]:
        """What a waiting question asks again (a grant made meanwhile answers it). Made here, not in
        _admit: a closure there would make cells of its variables on every admission."""

        def recheck() -> Decision | None:
            granted = self._granted(conn, attempt, asked_about)
            return None if granted.ask else granted

        return recheck

    def _granted(self, conn: ConnState, attempt: Attempt, decision: Decision) -> Decision:
        """The decision a grant makes of a `not_allowlisted` or `ask` one, or the same decision.

        The grant answers only the mode's question: the decision is asked again as `mode: ask`
        would see it, so ports and profiles still refuse; a non-global IP literal is never granted
        (the private-address guard), and a granted name resolves under the guard (private_ok off).
        """
        candidate = decision
        if not decision.ask:
            candidate = self.decider.decide(
                attempt.host,
                attempt.port,
                conn.profile,
                scheme=attempt.scheme,
                method=attempt.method,
                path=attempt.path,
                mode="ask",
                program=conn.identity.program if conn.identity is not None else None,
            )
        target = candidate.target
        if not candidate.ask or target is None:
            return decision
        if target.host.ip is not None and classify(target.host.ip) is not AddressClass.GLOBAL:
            return decision
        host, port = target.host.text, target.port
        if attempt.stage == "inner" and conn.granted == (host, port):
            rule, inspect = "this tunnel's grant or approval", False
            upgrade = candidate.upgrade
        else:
            taken = self.grants.take(attempt.stage, host, port, attempt.scheme, attempt.path)
            if taken is None:
                return decision
            grant, inspect = taken
            rule = f"grant {grant.id}: {grant.spec}"
            upgrade = candidate.upgrade and not grant.url_scoped  # a URL's grant is for that request
            if attempt.stage in ("connect", "socks") and not inspect:
                conn.granted = (host, port)  # the requests inside, if inspected, are the tunnel's
        return dataclasses.replace(
            candidate,
            allowed=True,
            ask=False,
            reason=Reason.GRANTED,
            rule=rule,
            detail=f"{host}:{port} is admitted by the user's {rule}",
            private_ok=False,
            needs_inspection=candidate.needs_inspection or inspect,
            upgrade=upgrade,
        )

    async def _identify(self, conn: ConnState) -> None:
        """The identity step: look the owner up. Through the child's tree it takes well under a
        millisecond; without one (`egressd run`) it may scan all of /proc, in a worker thread so
        other connections are not held up."""
        root = self.children.get(conn.creds.token) if conn.creds is not None else None
        if root is not None:
            identify(conn, root)
        else:
            await asyncio.to_thread(identify, conn, None)

    def _auth_refusal(self, conn: ConnState) -> Refusal:
        """407; on the child-only listener, with why the connection is not the child's."""
        who = conn.identity
        if not conn.tree_only or who is None or who.in_tree:
            return AUTH_REFUSAL
        detail = (
            "this listener admits only the child egressd started and its descendants, without "
            f"credentials; {who.why or 'the connection is held by another process'}"
        )
        return Refusal(Reason.PROXY_AUTH_REQUIRED, detail)

    def authenticate(self, conn: ConnState, presented: Presented) -> bool:
        """The credentials step alone, for a protocol that answers it before its request arrives
        (SOCKS5's RFC 1929 sub-negotiation); admit() runs it again on the same credentials."""
        return authenticate(self.credentials, conn, presented)

    async def _pin(self, conn: ConnState, admitted: Admitted) -> Refusal | None:
        """Resolve once, filter, and pin the addresses into admitted (or the refusal, recorded)."""
        target = admitted.decision.target
        # a name first (an IP literal has none): the memory's truth is a Python call
        known = self.handed.get(target.host.name) if target and target.host.name and self.handed else None
        # unpacked once: each field read of a named tuple is the generic attribute lookup
        decision, pin, refusal, resolved, lookup = await resolution.pin(
            admitted.decision, self.policies.now.policy, known
        )
        if lookup is not None and self.events.observed:
            self.events.emit(Resolved(*lookup))
        admitted.decision, admitted.pin, admitted.resolved = decision, pin, resolved
        if refusal is not None:
            self.connection_record(conn, admitted, (refusal.reason, refusal.detail))
        return refusal

    def _request_changes(
        self,
        conn: ConnState,
        attempt: Attempt,
        target: Target,
        url: str,
        origin: str | None,
        now: InForce,
    ) -> Refusal | tuple[frozenset[str], Injection]:
        """What egressd changes in an allowed HTTP request, the same for plain HTTP and inside a
        tunnel: the credential headers of a redirect's follow-up to another origin (`origin`: the
        redirect memory's answer for `url`, taken), dropped before anything else looks at them,
        then the secrets step (refusal or injection)."""
        host, port = target.host, target.port
        path = attempt.path or "/"
        strip: frozenset[str] = frozenset()
        if origin is not None:
            names = (*now.policy.credentials.strip_on_host_change, *now.secrets.header_names())
            strip = frozenset(name.lower() for name in names)
            present = {n.lower() for n, _ in attempt.headers or ()}
            stripped = [n for n in dict.fromkeys(names) if n in present and n != "proxy-authorization"]
            self.notice(
                conn,
                "credentials_stripped",
                redirected_from=origin,
                host=host.text,
                port=port,
                stripped=stripped,
            )
        headers = [(n, v) for n, v in attempt.headers or () if n.lower() not in strip]
        judged = now.secrets.judge(host, port, attempt.method, path, headers)
        if isinstance(judged, Refusal):
            return judged
        return strip, judged

    def _judge(
        self, conn: ConnState, attempt: Attempt, decision: Decision, now: InForce
    ) -> tuple[Refusal | None, bool]:
        """(refusal, inspect) for a decision: refused ones, the request rules, inspection."""
        if not decision.allowed or decision.target is None:
            return refusal_for(decision), False
        if attempt.stage in ("request", "inner"):
            if decision.needs_inspection:
                return needs_inspection_refusal(decision), False
            refusal = request_refusal(
                decision.target,
                attempt.headers or (),
                websocket=now.policy.websocket,
                upgrade=decision.upgrade,
                method=attempt.method,
            )
            return refusal, False
        inspect = self.wants_inspection(decision, conn, now)
        target = decision.target
        if not inspect and now.has_secrets and now.secrets.listed(target.host, target.port):
            # a secret's host unseen would get the placeholder, never the value: refused instead
            refusal = needs_inspection_refusal(decision)
            why = "a secret goes to this host, which needs TLS inspection (egressd puts it in the request)"
            return dataclasses.replace(refusal, detail=why), False
        if decision.needs_inspection and not inspect:
            return needs_inspection_refusal(decision), False
        return None, inspect

    def wants_inspection(self, decision: Decision, conn: ConnState, now: InForce) -> bool:
        """A tunnel is intercepted for hosts only a path/method rule admits, hosts the policy marks
        `inspect`, and the target of a cross-origin redirect this child was sent."""
        target = decision.target
        if not self.inspection or target is None:
            return False
        if decision.needs_inspection or now.policy.inspect.match(target.host, target.port):
            return True
        if now.has_secrets and now.secrets.listed(target.host, target.port):
            return True
        return self.redirects.expects(conn.client_key, "https", target.host.text, target.port)

    # -- the upstream connection -------------------------------------------------------------------
    async def connect(
        self, conn: ConnState, admitted: Admitted, protocol: asyncio.BaseProtocol, upstream_id: str
    ) -> Refusal | None:
        """Connect `protocol` to the pinned addresses only (a request's are resolved and pinned
        now), with the connection record either way. `upstream_id` counts against
        limits.max_connections until `disconnected(upstream_id)`. One coroutine: each awaited
        one is an object made, and gone through on every resumption."""
        limited = self.reserve_upstream(upstream_id)
        if limited is not None:
            return limited
        opened = False
        try:
            # the audit log's state read here first: most connections find it writable, with no call
            audit = self.audit
            if audit is not None and not audit.writable and (refused := self._unwritable(conn, admitted)):
                return self._in_context(refused)
            if admitted.pin is None and (refusal := await self._pin(conn, admitted)) is not None:
                return self._in_context(refusal)
            pin = admitted.pin
            assert pin is not None
            try:
                await connect_protocol(pin, protocol)
            except ConnectFailure as failure:
                self.connection_record(conn, admitted, (failure.reason, failure.detail))
                refusal = Refusal(failure.reason, failure.detail, pin.host, pin.port, admitted.decision.rule)
                return self._in_context(refusal)
            unrecorded = self._on_record(conn, admitted, pin)
            if unrecorded is not None:  # its record was not written: closed before a byte passes
                transport = getattr(protocol, "transport", None)  # the fronts' protocols keep theirs
                if transport is not None:
                    transport.close()
                return self._in_context(unrecorded)
            opened = True
            return None
        finally:
            if not opened:
                self.disconnected(upstream_id)  # refused, failed or cancelled: nothing is open

    def reused(self, conn: ConnState, admitted: Admitted, pin: Pin) -> Refusal | None:
        """A kept upstream connection (pinned as `pin`) taken for another client connection of the
        same child: that connection's record of it, as if opened now, so every client connection's
        requests have their upstream connection on record; the refusal when the record was not
        written (the connection is then not used)."""
        if admitted.pin is None:
            admitted.pin = pin
        return self._unwritable(conn, admitted) or self._on_record(conn, admitted, pin)

    def _unwritable(self, conn: ConnState, admitted: Admitted) -> Refusal | None:
        """Before an upstream connection is used: the refusal (recorded) while the audit log cannot
        take its record under audit.on_failure: refuse."""
        refused = self.audit_refusal()
        if refused is None:
            return None
        self.connection_record(conn, admitted, (refused.reason, refused.detail))
        return dataclasses.replace(refused, host=admitted.host, port=admitted.port)

    def _on_record(self, conn: ConnState, admitted: Admitted, pin: Pin) -> Refusal | None:
        """The connection's record; the refusal when it was not written (recorded as that), so the
        connection is not used."""
        unrecorded = self.connection_record(conn, admitted, None)
        if unrecorded is None:
            return None
        self.connection_record(conn, admitted, (unrecorded.reason, unrecorded.detail))
        return dataclasses.replace(unrecorded, host=pin.host, port=pin.port)

    def reserve_upstream(self, upstream_id: str) -> Refusal | None:
        """Count an upstream connection against limits.max_connections and egressd's descriptors
        before anything of it is opened (its lookup, its socket): of a burst of tunnels, no more
        than the limit ever get a descriptor. The refusal when the limit is reached or no
        descriptor is left (`overloaded`); `disconnected` gives both back."""
        limited = self.limits.connections() or self.limits.hold(upstream_id, self._conns.served)
        if limited is None:
            self.limits.upstreams.add(upstream_id)
        return limited

    def disconnected(self, upstream_id: str) -> None:
        self.limits.upstreams.discard(upstream_id)
        self.limits.release(upstream_id)

    def overloaded(self, conn: ConnState, attempt: Attempt) -> Refusal:
        """The answer to a client accepted beyond egressd's capacity, recorded (no decision made)."""
        refusal = overloaded(attempt.host, attempt.port)
        request = attempt.stage in ("request", "inner")
        self.refused_early(
            conn,
            attempt.host,
            attempt.port,
            refusal.reason,
            refusal.detail,
            stage=attempt.stage,
            method=attempt.method,
            scheme=attempt.scheme if request else None,
            path=attempt.path if request else None,
        )
        return refusal

    def upstream_failed(self, conn: ConnState, host: str, port: int, reason: Reason, detail: str) -> None:
        """An admitted exchange whose upstream connection opened and then failed it (no response
        head within timeouts.response, an answer that is not HTTP/1): recorded like a connection
        that could not be opened, stage "connection", so every observer tells it as a failure."""
        self.refused_early(conn, host, port, reason, detail, stage="connection")

    # -- events ------------------------------------------------------------------------------------
    def _refusal_record(
        self,
        conn: ConnState | None,
        stage: Stage,
        host: str | None,
        port: int | None,
        reason: Reason,
        detail: str,
        method: str | None,
        scheme: str | None,
        path: str | None,
    ) -> None:
        """The Decided event of a refusal no decision made (no rule, no addresses)."""
        self._record(
            conn,
            stage,
            host,
            port,
            False,
            reason,
            None,
            detail,
            method,
            scheme,
            path,
            (),
            None,
            None,
            None,
            None,
        )

    def _record(
        self,
        conn: ConnState | None,
        stage: Stage,
        host: str | None,
        port: int | None,
        allowed: bool,
        reason: Reason,
        rule: str | None,
        detail: str,
        method: str | None,
        scheme: str | None,
        path: str | None,
        resolved: tuple[str, ...],
        connected: str | None,
        attempts: tuple[str, ...] | None,
        would_be: str | None,
        via: str | None,
    ) -> Refusal | None:
        """A Decided event about this client connection. Its fields are passed by position, here and
        to Decided: a call naming twenty fields matches each name against the parameter list, and
        every tunnel and request makes one. What the child wrote — host, method, path, and the
        detail that may quote them — never keeps a placeholder's random part (the name does). An
        allow whose record the audit log did not take answers the refusal to act on instead
        (audit.on_failure: refuse), else None."""
        if type(reason) is not Reason:  # a code no registry knows raises here, before any record
            reason = Reason.of(reason)
        now = self.policies.now
        if now.has_secrets:
            host, method, path = map(self._recorded_path, (host, method, path))
            detail = now.secrets.needles.redact(detail)
        audit = self.audit
        lost = audit.lost if audit is not None else 0
        if conn is None:
            event = built_from(Decided, (
                None, None, None, stage, host, port, allowed, reason, rule, detail, method, scheme, path,
                resolved, connected, attempts, would_be, via, None, None, False,
            ))  # fmt: skip
        else:
            who, creds = conn.identity, conn.creds
            event = built_from(Decided, (
                conn.conn_id,
                creds.client if creds is not None else None,
                creds.profile if creds is not None else None,
                stage, host, port, allowed, reason, rule, detail, method, scheme, path,
                resolved, connected, attempts, would_be, via,
                who.pid if who is not None else None,
                who.exe if who is not None else None,
                conn.captured,
            ))  # fmt: skip
        self.events.emit(event)
        if audit is None or not allowed or audit.lost == lost:
            return None
        # its own record was lost (the log may take records again already: this one is gone)
        return self._unrecordable(audit, "egressd could not write this decision's audit record")

    def _decided(
        self, conn: ConnState, attempt: Attempt, decision: Decision, refusal: Refusal | None
    ) -> Refusal | None:
        target = decision.target
        request = attempt.stage in ("request", "inner")
        return self._record(
            conn,
            attempt.stage,
            target.host.text if target else attempt.host,
            target.port if target else attempt.port,
            refusal is None,
            refusal.reason if refusal else decision.reason,
            decision.rule,
            refusal.detail if refusal else decision.detail,
            attempt.method,
            attempt.scheme if request else None,
            attempt.path if request else None,
            (),
            None,
            None,
            None if refusal else decision.would_be,
            None,
        )

    def _recorded_path(self, path: str | None) -> str | None:
        """A path (or host, or method) as records show it: a placeholder's random part never kept
        (the name is)."""
        now = self.policies.now
        if path is None or not now.has_secrets:
            return path
        return now.secrets.needles.redact(path)

    def secret_refusal(self, host: str, port: int, name: str) -> Refusal:
        """The refusal of a request whose BODY carried a placeholder its host may not get (found by
        the front's streaming scan, which records it with refused_early)."""
        return secret_refusal(name, "request body", canonical_host(host), port, self.secrets.spec(name))

    def connection_record(
        self, conn: ConnState, admitted: Admitted, failure: tuple[str, str] | None
    ) -> Refusal | None:
        """The decision record of one upstream connection, with resolved and connected addresses;
        an opened one whose record was not written answers the refusal to close it with."""
        decision, pin = admitted.decision, admitted.pin
        target = decision.target
        reason, detail = failure if failure is not None else (decision.reason, decision.detail)
        allowed = decision.allowed and pin is not None and failure is None
        # an allowed connection's addresses only for an observer that reads them (not counters)
        told = not allowed or self.events.wants_addresses
        return self._record(
            conn,
            "connection",
            target.host.text if target else conn.host,
            target.port if target else conn.port,
            allowed,
            reason,
            decision.rule,
            detail,
            None,
            None,
            None,
            tuple(map(address_text, admitted.resolved)) if told else (),
            f"{pin.connected[0]}:{pin.connected[1]}" if told and pin and pin.connected else None,
            (tuple(pin.attempts) if pin is not None else ()) if told else None,
            decision.would_be if failure is None else None,
            pin.via.where if told and pin is not None and pin.via is not None else None,
        )

    def refused_early(
        self,
        conn: ConnState | None,
        host: str | None,
        port: int | None,
        reason: Reason,
        detail: str,
        *,
        stage: Stage,
        method: str | None = None,
        scheme: str | None = None,
        path: str | None = None,
    ) -> None:
        """A refusal no decision made: a tunnel closed after its first bytes (SNI, stage "tls"), a
        request head no parser may read (stage "request"; its method, scheme and path when its
        request line could be read)."""
        self._refusal_record(conn, stage, host, port, reason, detail, method, scheme, path)
        now = self.policies.now
        if now.has_secrets:
            host, detail = self._recorded_path(host), now.secrets.needles.redact(detail)
        where = f"{host if host is not None else '?'}:{port or '?'}"
        logger.info("%s (%s) %s: %s", Reason.of(reason).outcome, stage, where, detail)

    def header_timeout(self, conn: ConnState, timeout: float) -> None:
        """A client cut for not finishing its request head in time."""
        detail = f"no request within {timeout:g}s"
        self.events.emit(
            Notice("header_timeout", {"conn": conn.conn_id, "peer": conn.peer, "detail": detail})
        )

    def notice(self, conn: ConnState, kind: str, **fields: object) -> None:
        """What an HTTP exchange did besides deciding: credentials_stripped, response_cut."""
        self.events.emit(Notice(kind, {"conn": conn.conn_id, "client": conn.client_name, **fields}))

    def internal_error(self, where: str, exc: BaseException) -> Refusal:
        """A bug while admitting, on any front: logged, recorded, and answered by a refusal."""
        logger.error("egressd internal error in %s: %r", where, exc, exc_info=exc)
        refusal = Refusal(Reason.INTERNAL_ERROR, f"{where}: {type(exc).__name__}: {exc}")
        fields = {"hook": where, "decision": "deny", "reason": refusal.reason, "detail": refusal.detail}
        self.events.emit(Notice("internal_error", fields))
        return refusal
