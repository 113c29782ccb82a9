"""The request-rules step: what an HTTP request's headers must satisfy once its target is allowed.

Applied by the admission pipeline to every plain-HTTP request and every request inside an inspected
tunnel (the Host header names the decided host, the Connection header names no framing header,
upgrades only where the policy allows WebSockets). Pure; no mitmproxy import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from egressd.policy import TargetError, canonical_host
from egressd.refusal import Refusal
from egressd.wire.http_fields import connection_problem


def host_header_mismatch(values: Sequence[str], target: Any) -> str | None:
    """A Host header naming another host than the absolute-form target is refused (values: every
    Host header of the request)."""
    if not values:
        return None
    if len(values) > 1:
        return "more than one Host header"
    value = values[0].strip(" \t")
    host_part, port_part = value, None
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return f"malformed Host header {value!r}"
        host_part, rest = value[: end + 1], value[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                return f"malformed Host header {value!r}"
            port_part = rest[1:]
    elif value.count(":") == 1:
        host_part, port_part = value.split(":")
    try:
        host = canonical_host(host_part)
    except (TargetError, ValueError):
        return f"malformed Host header {value!r}"
    if host != target.host:
        return f"Host header names {host.text}, but the request is for {target.host.text}"
    if port_part is not None and (not port_part.isdigit() or int(port_part) != target.port):
        return f"Host header port {port_part!r} differs from the request's port {target.port}"
    return None


def request_refusal(target: Any, headers: Sequence[tuple[str, str]], *, websocket: bool) -> Refusal | None:
    """Why an allowed request is refused for its headers, or None."""
    host, port = target.host.text, target.port
    connection = ", ".join(v for n, v in headers if n.lower() == "connection")
    if (problem := connection_problem(connection)) is not None:
        return Refusal("bad_request", problem, host, port)
    hosts = [v for n, v in headers if n.lower() == "host"]
    if (mismatch := host_header_mismatch(hosts, target)) is not None:
        return Refusal("host_mismatch", mismatch, host, port)
    upgrade = "upgrade" in connection.lower() and any(n.lower() == "upgrade" for n, _ in headers)
    if upgrade and not websocket:
        return Refusal(
            "websocket", "protocol upgrades (WebSocket) are off in this policy (websocket: false)", host, port
        )
    return None
