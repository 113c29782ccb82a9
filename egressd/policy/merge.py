"""Several policies as one (`--policy npm --policy github`): allowances add up, restrictions hold.

The merged policy admits a target only where one of the policies admits it, and refuses wherever
any of them refuses by a deny rule or a guard: deny rules add up, the mode is the strictest, the
loopback, private and WebSocket licences hold only where every policy grants them, limits are the
tightest (a shipped preset's mode does not vote next to the user's own policy). A policy's `ports`
restriction is moved into its own allow rules (and drops its private origins on other ports)
before the allow lists are joined, so one preset's ports never open another preset's hosts on
more ports; so is its `private.allow` when not every policy has it (each of its allow rules is
marked `private`), so its names still resolve to its private mirrors while another preset's names
do not. The result does not depend on the order of the policies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from .hosts import IPAddress
from .model import (
    MODES,
    AuditPolicy,
    BuiltinAllowance,
    Credentials,
    Limits,
    LoopbackPolicy,
    Mode,
    Origin,
    Policy,
    PrivatePolicy,
    Profile,
    RefusalPages,
    ResolverConfig,
)
from .rules import HostRule, RuleSet
from .schema import PolicyError
from .secrets import SecretSpec, check_secret_hosts, check_unique
from .upstream import UpstreamProxy

__all__ = ["merge_policies"]

# strictest first: the merged mode is the first of these that any policy has
_STRICTNESS: tuple[Mode, ...] = ("off", "enforce", "ask", "learn", "allow")
assert set(_STRICTNESS) == set(MODES)


def _rule_text(rule: HostRule, port: int) -> str:
    """The rule's host as written, with `port` (what `parse_rule` reads back as the same rule)."""
    if rule.network is not None:
        net = rule.network
        if rule.kind == "ip":
            address = str(net.network_address)
            return f"[{address}]:{port}" if net.version == 6 else f"{address}:{port}"
        return f"[{net}]:{port}" if net.version == 6 else f"{net}:{port}"
    prefix = "*." if rule.kind == "wildcard" else ""
    return f"{prefix}{rule.name}:{port}"


def _fold_ports(rules: RuleSet, ports: tuple[int, ...]) -> tuple[HostRule, ...]:
    """Allow rules with the policy's `ports` restriction in each rule: a rule without a port becomes
    one rule per port, a rule on a port outside the list (which admitted nothing) is dropped."""
    if not ports:
        return rules.rules
    out: list[HostRule] = []
    for rule in rules.rules:
        if rule.port is not None:
            if rule.port in ports:
                out.append(rule)
            continue
        out += [replace(rule, port=port, text=_rule_text(rule, port)) for port in ports]
    return tuple(out)


def _licence_rules(rules: Iterable[HostRule], private: bool) -> tuple[HostRule, ...]:
    """A policy's allow rules carrying its `private.allow` (when the merge cannot keep it whole):
    the names they admit may still resolve to private addresses. An IP/CIDR rule licenses the
    addresses it names already."""
    if not private:
        return tuple(rules)
    return tuple(replace(r, private=True) if r.kind in ("name", "wildcard") else r for r in rules)


def _unique[T](items: Iterable[T]) -> tuple[T, ...]:
    return tuple(dict.fromkeys(items))


def _union_rules(sets: Iterable[Iterable[HostRule]]) -> RuleSet:
    return RuleSet(_unique(rule for rules in sets for rule in rules))


