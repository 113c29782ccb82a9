"""HTTP/1 header fields a proxy must treat specially: hop-by-hop names, the framing fields a
Connection header must not name, and the Host value for a canonical target. Pure."""

from __future__ import annotations

from egressd.policy import join_host_port

# hop-by-hop headers (RFC 9110 7.6.1) and proxy headers never forwarded upstream
HOP_BY_HOP = ("proxy-authorization", "proxy-connection", "keep-alive", "te", "trailer", "proxy-authenticate")


def hop_by_hop_names(connection: str, *, keep_upgrade: bool) -> list[str]:
    """The lower-case header names never forwarded upstream: the fixed hop-by-hop set plus those
    the Connection header lists (but not the close/keep-alive tokens themselves)."""
    names = list(HOP_BY_HOP)
    for token in connection.split(","):
        name = token.strip().lower()
        if not name or name in ("close", "keep-alive") or (keep_upgrade and name == "upgrade"):
            continue
        names.append(name)
    return names


# end-to-end headers a Connection header must not name: stripped as hop-by-hop while the body is
# still forwarded, the upstream would frame (or address) the request otherwise than it was decided,
# and read the body as a request nobody decided (request smuggling)
FRAMING = frozenset({"content-length", "transfer-encoding", "host"})


def connection_problem(connection: str) -> str | None:
    """Why a request whose Connection header names a framing header is refused (400), or None."""
    named = sorted(FRAMING.intersection(hop_by_hop_names(connection, keep_upgrade=True)))
    if not named:
        return None
    return f"the Connection header names {', '.join(named)}, which frames the request: not hop-by-hop"


def hostport(host: str, port: int, default_port: int = 80) -> str:
    """The Host header mitmproxy writes for a canonical host (no port when it is the default)."""
    if port == default_port:
        return f"[{host}]" if ":" in host else host
    return join_host_port(host, port)
