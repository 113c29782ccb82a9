"""mitmproxy's connection handler for one tunnel the front handed over (egressd.inspect.engine).

`TunnelHandler` is mitmproxy's `ProxyConnectionHandler` made for a tunnel that is already admitted:
its `Client` carries the tunnel, its first layer is `HandedOver` (the destination is known, the
client was not answered yet), and its upstream connections are opened by the pipeline's `connect`
(the pin step: each admitted address in turn, or the parent proxy), never by a lookup of mitmproxy's.
That connect is the one place egressd's code stands in mitmproxy's: see `TunnelHandler.open_connection`
and egressd.inspect.patches.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mitmproxy import connection, exceptions, flow
from mitmproxy.addonmanager import traverse
from mitmproxy.proxy import commands, events, layer, server, server_hooks
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.mode_servers import ProxyConnectionHandler
from mitmproxy.proxy.utils import expect

from egressd.inspect.inspected import STREAM_LIMIT, InspectedTunnel
from egressd.policy.reasons import Reason

if TYPE_CHECKING:
    from mitmproxy.master import Master

    from egressd.admission.pipeline import Pipeline

logger = logging.getLogger(__name__)


@dataclass(eq=False, repr=False, kw_only=True)
class TunnelClient(connection.Client):
    """mitmproxy's client connection of a handed-over tunnel: it carries the tunnel."""

    tunnel: InspectedTunnel | None = None


def tunnel_of(client: connection.Client) -> InspectedTunnel:
    """The tunnel a client connection carries (every client mitmproxy has here is one)."""
    if isinstance(client, TunnelClient) and client.tunnel is not None:
        return client.tunnel
    raise RuntimeError("a client connection egressd's front did not hand over")


class Hooks:
    """The callables of each hook among the engine's addons, in the order mitmproxy's AddonManager
    calls them (the chain, each addon's own addons after it), found once per hook rather than at
    every call: egressd adds no addon once the engine runs."""

    def __init__(self, master: Master) -> None:
        self._chain = master.addons.chain
        self._found: dict[str, tuple[Callable[..., Any], ...]] = {}

    def __getitem__(self, name: str) -> tuple[Callable[..., Any], ...]:
        found = self._found.get(name)
        if found is None:
            callables = (getattr(addon, name, None) for addon in traverse(self._chain))
            found = tuple(f for f in callables if callable(f) and not isinstance(f, types.ModuleType))
            self._found[name] = found
        return found


