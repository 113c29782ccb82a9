"""mitmproxy addon: choose the layer inside every tunnel egressd's front handed over, and guard it.

Replaces mitmproxy's built-in next-layer choice. mitmproxy only gets tunnels the admission pipeline
admitted for inspection, so inside a tunnel there is one choice — TLS towards both sides, then HTTP,
every request decided with its path — after one check: the TLS SNI must name the tunnel's host (an
IP-literal tunnel may carry no SNI); otherwise the tunnel is closed and recorded. The server's bytes
are held until the client spoke, whoever speaks first. The client's first bytes are read
incrementally (egressd.wire.sni.TunnelStart, as in the front), at a bounded cost.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

from mitmproxy.addons.next_layer import NextLayer
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers import ClientTLSLayer, HttpLayer, ServerTLSLayer
from mitmproxy.proxy.layers.http import HTTPMode

from egressd.admission.pipeline import Pipeline
from egressd.inspect.handler import tunnel_of
from egressd.wire.http_head import starts_like_request
from egressd.wire.sni import WAIT, TunnelStart

logger = logging.getLogger(__name__)


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


class TunnelGuard(NextLayer):
    """mitmproxy's next-layer addon, with egressd's rules for everything inside a tunnel."""

    name = "nextlayer"  # it replaces mitmproxy's, under the same addon name

    def __init__(self, pipeline: Pipeline) -> None:
        super().__init__()
        self.pipeline = pipeline
        # the SNI check of each tunnel whose layer is not chosen yet (gone with its NextLayer)
        self._starts: weakref.WeakKeyDictionary[layer.NextLayer, _Start] = weakref.WeakKeyDictionary()

    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        context = nextlayer.context
        if context.client.tls:
            self._inside_interception(nextlayer)
            return
        self._tunnel_layer(nextlayer)

    def _inside_interception(self, nextlayer: layer.NextLayer) -> None:
        """Inside intercepted TLS only HTTP is spoken: anything else cannot be decided per request.
        What is HTTP is egressd's call (a request line starts with a method token and a space), not
        mitmproxy's guess (its first three bytes are letters), so a request with any method is
        decided — and refused with its reason — instead of being taken for another protocol."""
        verdict = starts_like_request(nextlayer.data_client())
        if verdict is None:
            return  # too few bytes yet: asked again when more come
        if verdict:
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
            pass  # wait for (more of) the client's first bytes; the server's are held meanwhile
        elif self._intercept(context):
            nextlayer.layer = _inspection_layers(context, tls=start.check.tls is True)
        else:
            self._refuse(nextlayer, "a tunnel handed over without inspection", reason="internal_error")
        if nextlayer.layer is not None:
            self._starts.pop(nextlayer, None)

    def _intercept(self, context: Any) -> bool:
        """Only tunnels the pipeline admitted for inspection are handed to mitmproxy."""
        return self.pipeline.inspection and tunnel_of(context.client).admitted.inspect

    def _refuse(self, nextlayer: layer.NextLayer, problem: str, reason: str = "sni_mismatch") -> None:
        context = nextlayer.context
        host, port = context.server.address
        self.pipeline.refused_early(tunnel_of(context.client).conn, host, port, reason, problem, stage="tls")
        nextlayer.layer = RefuseTunnel(context)


@dataclass
class _Start:
    """How far the SNI check of one undecided tunnel has read (TunnelGuard.next_layer)."""

    check: TunnelStart
    events: int = 0  # of the NextLayer's events, fed already
    client_bytes: int = 0
    server_bytes: int = 0


def _inspection_layers(context: Any, *, tls: bool) -> layer.Layer:
    """TLS towards both sides, then HTTP: every request inside is decided with its path."""
    if not tls:
        return HttpLayer(context, HTTPMode.transparent)
    server_tls = ServerTLSLayer(context)
    server_tls.child_layer = ClientTLSLayer(context)
    return server_tls
