"""`egressd policy export --to envoy`, decoded by Envoy's own API types and evaluated on the Squid table.

Why: no envoy binary installs here, but Envoy's API does: envoy-data-plane is Envoy's data-plane
protos as Python classes. The bootstrap is decoded strictly — an unknown field, an unregistered
``@type``, an enum value Envoy does not have or a value of the wrong type fails (the decoder
refuses, or coerces and the re-encoded message differs from what was written). A small evaluator
then reads the DECODED messages — the HTTP connection manager's RBAC filters (deny, then allow,
RE2 full-match on ``:authority``), its routes (``connect_matcher`` for CONNECT, a prefix for the
rest) and the nftables guard the export prints for Envoy's host — and decides every row of the
target table the Squid differential uses (tests/support/export_targets.py), both fronts. Every
difference with egressd must be narrower and predicted by the report, or a spelling egressd refuses
that Envoy reads as the host it names, which egressd admits.
"""

from __future__ import annotations

import dataclasses
import importlib
import ipaddress
import re
from collections.abc import Iterator
from typing import Any

import betterproto2
import pytest
import re2
import yaml
from envoy_data_plane.envoy.config.bootstrap.v3 import Bootstrap
from envoy_data_plane.envoy.config.rbac.v3 import Permission, Principal, RbacAction
from envoy_data_plane.envoy.config.route.v3 import RouteMatch
from envoy_data_plane.envoy.type.matcher.v3 import StringMatcher

from egressd.policy import Policy, parse_policy
from egressd.tools.export import export_policy
from tests.support import export_targets as table

# The extensions the export names by `@type`: importing a module registers its messages for `Any`.
EXTENSIONS = (
    "envoy.extensions.filters.network.http_connection_manager.v3",
    "envoy.extensions.filters.http.rbac.v3",
    "envoy.extensions.filters.http.dynamic_forward_proxy.v3",
    "envoy.extensions.filters.http.router.v3",
    "envoy.extensions.clusters.dynamic_forward_proxy.v3",
)
for _module in EXTENSIONS:
    importlib.import_module(f"envoy_data_plane.{_module}")

PORT = 8080
# nghttp2_check_authority, which Envoy's header validation uses for :authority
_AUTHORITY = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@\[\]%]+")
_NFT = re.compile(
    r"#\s+nft add rule inet egressd_guard out meta skuid envoy (ip6?) daddr \{ (.*) \} (drop|accept)"
)


def _echo_mismatches(written: Any, decoded: Any, path: str = "") -> Iterator[str]:
    """Where the re-encoded message differs from what was written: a value the decoder coerced."""
    if isinstance(written, dict):
        if not isinstance(decoded, dict):
            yield f"{path}: written {written!r}, decoded {decoded!r}"
            return
        for key, value in written.items():
            yield from _echo_mismatches(value, decoded.get(key), f"{path}/{key}")
    elif isinstance(written, list):
        if not isinstance(decoded, list) or len(decoded) != len(written):
            yield f"{path}: written {written!r}, decoded {decoded!r}"
            return
        for i, (a, b) in enumerate(zip(written, decoded, strict=True)):
            yield from _echo_mismatches(a, b, f"{path}[{i}]")
    elif type(written) is not type(decoded) or written != decoded:
        yield f"{path}: written {written!r}, decoded {decoded!r}"


def strict_decode(doc: dict[str, Any]) -> Bootstrap:
    """Decode a bootstrap as Envoy's proto3 JSON reader would, refusing what it would refuse."""
    try:
        boot = Bootstrap.from_dict(doc)
    except Exception as exc:  # unknown field: KeyError; bad type or enum: ValueError, TypeError, ...
        raise ValueError(f"refused: {type(exc).__name__}: {exc}") from exc
    echoed = boot.to_dict(casing=betterproto2.Casing.SNAKE, include_default_values=True)
    mismatches = list(_echo_mismatches(doc, echoed))
    if mismatches:
        raise ValueError("the decoder coerced: " + "; ".join(mismatches[:5]))
    return boot


def _policies() -> list[tuple[str, Policy]]:
    from tests.support.export_policies import _policies as schema_policies

    return [*schema_policies(), ("table", parse_policy(yaml.safe_load(table.policy_text()), "table"))]


