"""Moving bytes of an admitted connection: two flow-controlled asyncio protocols, one per side.

Nothing here parses client input or decides anything: the front admitted the connection through
the pipeline before a relay is attached, or (`join`) the connection is the child's own business.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import types
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from egressd.admission.state import ConnState

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


class RelayOwner(Protocol):
    """The client connection a relay belongs to: whose bytes it counts, told when both sides end."""

    state: ConnState | None

    def finish(self) -> None: ...


class Pipe(asyncio.Protocol):
    """One side of a relay: what it reads goes to the peer; back-pressure both ways."""

    def __init__(self, tunnel: Tunnel, upstream: bool, coalesce: bool = False) -> None:
        self.tunnel = tunnel
        self.upstream = upstream
        self.coalesce = coalesce and COALESCE
        self.transport: asyncio.Transport | None = None
        self.peer: Pipe | None = None
        self.held = False  # the peer's write buffer is full: not reading until it drains
        self.last_bulk = -1.0  # when this side last read COALESCE_MIN bytes or more
        self.burst_start = 0.0  # when the current burst of such reads began
        self.burst_bytes = 0  # read in it after its first read
        self.coalescing: asyncio.TimerHandle | None = None
        self.ended = False  # this side said EOF: it is being closed, nothing is left to read
        # what arrived before the peer was attached (a server that speaks first may answer the
        # connect before the CONNECT's 200 is written): handed over by attach(). Made when such
        # bytes come: nearly every side has none
        self.early: bytearray | None = None

    def attach(self, peer: Pipe) -> None:
        """Pair this side with its peer and pass on what this side read before."""
        self.peer, peer.peer = peer, self
        early, self.early = self.early, None
        if early and peer.transport is not None and not peer.transport.is_closing():
            peer.transport.write(bytes(early))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but speak the same interface
        # (said to the type checker without typing.cast: a Python call per side)
        self.transport = transport  # type: ignore[assignment]
        # the high-water mark by position: a keyword is parsed by uvloop at each call
        transport.set_write_buffer_limits(HIGH_WATER)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        n = len(data)
        now = time.monotonic()
        # the tunnel's bytes, counted for its closed record here, not by a method called per read
        tunnel = self.tunnel
        tunnel.last_active = now
        owner = tunnel.front
        state = owner.state if owner is not None else None
        if state is not None:
            if self.upstream:
                state.bytes_down += n
            else:
                state.bytes_up += n
        peer = self.peer
        if peer is None:
            if self.early is None:
                self.early = bytearray()
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

    def _read_on(self) -> None:
        self.coalescing = None
        if not self.held and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def eof_received(self) -> bool:
        self.ended = True
        peer = self.peer
        if peer is None:
            return False
        peer.eof_received_from_peer()
        # the front keeps no half-open tunnel (this side closes, and its close closes the peer);
        # a joined connection stays open for the peer's answer until the peer ends too
        return self.tunnel.half_open and not peer.ended

    def connection_lost(self, exc: Exception | None) -> None:
        if self.coalescing is not None:
            self.coalescing.cancel()
            self.coalescing = None
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.close()
        self.tunnel.closed()

    def eof_received_from_peer(self) -> None:
        """Pass the peer's EOF on: a FIN ahead of the close that follows, so that a far end with
        bytes still unread here reads an end, not a reset. Made once the events read with it are
        handled: a side that said EOF in the same batch (a client that closes as the server does,
        what nearly every short tunnel ends with) is closed instead, and its close sends the FIN; a
        shutdown first would be a system call, and uvloop's callback of it, for nothing."""
        if not self.ended:
            asyncio.get_running_loop().call_soon(self._pass_eof)

    def _pass_eof(self) -> None:
        # runs before the peer's connection_lost, which closes this side (call_soon keeps order);
        # a side already closing for another reason (the sweep, a revocation) is left to its close
        transport = self.transport
        if self.ended or transport is None or transport.is_closing():
            return
        if transport.can_write_eof():
            try:  # noqa: SIM105 - contextlib.suppress costs an object and three Python calls per tunnel
                transport.write_eof()
            except OSError:
                pass

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


class ClientSide(Pipe):
    """A client connection's side of a relay, which the fronts' protocols are: Pipe's methods with
    code objects of their own. The interpreter caches an attribute's place in the code that reads
    it, for one class: code shared by the client's side and the upstream's, which alternate on
    every tunnel, would miss that cache and take the generic lookup on most reads and writes."""


for _name, _method in vars(Pipe).items():
    if isinstance(_method, types.FunctionType):
        _copy = types.FunctionType(
            _method.__code__.replace(), _method.__globals__, _name, _method.__defaults__, _method.__closure__
        )
        _copy.__qualname__, _copy.__doc__ = f"ClientSide.{_name}", _method.__doc__
        setattr(ClientSide, _name, _copy)


class Tunnel:
    """What the two sides of a relay share: when a byte last passed (the sides count their bytes
    into the owner's state), and the closed record, written once when the last side goes."""

    def __init__(self, front: RelayOwner, half_open: bool = False) -> None:
        self.front: RelayOwner | None = front  # None once the connection finished (see FrontProtocol)
        self.half_open = half_open  # a side's EOF leaves the other direction open
        self.open_sides = 2
        self.last_active = time.monotonic()

    def closed(self) -> None:
        self.open_sides -= 1
        if self.open_sides == 0 and self.front is not None:
            self.front.finish()


class _Joined:
    """The owner of a relay no client connection of the front owns: it counts nothing, and wakes
    `join` when both sides are gone."""

    state: ConnState | None = None

    def __init__(self, ended: asyncio.Future[None]) -> None:
        self.ended = ended

    def finish(self) -> None:
        if not self.ended.done():
            self.ended.set_result(None)


async def join(accepted: socket.socket, connected: socket.socket) -> None:
    """Relay two connected sockets until both sides have ended, keeping half-closes (a client that
    ends its request with EOF still reads the answer): the capture's bridge joins a child's
    connection to a loopback server of the child's own, which nothing decides. Takes ownership of
    both sockets."""
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()
    tunnel = Tunnel(_Joined(ended), half_open=True)
    client, server = Pipe(tunnel, upstream=False), Pipe(tunnel, upstream=True)
    try:
        await loop.connect_accepted_socket(lambda: server, connected)
    except OSError:
        accepted.close()
        connected.close()
        return
    # what the client sends goes straight to the server, which is there; what the server said
    # before the client's side was made (a server that speaks first) is handed over by attach
    client.peer = server
    try:
        await loop.connect_accepted_socket(lambda: client, accepted)
    except OSError:
        accepted.close()
        if server.transport is not None:
            server.transport.close()
        return
    server.attach(client)
    for side, other in ((client, server), (server, client)):
        # a side that ended before the two were paired takes the other with it
        if (side.transport is None or side.transport.is_closing()) and other.transport is not None:
            other.transport.close()
    await ended
