"""mitmproxy addon: choose the layer inside every tunnel, and guard it.

Replaces mitmproxy's built-in next-layer choice for tunnels (CONNECT and SOCKS5):
- the TLS SNI must name the tunnel's host (an IP-literal tunnel may carry no SNI); otherwise the
  tunnel is closed and audited;
- an allowed tunnel passes through untouched (`TCPLayer(ignore=True)`, no recorded flow, so nothing
  is buffered), counting bytes for the audit;
- TLS towards the proxy itself is not offered: the child talks plain HTTP or SOCKS5 to loopback.
It also gives SOCKS5 clients the right reply code: "not allowed by ruleset" for a policy refusal,
"host unreachable" for DNS, "connection refused" when the upstream refuses.

Loads in a stock `mitmdump -s addons/tunnel_guard.py` too.
"""

from __future__ import annotations

import logging
from typing import Any

from mitmproxy.addons.next_layer import NextLayer
from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers import ClientTLSLayer, HttpLayer, ServerTLSLayer, TCPLayer, modes
from mitmproxy.proxy.layers.http import HTTPMode
from mitmproxy.proxy.layers.tls import parse_client_hello
from mitmproxy.proxy.mode_servers import Socks5Instance

from egressd.engine.runtime import Runtime, shared_runtime
from egressd.engine.sni import sni_problem
from egressd.policy import TargetError, canonical_host
from egressd.refusal import POLICY_REASONS, parse_failure

logger = logging.getLogger(__name__)

SOCKS5_REPLY = {
    "policy": 0x02,  # connection not allowed by ruleset
    "dns_error": 0x04,  # host unreachable
    "dns_timeout": 0x04,
    "connect_refused": 0x05,  # connection refused
    "connect_timeout": 0x06,  # TTL expired: the closest code for "timed out"
}


class CountingTunnel(TCPLayer):
    """A passthrough tunnel (no flow, nothing kept) that counts bytes each way for the audit."""

    def __init__(self, context: Any, runtime: Runtime) -> None:
        super().__init__(context, ignore=True)
        self._state = runtime.conn(context.client.id)

    def relay_messages(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.DataReceived) and self._state is not None:
            if event.connection == self.context.client:
                self._state.bytes_up += len(event.data)
            else:
                self._state.bytes_down += len(event.data)
        yield from super().relay_messages(event)


class RefuseTunnel(layer.Layer):
    """Close both sides at once: what a tunnel that fails the SNI check gets."""

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, (events.Start, events.DataReceived)):
            yield commands.CloseConnection(self.context.client)
            if self.context.server.connected:
                yield commands.CloseConnection(self.context.server)
        self._handle_event = self._done  # type: ignore[method-assign]

    def _done(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from ()


class EgressSocks5Proxy(modes.Socks5Proxy):
    """mitmproxy's SOCKS5 layer with reply codes that say why a connect failed."""

    def state_connect(self) -> layer.CommandGenerator[None]:
        gen = super().state_connect()
        try:
            command = next(gen)
            while True:
                if (
                    isinstance(command, commands.SendData)
                    and command.connection == self.context.client
                    and command.data[:2] == b"\x05\x04"
                ):
                    command = commands.SendData(command.connection, self._reply(command.data))
                result = yield command
                command = gen.send(result)
        except StopIteration:
            return

    def _reply(self, data: bytes) -> bytes:
        failure = parse_failure(self.context.server.error or "")
        if failure is None:
            return data
        reason = failure[0]
        code = SOCKS5_REPLY["policy"] if reason in POLICY_REASONS else SOCKS5_REPLY.get(reason, 0x01)
        return bytes([0x05, code]) + data[2:]


def _install_socks5_layer() -> None:
    Socks5Instance.make_top_layer = lambda self, context: EgressSocks5Proxy(context)  # type: ignore[method-assign]


class TunnelGuard(NextLayer):
    """mitmproxy's next-layer addon, with egressd's rules for everything inside a tunnel."""

    name = "nextlayer"  # it replaces mitmproxy's, under the same addon name

    def __init__(self, runtime: Runtime) -> None:
        super().__init__()
        self.rt = runtime
        _install_socks5_layer()

    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        context = nextlayer.context
        if not context.layers:
            return
        if len(context.layers) == 1 and isinstance(context.layers[0], modes.HttpProxy):
            if starts_like_tls_record(nextlayer.data_client()):
                logger.info("refusing TLS towards the proxy itself (use http:// in the proxy URL)")
                nextlayer.layer = RefuseTunnel(context)
                return
            super().next_layer(nextlayer)  # an HTTP layer in regular mode
            return
        if context.server.address is None:
            super().next_layer(nextlayer)
            return
        if context.client.tls:
            self._inside_interception(nextlayer)
            return
        self._tunnel_layer(nextlayer)

    def _inside_interception(self, nextlayer: layer.NextLayer) -> None:
        """Inside intercepted TLS only HTTP is spoken: anything else cannot be decided per request."""
        super().next_layer(nextlayer)
        if nextlayer.layer is None or isinstance(nextlayer.layer, HttpLayer):
            return
        self._refuse(nextlayer, "not HTTP inside an intercepted TLS tunnel", reason="not_http")

    def _tunnel_layer(self, nextlayer: layer.NextLayer) -> None:
        context = nextlayer.context
        data_client = nextlayer.data_client()
        nextlayer.layer = None  # decided here only, whatever another next-layer addon chose
        if not data_client and not nextlayer.data_server():
            return  # wait for bytes
        if data_client and starts_like_tls_record(data_client):
            try:
                hello = parse_client_hello(data_client)
            except ValueError:
                hello = None
                problem = "unparseable TLS ClientHello"
            else:
                if hello is None:
                    return  # ClientHello split across packets: wait for the rest
                problem = sni_problem(context.server.address[0], hello.sni)
            if problem is not None:
                self._refuse(nextlayer, problem)
                return
        if self._intercept(context):
            nextlayer.layer = _inspection_layers(
                context, tls=bool(data_client) and starts_like_tls_record(data_client)
            )
            return
        nextlayer.layer = CountingTunnel(context, self.rt)

    def _intercept(self, context: Any) -> bool:
        if not self.rt.inspection:
            return False
        state = self.rt.conn(context.client.id)
        host, port = context.server.address
        if state is not None and (host, port) in state.intercept:
            return True
        try:
            target = canonical_host(host)
        except (TargetError, ValueError):
            return False
        return self.rt.policies.get().inspect.match(target, port) is not None

    def _refuse(self, nextlayer: layer.NextLayer, problem: str, reason: str = "sni_mismatch") -> None:
        context = nextlayer.context
        state = self.rt.conn(context.client.id)
        host, port = context.server.address
        self.rt.audit_early_refusal(state, host, port, reason, problem, stage="tls")
        nextlayer.layer = RefuseTunnel(context)


def _inspection_layers(context: Any, *, tls: bool) -> layer.Layer:
    """TLS towards both sides, then HTTP: every request inside is decided with its path."""
    if not tls:
        return HttpLayer(context, HTTPMode.transparent)
    server_tls = ServerTLSLayer(context)
    server_tls.child_layer = ClientTLSLayer(context)
    return server_tls


_stock: list[Any] | None = None


def __getattr__(name: str) -> Any:
    global _stock
    if name == "addons":
        if _stock is None:
            _stock = [TunnelGuard(shared_runtime())]
        return _stock
    raise AttributeError(name)
