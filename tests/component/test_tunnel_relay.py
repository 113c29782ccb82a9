"""The relay of an admitted tunnel: every byte in order both ways, read coalescing, back-pressure.

The relay pauses a streaming side for one timer tick so the next read takes a batch (fewer wake-ups
for both ends of the tunnel). These tests hold it to what a relay must never do: lose, reorder or
delay bytes it has read, stall an interactive exchange after a bulk phase, or keep reading while the
far side cannot take more.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import socket
import threading
import time

import pytest

from egressd.admission.credentials import ProxyCredentials
from egressd.front import relay
from egressd.front.server import Front
from egressd.session.proxy import ProxyServer
from tests.support.loops import ON_EVERY_LOOP
from tests.support.upstreams import TcpEchoServer

RECORD = 16 * 1024 + 21  # a TLS record with its header and tag: the chunk a TLS sender writes


def _tunnel(proxy: ProxyServer, tcp_echo: TcpEchoServer) -> socket.socket:
    """A tunnel to the echo server, with a fresh child's credentials."""
    return _tunnel_with(proxy, tcp_echo, proxy.issue_credentials())


def _tunnel_with(proxy: ProxyServer, tcp_echo: TcpEchoServer, creds: ProxyCredentials) -> socket.socket:
    auth = base64.b64encode(f"{creds.username}:{creds.token}".encode()).decode()
    host, port = tcp_echo.address
    sock = socket.create_connection(proxy.http_address, timeout=30)
    sock.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nProxy-Authorization: Basic {auth}\r\n\r\n".encode())
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        byte = sock.recv(1)
        assert byte, "proxy closed during CONNECT"
        head += byte
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def _read_exactly(sock: socket.socket, n: int, digest: hashlib._Hash) -> None:
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    while n > 0:
        got = sock.recv_into(view, min(len(buf), n))
        assert got, f"tunnel closed with {n} bytes still due"
        digest.update(view[:got])
        n -= got


def _ping_pong(sock: socket.socket, rounds: int) -> None:
    """Small request/response exchanges: each answer must come without more bytes being sent."""
    for i in range(rounds):
        message = f"ping {i}\n".encode()
        sock.sendall(message)
        got = b""
        while len(got) < len(message):
            chunk = sock.recv(len(message) - len(got))
            assert chunk, "tunnel closed during ping-pong"
            got += chunk
        assert got == message


def test_a_streamed_tunnel_keeps_every_byte_in_order_and_stays_interactive(
    echo_engine: ProxyServer, tcp_echo: TcpEchoServer
) -> None:
    """Full duplex through the echo upstream: TLS-record-sized writes up, echoes down, hashed."""
    total = 24 << 20
    payload = os.urandom(RECORD * 64)
    sent, received = hashlib.sha256(), hashlib.sha256()
    with _tunnel(echo_engine, tcp_echo) as sock:
        _ping_pong(sock, 3)
        reader = threading.Thread(target=_read_exactly, args=(sock, total, received))
        reader.start()
        remaining = total
        offset = 0
        while remaining:
            n = min(RECORD, remaining)
            chunk = payload[offset : offset + n]
            sock.sendall(chunk)
            sent.update(chunk)
            remaining -= n
            offset = (offset + n) % (len(payload) - RECORD)
        reader.join(timeout=120)
        assert not reader.is_alive(), "the echoed stream did not come back whole"
        assert received.hexdigest() == sent.hexdigest()
        # after the bulk phase: small exchanges are answered, nothing is held for a next batch
        _ping_pong(sock, 50)


