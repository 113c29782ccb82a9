"""The sandbox's own allowances (`--only`, `--profile`): they narrow the policy, never widen it.

They become one client profile in the policy (the mechanism the decision function already has:
a profile can only refuse, reason `profile`). The child's credentials name that profile, so every
decision the proxy makes for the child is policy AND profile AND `--only`.

With both `--profile P` and `--only R...`, the synthetic profile's allow list is the pairwise
intersection of P's allow rules and the `--only` rules (P's deny rules and ports are kept). Rules
are host sets, and two host rules intersect in at most one host rule, so the intersection is exact
(tested against the reference matcher), except that it never admits more than both would.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence
from dataclasses import replace

from egressd.policy import HostRule, Policy, PolicyError, RuleSet, parse_rule
from egressd.policy.model import Profile
from egressd.policy.rules import RuleError

ONLY_PROFILE = "sandbox"
_LOCALHOST = ipaddress.IPv4Address("127.0.0.1")


def parse_only(rules: Sequence[str]) -> tuple[HostRule, ...]:
    """`--only` values as host rules; a bad one raises PolicyError naming the option."""
    parsed = []
    for index, text in enumerate(rules):
        try:
            parsed.append(parse_rule(text))
        except RuleError as exc:
            raise PolicyError("<command line>", f"--only[{index}]", text, str(exc)) from None
    return tuple(parsed)


def _port(a: int | None, b: int | None) -> tuple[bool, int | None]:
    if a is None or b is None or a == b:
        return True, a if a is not None else b
    return False, None


def _domain(rule: HostRule) -> tuple[str, bool]:
    """(name, includes the name itself): `example.com` -> (.., True), `*.example.com` -> (.., False)."""
    assert rule.name is not None
    return rule.name, rule.kind == "name"


def _below(child: str, parent: str) -> bool:
    return child.endswith("." + parent)


def _names(a: HostRule, b: HostRule) -> tuple[str, str] | None:
    """(kind, name) of the intersection of two name/wildcard rules, or None when disjoint."""
    (x, x_self), (y, y_self) = _domain(a), _domain(b)
    if x == y:
        return ("name" if x_self and y_self else "wildcard"), x
    if _below(x, y):  # x's tree lies inside y's subdomains
        return ("name" if x_self else "wildcard"), x
    if _below(y, x):
        return ("name" if y_self else "wildcard"), y
    return None


def _text(kind: str, name: str | None, network: object, port: int | None) -> str:
    if kind in ("name", "wildcard"):
        host = name if kind == "name" else f"*.{name}"
    else:
        net = ipaddress.ip_network(str(network))
        single = net.prefixlen == net.max_prefixlen
        host = str(net.network_address) if single else str(net)
        if port is not None and net.version == 6:
            host = f"[{host}]"
    return host if port is None else f"{host}:{port}"


def intersect(a: HostRule, b: HostRule) -> HostRule | None:
    """The rule matching exactly what both match (None when nothing); `a` keeps its paths/methods.

    `--only` rules carry no paths or methods, so `a` (the profile's rule) supplies them.
    """
    ok, port = _port(a.port, b.port)
    if not ok:
        return None
    a_net, b_net = a.network is not None, b.network is not None
    if a_net and b_net:
        assert a.network is not None and b.network is not None
        if a.network.version != b.network.version or not a.network.overlaps(b.network):
            return None
        network = a.network if a.network.subnet_of(b.network) else b.network  # type: ignore[arg-type]
        kind = "ip" if network.prefixlen == network.max_prefixlen else "cidr"
        return HostRule(_text(kind, None, network, port), kind, None, network, port, a.paths, a.methods)
    if a_net != b_net:
        # A loopback name (`localhost`, `*.localhost`) also matches rules for 127.0.0.1.
        named, net = (b, a) if a_net else (a, b)
        assert net.network is not None
        if _LOCALHOST not in net.network:
            return None
        localhost = parse_rule("localhost")
        found = _names(named, localhost)
    else:
        found = _names(a, b)
    if found is None:
        return None
    kind, name = found
    return HostRule(_text(kind, name, None, port), kind, name, None, port, a.paths, a.methods)  # type: ignore[arg-type]


def intersect_sets(a: Sequence[HostRule], b: Sequence[HostRule]) -> tuple[HostRule, ...]:
    out = []
    for left in a:
        for right in b:
            rule = intersect(left, right)
            if rule is not None and rule not in out:
                out.append(rule)
    return tuple(out)


def narrowed_profile(only: Sequence[HostRule], base: Profile | None, name: str) -> Profile:
    """`--only` as a profile, intersected with the named profile when there is one."""
    if base is None:
        return Profile(name=name, allow=RuleSet(only))
    allow = only if base.allow is None else intersect_sets(base.allow.rules, only)
    return Profile(name=name, allow=RuleSet(allow), deny=base.deny, ports=base.ports)


def profile_name(base: str | None, taken: Sequence[str] = ()) -> str:
    """`sandbox` or `<profile>.sandbox`, made unique among the policy's own profiles."""
    stem = f"{base}.{ONLY_PROFILE}" if base else ONLY_PROFILE
    name, counter = stem, 1
    while name in taken:
        counter += 1
        name = f"{stem}{counter}"
    return name


class Narrowing:
    """A ProxySession transform adding the synthetic profile to every (re)loaded policy.

    The profile's name is chosen once, at the first load, and then fixed: the child's credentials
    carry it. Should a later edit of the policy define a profile of that name, the synthetic one
    replaces it, so the child's profile never changes under it.
    """

    def __init__(self, only: Sequence[HostRule], base: str | None) -> None:
        self.only = tuple(only)
        self.base = base
        self.profile: str | None = None

    def __call__(self, policy: Policy) -> Policy:
        if self.profile is None:
            self.profile = profile_name(self.base, tuple(policy.profiles))
        base = policy.profiles.get(self.base) if self.base else None
        if self.base and base is None:  # never fall back to --only alone: that could admit more
            raise PolicyError(policy.source, "--profile", self.base, "no such profile")
        profile = narrowed_profile(self.only, base, self.profile)
        return replace(policy, profiles={**policy.profiles, self.profile: profile})


class LoopbackConfinement:
    """A ProxySession transform: inside the sandbox the host's services (another proxy, a database,
    the Docker API on TCP), on its loopback and on its own interface addresses alike, are reachable
    only on the ports the policy's `loopback.ports` or `--allow-loopback-port` name: every other
    host port would be a way out of the sandbox."""

    def __init__(self, ports: Sequence[int], then: Callable[[Policy], Policy] | None = None) -> None:
        self.ports = tuple(ports)
        self.then = then

    def __call__(self, policy: Policy) -> Policy:
        from egressd.session import host_loopback

        policy = host_loopback(policy, self.ports)
        return self.then(policy) if self.then else policy
