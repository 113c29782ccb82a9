"""Close a client connection from outside mitmproxy's layers (timeouts, limits)."""

from __future__ import annotations

from mitmproxy import ctx


def close_client(client_id: str) -> bool:
    """Close the client connection with this id now; False when it is already gone."""
    server = ctx.master.addons.get("proxyserver")
    handler = server.connections.get(client_id) if server is not None else None
    if handler is None:
        return False
    handler.close_connection(handler.client)
    return True
