"""The embedded mitmproxy: its Master, and one connection handler for each tunnel the admission
pipeline admitted for inspection.

mitmproxy listens nowhere. The front hands over the client's own transport once the pipeline
admitted the tunnel (CONNECT or SOCKS5), and mitmproxy's connection handler reads and writes it as
streams, in this process and event loop, as its own listener would (`ServerInstance.handle_stream`).
The handler's client carries the tunnel — the client's state, what the pipeline admitted, how to
answer the client in its protocol — so nothing is written out and parsed again: no second CONNECT,
no registry of peers, no failure spelled into text. Its first layer (egressd.inspect.handler) opens
the upstream connection through the pipeline's own `connect`, answers the client (its 200, its
SOCKS5 reply, or the refusal), and only then are the layers inside chosen (egressd.addons.tunnel_guard).

mitmproxy is imported on first need, off the event loop's thread: a run that inspects nothing never
pays for it. This module imports nothing of mitmproxy itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from egressd.inspect.inspected import STREAM_LIMIT, InspectedTunnel

if TYPE_CHECKING:
    from mitmproxy.master import Master

    from egressd.admission.pipeline import Pipeline

# the mitmproxy addons that decide inside a tunnel, made for a pipeline; imported off the loop
AddonFactory = Callable[["Pipeline"], Sequence[object]]


class InspectionEngine:
    """The mitmproxy Master, started on first need, and the handlers of the tunnels handed to it."""

    def __init__(
        self,
        pipeline: Pipeline,
        load_addons: Callable[[], AddonFactory],
        *,
        idle_timeout: float,
        confdir: Path | None = None,
        upstream_roots: Path | None = None,
    ) -> None:
        """`load_addons`: imports the addons (in the loading thread) and returns what makes them;
        `confdir`: the CA's directory (None: no TLS interception, as with inspection off)."""
        self.pipeline = pipeline
        self._load_addons = load_addons
        self._idle_timeout = idle_timeout
        self._confdir = confdir
        self._upstream_roots = upstream_roots
        self.master: Master | None = None
        self._hooks: Any = None  # each hook's callables among the addons (egressd.inspect.handler)
        self._proxyserver: Any = None
        self._started: asyncio.Future[None] | None = None
        self._run: asyncio.Future[None] | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    # -- life cycle ----------------------------------------------------------------------------
    async def ready(self) -> InspectionEngine:
        """This engine, started once (concurrent callers wait for the same start; a start that
        failed is tried again by the next caller)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        started = self._started
        try:
            await asyncio.shield(started)
        except Exception:
            if self._started is started:
                self._started = None
            raise
        return self

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[AddonFactory] = loop.create_future()

        def load() -> None:
            try:
                _import_mitmproxy()
                factory = self._load_addons()
            except BaseException as exc:  # noqa: BLE001 - handed to the loop
                loop.call_soon_threadsafe(_settle, done, exc)
            else:
                loop.call_soon_threadsafe(_settle, done, factory)

        # a thread of its own (daemon: never waited for at exit), so the loop keeps serving tunnels
        threading.Thread(target=load, name="egressd-import", daemon=True).start()
        make_addons = await done

        from mitmproxy import options
        from mitmproxy.addons import core, proxyserver
        from mitmproxy.master import Master

        from egressd.inspect import patches
        from egressd.inspect.handler import Hooks

        patches.install(self.pipeline)
        opts = options.Options()
        master = Master(opts, event_loop=loop)
        server = proxyserver.Proxyserver()
        running = _Running(loop)
        master.addons.add(core.Core(), server, *make_addons(self.pipeline), running)
        if self._confdir is not None:
            from mitmproxy.addons import tlsconfig

            # confdir first: TlsConfig loads (or creates) its CA as soon as it is added
            opts.update(confdir=str(self._confdir))
            if self._upstream_roots is not None:
                opts.update(ssl_verify_upstream_trusted_ca=str(self._upstream_roots))
            master.addons.add(tlsconfig.TlsConfig())
        opts.update(
            mode=[],  # no listener: the front hands every tunnel over (serve)
            connection_strategy="eager",
            tcp_timeout=int(self._idle_timeout),
            stream_large_bodies="256k",
            http2=False,  # intercepted HTTPS speaks HTTP/1.1 on both sides: one Host, one request line
            # never a raw relay inside interception: whether the client speaks HTTP is the tunnel
            # guard's call, and a 101 for anything but an admitted WebSocket closes the connection
            rawtcp=False,
        )
        self.master, self._proxyserver, self._hooks = master, server, Hooks(master)
        self._run = run = asyncio.ensure_future(master.run())
        try:
            await asyncio.wait([run, running.started], return_when=asyncio.FIRST_COMPLETED)
            if not running.started.done():
                run.result()
                raise RuntimeError("the inspection engine stopped while starting")
        except BaseException:
            master.shutdown()
            with contextlib.suppress(BaseException):
                await run
            self.master = self._proxyserver = self._run = None
            raise

    def set_idle_timeout(self, timeout: float) -> None:
        """limits.idle_timeout of a new policy (on the loop's thread)."""
        self._idle_timeout = timeout
        if self.master is not None:
            self.master.options.update(tcp_timeout=int(timeout))

    async def stop(self) -> None:
        master, run = self.master, self._run
        if master is not None and run is not None:
            master.shutdown()
            with contextlib.suppress(Exception):
                await run

    # -- tunnels -------------------------------------------------------------------------------
    def serve(self, tunnel: InspectedTunnel, transport: asyncio.Transport, read: bytes, eof: bool) -> None:
        """Serve a tunnel on the client's transport (its reading paused): `read` is what the client
        sent after its request so far, `eof` whether it has ended its side already. From here on
        the transport is mitmproxy's; `tunnel.owner.finish()` is called when the handler ends."""
        from egressd.inspect.handler import TunnelHandler

        assert self.master is not None
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=STREAM_LIMIT, loop=loop)
        protocol = _ClientSide(reader, tunnel, loop)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if read:
            protocol.data_received(read)
        if eof:
            protocol.eof_received()
        writer = _ClientWriter(transport, protocol, reader, loop, tunnel)
        handler = TunnelHandler(self.master, self._hooks, self.pipeline, reader, writer, tunnel)
        task = loop.create_task(self._handle(handler, tunnel, writer))
        if not task.done():
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)
        if not eof and not transport.is_closing():
            transport.resume_reading()

    async def _handle(self, handler: Any, tunnel: InspectedTunnel, writer: asyncio.StreamWriter) -> None:
        """mitmproxy's own path for a connection (as `ServerInstance.handle_stream` takes it)."""
        try:
            with self._proxyserver.register_connection(handler.client.id, handler):
                await handler.handle_client()
        finally:
            writer.close()
            tunnel.owner.finish()


