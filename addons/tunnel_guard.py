"""mitmproxy addon: choose the layer inside every tunnel, and guard it.

Replaces mitmproxy's built-in next-layer choice for tunnels (CONNECT and SOCKS5):
- the TLS SNI must name the tunnel's host (an IP-literal tunnel may carry no SNI); otherwise the
  tunnel is closed and audited. The client's first bytes are checked whoever speaks first: when the
  server sends a banner before the client said anything, a passthrough tunnel relays it and checks
  the client's first bytes in the relay; a tunnel to inspect holds it until the client spoke. They
  are read incrementally (egressd.wire.sni.TunnelStart, as on the lean path), at a bounded cost;
- an allowed tunnel passes through untouched (`TCPLayer(ignore=True)`, no recorded flow, so nothing
  is buffered), counting bytes for the audit;
- TLS towards the proxy itself is not offered: the child talks plain HTTP or SOCKS5 to loopback.
It also gives SOCKS5 clients the right reply code: "not allowed by ruleset" for a policy refusal,
"host unreachable" for DNS, "connection refused" when the upstream refuses.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

from mitmproxy.addons.next_layer import NextLayer
from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers import ClientTLSLayer, HttpLayer, ServerTLSLayer, TCPLayer, modes
from mitmproxy.proxy.layers.http import HTTPMode
from mitmproxy.proxy.mode_servers import Socks5Instance

from egressd.admission.runtime import Runtime
from egressd.policy import TargetError, canonical_host
from egressd.refusal import POLICY_REASONS, parse_failure
from egressd.wire.sni import WAIT, TunnelStart

logger = logging.getLogger(__name__)

SOCKS5_REPLY = {
    "policy": 0x02,  # connection not allowed by ruleset
    "dns_error": 0x04,  # host unreachable
    "dns_timeout": 0x04,
    "connect_refused": 0x05,  # connection refused
    "connect_timeout": 0x06,  # TTL expired: the closest code for "timed out"
}


class CountingTunnel(TCPLayer):
    """A passthrough tunnel (no flow, nothing kept) that counts bytes each way for the audit.

    With `first_bytes` (the server spoke first), the client's bytes are held until that check
    answers: relayed when it allows them, the tunnel closed (and audited) when it does not."""

    def __init__(self, context: Any, runtime: Runtime, first_bytes: TunnelStart | None = None) -> None:
        super().__init__(context, ignore=True)
        self.rt = runtime
        self._state = runtime.conn(context.client.id)
        self._first_bytes = first_bytes
        self._held = b""

    def relay_messages(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.DataReceived):
            from_client = event.connection == self.context.client
            if self._state is not None:
                if from_client:
                    self._state.bytes_up += len(event.data)
                else:
                    self._state.bytes_down += len(event.data)
            if from_client and self._first_bytes is not None:
                verdict = self._first_bytes.feed(event.data)
                self._held += event.data
                if verdict is WAIT:
                    return
                if isinstance(verdict, str):
                    self._handle_event = self.done  # type: ignore[method-assign]
                    audit_refusal(self.rt, self.context, verdict)
                    yield commands.CloseConnection(self.context.client)
                    yield commands.CloseConnection(self.context.server)
                    return
                event = events.DataReceived(self.context.client, self._held)
                self._first_bytes, self._held = None, b""
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
        # the SNI check of each tunnel whose layer is not chosen yet (gone with its NextLayer)
        self._starts: weakref.WeakKeyDictionary[layer.NextLayer, _Start] = weakref.WeakKeyDictionary()
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
        nextlayer.layer = None  # decided here only, whatever another next-layer addon chose
        start = self._starts.get(nextlayer)
        if start is None:
            start = self._starts[nextlayer] = _Start(TunnelStart(context.server.address[0]))
        for event in nextlayer.events[start.events :]:  # only what arrived since the last call
            if isinstance(event, events.DataReceived):
                if event.connection == context.client:
                    start.client_bytes += len(event.data)
                    start.check.feed(event.data)
                else:
                    start.server_bytes += len(event.data)
        start.events = len(nextlayer.events)
        verdict = start.check.verdict
        if isinstance(verdict, str):
            self._refuse(nextlayer, verdict)
        elif verdict is WAIT:
            if not start.client_bytes and start.server_bytes and not self._intercept(context):
                # the server spoke first: relay it now, and check the client's first bytes in the relay
                nextlayer.layer = CountingTunnel(context, self.rt, start.check)
            # else: wait for (more of) the client's first bytes; a tunnel to inspect holds the server's
        elif self._intercept(context):
            nextlayer.layer = _inspection_layers(context, tls=start.check.tls is True)
        else:
            nextlayer.layer = CountingTunnel(context, self.rt)
        if nextlayer.layer is not None:
            self._starts.pop(nextlayer, None)

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
        audit_refusal(self.rt, nextlayer.context, problem, reason)
        nextlayer.layer = RefuseTunnel(nextlayer.context)


@dataclass
class _Start:
    """How far the SNI check of one undecided tunnel has read (TunnelGuard.next_layer)."""

    check: TunnelStart
    events: int = 0  # of the NextLayer's events, fed already
    client_bytes: int = 0
    server_bytes: int = 0


def audit_refusal(rt: Runtime, context: Any, problem: str, reason: str = "sni_mismatch") -> None:
    """The record of a tunnel closed for its first bytes (or what it carries)."""
    host, port = context.server.address
    rt.audit_early_refusal(rt.conn(context.client.id), host, port, reason, problem, stage="tls")


def _inspection_layers(context: Any, *, tls: bool) -> layer.Layer:
    """TLS towards both sides, then HTTP: every request inside is decided with its path."""
    if not tls:
        return HttpLayer(context, HTTPMode.transparent)
    server_tls = ServerTLSLayer(context)
    server_tls.child_layer = ClientTLSLayer(context)
    return server_tls