def test_only_relayed_tunnels_coalesce_an_inspected_one_has_no_relay(
    inspecting_engine: ProxyServer, tcp_echo: TcpEchoServer, inspected_echo: TcpEchoServer
) -> None:
    """An inspected tunnel has no relay to tick: the embedded mitmproxy reads the client's own
    transport, in this loop. The relayed tunnel's two sides coalesce."""
    from egressd.front.relay import Pipe

    front = inspecting_engine._front
    assert front is not None
    with _tunnel(inspecting_engine, tcp_echo) as relayed, _tunnel(inspecting_engine, inspected_echo):
        _ping_pong(relayed, 1)
        pairs = [(client, client.peer) for client in front.clients]
        assert len(pairs) == 2
        by_path = {client.server_id is not None: (client, peer) for client, peer in pairs}
        assert by_path[True][0].coalesce and by_path[True][1].coalesce  # type: ignore[union-attr]
        inspected, peer = by_path[False]
        assert peer is None and inspected.stage == "inspect"
        assert inspected.transport is not None
        assert not isinstance(inspected.transport.get_protocol(), Pipe)


@pytest.mark.parametrize("uvloop_on", ["1", "0"])
def test_relayed_sockets_have_nagle_off(
    tcp_echo: TcpEchoServer, monkeypatch: pytest.MonkeyPatch, uvloop_on: str
) -> None:
    """Small heads and answers go out at once: both event loops set TCP_NODELAY on every TCP
    transport, accepted (the client side) or connected (the pinned upstream), so the front does
    not set it again."""
    from egressd.policy import parse_policy
    from egressd.session.proxy import ProxyServer

    monkeypatch.setenv("EGRESSD_UVLOOP", uvloop_on)
    host, port = tcp_echo.address
    policy = parse_policy({"version": 1, "mode": "enforce", "allow": [f"{host}:{port}"]}, "test")
    engine = ProxyServer(policy)
    engine.start()
    try:
        assert engine.pipeline is not None  # waits for the load, which makes the front
        front = engine._front
        assert front is not None
        with _tunnel(engine, tcp_echo) as sock:
            _ping_pong(sock, 1)
            (client,) = front.clients
            for side in (client, client.peer):
                assert side is not None and side.transport is not None
                assert ("uvloop" in type(side.transport).__module__) == (uvloop_on == "1")
                raw = side.transport.get_extra_info("socket")
                assert raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        engine.stop()


def _buffered(front: Front) -> int:
    """The most bytes any relay transport of the front holds in its write buffer right now."""
    most = 0
    for client in list(front.clients):
        for side in (client, client.peer):
            transport = side.transport if side is not None else None
            if transport is not None and not transport.is_closing():
                most = max(most, transport.get_write_buffer_size())
    return most


@pytest.mark.parametrize("chunk", [RECORD, 256 * 1024])
def test_a_side_that_does_not_read_stops_the_relay_from_reading(
    echo_engine: ProxyServer, tcp_echo: TcpEchoServer, chunk: int
) -> None:
    """The client sends and does not read the echoes: the echo server blocks, then the relay must stop
    reading (its buffers stay near the high-water mark, coalescing ticks or not) and the client stall."""
    front = echo_engine._front
    assert front is not None
    payload = os.urandom(chunk)
    sent = hashlib.sha256()
    total = 0
    most = 0
    with _tunnel(echo_engine, tcp_echo) as sock:
        sock.setblocking(False)
        stalled_since = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                n = sock.send(payload)
            except BlockingIOError:
                n = 0
            if n:
                sent.update(payload[:n])
                total += n
                stalled_since = None
            else:
                stalled_since = stalled_since or time.monotonic()
                if time.monotonic() - stalled_since > 1.0:  # > many coalescing ticks
                    break
                time.sleep(0.005)
            most = max(most, _buffered(front))
        assert stalled_since is not None, f"the client never stalled after {total >> 20} MiB"
        # kernel socket buffers on four hops and the relay's two write buffers: tens of MiB, not more
        assert total < 160 << 20, f"{total >> 20} MiB went in while nothing came out"
        assert most <= relay.HIGH_WATER + 2 * 256 * 1024, f"a relay buffered {most} bytes"
        sock.setblocking(True)
        received = hashlib.sha256()
        _read_exactly(sock, total, received)
        assert received.hexdigest() == sent.hexdigest()


