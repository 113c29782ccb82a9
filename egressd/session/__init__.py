"""One proxy session: the policy (watched when it is a file), the audit, the running proxy and its
services. `root.py` wires it; the other modules each hold one concern of it."""

from egressd.session.info import load_policy_data
from egressd.session.options import SessionError, SessionOptions
from egressd.session.overrides import Overrides, base_policy, file_policy, host_loopback, resolve_policy_path
from egressd.session.root import ProxySession

__all__ = [
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
