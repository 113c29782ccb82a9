"""The request-rules step: what an HTTP request's headers must satisfy once its target is allowed.

Applied by the admission pipeline to every plain-HTTP request and every request inside an inspected
tunnel (the Host header names the decided host, the Connection header names no framing header, an
upgrade only as a WebSocket handshake the decision lets upgrade). Pure; no mitmproxy import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from egressd.policy import TargetError, canonical_host
from egressd.policy.ports import port_number
from egressd.policy.reasons import Reason
from egressd.policy.refusal import Refusal
from egressd.wire.http_fields import connection_problem, upgrade_protocols


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
    if port_part is not None and port_number(port_part) != target.port:
        return f"Host header port {port_part!r} differs from the request's port {target.port}"
    return None


def request_refusal(
    target: Any,
    headers: Sequence[tuple[str, str]],
    *,
    websocket: bool,
    upgrade: bool,
    method: str | None,
) -> Refusal | None:
    """Why an allowed request is refused for its headers, or None. `upgrade`: the decision lets
    this request upgrade its connection (egressd.policy.Decision.upgrade)."""
    host, port = target.host.text, target.port
    connection = ", ".join(v for n, v in headers if n.lower() == "connection")
    if (problem := connection_problem(connection)) is not None:
        return Refusal(Reason.BAD_REQUEST, problem, host, port)
    hosts = [v for n, v in headers if n.lower() == "host"]
    if (mismatch := host_header_mismatch(hosts, target)) is not None:
        return Refusal(Reason.HOST_MISMATCH, mismatch, host, port)
    protocols = upgrade_protocols(headers)
    if protocols is not None and (why := _upgrade_problem(protocols, headers, method, websocket, upgrade)):
        return Refusal(Reason.WEBSOCKET, why, host, port)
    return None


def _upgrade_problem(
    protocols: list[str],
    headers: Sequence[tuple[str, str]],
    method: str | None,
    websocket: bool,
    upgrade: bool,
) -> str | None:
    """Why a request asking to switch protocols may not: after a 101 egressd relays the connection
    undecided, so only a WebSocket handshake of a request the policy admits whole is let through."""
    if not websocket:
        return "protocol upgrades (WebSocket) are off in this policy (websocket: false)"
    if [p.lower() for p in protocols] != ["websocket"]:
        asked = ", ".join(protocols) or "(nothing)"
        why = f"only WebSocket upgrades are relayed, and this request asks for {asked}"
        if any(p.lower() == "h2c" for p in protocols):
            why += " (h2c would carry HTTP/2 requests nobody decides)"
        return why
    keys = [v for n, v in headers if n.lower() == "sec-websocket-key"]
    versions = [v.strip() for n, v in headers if n.lower() == "sec-websocket-version"]
    if method != "GET" or len(keys) != 1 or versions != ["13"]:
        return "not a WebSocket handshake (RFC 6455: GET, one Sec-WebSocket-Key, Sec-WebSocket-Version: 13)"
    if not upgrade:
        return (
            "this request is admitted only by rules naming paths or methods (or a builtin allowance, "
            "or under a deny rule naming paths), which cover it but not what its connection would "
            "carry after an upgrade; a rule allows that with websocket: true"
        )
    return None
