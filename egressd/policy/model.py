"""The policy as frozen data: built once by the loader, shared read-only by every decision."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import Literal, get_args

from .entries import parse_nameserver, parse_rule_list
from .hosts import Host, IPAddress
from .rules import RuleSet
from .schema import Reader
from .secrets import SecretSpec, check_secret_hosts, check_unique
from .upstream import UpstreamProxy, parse_proxy_url

__all__ = [
    "AUDIT_FAILURES",
    "MODES",
    "AuditPolicy",
    "BuiltinAllowance",
    "Credentials",
    "Limits",
    "LoopbackPolicy",
    "Mode",
    "Origin",
    "Policy",
    "PrivatePolicy",
    "PresetInfo",
    "Profile",
    "ProviderAck",
    "ResolverConfig",
    "default_policy",
]

Mode = Literal["enforce", "ask", "learn", "allow", "off"]
MODES: tuple[str, ...] = get_args(Mode)
RefusalPages = Literal["status", "tls"]
REFUSAL_PAGES: tuple[str, ...] = get_args(RefusalPages)
DEFAULT_BUILTIN_METHODS: tuple[str, ...] = ("GET", "HEAD")
AuditFailure = Literal["refuse", "continue"]
AUDIT_FAILURES: tuple[str, ...] = get_args(AuditFailure)


@dataclass(frozen=True)
class Origin:
    """An exact origin exempted from the private-address filter (scheme, host, port)."""

    scheme: str
    host: Host
    port: int

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host.url_host()}:{self.port}"


@dataclass(frozen=True)
class LoopbackPolicy:
    """`loopback:`: whether the child may reach this machine's own services, on which ports."""

    allow: bool = True
    ports: tuple[int, ...] = ()
    # the sandbox sets this: the host's loopback only on the ports named, none when `ports` is empty
    named_ports_only: bool = False
    # More addresses that lead to this machine's own services, under the loopback rules like
    # 127.0.0.1 (egressd ssh's relay: the client's interface addresses). Not in the file format.
    addresses: frozenset[IPAddress] = frozenset()

    def admits_port(self, port: int) -> bool:
        return port in self.ports if (self.ports or self.named_ports_only) else True


@dataclass(frozen=True)
class PrivatePolicy:
    """`private:`: whether private addresses are reachable, and the origins exempted from it."""

    allow: bool = False
    origins: tuple[Origin, ...] = ()


@dataclass(frozen=True)
class BuiltinAllowance:
    """Fixed paths of one exact host; empty ``methods`` means GET and HEAD."""

    host: str
    paths: tuple[str, ...]
    methods: tuple[str, ...] = ()
    websocket: bool = False  # a request it admits may upgrade to a WebSocket

    @property
    def effective_methods(self) -> tuple[str, ...]:
        return self.methods or DEFAULT_BUILTIN_METHODS


@dataclass(frozen=True)
class Credentials:
    """`credentials:`: the request headers dropped when the host changes."""

    strip_on_host_change: tuple[str, ...] = ("authorization", "cookie", "proxy-authorization")


@dataclass(frozen=True, slots=True)
class Limits:
    """`limits:` and `timeouts:`: how long egressd waits, how much it lets through."""

    connect_timeout: float = 10
    dns_timeout: float = 5
    idle_timeout: float = 3600
    max_response_bytes: int | None = None
    header_timeout: float = 30  # a client must finish its request head (or SOCKS greeting) by then
    max_connections: int | None = None  # concurrent upstream connections (tunnels); beyond: 429
    requests_per_second: float | None = None  # per child (credentials): CONNECTs, requests, SOCKS
    burst: int | None = None  # token-bucket depth for requests_per_second (default: 2x the rate)
    # an upstream that accepted a request must send its response head within this (timeouts.response)
    response_timeout: float = 300


@dataclass(frozen=True)
class AuditPolicy:
    """What egressd does while an audit record cannot be written (a full disk, a reader that stopped
    reading): `refuse` new work with `audit_unavailable`, or `continue` and count what is dropped.
    Records for a sink that is slow to read wait in memory up to `max_queue_bytes`."""

    on_failure: AuditFailure = "refuse"
    max_queue_bytes: int = 4 * 1024 * 1024


@dataclass(frozen=True)
class ResolverConfig:
    """Nameservers as (IP text, port); empty means the system resolver configuration."""

    nameservers: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Profile:
    """A client profile: can only narrow the policy. ``allow=None`` means no extra allow restriction."""

    name: str
    allow: RuleSet | None = None
    deny: RuleSet = field(default_factory=RuleSet)
    ports: tuple[int, ...] = ()


@dataclass(frozen=True)
class PresetInfo:
    """What a shipped provider preset says about itself (`preset:`); the decision never reads it."""

    name: str
    version: int
    summary: str = ""
    sends: str = ""  # what data goes to these hosts, shown before `egressd provider add` asks


@dataclass(frozen=True)
class ProviderAck:
    """A provider the user acknowledged (`providers:`, written by `egressd provider add`): its hosts,
    the day, the preset version, and which rules the add wrote to `allow` (what remove may take out).
    The decision never reads it: the hosts decide as the allow rules they are."""

    name: str
    version: int
    acknowledged: str
    hosts: tuple[str, ...] = ()
    added: tuple[str, ...] = ()


def _freeze_profiles(profiles: Mapping[str, Profile]) -> Mapping[str, Profile]:
    return MappingProxyType(dict(profiles))


