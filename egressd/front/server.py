"""egressd's front: the listeners every child connects to, on asyncio (uvloop).

The HTTP proxy port (CONNECT and absolute-form HTTP: `egressd.front.tunnel`, `egressd.front.plain_http`)
and the SOCKS5 port (`egressd.front.socks`), plus listening sockets made elsewhere (the sandbox's).
Every connection is admitted through the admission pipeline; the front does none of its steps itself.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from egressd.front.handed import Handed
from egressd.front.plain_http import IdleUpstreams
from egressd.front.socks import SocksProtocol
from egressd.front.tunnel import FrontProtocol, Inspection, RefusalContext, listener_end
from egressd.platform.listeners import register

if TYPE_CHECKING:
    import ssl as ssl_module

    from egressd.admission.credentials import ProxyCredentials
    from egressd.admission.pipeline import Pipeline
    from egressd.platform.diag import Diag


SWEEP = 1.0  # seconds between the checks of header_timeout and idle_timeout


def _check_kind(kind: str) -> None:
    if kind not in ("http", "socks"):
        raise ValueError(f"unknown listener kind {kind!r}")


class Front:
    """egressd's listeners: the HTTP proxy port (CONNECT and absolute-form HTTP) and SOCKS5."""

    def __init__(
        self,
        pipeline: Pipeline,
        inspection: Inspection,
        refusal_context: RefusalContext | None = None,
        *,
        health: bool = False,
    ) -> None:
        self.pipeline = pipeline
        self.health = health  # GET /healthz answered on the HTTP port, no credentials (the gateway)
        self.inspection = inspection  # the embedded mitmproxy, started on first need
        self.refusal_context = refusal_context  # refusal_pages: tls (None: inspection is off)
        self.servers: list[asyncio.Server] = []
        self.clients: set[FrontProtocol] = set()
        self.upstreams = IdleUpstreams(pipeline)
        self._sweeper: asyncio.Task[None] | None = None

    def _factory(
        self,
        kind: str,
        implicit: ProxyCredentials | None = None,
        tree_only: bool = False,
        diag: Diag | None = None,
        local: tuple[str, int] | None = None,
    ) -> Callable[[], FrontProtocol]:
        """What makes a listener's client of `kind`: "http" (CONNECT and absolute-form HTTP) or
        "socks" (SOCKS5); `local`: the listener's end of every connection it accepts
        (listener_end). The class bound to its arguments: the loop calls it per connection with no
        Python frame of ours before the protocol's own __init__ (a lambda would be one)."""
        if kind == "socks":
            return functools.partial(SocksProtocol, self, implicit, diag=diag, local=local)
        return functools.partial(FrontProtocol, self, implicit, tree_only, diag, local)  # by position

    async def adopt(
        self, sock: socket.socket, kind: str, ssl: ssl_module.SSLContext | None = None
    ) -> tuple[str, int]:
        """Listen for `kind` clients ("http": the proxy port, "socks": SOCKS5; over TLS with `ssl`) on a
        socket of this machine bound before (by the proxy at its start, or by a remote session's
        guard, which keeps the agent's ports): egressd's own."""
        _check_kind(kind)
        self._sweep_from_now()
        loop = asyncio.get_running_loop()
        local = listener_end(sock)
        server = await loop.create_server(
            self._factory(kind, local=local),
            sock=sock,
            backlog=4096,
            ssl=ssl,
            ssl_handshake_timeout=10 if ssl else None,
        )
        return self._own(server)

    async def serve(self, handed: Handed) -> None:
        """Also accept clients on a listening socket made elsewhere (ProxyServer.serve_socket): in a
        child's network namespace, so not an address of this one (never registered)."""
        _check_kind(handed.kind)
        loop = asyncio.get_running_loop()
        self._sweep_from_now()
        local = listener_end(handed.sock)
        server = await loop.create_server(
            self._factory(handed.kind, handed.implicit, diag=handed.diag, local=local),
            sock=handed.sock,
        )
        self.servers.append(server)

    async def serve_child_only(self, sock: socket.socket, implicit: ProxyCredentials) -> None:
        """Serve a listener without credentials for one child's process tree (bound and registered
        as egressd's own by its maker): a connection whose socket is held by the child (the pid
        the pipeline registered for `implicit`) or its descendants counts as the child's; any
        other gets 407."""
        loop = asyncio.get_running_loop()
        self._sweep_from_now()
        local = listener_end(sock)
        server = await loop.create_server(
            self._factory("http", implicit, tree_only=True, local=local), sock=sock, backlog=1024
        )
        self.servers.append(server)

    def _own(self, server: asyncio.Server) -> tuple[str, int]:
        """A listener of this machine's: every socket it bound is egressd's own (`self`)."""
        self.servers.append(server)
        register(self.pipeline.decider, [sock.getsockname() for sock in server.sockets])
        address = server.sockets[0].getsockname()
        return address[0], address[1]

    def _sweep_from_now(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        """limits.header_timeout for request heads and SOCKS5 handshakes, limits.idle_timeout for
        relayed tunnels and plain-HTTP connections, timeouts.response for a plain-HTTP exchange's
        answer, and the pool's kept upstream connections: one sweep a second, not a timer per
        connection or request (a timer set and cancelled for every tunnel would cost more than the
        sweep). A limit is kept to within a second late."""
        while True:
            await asyncio.sleep(SWEEP)
            limits = self.pipeline.policies.get().limits
            now = time.monotonic()
            idle_cutoff, head_cutoff = now - limits.idle_timeout, now - limits.header_timeout
            for client in list(self.clients):
                if client.stage == "head":
                    if client.state is not None and client.state.started <= head_cutoff:
                        client.head_timed_out(limits.header_timeout)
                elif client.stage in ("relay", "sni") and client.tunnel.last_active < idle_cutoff:
                    client.close_idle()
                elif client.stage == "plain" and client.plain is not None:
                    client.plain.sweep(now, limits.header_timeout, limits.idle_timeout)
            self.upstreams.sweep(now)

    def close_clients(self, revoked: Callable[[ProxyCredentials], bool]) -> int:
        """End every client connection whose credentials are `revoked` (a gateway client removed
        from the token file): its open tunnels and kept-alive connections end now, and what still
        waits for an answer is answered (FrontProtocol.revoke)."""
        closed = 0
        for client in list(self.clients):
            creds = client.state.creds if client.state is not None else None
            if creds is not None and revoked(creds) and client.transport is not None:
                client.revoke()
                closed += 1
        return closed

    def close_listeners(self) -> None:
        for server in self.servers:
            server.close()

    def close(self) -> None:
        self.close_listeners()
        self.upstreams.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