@pytest.mark.parametrize(("name", "policy"), _policies(), ids=[n for n, _ in _policies()])
def test_export_decodes_strictly(name: str, policy: Policy) -> None:
    """Every export of the presets and test policies decodes, listeners, clusters and RBAC typed."""
    boot = strict_decode(yaml.safe_load(export_policy(policy, "envoy").text))
    (listener,) = boot.static_resources.listeners
    hcm = listener.filter_chains[0].filters[0].typed_config.unpack()
    assert type(hcm).__name__ == "HttpConnectionManager"
    kinds = [type(f.typed_config.unpack()).__name__ for f in hcm.http_filters]
    assert kinds[-2:] == ["FilterConfig", "Router"], kinds
    assert set(kinds[:-2]) <= {"Rbac"}, kinds
    (cluster,) = boot.static_resources.clusters
    assert type(cluster.cluster_type.typed_config.unpack()).__name__ == "ClusterConfig"


def _table_doc() -> dict[str, Any]:
    return yaml.safe_load(export_policy(parse_policy(yaml.safe_load(table.policy_text()), "t"), "envoy").text)


def _set(doc: dict[str, Any], path: list[Any], value: Any) -> dict[str, Any]:
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


HCM = ["static_resources", "listeners", 0, "filter_chains", 0, "filters", 0, "typed_config"]
RBAC_RULES = [*HCM, "http_filters", 1, "typed_config", "rules"]
CLUSTER = ["static_resources", "clusters", 0]
BROKEN = {
    "unknown field": (CLUSTER + ["conect_timeout"], "10s"),
    "unknown field inside an Any": ([*HCM, "stat_prefixx"], "egressd"),
    "unknown RBAC action": ([*RBAC_RULES, "action"], "REFUSE"),
    "unregistered @type": ([*HCM, "@type"], "type.googleapis.com/envoy.nope.v3.Nope"),
    "a string for a message": ([*RBAC_RULES, "policies"], "allow-0"),
    "a number for a string": (CLUSTER + ["name"], 7),
    "a string for a bool": ([*RBAC_RULES, "policies", "allow-0", "principals", 0, "any"], "yes"),
    "a bad duration": (CLUSTER + ["connect_timeout"], "ten seconds"),
    "two members of a oneof": (CLUSTER + ["type"], "STATIC"),
    "a port out of range": (
        ["static_resources", "listeners", 0, "address", "socket_address", "port_value"],
        -1,
    ),
}


@pytest.mark.parametrize("what", list(BROKEN))
def test_decoder_refuses_a_wrong_document(what: str) -> None:
    """The decode is strict: each kind of mistake an export could make is refused."""
    path, value = BROKEN[what]
    doc = _set(_table_doc(), path, value)
    with pytest.raises(ValueError):
        strict_decode(doc)


