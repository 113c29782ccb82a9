"""THE decision: one pure function of (target, client, policy), plus the post-resolution filter.

The proxy engine, SOCKS, the sandbox bridge, the SSH relay and ``egressd check`` all call
``decide``; none has a decision of its own. The steps run in the order docs/policy.md lists ("How a
target is decided"); the address classes are docs/architecture.md's.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace

from .addresses import AddressClass, classify, describe, embedded_ipv4_candidates
from .hosts import (
    Host,
    IPAddress,
    Target,
    TargetError,
    canonical_ip,
    join_host_port,
    make_target,
    parse_target,
)
from .model import Policy, Profile
from .paths import normalise_path, path_matches
from .reasons import Reason
from .rules import HostRule, RuleSet

__all__ = [
    "AddressVerdict",
    "Client",
    "Decision",
    "Program",
    "decide",
    "decide_written",
    "filter_addresses",
    "resolution_refusal",
]

LOCALHOST_ADDRESS = ipaddress.IPv4Address("127.0.0.1")
# egressd's own listening addresses as the caller gave them; canonicalised where they are compared
_Own = tuple[tuple[IPAddress, int], ...]


@dataclass(frozen=True)
class Program:
    """The program that opened a connection, as an `exe` rule sees it.

    ``paths``: the executable's path as the kernel reports it (symlinks resolved) and the system
    aliases found for it (``/usr/bin/python3`` for ``/usr/bin/python3.11``); a rule's name matches
    the file name of any of them, a rule's path one of them exactly."""

    exe: str
    paths: frozenset[str] = frozenset()

    @property
    def names(self) -> frozenset[str]:
        return frozenset(path.rsplit("/", 1)[-1] for path in self.paths | {self.exe})

    def matches(self, entries: Sequence[str]) -> bool:
        paths = self.paths | {self.exe}
        names = self.names
        return any((entry in paths) if "/" in entry else (entry in names) for entry in entries)