@dataclass(frozen=True)
class Policy:
    """One policy, parsed and checked: everything the decision reads."""

    version: int
    mode: Mode
    allow: RuleSet
    deny: RuleSet
    loopback: LoopbackPolicy
    private: PrivatePolicy
    builtin: tuple[BuiltinAllowance, ...]
    inspect: RuleSet
    ports: tuple[int, ...]
    credentials: Credentials
    limits: Limits
    resolver: ResolverConfig
    profiles: Mapping[str, Profile]
    websocket: bool = True
    # how a refused HTTPS CONNECT is answered: "status" (a 403 on the CONNECT, the default) or
    # "tls" (200, then the 403 inside TLS with egressd's certificate for the host, so clients that
    # show nothing of a refused CONNECT print the reason; needs inspection: the child trusts the CA)
    refusal_pages: RefusalPages = "status"
    ask_timeout: float = 60  # mode: ask waits this long for an answer, then refuses (ask_timeout)
    # the parent proxy admitted connections leave through (docs/upstream-proxy.md); None: direct
    upstream_proxy: UpstreamProxy | None = None
    preset: PresetInfo | None = None  # a shipped provider preset describes itself (docs/providers.md)
    providers: tuple[ProviderAck, ...] = ()  # acknowledged providers (egressd provider add)
    # credentials egressd swaps in for the child's placeholders (egressd.policy.secrets); never values
    secrets: tuple[SecretSpec, ...] = ()
    audit: AuditPolicy = AuditPolicy()
    source: str = field(default="<builtin>", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.profiles, MappingProxyType):
            object.__setattr__(self, "profiles", _freeze_profiles(self.profiles))

    def __hash__(self) -> int:
        return hash((self.version, self.mode, self.allow, self.deny, self.ports))

    @property
    def needs_ca(self) -> bool:
        """egressd's CA is needed (and its bundle given to the child): for inspection, or to answer
        refused HTTPS inside TLS (`refusal_pages: tls`)."""
        return self.needs_inspection or self.refusal_pages == "tls"

    @property
    def needs_inspection(self) -> bool:
        """Some HTTPS would be TLS-intercepted: inspect rules, built-in allowances, and path/method
        rules in allow or deny lists, the policy's or a profile's. Any rule that `decide` can only
        settle with the path (a path-scoped deny too) needs it, or the proxy would refuse what
        `egressd check` allows."""
        rulesets = [self.allow, self.deny]
        for profile in self.profiles.values():
            rulesets += [profile.deny] if profile.allow is None else [profile.allow, profile.deny]
        restricted = any(rule.restricted for rules in rulesets for rule in rules.rules)
        return bool(len(self.inspect) or self.builtin or restricted or self.secrets)

    @cached_property
    def needs_program(self) -> bool:
        """Some allow rule is scoped by `exe`: each connection's program must be looked up."""
        rulesets = [self.allow] + [p.allow for p in self.profiles.values() if p.allow is not None]
        return any(rule.exe for rules in rulesets for rule in rules.rules)

    def with_overrides(
        self,
        *,
        allow: Sequence[str] = (),
        deny: Sequence[str] = (),
        mode: Mode | None = None,
        nameservers: Sequence[str] = (),
        upstream_proxy: str | None = None,
        secrets: Sequence[SecretSpec] = (),
    ) -> Policy:
        """Policy plus command-line additions; a bad entry raises PolicyError naming the option."""
        extra_allow = parse_rule_list(list(allow), self.source, "--allow")
        extra_deny = parse_rule_list(list(deny), self.source, "--deny")
        if mode is not None:
            Reader(self.source).choice(mode, "--mode", MODES)
        servers = tuple(
            parse_nameserver(entry, self.source, f"--nameserver[{i}]") for i, entry in enumerate(nameservers)
        )
        parent = self.upstream_proxy
        if upstream_proxy is not None:  # the URL replaces the file's; its other settings stay
            host, port = parse_proxy_url(upstream_proxy, self.source, "--upstream-proxy")
            parent = replace(parent, host=host, port=port) if parent else UpstreamProxy(host, port)
        allow_rules = RuleSet(self.allow.rules + extra_allow) if extra_allow else self.allow
        deny_rules = RuleSet(self.deny.rules + extra_deny) if extra_deny else self.deny
        all_secrets = self.secrets
        if secrets:
            all_secrets = check_unique((*self.secrets, *secrets), self.source, "--secret")
        if all_secrets and (secrets or extra_deny):
            # a command-line deny or secret is checked like the file's: secrets go to allowed hosts only
            check_secret_hosts(all_secrets, allow_rules, deny_rules, self.source, "secrets")
        return replace(
            self,
            upstream_proxy=parent,
            allow=allow_rules,
            deny=deny_rules,
            mode=mode if mode is not None else self.mode,
            resolver=ResolverConfig(servers) if servers else self.resolver,
            secrets=all_secrets,
        )


def default_policy() -> Policy:
    """The policy of ``policies/default.yaml``, without reading a file."""
    return Policy(
        version=1,
        mode="enforce",
        allow=RuleSet(),
        deny=RuleSet(),
        loopback=LoopbackPolicy(),
        private=PrivatePolicy(),
        builtin=(),
        inspect=RuleSet(),
        ports=(),
        credentials=Credentials(),
        limits=Limits(),
        resolver=ResolverConfig(),
        profiles={},
    )