# -- the evaluator, on the decoded messages ------------------------------------------------------
@dataclasses.dataclass
class Envoy:
    """What the exported Envoy decides, read from the decoded bootstrap and the printed guard."""

    rbac: list[tuple[RbacAction, list[list[Permission]], list[list[Principal]]]]
    routes: list[RouteMatch]
    guard: list[tuple[int, list[ipaddress.IPv4Network | ipaddress.IPv6Network], str]]

    @classmethod
    def load(cls, text: str) -> Envoy:
        boot = strict_decode(yaml.safe_load(text))
        hcm = boot.static_resources.listeners[0].filter_chains[0].filters[0].typed_config.unpack()
        rbac = []
        for f in hcm.http_filters:
            config = f.typed_config.unpack()
            if type(config).__name__ == "Rbac":
                policies = list(config.rules.policies.values())
                rbac.append(
                    (config.rules.action, [p.permissions for p in policies], [p.principals for p in policies])
                )
        (vhost,) = hcm.route_config.virtual_hosts
        assert vhost.domains == ["*"]
        guard = []
        for family, nets, verdict in _NFT.findall(text):
            networks = [ipaddress.ip_network(n.strip()) for n in nets.split(",")]
            guard.append((6 if family == "ip6" else 4, networks, verdict))
        return cls(rbac, [r.match for r in vhost.routes], guard)

    def decides(self, front: str, host: str, port: int) -> tuple[bool, str]:
        """(allowed, why) for one row as the fronts send it."""
        if front == "connect":
            authority = f"{host}:{port}"
        else:  # the absolute URL's authority, userinfo dropped (http_parser's UF_HOST and UF_PORT)
            authority = re.split(r"[/?#]", f"{host}:{port}/spell", maxsplit=1)[0].rpartition("@")[2]
        if not _AUTHORITY.fullmatch(authority):
            return False, "400: not a valid :authority"
        for action, permissions, principals in self.rbac:
            hit = any(
                any(_permission(p, authority) for p in perms) and any(_principal(p) for p in princ)
                for perms, princ in zip(permissions, principals, strict=True)
            )
            if action == RbacAction.DENY and hit:
                return False, "403: rbac deny"
            if action == RbacAction.ALLOW and not hit:
                return False, "403: rbac allow matched nothing"
        if not any(_route(m, front) for m in self.routes):
            return False, "404: no route"
        return self._connect(authority)

    def _connect(self, authority: str) -> tuple[bool, str]:
        """The dynamic forward proxy resolves the host (an address is used as is), then the nftables
        guard decides the address: first matching rule wins, no rule means accept."""
        host = authority.rpartition(":")[0] if not authority.endswith("]") else authority
        address = table.literal(host)
        addresses = (
            [address] if address is not None else [ipaddress.ip_address(a) for a in table.resolve(host)]
        )
        if not addresses:
            return False, "503: no address"
        ip = addresses[0]
        for version, networks, verdict in self.guard:
            if ip.version == version and any(ip in n for n in networks):
                return verdict == "accept", f"nft {verdict} {ip}"
        return True, f"connected {ip}"


def _string(m: StringMatcher, value: str) -> bool:
    which, _ = betterproto2.which_one_of(m, "match_pattern")
    if which == "safe_regex":
        return re2.fullmatch(m.safe_regex.regex, value) is not None
    if which == "exact":
        return (value.lower() == m.exact.lower()) if m.ignore_case else value == m.exact
    raise AssertionError(f"the evaluator does not know StringMatcher.{which}: extend it")


def _permission(p: Permission, authority: str) -> bool:
    which, _ = betterproto2.which_one_of(p, "rule")
    if which == "any":
        return bool(p.any)
    if which == "header":
        assert p.header.name == ":authority", p.header.name
        return _string(p.header.string_match, authority) != p.header.invert_match
    if which == "or_rules":
        return any(_permission(r, authority) for r in p.or_rules.rules)
    if which == "and_rules":
        return all(_permission(r, authority) for r in p.and_rules.rules)
    if which == "not_rule":
        return not _permission(p.not_rule, authority)
    raise AssertionError(f"the evaluator does not know Permission.{which}: extend it")


def _principal(p: Principal) -> bool:
    which, _ = betterproto2.which_one_of(p, "identifier")
    assert which == "any", f"the evaluator does not know Principal.{which}: extend it"
    return bool(p.any)


def _route(m: RouteMatch, front: str) -> bool:
    which, _ = betterproto2.which_one_of(m, "path_specifier")
    if which == "connect_matcher":
        return front == "connect"
    if which == "prefix":
        return front == "get" and "/spell".startswith(m.prefix)
    raise AssertionError(f"the evaluator does not know RouteMatch.{which}: extend it")


def test_envoy_decides_like_egressd() -> None:
    """The target table through egressd and the decoded Envoy: differences narrower and predicted,
    and per target kind exactly what the loss report says."""
    table.check_differential("envoy", lambda text: Envoy.load(text).decides, PORT)


def test_envoy_guard_and_wildcard() -> None:
    """Spot checks of the evaluator itself: deny wins, `*.` is not the apex, the guard drops
    metadata even for an allowed name."""
    policy = parse_policy(yaml.safe_load(table.policy_text()), "table")
    envoy = Envoy.load(export_policy(policy, "envoy").text)
    assert envoy.decides("connect", "a.wild.test", PORT)[0]
    assert not envoy.decides("connect", "wild.test", PORT)[0]
    assert not envoy.decides("connect", "q.sub.wild.test", PORT)[0]
    assert envoy.decides("connect", "meta.allowed.test", PORT) == (False, "nft drop 169.254.169.254")
    assert envoy.decides("get", "cidr.test", PORT) == (True, "nft accept 192.0.2.1")
