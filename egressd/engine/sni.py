"""The TLS SNI rule for tunnels, shared by the lean tunnel path and the mitmproxy tunnel guard."""

from __future__ import annotations

from egressd.policy import TargetError, canonical_host


def sni_problem(tunnel_host: str, sni: str | None) -> str | None:
    """None when the SNI may be used in a tunnel to tunnel_host, else what is wrong."""
    try:
        expected = canonical_host(tunnel_host)
    except (TargetError, ValueError):
        return f"tunnel host {tunnel_host!r} is not a valid host"
    if sni is None or sni == "":
        if expected.is_ip:
            return None
        return f"TLS ClientHello without SNI in a tunnel to {expected.text}"
    try:
        named = canonical_host(sni)
    except (TargetError, ValueError):
        return f"TLS SNI {sni!r} is not a valid host name"
    if named != expected:
        return f"TLS SNI {named.text} does not match the tunnel host {expected.text}"
    return None
