"""The pure policy core: canonical targets, address classes, rules, policy model, THE decision.

No network, no DNS, no mitmproxy here: everything that decides is a pure function, so the engine,
SOCKS, the sandbox bridge, the SSH relay and ``egressd check`` cannot disagree.
"""

from .addresses import AddressClass, classify, embedded_ipv4
from .decision import (
    AddressVerdict,
    Client,
    Decision,
    Program,
    decide,
    decide_written,
    filter_addresses,
    resolution_refusal,
)
from .hosts import (
    Host,
    IPAddress,
    Target,
    TargetError,
    canonical_host,
    join_host_port,
    make_target,
    parse_target,
)
from .loader import (
    PolicyError,
    apply_env_mode,
    builtin_policy_path,
    load_policy,
    parse_policy,
    policy_from_bytes,
)
from .model import (
    BuiltinAllowance,
    Credentials,
    Limits,
    LoopbackPolicy,
    Mode,
    Origin,
    Policy,
    PrivatePolicy,
    Profile,
    ResolverConfig,
    default_policy,
)
from .paths import normalise_path, path_matches
from .rules import HostRule, RuleError, RuleSet, parse_rule
from .upstream import UpstreamProxy

__all__ = [
    "AddressClass",
    "AddressVerdict",
    "BuiltinAllowance",
    "Client",
    "Credentials",
    "Decision",
    "Host",
    "HostRule",
    "IPAddress",
    "Limits",
    "LoopbackPolicy",
    "Mode",
    "Origin",
    "Policy",
    "PolicyError",
    "PrivatePolicy",
    "Profile",
    "Program",
    "ResolverConfig",
    "RuleError",
    "RuleSet",
    "Target",
    "TargetError",
    "UpstreamProxy",
    "apply_env_mode",
    "builtin_policy_path",
    "canonical_host",
    "classify",
    "decide",
    "decide_written",
    "default_policy",
    "embedded_ipv4",
    "filter_addresses",
    "load_policy",
    "join_host_port",
    "make_target",
    "normalise_path",
    "parse_policy",
    "parse_rule",
    "parse_target",
    "path_matches",
    "policy_from_bytes",
    "resolution_refusal",
]