def _merged_ports(lists: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """Ports for what no allow rule decides (builtins, ask/learn/allow modes): every port one of
    the policies admits; no restriction when one of them has none."""
    if any(not ports for ports in lists):
        return ()
    return tuple(sorted({port for ports in lists for port in ports}))


def _loopback(policies: Sequence[Policy]) -> LoopbackPolicy:
    """Loopback only where every policy admits it: the ports they all admit."""
    allowed = all(p.loopback.allow for p in policies)
    restricted = [set(p.loopback.ports) for p in policies if p.loopback.ports or p.loopback.named_ports_only]
    ports: tuple[int, ...] = ()
    named_only = any(p.loopback.named_ports_only for p in policies)
    if restricted:
        common = set.intersection(*restricted)
        ports = tuple(sorted(common))
        if not common:
            allowed = allowed and named_only  # nothing in common: no loopback port at all
    addresses: frozenset[IPAddress] = frozenset().union(*(p.loopback.addresses for p in policies))
    return LoopbackPolicy(allow=allowed, ports=ports, named_ports_only=named_only, addresses=addresses)


def _origins(policy: Policy) -> tuple[Origin, ...]:
    if not policy.ports:
        return policy.private.origins
    return tuple(o for o in policy.private.origins if o.port in policy.ports)


def _builtins(policies: Sequence[Policy], merged_ports: tuple[int, ...]) -> tuple[BuiltinAllowance, ...]:
    for policy in policies:
        wider = not merged_ports or not set(merged_ports) <= set(policy.ports)
        if policy.builtin and policy.ports and wider:
            raise PolicyError(
                policy.source,
                "builtin",
                message="cannot be merged with a policy admitting other ports: its built-in "
                f"allowances hold on ports {list(policy.ports)} only (write them as allow rules "
                "with a port and paths instead)",
            )
    return _unique(b for p in policies for b in p.builtin)


def _least(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _limits(policies: Sequence[Policy]) -> Limits:
    limits = [p.limits for p in policies]

    def least(name: str) -> float:
        return min(getattr(limit, name) for limit in limits)

    def least_count(name: str) -> int | None:
        value = _least(getattr(limit, name) for limit in limits)
        return None if value is None else int(value)

    return Limits(
        connect_timeout=least("connect_timeout"),
        dns_timeout=least("dns_timeout"),
        idle_timeout=least("idle_timeout"),
        max_response_bytes=least_count("max_response_bytes"),
        header_timeout=least("header_timeout"),
        max_connections=least_count("max_connections"),
        requests_per_second=_least(limit.requests_per_second for limit in limits),
        burst=least_count("burst"),
        response_timeout=least("response_timeout"),
    )


def _resolver(policies: Sequence[Policy]) -> ResolverConfig:
    named = {p.resolver.nameservers for p in policies if p.resolver.nameservers}
    if len(named) > 1:
        sources = ", ".join(p.source for p in policies if p.resolver.nameservers)
        raise PolicyError(sources, "resolver.nameservers", message="the policies name different nameservers")
    return ResolverConfig(next(iter(named))) if named else ResolverConfig()


def _profile(name: str, profiles: Sequence[Profile]) -> Profile:
    """One profile from several of that name: what any of them admits, minus what any denies."""
    allows = [p.allow for p in profiles]
    allow = None if any(a is None for a in allows) else _union_rules(a.rules for a in allows if a is not None)
    return Profile(
        name=name,
        allow=allow,
        deny=_union_rules(p.deny.rules for p in profiles),
        ports=_merged_ports([p.ports for p in profiles]),
    )


def _profiles(policies: Sequence[Policy]) -> dict[str, Profile]:
    names = sorted({name for p in policies for name in p.profiles})
    return {
        name: _profile(name, [p.profiles[name] for p in policies if name in p.profiles]) for name in names
    }


def _secrets(
    policies: Sequence[Policy], allow: RuleSet, deny: RuleSet, source: str
) -> tuple[SecretSpec, ...]:
    """Every policy's secrets (one name, one variable each), by name; each still goes only to hosts
    the merged policy allows and denies none of (another policy's deny refuses the merge)."""
    specs = sorted(_unique(spec for p in policies for spec in p.secrets), key=lambda spec: spec.name)
    merged = check_unique(specs, source)
    if merged:
        check_secret_hosts(merged, allow, deny, source)
    return merged


def merge_policies(policies: Sequence[Policy]) -> Policy:
    """One policy deciding as the list does: admitted where one admits, refused where one denies."""
    if not policies:
        raise ValueError("merge_policies needs at least one policy")
    if len(policies) == 1:
        return policies[0]
    ports = _merged_ports([p.ports for p in policies])
    # a shipped preset's `mode: enforce` is its default when used alone: next to the user's own
    # policy it does not vote (so `--policy mine.yaml --policy npm` keeps mine's `mode: ask`)
    voters = [p for p in policies if p.preset is None] or list(policies)
    mode = next(m for m in _STRICTNESS if any(p.mode == m for p in voters))
    pages: RefusalPages = "tls" if all(p.refusal_pages == "tls" for p in policies) else "status"
    strip = _unique(h for p in policies for h in p.credentials.strip_on_host_change)
    private = all(p.private.allow for p in policies)
    allow = _union_rules(
        _licence_rules(_fold_ports(p.allow, p.ports), p.private.allow and not private) for p in policies
    )
    deny = _union_rules(p.deny.rules for p in policies)
    source = " + ".join(p.source for p in policies)
    return Policy(
        version=1,
        mode=mode,
        allow=allow,
        deny=deny,
        loopback=_loopback(policies),
        private=PrivatePolicy(
            allow=private,
            origins=_unique(o for p in policies for o in _origins(p)),
        ),
        builtin=_builtins(policies, ports),
        inspect=_union_rules(p.inspect.rules for p in policies),
        ports=ports,
        credentials=Credentials(strip_on_host_change=strip),
        limits=_limits(policies),
        resolver=_resolver(policies),
        profiles=_profiles(policies),
        websocket=all(p.websocket for p in policies),
        refusal_pages=pages,
        ask_timeout=min(p.ask_timeout for p in policies),
        providers=tuple(sorted(set(a for p in policies for a in p.providers), key=repr)),
        secrets=_secrets(policies, allow, deny, source),
        upstream_proxy=_upstream_proxy(policies, source),
        audit=_audit(voters),
        source=source,
    )


def _audit(policies: Sequence[Policy]) -> AuditPolicy:
    """One policy that refuses what cannot be recorded is enough: refuse wins, the smallest queue
    (a shipped preset does not vote, as for the mode: its `refuse` is only the default)."""
    refuse = any(p.audit.on_failure == "refuse" for p in policies)
    return AuditPolicy(
        on_failure="refuse" if refuse else "continue",
        max_queue_bytes=min(p.audit.max_queue_bytes for p in policies),
    )


def _upstream_proxy(policies: Sequence[Policy], source: str) -> UpstreamProxy | None:
    """The one parent proxy the policies name (a way out is not a permission to add up or narrow):
    none, or the same one in each policy that names one; two different ones are an error."""
    parents = _unique(p.upstream_proxy for p in policies if p.upstream_proxy is not None)
    if len(parents) > 1:
        named = ", ".join(f"{p.where} ({q.source})" for q in policies if (p := q.upstream_proxy) is not None)
        raise PolicyError(
            source, "upstream_proxy", message=f"the policies name different parent proxies: {named}"
        )
    return parents[0] if parents else None
