"""A client connection to egressd's HTTP port: its CONNECT read, admitted through the pipeline,
answered and relayed; absolute-form HTTP is given to `egressd.front.plain_http`.

The tunnel is relayed (`egressd.front.relay`) after the TLS SNI check of the client's first bytes;
a tunnel the pipeline marks for inspection is handed to the embedded mitmproxy, already admitted
and pinned, on the client's own transport (`egressd.inspect.engine`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from egressd.admission.events import built_from
from egressd.admission.limits import overloaded
from egressd.admission.pipeline import Admitted, Attempt
from egressd.front.plain_http import REVOKED, IdleUpstreams, PlainClient
from egressd.front.refusal_page import RefusalPage, wants_page
from egressd.front.relay import COALESCE, ClientSide, Pipe, Tunnel
from egressd.inspect.inspected import InspectedTunnel
from egressd.platform.descriptors import out_of_descriptors
from egressd.policy.reasons import Reason
from egressd.policy.refusal import Refusal
from egressd.wire.http1 import WireError, read_connect, take_head
from egressd.wire.http_head import HeadScanner, leading_empty_lines
from egressd.wire.refusal import http_response
from egressd.wire.remembered import HeadMemory
from egressd.wire.sni import WAIT, TunnelStart

if TYPE_CHECKING:
    from egressd.admission.credentials import ProxyCredentials
    from egressd.admission.pipeline import Pipeline
    from egressd.admission.state import ConnState
    from egressd.inspect.engine import InspectionEngine
    from egressd.platform.diag import Diag

logger = logging.getLogger(__name__)

# the embedded mitmproxy, for the tunnels admitted for inspection (started on first use)
Inspection = Callable[[], Awaitable["InspectionEngine"]]
# the TLS server context egressd answers a refused host's HTTPS with (refusal_pages: tls)
RefusalContext = Callable[[str], Awaitable[ssl.SSLContext]]
# the gateway's health check: an origin-form request no proxy request can be, answered without
# credentials (it proxies nothing and tells nothing but that the gateway's loop serves)
HEALTH_REQUEST = b"GET /healthz HTTP/1."
HEALTH_ANSWER = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n"
)
# The CONNECT heads read, with the attempt read from them (egressd.wire.remembered): the same head
# again is that attempt without a reading, and a connection's first read that is exactly such a head
# is that attempt without a look at it. Every head the guard passed and read_connect read is kept;
# a refused head is read each time.
_read_connects: HeadMemory[Attempt] = HeadMemory()


class Listeners(Protocol):
    """What a client connection needs of the listeners that accepted it."""

    pipeline: Pipeline
    inspection: Inspection
    refusal_context: RefusalContext | None
    clients: set[FrontProtocol]
    health: bool
    upstreams: IdleUpstreams  # plain HTTP's kept-alive upstream connections


class FrontProtocol(ClientSide):
    """The client side: reads the request head, then becomes one side of a relay.

    Its methods call ClientSide's by name, not through super(): each super() call looks the
    method up along the class's MRO, several times per tunnel."""

    early_stage = "connect"  # the stage of a refusal made before the head is read
    # the established answer names egressd's end towards the server (SOCKS5's reply does; looking it
    # up spells an address, so a protocol whose answer does not name it skips it)
    names_bound = False

    def __init__(
        self,
        front: Listeners,
        implicit: ProxyCredentials | None = None,
        tree_only: bool = False,
        diag: Diag | None = None,
        local: tuple[str, int] | None = None,
    ) -> None:
        ClientSide.__init__(self, Tunnel(self), False)
        # the local end of every connection its listener accepts (listener_end), else asked per connection
        self.local = local
        self.implicit = implicit  # the credentials a credential-free listener grants (ConnState.implicit)
        self.tree_only = tree_only  # ... to the child's process tree only (ConnState.tree_only)
        self.diag = diag  # the listener is in another network namespace: its sockets are asked there
        self.front = front
        self.pipeline = front.pipeline
        self.buffer = bytearray()
        self.stage = "head"
        self.state: ConnState | None = None
        self.server_id: str | None = None
        self.task: asyncio.Task[None] | None = None
        self.hello: TunnelStart | None = None  # the SNI check of the tunnel's first bytes
        self.plain: PlainClient | None = None  # the plain-HTTP path serving this connection
        # the CONNECT head read so far: a head sent a byte at a time costs its length, not its square
        self.head_scanner: HeadScanner | None = None
        self.finished = False
        self.eof_pending = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        ClientSide.connection_made(self, transport)
        if self.pipeline.draining:
            transport.close()
            return
        self.front.clients.add(self)
        peer = transport.get_extra_info("peername") or ("?", 0)
        self.state = self.pipeline.open_conn(
            f"{peer[0]}:{peer[1]}",
            self.implicit,
            ends=self._ends(peer, transport),
            tree_only=self.tree_only,
            diag=self.diag,
        )
        if self.state.room == "answer_now":  # far beyond capacity: not even its head is waited for
            self._overloaded_now()

    def _ends(
        self, peer: tuple[str, int], transport: asyncio.BaseTransport
    ) -> tuple[tuple[str, int], tuple[str, int]] | None:
        """The client's socket's own two ends (its local address, then its peer's): our peer, and
        our local address (the listener's, when it listens on one address: not spelled again per
        connection, as uvloop spells a transport's with inet_ntop on each look)."""
        local = self.local or transport.get_extra_info("sockname")
        return ((peer[0], peer[1]), (local[0], local[1])) if local and peer[0] != "?" else None

    def _overloaded_now(self) -> None:
        """503 `overloaded` before the request is read (recorded), and closed."""
        assert self.state is not None and self.transport is not None
        refusal = overloaded()
        self.pipeline.refused_early(
            self.state, None, None, refusal.reason, refusal.detail, stage=self.early_stage
        )
        self.stage = "done"
        self._answer_overloaded_now(refusal)
        self.transport.close()

    def _answer_overloaded_now(self, refusal: Refusal) -> None:
        assert self.transport is not None
        self.transport.write(http_response(refusal))

    def close_idle(self) -> None:
        """limits.idle_timeout passed without a byte either way (the front's sweep)."""
        if self.transport is not None:
            self.transport.close()

    def revoke(self) -> None:
        """Its credentials were revoked (a gateway client removed from the token file): a tunnel
        not answered yet gets the 407 it would get now, never a close without an answer; an open
        tunnel ends. A SOCKS5 client between its authentication and its request is refused when
        the request comes (admit checks the credentials again)."""
        if self.stage == "admit":
            if self.task is not None and not self.task.done():
                self.task.cancel()
            self._refuse(REVOKED)
        elif self.stage == "plain" and self.plain is not None:
            self.plain.revoke()
        elif self.stage != "head" and self.transport is not None:
            self.transport.close()

    def head_timed_out(self, timeout: float) -> None:
        """limits.header_timeout passed before the request head (or SOCKS5 request) was complete:
        the front's sweep calls this, once a second, instead of a timer per connection."""
        if self.stage == "head" and self.transport is not None:
            if self.state is not None:
                self.pipeline.header_timeout(self.state, timeout)
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.stage == "relay":
            ClientSide.data_received(self, data)
            return
        if self.stage == "sni":
            self._on_hello_bytes(data)
            return
        if self.stage == "head":
            self._on_head_bytes(data)
            return
        self.buffer += data
        if self.stage == "handoff":
            # kept until mitmproxy takes the transport (uvloop may start reading after
            # connection_made even when it paused reading, so pausing alone does not hold them back)
            assert self.transport is not None
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        if self.stage == "relay":
            return ClientSide.eof_received(self)
        if self.stage == "handoff":
            self.eof_pending = True  # passed on with the transport
            return True
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if self.stage == "relay":
            ClientSide.connection_lost(self, exc)
        else:
            if self.peer is not None and self.peer.transport is not None:
                self.peer.transport.close()
            self.finish()

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        self.front.clients.discard(self)
        if self.server_id is not None:
            self.pipeline.disconnected(self.server_id)
        if self.state is not None:
            self.pipeline.close_conn(self.state)
        self._unlink()

    def _unlink(self) -> None:
        """Let go of what points back here (the tunnel, the far side): a finished connection's
        objects are then freed at once, not on the cyclic garbage collector's next pass (a walk over
        every live object, which a busy front would pay for again and again)."""
        peer, self.peer = self.peer, None
        if peer is not None:
            peer.peer = None
        self.tunnel.front = None

    # -- the request head --------------------------------------------------------------------------
    def _on_head_bytes(self, data: bytes) -> None:
        """The bytes of the last read (`data`) of the request head, after those read before it (kept
        in the buffer, as these are unless they answer at once)."""
        # a whole CONNECT head read before, with nothing before it: what reading it answered
        if not self.buffer and (attempt := _read_connects.get(data)) is not None:
            self._start_tunnel(attempt)
            return
        self.buffer += data
        del self.buffer[: leading_empty_lines(self.buffer)]  # RFC 9112 2.2, before telling CONNECT apart
        if self.buffer == b"\r":  # the first half of another empty line: nothing told yet
            return
        if self.front.health and self._health_check():
            return
        if not self.buffer[:8].upper().startswith(b"CONNECT "[: len(self.buffer[:8])]):
            self._serve_plain()  # plain HTTP: served by egressd.front.plain_http, never by mitmproxy
            return
        if self.head_scanner is None:
            self.head_scanner = HeadScanner()
        try:
            head = take_head(self.buffer, self.head_scanner)  # each new byte looked at, not all again
            if head is None:
                return
            self.head_scanner = None
            attempt = _read_connects.get(head)
            if attempt is None:
                attempt = _connect_attempt(head)
        except WireError as exc:
            self._refuse_unreadable(Refusal(Reason.BAD_REQUEST, exc.detail))
            return
        self._start_tunnel(attempt)

    def _health_check(self) -> bool:
        """`GET /healthz` (the gateway's): answered 200 "ok" and closed. True while the bytes so far
        may still be one (wait for more), or once it was answered."""
        seen = bytes(self.buffer[: len(HEALTH_REQUEST)])
        if not HEALTH_REQUEST.startswith(seen):
            return False
        if len(seen) < len(HEALTH_REQUEST):
            return True
        assert self.transport is not None
        self.stage = "done"
        self.transport.write(HEALTH_ANSWER)
        self.transport.close()
        return True

    def _start_tunnel(self, attempt: Attempt) -> None:
        """Admit and open the tunnel whose request was read (CONNECT or SOCKS5): reading paused
        until it is open, header_timeout over with the stage (connect_timeout bounds the rest)."""
        assert self.transport is not None
        self.stage = "admit"  # bytes read meanwhile stay in the buffer
        self.transport.pause_reading()
        self.task = asyncio.get_running_loop().create_task(self._open_tunnel(attempt))

    async def _open_tunnel(self, attempt: Attempt) -> None:
        """Admit a tunnel (CONNECT or SOCKS5) and open it: relayed here, or handed to mitmproxy to
        inspect. Only the answers differ between the protocols (established_answer, refusal_answer).
        A bug refuses (fail closed), caught here rather than by a wrapping coroutine: one frame
        less for every tunnel to build and to resume through."""
        try:
            state = self.state
            assert state is not None
            admitted = await self.pipeline.admit(state, attempt)
            if isinstance(admitted, Refusal):
                if self._page_inside_tls(admitted, attempt):
                    await self._refuse_inside_tls(admitted)
                else:
                    self._refuse(admitted)
                return
            if admitted.inspect:
                await self._hand_off(admitted)
                return
            upstream = Pipe(self.tunnel, True, True)  # upstream, coalescing: by position, per tunnel
            server_id = f"{state.conn_id}-up"
            refusal = await self.pipeline.connect(state, admitted, upstream, server_id)
            if refusal is not None:
                self._refuse(refusal)
                return
            self.server_id = server_id
            if self.transport is None or self.transport.is_closing():
                upstream.transport and upstream.transport.close()  # type: ignore[func-returns-value]
                return
            self.coalesce = COALESCE
            self.transport.write(self.established_answer(_bound(upstream) if self.names_bound else None))
            upstream.attach(self)  # after the answer: a server's first bytes follow it
            self.stage = "sni"
            self.hello = TunnelStart(admitted.host)
            self.transport.resume_reading()
            if self.buffer:  # read while it was admitted
                read, self.buffer = bytes(self.buffer), bytearray()
                self._on_hello_bytes(read)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - fail closed
            self._refuse(self.pipeline.internal_error("front", exc))

    # -- the TLS SNI check -------------------------------------------------------------------------
    def _on_hello_bytes(self, data: bytes) -> None:
        """The SNI check on the bytes just read; the buffer holds those read before them, kept to
        relay (a tunnel's first read, which most often answers the check, is relayed as read)."""
        assert self.hello is not None
        verdict = self.hello.feed(data)
        if verdict is WAIT:
            self.buffer += data
            return
        if verdict is not None:
            self._close_tunnel(str(verdict))
            return
        self.stage = "relay"
        if self.buffer:
            data, self.buffer = bytes(self.buffer + data), bytearray()
        ClientSide.data_received(self, data)

    def _close_tunnel(self, problem: str) -> None:
        state = self.state
        host, port = (state.host, state.port) if state else (None, None)
        self.pipeline.refused_early(state, host, port, Reason.SNI_MISMATCH, problem, stage="tls")
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()
        if self.transport is not None:
            self.transport.close()

    # -- answers -----------------------------------------------------------------------------------
    def _refuse(self, refusal: Refusal) -> None:
        state = self.state
        if refusal.host == "" and state is not None and state.host:
            refusal = dataclasses.replace(refusal, host=state.host, port=state.port)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(self.refusal_answer(refusal))
            self.transport.close()

    def established_answer(self, bound: tuple[str, int] | None) -> bytes:
        """What tells the client its tunnel is open (`bound`: egressd's end towards the server)."""
        return b"HTTP/1.1 200 Connection established\r\n\r\n"

    def refusal_answer(self, refusal: Refusal) -> bytes:
        """What tells the client it is refused, in its protocol (it is closed after)."""
        return http_response(refusal)

    def _page_inside_tls(self, refusal: Refusal, attempt: Attempt) -> bool:
        """A refused HTTPS CONNECT whose client sent nothing after its head yet, answered inside TLS
        where the policy and inspection allow it (_pages_inside_tls)."""
        return not self.buffer and self._pages_inside_tls(refusal, attempt)

    def _pages_inside_tls(self, refusal: Refusal, attempt: Attempt) -> bool:
        """refusal_pages: tls, with inspection on (the child trusts egressd's CA), for a refusal of
        a tunnel to port 443 (refusal_page.wants_page)."""
        return (
            self.front.refusal_context is not None
            and self.pipeline.inspection
            and bool(refusal.host)
            and self.pipeline.policies.get().refusal_pages == "tls"
            and wants_page(refusal, attempt.stage, attempt.port)
        )

    async def _refuse_inside_tls(self, refusal: Refusal) -> None:
        """200, then TLS as the refused host, then the refusal as the answer to the first request
        (egressd.front.refusal_page). Nothing is resolved or connected: the pipeline refused."""
        transport = self.transport
        assert transport is not None and self.front.refusal_context is not None
        try:
            context = await self.front.refusal_context(refusal.host)
        except Exception as exc:  # noqa: BLE001 - the plain refusal still tells the client
            logger.error("egressd could not make a TLS refusal page for %s: %r", refusal.host, exc)
            self._refuse(refusal)
            return
        if transport.is_closing():
            return
        timeout = self.pipeline.policies.get().limits.header_timeout
        self.stage = "page"
        transport.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        page = RefusalPage(self, refusal, timeout)
        try:
            tls = await asyncio.wait_for(
                asyncio.get_running_loop().start_tls(transport, page, context, server_side=True), timeout
            )
        except Exception:  # noqa: BLE001 - not TLS, an untrusted CA, a timeout: the client is closed
            transport.close()
            self.finish()
            return
        page.attach(tls)

    def _refuse_unreadable(self, refusal: Refusal) -> None:
        """A CONNECT head refused before any decision: recorded, as every unreadable head is."""
        self.pipeline.refused_early(self.state, None, None, refusal.reason, refusal.detail, stage="request")
        self._refuse(refusal)

    # -- inspection: the embedded mitmproxy --------------------------------------------------------
    async def _hand_off(self, admitted: Admitted) -> None:
        """Hand a tunnel the pipeline admitted for inspection (CONNECT or SOCKS5) to the embedded
        mitmproxy, on this client's own transport: its addons decide each request inside it, and
        its first layer opens the upstream connection and answers the client in its protocol
        (established_answer, refusal_answer). Reading stays paused until mitmproxy has the transport."""
        assert self.transport is not None and self.state is not None
        self.stage = "handoff"
        self.transport.pause_reading()
        try:
            engine = await self.front.inspection()
        except Exception as exc:  # noqa: BLE001 - the client is refused, never let through
            if out_of_descriptors(exc):  # no descriptor left to start mitmproxy
                refusal = overloaded(admitted.host, admitted.port)
            else:
                logger.error("egressd could not start its inspection engine: %r", exc)
                refusal = Refusal(Reason.INTERNAL_ERROR, f"proxy engine: {exc}", admitted.host, admitted.port)
            self._refuse(refusal)
            return
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self.stage = "inspect"
        read, self.buffer = bytes(self.buffer), bytearray()
        engine.serve(InspectedTunnel(self.state, admitted, self), transport, read, self.eof_pending)

    # -- plain HTTP (egressd.front.plain_http) -------------------------------------------------------
    def _serve_plain(self) -> None:
        """Give the client to the plain-HTTP path (egressd.front.plain_http): it serves every request."""
        assert self.transport is not None
        self.stage = "plain"  # the front's sweep asks the plain path for its timeouts
        client = self.plain = PlainClient(self, bytes(self.buffer), self.front.upstreams)
        self.buffer = bytearray()
        self.transport.set_protocol(client)
        client.start()


