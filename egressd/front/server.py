"""egressd's front: the listeners every child connects to, on asyncio (uvloop).

A CONNECT's head is read here and admitted through the admission pipeline (the front does none of
its steps itself). An admitted tunnel is relayed by two small flow-controlled asyncio protocols after
the TLS SNI check, nothing recorded; a tunnel the pipeline marks for inspection is handed to the
embedded mitmproxy, already admitted, and its addons decide each request inside it through the same
pipeline. Absolute-form HTTP requests are served by `egressd.front.plain_http` (h11), never by
mitmproxy; an allowed WebSocket becomes the same relay after its 101.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, cast

from egressd.admission.pipeline import Admitted, Ask
from egressd.inspect.handoffs import Handoff, Handoffs
from egressd.policy import join_host_port
from egressd.refusal import Refusal
from egressd.wire.http1 import WireError, read_connect
from egressd.wire.http_head import head_problem, leading_empty_lines
from egressd.wire.sni import WAIT, TunnelStart

if TYPE_CHECKING:
    from egressd.admission.credentials import ProxyCredentials
    from egressd.admission.pipeline import Pipeline
    from egressd.admission.state import ConnState

logger = logging.getLogger(__name__)

# where the embedded mitmproxy listens for "http" or "socks" clients (started on first use)
MitmproxyAddress = Callable[[str], Awaitable[tuple[str, int]]]
HIGH_WATER = 1 << 20
# Read coalescing for streaming tunnels. A relay that reads each packet as it arrives (a TLS sender
# writes one 16 KiB record per send) wakes up, and wakes the far side, once per packet: on a busy
# machine those wake-ups, not the copying, are what a tunnel costs its endpoints. When a side keeps
# reading medium chunks (a burst: reads of COALESCE_MIN or more, less than COALESCE_WINDOW apart)
# it is streaming, and after forwarding what it read it stops reading for one timer tick, so the
# next read takes everything that arrived meanwhile. Bytes already read are never held back. No
# pause after a read of COALESCE_MAX or more (the relay is behind: it reads on), nor when the burst
# comes faster than COALESCE_RATE (the relay is busy moving bytes, not waiting for them: a tick
# would only starve the far side). EGRESSD_COALESCE=0 turns this off.
COALESCE = os.environ.get("EGRESSD_COALESCE", "1") != "0"
COALESCE_MIN = 16 * 1024
COALESCE_MAX = 128 * 1024
COALESCE_WINDOW = 0.002  # s
COALESCE_RATE = float(1 << 30)  # bytes/s
COALESCE_PAUSE = 0.001  # s: one tick of uvloop's millisecond timers


def render(refusal: Refusal) -> bytes:
    """A refusal as a complete HTTP/1.1 response (Connection: close)."""
    body = refusal.body().encode()
    reason = {
        400: "Bad Request",
        403: "Forbidden",
        407: "Proxy Authentication Required",
        408: "Request Timeout",
        429: "Too Many Requests",
        500: "Internal Server Error",
        502: "Bad Gateway",
        504: "Gateway Timeout",
    }.get(refusal.status, "Error")
    lines = [f"HTTP/1.1 {refusal.status} {reason}"]
    lines += [f"{name}: {value}" for name, value in refusal.headers()]
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class _Pipe(asyncio.Protocol):
    """One side of a relay: what it reads goes to the peer; back-pressure both ways."""

    def __init__(self, tunnel: Tunnel, upstream: bool, coalesce: bool = False) -> None:
        self.tunnel = tunnel
        self.upstream = upstream
        # only a lean tunnel's two sides: on the hand-off to the embedded mitmproxy the far side is
        # this very event loop, and a tick would only delay its own work
        self.coalesce = coalesce and COALESCE
        self.transport: asyncio.Transport | None = None
        self.peer: _Pipe | None = None
        self.held = False  # the peer's write buffer is full: not reading until it drains
        self.last_bulk = -1.0  # when this side last read COALESCE_MIN bytes or more
        self.burst_start = 0.0  # when the current burst of such reads began
        self.burst_bytes = 0  # read in it after its first read
        self.coalescing: asyncio.TimerHandle | None = None
        # what arrived before the peer was attached (a server that speaks first may answer the
        # connect before the CONNECT's 200 is written): handed over by attach()
        self.early = bytearray()
        # the embedded mitmproxy's answer to a hand-off's CONNECT: read here, not relayed
        self.answer: asyncio.Future[bytes] | None = None
        self.answer_buffer = bytearray()

    def attach(self, peer: _Pipe) -> None:
        """Pair this side with its peer and pass on what this side read before."""
        self.peer, peer.peer = peer, self
        if self.early and peer.transport is not None and not peer.transport.is_closing():
            peer.transport.write(bytes(self.early))
        self.early = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but speak the same interface
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=HIGH_WATER)

    def data_received(self, data: bytes) -> None:
        if self.answer is not None:
            data = self._read_answer(data)
            if not data:
                return
        n = len(data)
        now = time.monotonic()
        self.tunnel.count(self.upstream, n, now)
        peer = self.peer
        if peer is None:
            self.early += data
        elif peer.transport is not None and not peer.transport.is_closing():
            peer.transport.write(data)
        if n >= COALESCE_MIN and self.coalesce:
            if now - self.last_bulk >= COALESCE_WINDOW:
                self.burst_start, self.burst_bytes = now, 0  # a new burst
            else:
                self.burst_bytes += n
            self.last_bulk = now
            elapsed = now - self.burst_start
            if (
                self.burst_bytes
                and n < COALESCE_MAX
                and self.burst_bytes < COALESCE_RATE * elapsed
                and self.coalescing is None
                and self.transport is not None
            ):
                self.transport.pause_reading()
                self.coalescing = asyncio.get_running_loop().call_later(COALESCE_PAUSE, self._read_on)

    def _read_answer(self, data: bytes) -> bytes:
        """Collect one complete response (head and Content-Length body); the rest is returned."""
        assert self.answer is not None
        self.answer_buffer += data
        buffer = self.answer_buffer
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > 65536:
                self._settle_answer(ConnectionError("no response head from the inspection engine"))
            return b""
        length = 0
        for line in bytes(buffer[:end]).split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length" and value.strip().isdigit():
                length = int(value.strip())
        total = end + 4 + length
        if len(buffer) < total:
            return b""
        answer, rest = bytes(buffer[:total]), bytes(buffer[total:])
        self.answer_buffer = bytearray()
        self._settle_answer(answer)
        return rest

    def _settle_answer(self, outcome: bytes | BaseException) -> None:
        future, self.answer = self.answer, None
        if future is None or future.done():
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def _read_on(self) -> None:
        self.coalescing = None
        if not self.held and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def eof_received(self) -> bool:
        if self.peer is not None:
            self.peer.eof_received_from_peer()
        # a half-open tunnel is not kept: once both sides said EOF, or now if the peer cannot
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.answer is not None:
            self._settle_answer(ConnectionError("the inspection engine closed the connection"))
        if self.coalescing is not None:
            self.coalescing.cancel()
            self.coalescing = None
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.close()
        self.tunnel.closed()

    def eof_received_from_peer(self) -> None:
        if self.transport is not None and self.transport.can_write_eof():
            with contextlib.suppress(OSError):
                self.transport.write_eof()

    def pause_writing(self) -> None:
        peer = self.peer
        if peer is not None:
            peer.held = True
            if peer.transport is not None:
                peer.transport.pause_reading()

    def resume_writing(self) -> None:
        peer = self.peer
        if peer is not None:
            peer.held = False
            if peer.coalescing is None and peer.transport is not None:
                peer.transport.resume_reading()  # else its coalescing tick resumes it


class Tunnel:
    """Counts bytes for the closed record, and writes it once when the last side goes."""

    def __init__(self, front: FrontProtocol) -> None:
        self.front = front
        self.open_sides = 2
        self.last_active = time.monotonic()

    def count(self, upstream: bool, n: int, now: float) -> None:
        self.last_active = now
        state = self.front.state
        if state is None:
            return
        if upstream:
            state.bytes_down += n
        else:
            state.bytes_up += n

    def closed(self) -> None:
        self.open_sides -= 1
        if self.open_sides == 0:
            self.front.finish()


class FrontProtocol(_Pipe):
    """The client side: reads the request head, then becomes one side of a relay."""

    def __init__(
        self, front: FastFront, kind: str = "http", implicit: ProxyCredentials | None = None
    ) -> None:
        super().__init__(Tunnel(self), upstream=False)
        self.implicit = implicit  # the credentials a credential-free listener grants (ConnState.implicit)
        self.handed_off_as: str | None = None  # this client's address as the embedded mitmproxy sees it
        self.front = front
        self.kind = kind
        self.rt = front.rt
        self.buffer = bytearray()
        self.stage = "head"
        self.state: ConnState | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.server_id: str | None = None
        self.task: asyncio.Task[None] | None = None
        self.hello: TunnelStart | None = None  # the SNI check of the tunnel's first bytes
        self.finished = False
        self.eof_pending = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.rt.draining:
            transport.close()
            return
        self.front.clients.add(self)
        peer = transport.get_extra_info("peername") or ("?", 0)
        self.state = self.rt.open_conn(f"{peer[0]}:{peer[1]}", self.implicit)
        if self.kind != "http":
            self._hand_off(None)  # SOCKS5: mitmproxy's SOCKS5 layer (being moved into the front)
            return
        timeout = self.rt.policies.get().limits.header_timeout
        self.timer = asyncio.get_running_loop().call_later(timeout, self._head_timeout, timeout)

    def _head_timeout(self, timeout: float) -> None:
        if self.stage == "head" and self.transport is not None:
            if self.state is not None:
                self.rt.header_timeout(self.state, timeout)
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.stage == "relay":
            super().data_received(data)
            return
        self.buffer += data
        if self.stage == "sni":
            self._on_hello_bytes(data)
            return
        if self.stage == "handoff":
            # kept until mitmproxy is connected (uvloop may start reading after connection_made
            # even when it paused reading, so pausing alone does not hold the bytes back)
            assert self.transport is not None
            self.transport.pause_reading()
            return
        if self.stage == "head":
            self._on_head_bytes()

    def eof_received(self) -> bool:
        if self.stage == "relay":
            return super().eof_received()
        if self.stage == "handoff":
            self.eof_pending = True  # passed on once mitmproxy is connected
            return True
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if self.stage == "relay":
            super().connection_lost(exc)
        else:
            if self.peer is not None and self.peer.transport is not None:
                self.peer.transport.close()
            self.finish()

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        self.front.clients.discard(self)
        if self.handed_off_as is not None:
            self.front.handoffs.remove(self.handed_off_as)
        if self.server_id is not None:
            self.rt.disconnected(self.server_id)
        if self.state is not None:
            self.rt.close_conn(self.state)

    # -- the request head --------------------------------------------------------------------------
    def _on_head_bytes(self) -> None:
        del self.buffer[: leading_empty_lines(self.buffer)]  # RFC 9112 2.2, before telling CONNECT apart
        if not self.buffer[:8].upper().startswith(b"CONNECT "[: len(self.buffer[:8])]):
            self._serve_plain()  # plain HTTP: served by egressd.front.plain_http, never by mitmproxy
            return
        problem = head_problem(bytes(self.buffer))
        if problem is not None:
            self._refuse_unreadable(Refusal("bad_request", problem[1]))
            return
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        assert self.transport is not None
        if self.timer is not None:
            self.timer.cancel()  # header_timeout bounds the head; connect_timeout bounds the rest
            self.timer = None
        self.transport.pause_reading()
        head = bytes(self.buffer[: end + 4])
        del self.buffer[: end + 4]
        self.task = asyncio.get_running_loop().create_task(self._connect(head))

    async def _connect(self, head: bytes) -> None:
        try:
            await self._admit_and_open(head)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - fail closed
            self._refuse(self.rt.internal_error("front", exc))

    async def _admit_and_open(self, head: bytes) -> None:
        state = self.state
        assert state is not None
        try:
            connect = read_connect(head)
        except WireError as exc:
            self._refuse_unreadable(Refusal("bad_request", exc.detail))
            return
        ask = Ask(
            "connect",
            connect.host,
            connect.port,
            scheme="connect",
            method="CONNECT",
            credentials=connect.authorization,
        )
        admitted = await self.rt.admit(state, ask)
        if isinstance(admitted, Refusal):
            self._refuse(admitted)
            return
        if admitted.inspect:
            self._hand_off(admitted)
            return
        upstream = _Pipe(self.tunnel, upstream=True, coalesce=True)
        server_id = f"{state.conn_id}-up"
        refusal = await self.rt.connect(state, admitted, upstream, server_id)
        if refusal is not None:
            self._refuse(refusal)
            return
        self.server_id = server_id
        if self.transport is None or self.transport.is_closing():
            upstream.transport and upstream.transport.close()  # type: ignore[func-returns-value]
            return
        self.coalesce = COALESCE
        self.transport.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        upstream.attach(self)  # after the 200: a server's first bytes follow it
        self.stage = "sni"
        self.hello = TunnelStart(admitted.host)
        self.transport.resume_reading()
        if self.buffer:
            self._on_hello_bytes(bytes(self.buffer))

    # -- the TLS SNI check -------------------------------------------------------------------------
    def _on_hello_bytes(self, data: bytes) -> None:
        """The SNI check on the bytes just read (the buffer holds all read so far, to relay)."""
        assert self.hello is not None
        verdict = self.hello.feed(data)
        if verdict is WAIT:
            return
        if verdict is not None:
            self._close_tunnel(str(verdict))
            return
        self.stage = "relay"
        if self.timer is not None:
            self.timer.cancel()
        data, self.buffer = bytes(self.buffer), bytearray()
        super().data_received(data)

    def _close_tunnel(self, problem: str) -> None:
        state = self.state
        host, port = (state.host, state.port) if state else (None, None)
        self.rt.refused_early(state, host, port, "sni_mismatch", problem, stage="tls")
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()
        if self.transport is not None:
            self.transport.close()

    # -- answers -----------------------------------------------------------------------------------
    def _refuse(self, refusal: Refusal) -> None:
        state = self.state
        if refusal.host == "" and state is not None and state.host:
            refusal = Refusal(
                refusal.reason, refusal.detail, state.host, state.port, refusal.rule, refusal.retry_after
            )
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(render(refusal))
            self.transport.close()

    def _refuse_unreadable(self, refusal: Refusal) -> None:
        """A CONNECT head refused before any decision: recorded, as every unreadable head is."""
        self.rt.refused_early(self.state, None, None, refusal.reason, refusal.detail, stage="request")
        self._refuse(refusal)

    # -- inspection: the embedded mitmproxy --------------------------------------------------------
    def _hand_off(self, admitted: Admitted | None) -> None:
        """Relay this client to the embedded mitmproxy: a tunnel the pipeline admitted for
        inspection (mitmproxy's addons decide each request inside it), or a SOCKS5
        client whose requests mitmproxy reads."""
        assert self.transport is not None and self.state is not None
        self.transport.pause_reading()
        if admitted is not None:
            target = join_host_port(admitted.host, admitted.port)
            pending = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode()
        else:
            pending = bytes(self.buffer)
            self.buffer = bytearray()
        if self.timer is not None:
            self.timer.cancel()
        self.stage = "handoff"
        handoff = Handoff(self.state, admitted)
        self.task = asyncio.get_running_loop().create_task(self._open_mitmproxy(handoff, pending))

    async def _open_mitmproxy(self, handoff: Handoff, pending: bytes) -> None:
        loop = asyncio.get_running_loop()
        inner = _Pipe(self.tunnel, upstream=True)
        admitted = handoff.tunnel
        answered: asyncio.Future[bytes] | None = None
        if admitted is not None:
            answered = inner.answer = loop.create_future()  # mitmproxy's answer to the CONNECT
        try:
            address = await self.front.mitmproxy_address(self.kind)
            sock = await self._handed_off_socket(address, handoff)
            await loop.create_connection(lambda: inner, sock=sock)
            assert inner.transport is not None
            inner.transport.write(pending)
            if answered is not None:
                answer = await answered
        except Exception as exc:  # noqa: BLE001 - the client is closed, never let through
            logger.error("egressd could not hand a connection to mitmproxy: %r", exc)
            if self.transport is not None:
                if self.kind == "http" and not self.transport.is_closing():
                    self.transport.write(render(Refusal("internal_error", f"proxy engine: {exc}")))
                self.transport.close()
            if inner.transport is not None:
                inner.transport.close()
            return
        assert self.transport is not None
        if answered is not None and not answer.startswith(b"HTTP/1.1 200"):
            self.transport.write(answer)  # egressd's refusal, rendered by the addon (connect failed)
            self.transport.close()
            inner.transport.close()
            return
        if answered is not None:
            self.transport.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        inner.attach(self)
        pending = bytes(self.buffer)
        self.buffer = bytearray()
        self.stage = "relay"
        if pending:
            inner.transport.write(pending)
        if self.eof_pending:
            inner.eof_received_from_peer()
        if not self.transport.is_closing():
            self.transport.resume_reading()
        else:
            inner.transport.close()

    async def _handed_off_socket(self, address: tuple[str, int], handoff: Handoff) -> socket.socket:
        """A connection to mitmproxy from a local address registered first (inspect.handoffs):
        mitmproxy serves only connections it finds there."""
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.bind((address[0], 0))
            local = sock.getsockname()
            self.handed_off_as = f"{local[0]}:{local[1]}"
            self.front.handoffs.add(self.handed_off_as, handoff)
            await asyncio.get_running_loop().sock_connect(sock, address)
        except BaseException:
            sock.close()
            raise
        return sock

    # -- plain HTTP (egressd.front.plain_http) -------------------------------------------------------
    def _serve_plain(self) -> None:
        """Give the client to the plain-HTTP path (egressd.front.plain_http): it serves every request."""
        from egressd.front.plain_http import PlainClient  # it imports this module

        assert self.transport is not None
        if self.timer is not None:
            self.timer.cancel()  # the plain path keeps header_timeout and idle_timeout itself
        self.stage = "plain"
        client = PlainClient(self, bytes(self.buffer))
        self.buffer = bytearray()
        self.transport.set_protocol(client)
        client.start()


class FastFront:
    """egressd's listeners: the HTTP proxy port (CONNECT and absolute-form HTTP) and SOCKS5."""

    def __init__(self, pipeline: Pipeline, mitmproxy_address: MitmproxyAddress, handoffs: Handoffs) -> None:
        self.rt = pipeline
        self.mitmproxy_address = mitmproxy_address
        self.handoffs = handoffs
        self.servers: list[asyncio.Server] = []
        self.clients: set[FrontProtocol] = set()
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int, kind: str = "http") -> tuple[str, int]:
        """Listen for `kind` clients: "http" (the proxy port) or "socks" (relayed to mitmproxy)."""
        loop = asyncio.get_running_loop()
        if self._sweeper is None:
            self._sweeper = loop.create_task(self._sweep_idle())
        server = await loop.create_server(lambda: FrontProtocol(self, kind), host, port, backlog=4096)
        self.servers.append(server)
        address = server.sockets[0].getsockname()
        return address[0], address[1]

    async def serve(self, sock: socket.socket, kind: str, implicit: ProxyCredentials | None = None) -> None:
        """Also accept `kind` clients on a listening socket made elsewhere (EgressProxy.serve_socket)."""
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: FrontProtocol(self, kind, implicit=implicit), sock=sock)
        self.servers.append(server)

    async def _sweep_idle(self) -> None:
        """limits.idle_timeout for relayed tunnels: one sweep a second, not a timer per tunnel."""
        while True:
            await asyncio.sleep(1.0)
            cutoff = time.monotonic() - self.rt.policies.get().limits.idle_timeout
            for client in list(self.clients):
                idle = client.stage in ("relay", "sni") and client.tunnel.last_active < cutoff
                if idle and client.transport is not None:
                    client.transport.close()

    def close_listeners(self) -> None:
        for server in self.servers:
            server.close()

    def close(self) -> None:
        self.close_listeners()
        if self._sweeper is not None:
            self._sweeper.cancel()