class TunnelHandler(ProxyConnectionHandler):
    """mitmproxy's handler of one client connection, for a tunnel the pipeline admitted."""

    def __init__(
        self,
        master: Master,
        hooks: Hooks,
        pipeline: Pipeline,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        tunnel: InspectedTunnel,
    ) -> None:
        # LiveConnectionHandler's set-up, with egressd's client in place of a bare one
        self.master = master
        self.hooks = hooks
        self.pipeline = pipeline
        client = TunnelClient(
            peername=writer.get_extra_info("peername"),
            sockname=writer.get_extra_info("sockname"),
            timestamp_start=time.time(),
            state=connection.ConnectionState.OPEN,
            tunnel=tunnel,
        )
        server.ConnectionHandler.__init__(self, Context(client, master.options))
        self.transports[client] = server.ConnectionIO(handler=None, reader=reader, writer=writer)
        self.log_prefix = ""
        self.layer = HandedOver(self.layer.context)  # the top layer, as a mode's server sets it

    async def handle_hook(self, hook: commands.StartHook) -> None:
        """Each of the engine's addons' callables of this hook, as mitmproxy's AddonManager calls
        them (`handle_lifecycle`): in order, an awaitable awaited (with the idle timer held, as
        ProxyConnectionHandler holds it), an addon's error logged and the next called, AddonHalt
        ending the chain; then "update" for a flow, and an intercepted flow waits to be resumed."""
        (data,) = hook.args()
        for func in self.hooks[hook.name]:
            try:
                result = func(data)
                if result is not None and inspect.isawaitable(result):
                    with self.timeout_watchdog.disarm():
                        await result
            except exceptions.AddonHalt:
                break
            except Exception as exc:  # noqa: BLE001 - as mitmproxy's safecall: logged, the chain goes on
                logger.error("Addon error: %s", exc, exc_info=exc)
        if isinstance(data, flow.Flow):
            for func in self.hooks["update"]:
                func([data])
            if data.intercepted:
                with self.timeout_watchdog.disarm():
                    await data.wait_for_resume()

    async def open_connection(self, command: commands.OpenConnection) -> None:
        """`ConnectionHandler.open_connection` of mitmproxy 12.3.1 with one difference: the streams
        come from the pipeline's `connect` to the pin of the connection the policy addon admitted
        in the server_connect hook (`InspectedTunnel.connections`), which also counts it against the limits
        and writes its connection record — not from `asyncio.open_connection(*address)`. The hooks
        run as mitmproxy runs them; a failure is kept, typed, as the tunnel's (`InspectedTunnel.fail`)."""
        conn = command.connection
        hook_data = server_hooks.ServerConnectionHookData(client=self.client, server=conn)
        await self.handle_hook(server_hooks.ServerConnectHook(hook_data))
        streams = None
        if not conn.error:
            conn.timestamp_start = time.time()
            try:
                streams = await self._connect(conn)
            except asyncio.CancelledError:
                conn.error = "connection cancelled"
                await self.handle_hook(server_hooks.ServerConnectErrorHook(hook_data))
                await self.server_event(events.OpenConnectionCompleted(command, conn.error))
                raise
        if streams is None:
            self.log(f"server connection to {conn.address} not opened: {conn.error}")
            await self.handle_hook(server_hooks.ServerConnectErrorHook(hook_data))
            await self.server_event(events.OpenConnectionCompleted(command, conn.error or "not admitted"))
            return
        reader, writer = streams
        conn.timestamp_tcp_setup = time.time()
        conn.state = connection.ConnectionState.OPEN
        conn.peername = writer.get_extra_info("peername")
        conn.sockname = writer.get_extra_info("sockname")
        self.transports[conn] = server.ConnectionIO(
            handler=asyncio.current_task(), reader=reader, writer=writer
        )
        await self.handle_hook(server_hooks.ServerConnectedHook(hook_data))
        await self.server_event(events.OpenConnectionCompleted(command, None))
        try:
            await self.handle_connection(conn)
        finally:
            conn.timestamp_end = time.time()
            await self.handle_hook(server_hooks.ServerDisconnectedHook(hook_data))

    async def _connect(
        self, conn: connection.Server
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """Streams to the admitted connection's pin, or None with the failure on the tunnel."""
        tunnel = tunnel_of(self.client)
        admitted = tunnel.connections.get(conn.id)
        if admitted is None:  # no hook admitted it: fail closed
            refusal = tunnel.refusal(
                Reason.INTERNAL_ERROR, f"{conn.address} was not admitted by the policy gate"
            )
            conn.error = tunnel.fail(refusal).detail
            return None
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=STREAM_LIMIT, loop=loop)
        protocol = _Upstream(reader, loop=loop)
        refusal = await self.pipeline.connect(tunnel.conn, admitted, protocol, conn.id)
        if refusal is not None:
            conn.error = tunnel.fail(refusal).detail
            return None
        assert protocol.transport is not None
        return reader, asyncio.StreamWriter(protocol.transport, protocol, reader, loop)


class _Upstream(asyncio.StreamReaderProtocol):
    """The upstream side as mitmproxy's streams; its transport is the pipeline's to close while it
    writes the connection's record."""

    transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        super().connection_made(transport)


class HandedOver(layer.Layer):
    """The first layer of a handed-over tunnel: its destination is what the pipeline admitted. The
    upstream connection is opened first, as mitmproxy does for a CONNECT (an upstream that cannot
    be reached is the client's answer), then the client is told in its protocol, then the layer
    inside is chosen from the client's first bytes (egressd.addons.tunnel_guard)."""

    @expect(events.Start)
    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        tunnel = tunnel_of(self.context.client)
        client, upstream = self.context.client, self.context.server
        upstream.address = (tunnel.admitted.host, tunnel.admitted.port)
        err = yield commands.OpenConnection(upstream)
        if err:
            refusal = tunnel.take_failure() or tunnel.refusal(Reason.CONNECT_ERROR, err)
            yield commands.SendData(client, tunnel.owner.refusal_answer(refusal))
            yield commands.CloseConnection(client)
            self._handle_event = self._closed  # type: ignore[method-assign]
            return
        bound = upstream.sockname  # an IPv6 socket's has four parts
        answer = tunnel.owner.established_answer((str(bound[0]), int(bound[1])) if bound else None)
        yield commands.SendData(client, answer)
        tunnel.counting = True
        child = layer.NextLayer(self.context)
        self._handle_event = child.handle_event  # type: ignore[method-assign]
        yield from child.handle_event(events.Start())

    def _closed(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from ()