@dataclass(frozen=True)
class Client:
    """Who is asking; ``profile`` names one of ``policy.profiles`` (it can only narrow).

    ``program``: the program holding the connection, None when unknown (not looked up, gone, or
    ambiguous); a rule scoped by `exe` admits no unknown program."""

    profile: str | None = None
    program: Program | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer, with the stable reason code and the rule or setting that decided it."""

    allowed: bool
    reason: Reason
    rule: str | None
    target: Target | None
    detail: str = ""
    ask: bool = False
    needs_resolution: bool = False
    needs_inspection: bool = False
    private_ok: bool = False
    addresses: tuple[IPAddress, ...] = ()
    profile: str | None = None
    self_addresses: tuple[tuple[IPAddress, int], ...] = field(default=(), repr=False)
    # mode: learn: the reason enforce would have refused with (the audit records it; suggest reads it)
    would_be: Reason | None = None
    # an admitted HTTP request may upgrade its connection (a WebSocket): not where only path/method
    # rules or a builtin allowance admit it (the relay after a 101 carries any request), unless the
    # rule says `websocket: true`, nor where a path/method deny rule names the host
    upgrade: bool = False

    def __post_init__(self) -> None:
        if type(self.reason) is not Reason:  # a code given from outside (an approver's): a typo raises
            object.__setattr__(self, "reason", Reason.of(self.reason))


@dataclass(frozen=True)
class AddressVerdict:
    """What the filter did with one resolved address, and why (for audit and refusal details)."""

    address: IPAddress
    klass: AddressClass
    kept: bool
    why: str


# _Request and _Allow live within one decision, never compared nor printed: plain classes, since a
# dataclass would only add its start-up time (its methods are generated when the module loads).
class _Request:
    """The canonical target plus what the rules need to know about it, worked out once."""

    __slots__ = (
        "target",
        "host",
        "port",
        "text",
        "where",
        "klass",
        "loopback_name",
        "loopback",
        "path",
        "path_known",
        "method",
        "program",
    )

    def __init__(
        self,
        target: Target,
        host: Host,
        port: int,
        text: str,  # the host's canonical spelling
        where: str,  # host:port, IPv6 bracketed, for messages
        klass: tuple[AddressClass, str] | None,  # describe() of an IP literal
        loopback_name: bool,
        loopback: bool,
        path: str | None,  # normalised; None when unknown or unreadable
        path_known: bool,
        method: str,
        program: Program | None = None,
    ) -> None:
        self.target = target
        self.host = host
        self.port = port
        self.text = text
        self.where = where
        self.klass = klass
        self.loopback_name = loopback_name
        self.loopback = loopback
        self.path = path
        self.path_known = path_known
        self.method = method
        self.program = program


class _Allow:
    """An intermediate allow (or ask) awaiting the step-11 checks."""

    __slots__ = ("reason", "rule", "detail", "private_ok", "needs_inspection", "ask", "would_be", "upgrade")

    def __init__(
        self,
        reason: Reason,
        rule: str,
        detail: str,
        private_ok: bool = False,
        needs_inspection: bool = False,
        ask: bool = False,
        would_be: Reason | None = None,
        upgrade: bool = True,
    ) -> None:
        self.reason = reason
        self.rule = rule
        self.detail = detail
        self.private_ok = private_ok
        self.needs_inspection = needs_inspection
        self.ask = ask
        self.would_be = would_be
        self.upgrade = upgrade


def _as_ip(value: object) -> IPAddress:
    if isinstance(value, ipaddress.IPv4Address | ipaddress.IPv6Address):
        return canonical_ip(value)
    return canonical_ip(ipaddress.ip_address(str(value)))


def _canonical(raw: Target | str) -> Target:
    """The canonical Target of a `host:port` text, or of a Target built anywhere: its host is
    canonicalised again (``Target(Host("EXAMPLE.com"), 443)`` is a Target too)."""
    if isinstance(raw, str):
        return parse_target(raw)
    if not isinstance(raw, Target) or not isinstance(raw.host, Host):
        raise TargetError(f"not a target: {raw!r}")
    return make_target(raw.host, raw.port, scheme=raw.scheme, path=raw.path, method=raw.method)


def _is_loopback_name(host: Host) -> bool:
    return host.name is not None and (host.name == "localhost" or host.name.endswith(".localhost"))


_THIS_MACHINE = (AddressClass.LOOPBACK, "an address of this machine (loopback rules)")


def _local(ip: IPAddress, addresses: frozenset[IPAddress]) -> bool:
    """ip, in any spelling that embeds one, is one of `loopback.addresses`."""
    if ip in addresses:
        return True
    return ip.version == 6 and any(v4 in addresses for v4 in embedded_ipv4_candidates(ip))


def _describe(ip: IPAddress, policy: Policy) -> tuple[AddressClass, str]:
    """describe(), with `loopback.addresses` classed as loopback (always-refused stays so)."""
    klass = describe(ip)
    local = policy.loopback.addresses
    if local and klass[0] is not AddressClass.FORBIDDEN and _local(canonical_ip(ip), local):
        return _THIS_MACHINE
    return klass


def _request(target: Target) -> _Request:
    """What the steps ask about the target, worked out once instead of once per step."""
    host = target.host
    text = host.text
    where = target.authority()
    klass = describe(host.ip) if host.ip is not None else None
    loopback_name = _is_loopback_name(host)
    path = target.path
    return _Request(
        target,
        host,
        target.port,
        text,
        where,
        klass,
        loopback_name,
        loopback_name or (klass is not None and klass[0] is AddressClass.LOOPBACK),
        normalise_path(path) if path is not None else None,
        path is not None,
        target.method or "GET",
    )


def _fmt(ip: IPAddress, port: int) -> str:
    return join_host_port(str(ip), port)


_LOCALHOST = Host(name=None, ip=LOCALHOST_ADDRESS)


def _matching(rules: RuleSet, request: _Request) -> list[HostRule]:
    """Rules matching the target; ``localhost`` names also match rules for 127.0.0.1."""
    found = rules.matching(request.host, request.port)
    if request.loopback_name:
        return found + rules.matching(_LOCALHOST, request.port)
    return found


def _covers(rule: HostRule, request: _Request) -> bool | None:
    """Does the rule cover this request? None when it depends on a path not yet known (CONNECT)."""
    if rule.exe and (request.program is None or not request.program.matches(rule.exe)):
        return False
    if not rule.restricted:
        return True
    if not request.path_known:
        return None
    if rule.methods and request.method not in rule.methods:
        return False
    if not rule.paths:
        return True
    return request.path is not None and any(path_matches(p, request.path) for p in rule.paths)


def _upgradable(rules: Iterable[HostRule], request: _Request) -> bool:
    """Some rule admitting the request admits it whole (no paths or methods) or says websocket."""
    return any((not rule.restricted or rule.websocket) and _covers(rule, request) for rule in rules)


def _admission(rules: Iterable[HostRule], request: _Request) -> tuple[HostRule | None, HostRule | None]:
    """(first rule that admits, first rule that would admit once the path is known)."""
    pending: HostRule | None = None
    for rule in rules:
        covered = _covers(rule, request)
        if covered:
            return rule, None
        if covered is None and pending is None:
            pending = rule
    return None, pending


def _exe_refusal(rules: RuleSet, request: _Request, client: Client) -> Decision | None:
    """Step 8b: allow rules name this host, but only for other programs (`exe`): refused in every
    mode, since the policy said which programs may reach it."""
    scoped = [rule for rule in _matching(rules, request) if rule.exe]
    if not scoped:
        return None
    programs = list(dict.fromkeys(entry for rule in scoped for entry in rule.exe))
    program = request.program
    who = (
        f"program {program.exe}"
        if program is not None
        else "a program egressd could not identify (the connection's owner is unknown)"
    )
    detail = (
        f"{request.where} is allowed only for the programs {', '.join(programs)} "
        f"(rule {scoped[0].describe()!r}); this connection comes from {who}."
    )
    return _refuse(request, Reason.EXE_NOT_ALLOWED, f"allow: {scoped[0].text}", detail, client)


def _refuse(request: _Request, reason: Reason, rule: str | None, detail: str, client: Client) -> Decision:
    return Decision(False, reason, rule, request.target, detail, profile=client.profile)


def _self_match(
    request: _Request, self_addresses: Sequence[tuple[IPAddress, int]]
) -> tuple[IPAddress, int] | None:
    if not self_addresses:
        return None
    host_ip = canonical_ip(request.host.ip) if request.host.ip is not None else None
    for raw_ip, raw_port in self_addresses:
        port = int(raw_port)
        if port != request.port:
            continue
        ip = _as_ip(raw_ip)
        if host_ip is not None and host_ip == ip:
            return ip, port
        if request.loopback and (ip.is_loopback or ip.is_unspecified):
            return ip, port
    return None


def _profile_refusal(request: _Request, client: Client, policy: Policy) -> tuple[Decision | None, bool, bool]:
    """Step 11b: the client's profile may refuse (never admit). Returns (refusal,
    needs_inspection, upgrade: the profile lets an admitted request upgrade)."""
    name = client.profile
    if name is None:
        return None, False, True
    profile: Profile | None = policy.profiles.get(name)
    if profile is None:
        known = ", ".join(sorted(policy.profiles)) or "none"
        detail = f"unknown profile {name!r} (profiles in {policy.source}: {known})."
        return _refuse(request, Reason.PROFILE, f"profile {name}", detail, client), False, False
    pending, upgrade = False, True
    for rule in _matching(profile.deny, request):
        covered = _covers(rule, request)
        if covered:
            detail = f"{request.where} is denied by profile {name} rule {rule.describe()!r}."
            return (
                _refuse(request, Reason.PROFILE, f"profile {name}: deny {rule.text}", detail, client),
                False,
                False,
            )
        pending = pending or covered is None
        upgrade = upgrade and not rule.restricted
    if profile.ports and not request.loopback and request.port not in profile.ports:
        detail = f"port {request.port} is not in profile {name} ports {list(profile.ports)}."
        rule_text = f"profile {name}: ports {list(profile.ports)}"
        refusal = _refuse(request, Reason.PROFILE, rule_text, detail, client)
        return refusal, False, False
    if profile.allow is not None:
        matching = _matching(profile.allow, request)
        admitted, waiting = _admission(matching, request)
        if admitted is None and waiting is None:
            detail = f"{request.where} is not in the allowlist of profile {name}."
            return _refuse(request, Reason.PROFILE, f"profile {name}: allow", detail, client), False, False
        pending = pending or admitted is None
        upgrade = upgrade and _upgradable(matching, request)
    return None, pending, upgrade


def _finish(
    request: _Request,
    client: Client,
    policy: Policy,
    outcome: _Allow,
    deny_pending: bool,
    self_addresses: tuple[tuple[IPAddress, int], ...],
) -> Decision:
    """Step 11: ``ports`` (non-loopback) and the profile, then the final Decision."""
    if not request.loopback and policy.ports and request.port not in policy.ports:
        detail = f"port {request.port} is not in the allowed ports {list(policy.ports)}."
        return _refuse(request, Reason.PORT, f"ports: {list(policy.ports)}", detail, client)
    profile_pending, profile_upgrade = False, True
    if client.profile is not None:
        refusal, profile_pending, profile_upgrade = _profile_refusal(request, client, policy)
        if refusal is not None:
            return refusal
    host = request.host
    if host.ip is not None:
        addresses: tuple[IPAddress, ...] = (host.ip,)
    elif request.loopback_name:
        addresses = (LOCALHOST_ADDRESS,)
    else:
        addresses = ()
    needs_resolution = not addresses
    upgrade = (
        outcome.upgrade
        and profile_upgrade
        and request.path_known  # an HTTP request: a tunnel has no upgrade of its own
        and not outcome.needs_inspection
        and not any(rule.restricted for rule in _matching(policy.deny, request))
    )
    return Decision(
        not outcome.ask,
        outcome.reason,
        outcome.rule,
        request.target,
        outcome.detail,
        outcome.ask,
        needs_resolution,
        outcome.needs_inspection or deny_pending or profile_pending,
        outcome.private_ok or bool(addresses),
        addresses,
        client.profile,
        self_addresses if needs_resolution else (),
        outcome.would_be,
        upgrade,
    )


def _guarded_literal(request: _Request, policy: Policy) -> bool:
    """An IP literal a name could not resolve to without a licence: non-global, and no private.allow.

    Always-refused literals left at step 4 and loopback ones at step 6; this is the rest (RFC 1918,
    CGNAT, ULA, documentation and other special-purpose ranges, in every spelling describe() knows).
    """
    klass = request.klass
    return klass is not None and klass[0] is not AddressClass.GLOBAL and not policy.private.allow


def _licensed(rule: HostRule, request: _Request, policy: Policy, rules: Sequence[HostRule]) -> bool:
    """May an allowed target use private addresses: an IP/CIDR rule names them itself, a private
    origin licenses exactly its own (an allow rule for the same name keeps that licence), and so
    does any rule marked `private` that admits the target as far as `rule` does (`rules`: those
    matching it; a rule that waits for the path counts only while `rule` waits too)."""
    if rule.kind in ("ip", "cidr") or (
        bool(policy.private.origins) and _origin_matches(request, policy) is not None
    ):
        return True
    covered = (True, _covers(rule, request))
    return any(other.private and _covers(other, request) in covered for other in rules)


def _origin_matches(request: _Request, policy: Policy) -> str | None:
    scheme = request.target.scheme
    for origin in policy.private.origins:
        if origin.host != request.host or origin.port != request.port:
            continue
        if origin.scheme == "http" and scheme == "http":
            return str(origin)
        if origin.scheme == "https" and scheme in ("https", "connect", "socks5", None):
            return str(origin)
    return None


def _builtin_step(
    request: _Request,
    client: Client,
    policy: Policy,
    admitted: HostRule | None,
    deny_pending: bool,
    own: _Own,
) -> Decision | None:
    """Step 7: built-in allowances (exact host, fixed path prefixes, methods), when they apply."""
    if not policy.builtin:
        return None
    text, where = request.text, request.where
    builtins = [b for b in policy.builtin if b.host == text]
    if not builtins or (admitted is not None and not admitted.restricted):
        return None
    if not request.path_known:
        if admitted is not None:
            return None
        detail = f"{where} is allowed for some paths only; the path is not visible without inspection"
        outcome = _Allow(Reason.BUILTIN, f"builtin: {text}", detail, needs_inspection=True)
        return _finish(request, client, policy, outcome, deny_pending, own)
    for allowance in builtins:
        if request.method not in allowance.effective_methods or request.path is None:
            continue
        for prefix in allowance.paths:
            if path_matches(prefix, request.path):
                methods = ",".join(allowance.effective_methods)
                rule = f"builtin: {text} {prefix} {methods}"
                detail = f"{request.method} {request.path} on {where}"
                outcome = _Allow(Reason.BUILTIN, rule, detail, upgrade=allowance.websocket)
                return _finish(request, client, policy, outcome, deny_pending, own)
    if admitted is not None:
        return None
    covered = "; ".join(f"{','.join(b.paths)} {','.join(b.effective_methods)}" for b in builtins)
    detail = (
        f"{request.method} {request.target.path} on {where} is outside the built-in allowance ({covered})."
    )
    return _refuse(request, Reason.BUILTIN_PATH, f"builtin: {text}", detail, client)


def _decide(target: Target, client: Client, policy: Policy, own: _Own) -> Decision:
    """The steps, on a canonical Target (1. parse and canonicalise: the callers, once)."""
    request = _request(target)
    request.program = client.program
    if policy.loopback.addresses and request.host.ip is not None and not request.loopback:
        request.klass = _describe(request.host.ip, policy)
        request.loopback = request.klass is _THIS_MACHINE
    where = request.where

    # 2. egressd's own listening addresses.
    mine = _self_match(request, own)
    if mine is not None:
        detail = f"{where} is egressd's own listening address; a child may not loop back into it."
        return _refuse(request, Reason.SELF, f"self {_fmt(*mine)}", detail, client)

    # 3. mode off.
    if policy.mode == "off":
        return _refuse(request, Reason.MODE_OFF, "mode: off", "egress is switched off (mode: off).", client)

    # 4. Always-refused addresses, in any spelling.
    if request.klass is not None and request.klass[0] is AddressClass.FORBIDDEN:
        why = request.klass[1]
        detail = f"{request.text} is an always-refused address ({why}); no setting lifts this."
        return _refuse(request, Reason.FORBIDDEN_ADDRESS, f"always refused: {why}", detail, client)

    # 5. Deny rules (a path-restricted deny needs the path: the tunnel must then be inspected).
    deny_pending = False
    for rule in _matching(policy.deny, request):
        covered = _covers(rule, request)
        if covered:
            detail = f"{where} matches deny rule {rule.describe()!r} in {policy.source}."
            return _refuse(request, Reason.DENYLIST, f"deny: {rule.text}", detail, client)
        deny_pending = deny_pending or covered is None

    # 6. Loopback literals: decided here, not subject to `ports`.
    if request.loopback:
        if not policy.loopback.allow:
            detail = f"{where} is a loopback address and loopback.allow is false in {policy.source}."
            return _refuse(request, Reason.LOOPBACK_DISABLED, "loopback.allow: false", detail, client)
        ports = policy.loopback.ports
        if not policy.loopback.admits_port(request.port):
            detail = f"loopback port {request.port} is not in loopback.ports {list(ports)}."
            if policy.loopback.named_ports_only:
                detail = (
                    f"inside the sandbox the host's loopback is reachable only on the ports the policy "
                    f"names (loopback.ports: {list(ports)}); allow this one with "
                    f"--allow-loopback-port {request.port}."
                )
            return _refuse(request, Reason.LOOPBACK_PORT, f"loopback.ports: {list(ports)}", detail, client)
        outcome = _Allow(Reason.LOOPBACK, "loopback.allow", f"{where} is loopback (loopback.allow)", True)
        return _finish(request, client, policy, outcome, deny_pending, own)

    allowing = _matching(policy.allow, request)
    admitted, pending = _admission(allowing, request)

    # 7. Built-in allowances: exact host, fixed path prefixes, methods.
    builtin = _builtin_step(request, client, policy, admitted, deny_pending, own)
    if builtin is not None:
        return builtin

    # 8. Allow rules.
    if admitted is not None:
        outcome = _Allow(
            Reason.ALLOWLIST,
            f"allow: {admitted.text}",
            f"{where} matches allow rule {admitted.describe()!r} in {policy.source}",
            private_ok=_licensed(admitted, request, policy, allowing),
            upgrade=not admitted.restricted or admitted.websocket or _upgradable(allowing, request),
        )
        return _finish(request, client, policy, outcome, deny_pending, own)
    if pending is not None:
        outcome = _Allow(
            Reason.ALLOWLIST,
            f"allow: {pending.text}",
            f"{where} is allowed for {pending.describe()!r} only; the path needs inspection",
            private_ok=_licensed(pending, request, policy, allowing),
            needs_inspection=True,
        )
        return _finish(request, client, policy, outcome, deny_pending, own)
    scoped = _exe_refusal(policy.allow, request, client)
    if scoped is not None:
        return scoped

    # 9. Private exact origin.
    origin = _origin_matches(request, policy)
    if origin is not None:
        outcome = _Allow(
            Reason.PRIVATE_ORIGIN,
            f"private.origins: {origin}",
            f"{where} is the private origin {origin}",
            private_ok=True,
        )
        return _finish(request, client, policy, outcome, deny_pending, own)

    # 10. By mode. The address guard first, in every mode: a private, CGNAT, ULA, documentation or
    # other non-global literal needs private.allow, an explicit IP/CIDR rule (step 8) or a private
    # origin (step 9), exactly as a NAME resolving there does. Enforce gives the guard's reason too:
    # a refusal a rule could lift (not_allowlisted) is what `policy suggest` turns into a rule.
    if _guarded_literal(request, policy):
        assert request.klass is not None
        detail = (
            f"{request.text} is a {request.klass[1]} address: in every mode (here mode: {policy.mode}) it "
            f"needs private.allow, an explicit IP/CIDR allow rule or a private origin in {policy.source}."
        )
        return _refuse(request, Reason.PRIVATE_ADDRESS, "private.allow: false", detail, client)
    if policy.mode == "allow":
        outcome = _Allow(Reason.MODE_ALLOW, "mode: allow", f"{where} is allowed by mode: allow")
        return _finish(request, client, policy, outcome, deny_pending, own)
    if policy.mode == "learn":
        detail = (
            f"{where} is allowed by mode: learn; enforce would refuse it (not_allowlisted): "
            f"it is not in the allowlist of {policy.source}"
        )
        outcome = _Allow(Reason.LEARNED, "mode: learn", detail, would_be=Reason.NOT_ALLOWLISTED)
        return _finish(request, client, policy, outcome, deny_pending, own)
    if policy.mode == "ask":
        detail = f"{where} is not in the allowlist: ask an approver"
        outcome = _Allow(Reason.ASK, "mode: ask", detail, ask=True)
        return _finish(request, client, policy, outcome, deny_pending, own)
    detail = f"{where} is not in the allowlist of {policy.source} (mode: enforce)."
    return _refuse(request, Reason.NOT_ALLOWLISTED, "mode: enforce", detail, client)


def decide(
    target: Target | str,
    client: Client,
    policy: Policy,
    *,
    self_addresses: Collection[tuple[IPAddress, int]] = (),
) -> Decision:
    """Decide one connection or request. Never raises: failures become ``internal_error`` refusals."""
    try:
        canonical = _canonical(target)
    except TargetError as exc:
        return _invalid(exc, client)
    return _guarded(canonical, client, policy, self_addresses)


def decide_written(
    host: str,
    port: int,
    client: Client,
    policy: Policy,
    *,
    scheme: str | None = None,
    path: str | None = None,
    method: str | None = None,
    self_addresses: Collection[tuple[IPAddress, int]] = (),
) -> Decision:
    """``decide`` for a target as a client wrote it, in parts (a CONNECT's authority, a request's
    method and path): canonicalised once, here. Never raises."""
    try:
        canonical = make_target(host, port, scheme=scheme, path=path, method=method)
    except TargetError as exc:
        return _invalid(exc, client)
    return _guarded(canonical, client, policy, self_addresses)


def _invalid(exc: TargetError, client: Client) -> Decision:
    return Decision(False, Reason.INVALID_TARGET, None, None, detail=f"{exc}.", profile=client.profile)


def _guarded(
    target: Target, client: Client, policy: Policy, self_addresses: Collection[tuple[IPAddress, int]]
) -> Decision:
    try:
        own = self_addresses if type(self_addresses) is tuple else tuple(self_addresses)
        return _decide(target, client if client is not None else Client(), policy, own)
    except Exception as exc:  # the decision must always be an answer, and a refusal when unsure
        return Decision(
            allowed=False,
            reason=Reason.INTERNAL_ERROR,
            rule=None,
            target=target,
            detail=f"internal error while deciding: {type(exc).__name__}: {exc}",
        )


def _address_license(decision: Decision, policy: Policy, ip: IPAddress, port: int) -> str | None:
    if policy.private.allow:
        return "private.allow"
    if decision.private_ok:
        return decision.rule or "private_ok"
    rule = policy.allow.match_address(ip, port)
    return f"allow: {rule.text}" if rule is not None else None


def _verdict(decision: Decision, policy: Policy, ip: IPAddress, port: int) -> tuple[AddressClass, bool, str]:
    klass, why = _describe(ip, policy)
    if klass is AddressClass.FORBIDDEN:
        return klass, False, f"always refused ({why})"
    rule = policy.deny.match_address(ip, port)
    if rule is not None:
        return klass, False, f"deny: {rule.text}"
    profile = policy.profiles.get(decision.profile) if decision.profile is not None else None
    if profile is not None:
        rule = profile.deny.match_address(ip, port)
        if rule is not None:
            return klass, False, f"profile {profile.name}: deny {rule.text}"
    if klass is AddressClass.GLOBAL:
        return klass, True, "global"
    license_ = _address_license(decision, policy, ip, port)
    if license_ is None:
        return klass, False, f"{why}: a name may not resolve to a {klass.value} address"
    if klass is AddressClass.LOOPBACK:
        canonical = canonical_ip(ip)
        for raw, own_port in decision.self_addresses:
            own = _as_ip(raw)
            if int(own_port) == port and (own == canonical or own.is_unspecified or own.is_loopback):
                return klass, False, "egressd's own listening address"
        if not policy.loopback.allow:
            return klass, False, "loopback (loopback.allow is false)"
        if not policy.loopback.admits_port(port):
            return klass, False, f"loopback port not in loopback.ports {list(policy.loopback.ports)}"
    return klass, True, f"{why} (allowed by {license_})"


def filter_addresses(
    decision: Decision, addresses: Sequence[IPAddress], policy: Policy, *, limit: int = 4
) -> tuple[list[IPAddress], list[AddressVerdict]]:
    """Keep only the resolved addresses this decision may connect to (at most ``limit``, in order)."""
    kept: list[IPAddress] = []
    verdicts: list[AddressVerdict] = []
    seen: set[IPAddress] = set()
    port = decision.target.port if decision.target is not None else 0
    for address in addresses:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            continue
        key = canonical_ip(ip)
        if key in seen:
            continue
        seen.add(key)
        if not decision.allowed or decision.target is None:
            verdicts.append(AddressVerdict(ip, classify(ip), False, f"decision refused ({decision.reason})"))
            continue
        klass, keep, why = _verdict(decision, policy, ip, port)
        if keep and len(kept) >= limit:
            keep, why = False, f"over the limit of {limit} addresses"
        if keep:
            kept.append(ip)
        verdicts.append(AddressVerdict(ip, klass, keep, why))
    return kept, verdicts


def resolution_refusal(decision: Decision, verdicts: Sequence[AddressVerdict]) -> Decision:
    """The refusal when no resolved address survived the filter; lists every address and why."""
    name = decision.target.host.text if decision.target is not None else "the target"
    if verdicts:
        listing = "; ".join(f"{v.address} ({v.klass.value}): {v.why}" for v in verdicts)
        detail = f"{name} resolved only to addresses that may not be used: {listing}."
    else:
        detail = f"{name} resolved to no usable address."
    return replace(
        decision,
        allowed=False,
        reason=Reason.RESOLVED_FORBIDDEN,
        detail=detail,
        ask=False,
        needs_resolution=False,
        needs_inspection=False,
        private_ok=False,
        addresses=(),
        would_be=None,  # refused now: nothing was learned
    )