# -- the coalescing state machine on real sockets ------------------------------------------------
class _Front:
    """What a Tunnel asks of its front: the connection record (none here) and the end."""

    state = None

    def __init__(self) -> None:
        self.finished = asyncio.Event()

    def finish(self) -> None:
        self.finished.set()


def _relay_pipes(tunnel: relay.Tunnel) -> tuple[relay.Pipe, relay.Pipe]:
    """The two sides of a relayed tunnel (client, upstream), as FrontProtocol sets them up."""
    return relay.Pipe(tunnel, False, coalesce=True), relay.Pipe(tunnel, True, coalesce=True)


async def _recv_for(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, seconds: float, want: int | None = None
) -> bytes:
    """What arrives within `seconds` (sooner once `want` bytes are in)."""
    got = b""
    end = loop.time() + seconds
    while (left := end - loop.time()) > 0 and (want is None or len(got) < want):
        try:
            got += await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), left)
        except TimeoutError:
            break
    return got


async def _coalescing_on_real_sockets() -> None:
    loop = asyncio.get_running_loop()
    front = _Front()
    tunnel = relay.Tunnel(front)  # type: ignore[arg-type]
    a_pipe, b_pipe = _relay_pipes(tunnel)
    a, a_far = socket.socketpair()
    b, b_far = socket.socketpair()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 * 1024)  # b's buffer fills sooner
    for s in (a_far, b_far):
        s.setblocking(False)
    await loop.connect_accepted_socket(lambda: a_pipe, a)
    await loop.connect_accepted_socket(lambda: b_pipe, b)
    a_pipe.peer, b_pipe.peer = b_pipe, a_pipe
    a_transport, b_transport = a_pipe.transport, b_pipe.transport
    assert a_transport is not None and b_transport is not None

    # one medium read: forwarded, and the side reads on (no stream seen yet)
    first = os.urandom(20_000)
    a_far.send(first)
    assert await _recv_for(loop, b_far, 5, len(first)) == first
    assert a_transport.is_reading() and a_pipe.coalescing is None

    # a second medium read within the window: forwarded at once, then one tick without reading
    second = os.urandom(20_000)
    a_far.send(second)
    assert await _recv_for(loop, b_far, 5, len(second)) == second, "bytes already read were held back"
    assert not a_transport.is_reading() and a_pipe.coalescing is not None
    batch = os.urandom(60_000)
    a_far.send(batch)
    assert await _recv_for(loop, b_far, 0.3) == b"", "read during the coalescing tick"
    assert await _recv_for(loop, b_far, 5, len(batch)) == batch  # after the tick, the batch in one go
    assert a_transport.is_reading() or a_pipe.coalescing is not None

    # back-pressure wins over the tick: b's buffer is full, so a must not read when its tick ends
    while a_pipe.coalescing is not None:
        await asyncio.sleep(0.05)
    relay.COALESCE_PAUSE = 0.1  # short ticks from here: many of them end while a is held
    b_transport.set_write_buffer_limits(high=64 * 1024)
    pushed = bytearray()
    while not a_pipe.held:  # medium chunks, one per tick: the read that fills b starts a tick too
        chunk = os.urandom(20_000)
        pushed += chunk[: a_far.send(chunk)]
        for _ in range(15):
            await asyncio.sleep(0.01)
            if a_pipe.held:
                break
    assert not a_transport.is_reading() and a_pipe.coalescing is not None
    for _ in range(8):  # more waiting for a to read, and several ticks: none may resume a held side
        chunk = os.urandom(30_000)
        with contextlib.suppress(BlockingIOError):
            pushed += chunk[: a_far.send(chunk)]
    held_at = b_transport.get_write_buffer_size()
    await asyncio.sleep(0.6)
    assert a_pipe.held and not a_transport.is_reading()
    assert b_transport.get_write_buffer_size() == held_at, "a held side read on"
    drained = await _recv_for(loop, b_far, 10, len(pushed))  # b drains: a reads again, every byte arrives
    assert drained == bytes(pushed)
    assert not a_pipe.held
    while a_pipe.coalescing is not None:
        await asyncio.sleep(0.05)
    assert a_transport.is_reading()

    a_transport.close()
    await asyncio.wait_for(front.finished.wait(), 5)
    assert a_pipe.coalescing is None and b_transport.is_closing()
    for s in (a_far, b_far):
        s.close()


