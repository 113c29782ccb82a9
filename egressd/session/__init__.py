"""One proxy session: the policy (watched when it is a file), the audit, the running proxy and its
services. `root.py` wires it; the other modules each hold one concern of it."""

from egressd.session.info import load_policy_data
from egressd.session.options import SessionError, SessionOptions
from egressd.session.overrides import Overrides, base_policy, file_policy, host_loopback, resolve_policy_path
from egressd.session.root import ProxySession

__all__ = [
    "GatewayOptions",
    "ListenerTLS",
    "Overrides",
    "ProxySession",
    "SessionError",
    "SessionOptions",
    "base_policy",
    "file_policy",
    "host_loopback",
    "load_policy_data",
    "resolve_policy_path",
]


def __getattr__(name: str) -> object:
    """The gateway's options, loaded when first asked for (gateway_options.py)."""
    if name in ("GatewayOptions", "ListenerTLS"):
        from egressd.session import gateway_options

        return getattr(gateway_options, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
