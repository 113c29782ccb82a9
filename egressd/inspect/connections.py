"""Close an upstream connection from outside mitmproxy's layers (the response timeout)."""

from __future__ import annotations

from mitmproxy import connection, ctx


def close_server(client_id: str, server: connection.Server) -> bool:
    """Close an upstream connection of this client's now; False when it is already gone."""
    proxy = ctx.master.addons.get("proxyserver")
    handler = proxy.connections.get(client_id) if proxy is not None else None
    if handler is None or server not in handler.transports:
        return False
    handler.close_connection(server)
    return True