def _connect_attempt(head: bytes) -> Attempt:
    """The attempt a complete, guarded CONNECT head asks for (remembered in _read_connects when it
    is short). Raises WireError, and nothing is remembered, for a head to refuse."""
    connect = read_connect(head)
    # every field by position: stage, host, port, scheme, method, path, credentials, headers
    attempt = built_from(
        Attempt,
        ("connect", connect.host, connect.port, "connect", "CONNECT", None, connect.authorization, None),
    )
    return _read_connects.keep(head, attempt)


def listener_end(sock: socket.socket) -> tuple[str, int] | None:
    """The local end every connection accepted on a listening socket has: the address it is bound
    to, unless that is every address (0.0.0.0, ::) or not an IP socket's (then each connection's
    own is asked)."""
    try:
        name = sock.getsockname()
    except OSError:
        return None
    if not isinstance(name, tuple) or len(name) < 2 or not isinstance(name[0], str):
        return None
    try:
        if ipaddress.ip_address(name[0].partition("%")[0]).is_unspecified:
            return None
    except ValueError:
        return None
    return name[0], name[1]


def _bound(upstream: Pipe) -> tuple[str, int] | None:
    """egressd's end of an upstream connection (a SOCKS5 reply names it)."""
    bound = upstream.transport.get_extra_info("sockname") if upstream.transport is not None else None
    return (str(bound[0]), int(bound[1])) if isinstance(bound, tuple) and len(bound) >= 2 else None
