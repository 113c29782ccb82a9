"""The native tunnel front: egressd's proxy port served by egressd/engine/_tunnels.c where it is built.

Python decides every CONNECT head the first time it arrives (the lean path in fastpath.py: the same
credentials check, decision, limits, resolution and pinned connect). When it admitted and connected
a plain tunnel, it remembers that exact head, with the address it connected to. The C front then
serves the same head again -- the same bytes, so the same client credentials, target and headers --
without running Python: connect to that address, 200, relay. It forgets every head on any change a
decision depends on (the policy, the issued credentials, the redirect memory, egressd's own
addresses: `Runtime.watch_decisions`), a head of a name after NAME_TTL (names are resolved again),
and never remembers when a rate or connection limit is set (those count every request). Whatever
it has not remembered, it hands to Python at once with the bytes read so far.

EGRESSD_NATIVE=0 turns it off; without a C compiler at install time it is not built, and the
Python lean path serves everything.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from egressd.engine.pinning import EarlierAttempt, Pin
from egressd.engine.runtime import ConnState

if TYPE_CHECKING:
    from egressd.engine.credentials import ProxyCredentials
    from egressd.engine.fastpath import FastFront, FrontProtocol
    from egressd.engine.gate import Admission
    from egressd.engine.plain_http import Request
    from egressd.policy import Decision

# fastpath imports this module, and the plain-HTTP modules cost ~9 ms to import that a command
# with no plain-HTTP request never pays: those names are imported where they are used

try:
    from egressd.engine import _tunnels
except ImportError:  # not built (no compiler, not Linux): the Python lean path serves everything
    _tunnels = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

ENABLED = os.environ.get("EGRESSD_NATIVE", "1") != "0"
NAME_TTL = 1.0  # s: a head whose target is a name is resolved again after this
IP_TTL = 60.0  # s: an IP target has nothing to re-resolve; changes invalidate it anyway


def available() -> bool:
    return ENABLED and _tunnels is not None


@dataclass(frozen=True)
class Remembered:
    """What the records of a tunnel served natively need: who, to where, admitted how."""

    creds: ProxyCredentials | None
    host: str
    port: int
    admission: Admission


@dataclass(frozen=True)
class RememberedRequest(Remembered):
    """A plain-HTTP request served natively: also what was decided, for its request record."""

    decision: Decision
    request: Request


class NativeFront:
    """One listening socket served by the C front; misses go to FastFront's Python protocols."""

    def __init__(
        self, front: FastFront, sock: socket.socket, implicit: ProxyCredentials | None = None
    ) -> None:
        assert _tunnels is not None
        self.front = front
        self.implicit = implicit  # a credential-free listener's credentials (ConnState.implicit)
        self.rt = front.rt
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.states: dict[int, ConnState] = {}  # by serial, while audited
        self.tunnels = _tunnels.Front(
            sock.fileno(), self._miss, self._hello, self._opened, self._closed, self._timed_out, self._request
        )
        self._configure()
        self.loop.add_reader(self.tunnels.fileno(), self.tunnels.poll)
        self.rt.watch_decisions(self._changed)
        self.rt.native_fronts.append(self.tunnels)
        self.closed = False

    @property
    def generation(self) -> int:
        return int(self.tunnels.generation)

    def _configure(self) -> None:
        from egressd.engine.fastpath import COALESCE

        limits = self.rt.policies.get().limits
        self.tunnels.configure(
            limits.header_timeout, limits.idle_timeout, self.rt.audit is not None, COALESCE
        )

    def _changed(self) -> None:
        """Any change a decision depends on (any thread): forget every head; new timeouts."""
        if self.closed:
            return
        self.tunnels.invalidate()
        self._configure()

    # -- Python decided: remember ------------------------------------------------------------------
    def remember(
        self,
        head: bytes,
        generation: int,
        creds: ProxyCredentials | None,
        decision: Decision,
        admission: Admission,
        request: tuple[Request, bytes] | None = None,
    ) -> bool:
        """Serve this head natively from now on, unless anything changed since `generation`.

        A CONNECT head, or with `request` (the parsed request and the head sent upstream) a
        plain-HTTP request head."""
        if self.closed:
            return False
        limits = self.rt.policies.get().limits
        pin = admission.pin
        target = decision.target
        if limits.requests_per_second is not None or limits.max_connections is not None:
            return False  # every request counts: Python sees each one
        if pin is None or pin.connected is None or target is None:
            return False
        if decision.reason == "approved":
            return False  # an approver answers each connection
        # a served tunnel connects at its first try: its record has no earlier attempts
        hit_pin = Pin(pin.host, pin.port, pin.addresses, pin.connect_timeout, connected=pin.connected)
        hit = replace(admission, pin=hit_pin)
        meta: Remembered
        outgoing = None
        if request is None:
            meta = Remembered(creds, target.host.text, target.port, hit)
        else:
            parsed, outgoing = request
            meta = RememberedRequest(creds, target.host.text, target.port, hit, decision, parsed)
        ttl = NAME_TTL if decision.needs_resolution else IP_TTL
        ip, port = pin.connected
        return bool(
            self.tunnels.remember(head, generation, ip, port, pin.connect_timeout, ttl, meta, outgoing)
        )

    # -- callbacks from C (inside poll, on the loop thread) ----------------------------------------
    def _miss(self, fd: int, data: bytes, waited: float, timed_out: tuple[Remembered, float] | None) -> bool:
        """A connection Python decides: adopt its socket with the bytes read so far (and, when the
        remembered address did not answer within connect_timeout, which one and for how long)."""
        from egressd.engine.fastpath import FrontProtocol

        earlier = None
        if timed_out is not None:
            meta, seconds = timed_out
            pin = meta.admission.pin
            if pin is not None and pin.connected is not None:
                earlier = EarlierAttempt(pin.connected[0], pin.connected[1], seconds)
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            return False
        try:
            protocol = FrontProtocol(
                self.front,
                "http",
                initial=data,
                waited=waited,
                earlier=earlier,
                native=self,
                implicit=self.implicit,
            )
            self.loop.create_task(self._adopt(sock, protocol))
        except Exception:  # noqa: BLE001 - C closes the fd
            logger.exception("could not adopt a connection")
            sock.detach()
            return False
        return True

    async def _adopt(self, sock: socket.socket, protocol: FrontProtocol) -> None:
        try:
            await self.loop.connect_accepted_socket(lambda: protocol, sock)
        except Exception:  # noqa: BLE001 - the client is closed, never let through
            logger.exception("could not adopt a connection")
            sock.close()

    def _hello(self, meta: Remembered, data: bytes, serial: int) -> int:
        """0: wait for more, 1: relay, 2: close (recorded here)."""
        from egressd.engine.sni import WAIT, first_bytes_verdict

        verdict = first_bytes_verdict(meta.host, data)
        if verdict is WAIT:
            return 0
        if verdict is None:
            return 1
        self.rt.audit_early_refusal(
            self.states.get(serial), meta.host, meta.port, "sni_mismatch", str(verdict), stage="tls"
        )
        return 2

    def _served_state(self, meta: Remembered, peer: str) -> ConnState:
        """What the records of a served connection say: a fresh connection id, who, to where."""
        state = ConnState(conn_id=self.rt.new_conn_id(), peer=peer, creds=meta.creds)
        state.host, state.port, state.head_seen = meta.host, meta.port, True
        return state

    def _opened(self, meta: Remembered, serial: int, peer: str) -> None:
        """A remembered tunnel is open (called only with an audit log): its connection record."""
        state = self.states[serial] = self._served_state(meta, peer)
        self.rt.audit_connection(state, meta.admission, None)

    def _request(self, meta: RememberedRequest, serial: int, peer: str) -> object:
        """A remembered request is being served: its records, and the reader of its response."""
        from egressd.engine.native_exchange import NativeExchange
        from egressd.engine.plain_http import audit_request

        state = self._served_state(meta, peer)
        request = meta.request
        audit_request(self.rt, state, meta.decision, None, request)
        self.rt.audit_connection(state, meta.admission, None)
        # whose redirect memory: the child's token, or (no credentials) this exchange's own, as the
        # Python path keys it by the connection
        client_key = state.client_key(f"native-{serial}")
        exchange = NativeExchange(self.rt, state, request, (meta.host, meta.port), client_key)
        self.states[serial] = state
        return exchange.feed

    def _closed(self, serial: int, bytes_up: int, bytes_down: int) -> None:
        state = self.states.pop(serial, None)
        if state is not None:
            state.bytes_up, state.bytes_down = bytes_up, bytes_down
            self.rt.audit_closed(state)

    def _timed_out(self, peer: str, timeout: float) -> None:
        self.rt.audit_header_timeout(ConnState(conn_id=self.rt.new_conn_id(), peer=peer), timeout)

    # -- life --------------------------------------------------------------------------------------
    def stop_listening(self) -> None:
        if not self.closed:
            self.tunnels.stop_listening()
        self.sock.close()

    def close(self) -> None:
        if self.closed:
            return
        self.stop_listening()
        self.closed = True
        self.rt.unwatch_decisions(self._changed)
        self.loop.remove_reader(self.tunnels.fileno())
        self.tunnels.close()
        self.rt.native_fronts.remove(self.tunnels)

    def stats(self) -> dict[str, Any]:
        return dict(self.tunnels.stats())


def listening_socket(host: str, port: int) -> socket.socket:
    """The proxy port's socket (what asyncio's create_server would make: reuse-address, backlog 4096)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(4096)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