@ON_EVERY_LOOP
async def test_coalescing_pauses_only_after_forwarding_and_never_overrides_back_pressure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a wide window and a long tick make each state observable on a busy machine
    monkeypatch.setattr(relay, "COALESCE", True)
    monkeypatch.setattr(relay, "COALESCE_WINDOW", 30.0)
    monkeypatch.setattr(relay, "COALESCE_PAUSE", 1.5)
    await _coalescing_on_real_sockets()


@ON_EVERY_LOOP
@pytest.mark.parametrize("setting", ["EGRESSD_COALESCE=0", "burst faster than COALESCE_RATE"])
async def test_without_coalescing_every_chunk_is_read_at_once(
    monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    monkeypatch.setattr(relay, "COALESCE_WINDOW", 30.0)
    if setting == "EGRESSD_COALESCE=0":
        monkeypatch.setattr(relay, "COALESCE", False)
    else:  # any burst is "fast" against 1 byte/s: the relay is busy, a tick would starve the far side
        monkeypatch.setattr(relay, "COALESCE", True)
        monkeypatch.setattr(relay, "COALESCE_RATE", 1.0)

    loop = asyncio.get_running_loop()
    tunnel = relay.Tunnel(_Front())  # type: ignore[arg-type]
    a_pipe, b_pipe = _relay_pipes(tunnel)
    a, a_far = socket.socketpair()
    b, b_far = socket.socketpair()
    b_far.setblocking(False)
    await loop.connect_accepted_socket(lambda: a_pipe, a)
    await loop.connect_accepted_socket(lambda: b_pipe, b)
    a_pipe.peer, b_pipe.peer = b_pipe, a_pipe
    for _ in range(5):
        data = os.urandom(20_000)
        a_far.send(data)
        assert await _recv_for(loop, b_far, 5, len(data)) == data
        assert a_pipe.coalescing is None and a_pipe.transport is not None
        assert a_pipe.transport.is_reading()
    for s in (a_far, b_far):
        s.close()
    assert a_pipe.transport is not None
    a_pipe.transport.close()


class _CountedEofs:
    """A side's transport, with the half-closes (write_eof: a shutdown system call) it is asked for
    counted, and those asked for once it was closing (too late to put a FIN ahead of the close)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.write_eofs = 0
        self.late = 0

    def write_eof(self) -> None:
        self.write_eofs += 1
        self.late += self.transport.is_closing()
        self.transport.write_eof()

    def __getattr__(self, name: str) -> object:
        return getattr(self.transport, name)


async def _relayed_pair() -> tuple[_Front, relay.Pipe, relay.Pipe, socket.socket, socket.socket]:
    """Two relay sides on socketpairs, paired, with their far ends (non-blocking) and counted EOFs."""
    loop = asyncio.get_running_loop()
    front = _Front()
    a_pipe, b_pipe = _relay_pipes(relay.Tunnel(front))  # type: ignore[arg-type]
    a, a_far = socket.socketpair()
    b, b_far = socket.socketpair()
    for s in (a_far, b_far):
        s.setblocking(False)
    await loop.connect_accepted_socket(lambda: a_pipe, a)
    await loop.connect_accepted_socket(lambda: b_pipe, b)
    a_pipe.attach(b_pipe)
    for pipe in (a_pipe, b_pipe):
        assert pipe.transport is not None
        pipe.transport = _CountedEofs(pipe.transport)  # type: ignore[assignment]
    return front, a_pipe, b_pipe, a_far, b_far


async def _until_closed(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    """Everything `sock` reads until its peer's end (a reset fails the test)."""
    got = b""
    while chunk := await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 10):
        got += chunk
    return got


