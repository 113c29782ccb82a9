"""HTTP/1 header fields a proxy must treat specially: hop-by-hop names, the framing fields a
Connection header must not name, and the Host value for a canonical target. Pure."""

from __future__ import annotations

from collections.abc import Sequence

from egressd.policy import join_host_port

# hop-by-hop headers (RFC 9110 7.6.1) and proxy headers never forwarded upstream; HTTP2-Settings
# belongs to an h2c upgrade, which egressd never relays
HOP_BY_HOP = (
    "proxy-authorization",
    "proxy-connection",
    "keep-alive",
    "te",
    "trailer",
    "proxy-authenticate",
    "http2-settings",
)


def hop_by_hop_names(connection: str, *, keep_upgrade: bool) -> list[str]:
    """The lower-case header names never forwarded: the fixed hop-by-hop set plus those the
    Connection header lists (but not the close/keep-alive tokens themselves), and Upgrade unless
    the message is an upgrade egressd relays (a lenient peer may switch on Upgrade alone)."""
    names = list(HOP_BY_HOP)
    if not keep_upgrade:
        names.append("upgrade")
    for token in connection.split(","):
        name = token.strip().lower()
        if not name or name in ("close", "keep-alive", "upgrade"):
            continue
        names.append(name)
    return names


def upgrade_protocols(fields: Sequence[tuple[str, str]]) -> list[str] | None:
    """The protocols a request asks to switch to, in order (every Upgrade field's list), or None
    when it asks for no upgrade: that takes a Connection field naming `upgrade` and an Upgrade
    field."""
    connection = ",".join(v for n, v in fields if n.lower() == "connection")
    if "upgrade" not in {token.strip().lower() for token in connection.split(",")}:
        return None
    values = [v for n, v in fields if n.lower() == "upgrade"]
    if not values:
        return None
    return [token.strip() for value in values for token in value.split(",") if token.strip()]


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