class _Running:
    """A mitmproxy addon: tells the engine once mitmproxy runs (its addons configured, its CA loaded)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.started: asyncio.Future[None] = loop.create_future()

    def running(self) -> None:
        if not self.started.done():
            self.started.set_result(None)


class _ClientSide(asyncio.StreamReaderProtocol):
    """The client's transport read as mitmproxy's stream; what it reads counts as the tunnel's."""

    def __init__(
        self, reader: asyncio.StreamReader, tunnel: InspectedTunnel, loop: asyncio.AbstractEventLoop
    ) -> None:
        super().__init__(reader, loop=loop)
        self.conn = tunnel.conn

    def data_received(self, data: bytes) -> None:
        self.conn.bytes_up += len(data)
        super().data_received(data)


class _ClientWriter(asyncio.StreamWriter):
    """The client's transport written by mitmproxy; what goes out after the answer counts."""

    def __init__(
        self,
        transport: asyncio.Transport,
        protocol: asyncio.StreamReaderProtocol,
        reader: asyncio.StreamReader,
        loop: asyncio.AbstractEventLoop,
        tunnel: InspectedTunnel,
    ) -> None:
        super().__init__(transport, protocol, reader, loop)
        self.tunnel = tunnel

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.tunnel.counting:
            self.tunnel.conn.bytes_down += len(data)
        super().write(data)


def _settle(future: asyncio.Future[Any], outcome: Any) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _import_mitmproxy() -> None:
    """The modules mitmproxy's start needs, imported off the event loop's thread."""
    import mitmproxy.addons.core
    import mitmproxy.addons.next_layer
    import mitmproxy.addons.proxyserver
    import mitmproxy.addons.tlsconfig
    import mitmproxy.master
    import mitmproxy.options
    import mitmproxy.proxy.server  # noqa: F401

    import egressd.inspect.handler  # noqa: F401
