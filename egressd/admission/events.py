"""What the admission pipeline tells the world: typed events and the bus that carries them.

Fronts never write audit records or traces themselves: the pipeline emits one event per step that
matters (a decision, a connection opened, a connection closed with its bytes, a refusal no decision
made, a notice such as credentials stripped), and every observer — the audit log, the trace, the
metrics, the refusal report, later a dashboard — subscribes to the bus. A failing observer is
logged, never propagated: it must not change what was decided.

Events are named tuples: immutable like frozen dataclasses, without their cost (a frozen dataclass
sets each field through object.__setattr__, and every tunnel builds two events).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Literal, NamedTuple, Protocol

from egressd.platform.log import Logger
from egressd.policy.reasons import Reason
from egressd.policy.refusal import HintContext, Refusal

logger = Logger(__name__)

# A named tuple made from a tuple of all its fields, in order: `built_from(Decided, (...))` is
# tuple.__new__ itself. A named tuple's own __new__ is Python code its type's call reaches from C
# (the arguments copied into a frame, then into the tuple): a third of a small event's making.
# The tuple names every field, defaults too (tests hold each event made to its fields' count).
built_from = tuple.__new__

Stage = Literal["connect", "socks", "request", "inner", "connection", "tls", "dns"]


class Decided(NamedTuple):
    """One decision: a CONNECT, SOCKS5 connect or request (allowed or refused), an upstream
    connection (stage "connection": opened, with its resolved and connected addresses, or not), or
    a name a sandboxed child's DNS asked for that the policy refuses (stage "dns", no port)."""

    conn: str | None
    client: str | None
    profile: str | None
    stage: Stage
    host: str | None
    port: int | None
    allowed: bool
    reason: Reason
    rule: str | None
    detail: str
    method: str | None = None
    scheme: str | None = None
    path: str | None = None
    resolved: tuple[str, ...] = ()
    connected: str | None = None
    attempts: tuple[str, ...] | None = None
    would_be: str | None = None  # mode: learn: the reason enforce would have refused with
    via: str | None = None  # stage "connection": the parent proxy (host:port) it went through
    pid: int | None = None  # the program holding the client's connection, when it was looked up
    exe: str | None = None
    # the capture took the connection from a client that ignored the proxy variables
    captured: bool = False

    def refusal(self, context: HintContext | None = None) -> Refusal:
        """The refusal this records, for an observer that words it (the report, a notice), read
        where `context` says: the addresses are the ones resolved (their rules are the hint of
        resolved_forbidden)."""
        return Refusal(
            self.reason,
            self.detail,
            self.host or "",
            self.port,
            self.rule,
            profile=self.profile,
            addresses=self.resolved,
            context=context,
        )


class Closed(NamedTuple):
    """A client connection ended: bytes each way and how long it lived (seconds, as measured: what
    writes it as text rounds it to milliseconds)."""

    conn: str
    client: str | None
    host: str | None
    port: int | None
    bytes_up: int
    bytes_down: int
    duration: float


class Notice(NamedTuple):
    """Anything else an observer may want: header_timeout, internal_error, credentials_stripped,
    response_cut."""

    kind: str
    fields: Mapping[str, object] = MappingProxyType({})


class Resolved(NamedTuple):
    """One DNS lookup of the resolve step ended (metrics' latency histogram): how long the
    connection waited for its addresses, and how it ended (ok, dns_error, dns_timeout). Not an
    audit record: the connection's decision record already names what was resolved."""

    seconds: float
    outcome: str


class Asked(NamedTuple):
    """A decision that reached `mode: ask` was answered: how long it waited for the approver and
    the outcome (approved, ask_refused, no_approver, ask_timeout)."""

    seconds: float
    outcome: str


Event = Decided | Closed | Notice | Resolved | Asked
Observer = Callable[[Event], None]


class Told:
    """Which decision records a live view shows as decisions: every one but an allowed upstream
    connection's whose client connection had a decision told already (a request's, or its
    tunnel's first connection). An allowed tunnel's only record is its connection's, so skipping
    every allowed connection record would hide allowed tunnels. Bounded: a view of a long run
    remembers the last `size` client connections, in an OrderedDict, whose oldest goes in
    constant time (a dict's first key, once many were deleted before it, is found by a walk over
    their empty slots: a microsecond per connection once the memory is full)."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._conns: collections.OrderedDict[str, None] = collections.OrderedDict()

    def first(self, conn: str | None, stage: str, allowed: bool) -> bool:
        if conn is None:
            return True
        conns = self._conns
        if conn in conns:
            if stage == "connection" and allowed:
                return False
            conns.move_to_end(conn)
        else:
            conns[conn] = None
            if len(conns) > self.size:
                conns.popitem(last=False)
        return True


class Recorder(Protocol):
    """What the pipeline needs of the audit log (egressd.observe.audit.AuditLog): whether a record
    given now would be written, so nothing is acted upon without one; the observers stay above."""

    @property
    def writable(self) -> bool: ...

    @property
    def lost(self) -> int: ...

    @property
    def problem(self) -> str: ...

    def observe(self, event: Event) -> None: ...


class EventBus:
    """Synchronous fan-out to the observers, in subscription order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._observers: tuple[Observer, ...] = ()
        self._readers: tuple[Observer, ...] = ()  # those that read an allowed connection's addresses
        self._kinds: dict[Observer, tuple[type, ...] | None] = {}  # the kinds each one reads (None: all)
        # the observers of each kind of event, in subscription order: made at its first emit
        self._by_kind: dict[type, tuple[Observer, ...]] = {}

    def subscribe(
        self, observer: Observer, *, addresses: bool = True, kinds: tuple[type, ...] | None = None
    ) -> None:
        """`addresses=False`: the observer never reads an allowed upstream connection's addresses
        (resolved, connected, attempts, via): while only such observers listen (counters), those
        are not formatted (`wants_addresses`). `kinds`: the only events it is given (one that
        ignores the others is not called for each, as a tunnel's Closed)."""
        with self._lock:
            self._observers = (*self._observers, observer)
            self._kinds = {**self._kinds, observer: kinds}
            self._by_kind = {}
            if addresses:
                self._readers = (*self._readers, observer)

    def unsubscribe(self, observer: Observer) -> None:
        """By equality: `obj.method` makes a new bound method each time it is read."""
        with self._lock:
            self._observers = tuple(o for o in self._observers if o != observer)
            self._readers = tuple(o for o in self._readers if o != observer)
            self._kinds = {o: k for o, k in self._kinds.items() if o != observer}
            self._by_kind = {}

    @property
    def observed(self) -> bool:
        return bool(self._observers)

    @property
    def wants_addresses(self) -> bool:
        """Some observer reads an allowed upstream connection's addresses as text."""
        return bool(self._readers)

    def _observers_of(self, kind: type) -> tuple[Observer, ...]:
        with self._lock:
            kinds = self._kinds
            observers = tuple(o for o in self._observers if (k := kinds.get(o)) is None or kind in k)
            self._by_kind = {**self._by_kind, kind: observers}
        return observers

    def emit(self, event: Event) -> None:
        observers = self._by_kind.get(type(event))
        if observers is None:
            observers = self._observers_of(type(event))
        for observer in observers:
            try:
                observer(event)
            except Exception:  # noqa: BLE001 - an observer never changes a decision
                logger.exception("egressd: an observer failed on %s", type(event).__name__)