@ON_EVERY_LOOP
async def test_an_end_from_one_side_reaches_the_other_as_an_end_after_every_byte() -> None:
    """One side's EOF is passed on as a FIN after what it sent (a half-close first, not a bare close
    that would reset a far end with bytes still unread here), and the tunnel then ends."""
    loop = asyncio.get_running_loop()
    front, a_pipe, b_pipe, a_far, b_far = await _relayed_pair()
    a_far.send(b"last words")
    a_far.shutdown(socket.SHUT_WR)
    assert await _until_closed(loop, b_far) == b"last words"
    await asyncio.wait_for(front.finished.wait(), 10)
    assert b_pipe.transport.write_eofs == 1  # type: ignore[union-attr]
    assert b_pipe.transport.late == 0  # type: ignore[union-attr]
    for s in (a_far, b_far):
        s.close()


@ON_EVERY_LOOP
async def test_sides_that_end_together_are_closed_without_a_half_close() -> None:
    """Both sides end at once (a client that closes as the server does: how nearly every short
    tunnel ends): each far end reads every byte and its end, and neither side is half-closed first
    (its close sends the FIN; a shutdown before it is a system call for nothing)."""
    loop = asyncio.get_running_loop()
    front, a_pipe, b_pipe, a_far, b_far = await _relayed_pair()
    b_far.send(b"response")
    assert await _recv_for(loop, a_far, 5, 8) == b"response"
    b_far.shutdown(socket.SHUT_WR)  # both ends, before the loop looks again: one batch of events
    a_far.shutdown(socket.SHUT_WR)
    await asyncio.wait_for(front.finished.wait(), 10)
    assert await _until_closed(loop, a_far) == b""
    assert await _until_closed(loop, b_far) == b""
    eofs = (a_pipe.transport.write_eofs, b_pipe.transport.write_eofs)  # type: ignore[union-attr]
    assert eofs == (0, 0)
    for s in (a_far, b_far):
        s.close()


@ON_EVERY_LOOP
async def test_a_side_closed_before_its_peers_end_is_passed_on_is_left_to_its_close() -> None:
    """A side closed for another reason (the sweep, a revocation) in the same turn of the loop as
    its peer's EOF: no half-close of a closed transport, no error."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    front, a_pipe, b_pipe, a_far, b_far = await _relayed_pair()
    assert b_pipe.transport is not None
    b_pipe.transport.close()
    b_pipe.eof_received_from_peer()
    assert await _until_closed(loop, b_far) == b""
    await asyncio.sleep(0.1)
    assert errors == []
    assert b_pipe.transport.write_eofs == 0  # type: ignore[attr-defined]
    for s in (a_far, b_far):
        s.close()
    assert a_pipe.transport is not None
    a_pipe.transport.close()


def test_a_finished_tunnel_is_freed_without_the_cyclic_collector(
    echo_engine: ProxyServer, tcp_echo: TcpEchoServer
) -> None:
    """When a tunnel ends, its objects (the client side, the tunnel, the far side) stop pointing at
    each other, so they are freed then and there, not left to the cyclic garbage collector."""
    import gc

    from egressd.front.tunnel import FrontProtocol

    front = echo_engine._front
    assert front is not None
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds is kept in gc.garbage, not freed
    try:
        for _ in range(5):
            with _tunnel(echo_engine, tcp_echo) as sock:
                _ping_pong(sock, 1)
        deadline = time.monotonic() + 10
        while front.clients and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not front.clients, "the tunnels did not finish"
        gc.collect()
        left = [o for o in gc.garbage if isinstance(o, FrontProtocol | relay.Pipe | relay.Tunnel)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert left == []
