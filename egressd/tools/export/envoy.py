"""Envoy: a bootstrap with an HTTP forward proxy (CONNECT and absolute-form) on the dynamic forward
proxy, decided by two RBAC filters on ``:authority`` (deny first, then allow).

Why this shape: the RBAC filters run before the dynamic-forward-proxy filter resolves anything, so a
refused authority is never resolved or connected. ``:authority`` is ``host:port`` for CONNECT and
``host[:port]`` for absolute-form requests, matched by full-match RE2 regexes: case-insensitive, one
trailing dot, a rule's port (80 may be left out on plain HTTP). The CONNECT host is what the tunnel
connects to, so it is what is decided (as egressd's CONNECT host; SNI is not re-checked). Envoy
resolves names without an address filter: egressd's guard (always-refused and private ranges, deny
CIDRs) must be an L3 firewall on Envoy's host; the nftables rules are printed in the header.
"""

from __future__ import annotations

import re
from ipaddress import collapse_addresses
from typing import Any

import yaml

from egressd.policy import HostRule, Policy
from egressd.tools.export.common import (
    Rule,
    allow_rules,
    deny_rules,
    mode_of,
    origins_dropped,
    policy_findings,
    restricted_finding,
)
from egressd.tools.export.guards import FORBIDDEN, LOOPBACK, PRIVATE, Network
from egressd.tools.export.report import Export, Finding

__all__ = ["export_envoy"]

TARGET = "envoy"
_T = "type.googleapis.com/envoy.extensions"
_LABEL = r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?"  # one DNS label, as egressd reads them
_DNS_CACHE = {"name": "egressd_dfp", "dns_lookup_family": "V4_PREFERRED"}


def authority_regex(rule: HostRule) -> str | None:
    """RE2 full-match regex for ``:authority`` of the rule's hosts and port; None if not expressible."""
    if rule.kind == "name":
        host = f"({_LABEL}\\.)*" + re.escape(str(rule.name))
    elif rule.kind == "wildcard":
        host = f"({_LABEL}\\.)+" + re.escape(str(rule.name))
    elif rule.network is not None and rule.network.num_addresses == 1:
        address = str(rule.network.network_address)
        host = re.escape(address) if rule.network.version == 4 else r"\[" + re.escape(address) + r"\]"
        return "(?i)" + host + _port(rule)
    else:
        return None
    return "(?i)" + host + r"\.?" + _port(rule)


def _port(rule: HostRule) -> str:
    if rule.port is None:
        return r"(:[0-9]+)?"
    return f"(:{rule.port})?" if rule.port == 80 else f":{rule.port}"


def _rbac(action: str, regexes: dict[str, str]) -> dict[str, Any]:
    policies = {
        name: {
            "permissions": [
                {"header": {"name": ":authority", "string_match": {"safe_regex": {"regex": rx}}}}
            ],
            "principals": [{"any": True}],
        }
        for name, rx in regexes.items()
    }
    return {
        "name": "envoy.filters.http.rbac",
        "typed_config": {
            "@type": f"{_T}.filters.http.rbac.v3.RBAC",
            "rules": {"action": action, "policies": policies},
        },
    }


def _nft(policy: Policy, deny_cidrs: list[Network], licensed: list[Network]) -> list[str]:
    """nftables rules for Envoy's host: what egressd's address filter refuses, never connected to."""
    lines = [
        "nft add table inet egressd_guard",
        "nft add chain inet egressd_guard out '{ type filter hook output priority 0; }'",
    ]

    def rule(nets: list[Network], verdict: str) -> None:
        for version, family in ((4, "ip"), (6, "ip6")):
            # nftables refuses overlapping intervals in one set: collapse them first
            same = [n for n in nets if n.version == version]
            chosen = [str(n) for n in collapse_addresses(same)]  # type: ignore[arg-type]
            if chosen:
                lines.append(
                    f"nft add rule inet egressd_guard out meta skuid envoy {family} daddr "
                    f"{{ {', '.join(chosen)} }} {verdict}"
                )

    rule(list(FORBIDDEN) + deny_cidrs, "drop")
    rule(licensed, "accept")
    rule(list(PRIVATE) + list(LOOPBACK) if not policy.private.allow else list(LOOPBACK), "drop")
    return lines


def export_envoy(policy: Policy, port: int = 3128) -> Export:
    """The Envoy bootstrap for ``policy`` and what it could not say exactly."""
    findings = policy_findings(policy, TARGET)
    findings.append(
        Finding(
            "target",
            None,
            "unsupported",
            "envoy matches :authority as written: spellings egressd refuses as unparseable (a trailing dot, "
            "labels that are not valid IDNA) pass when they are, or are under, an allowed name",
        )
    )
    mode = mode_of(policy)
    # egressd refuses a name longer than 253 characters as unparseable; a regex of labels cannot count
    deny: dict[str, str] = {"overlong-name": r"[^:\[\]]{254,}(:[0-9]+)?"}
    allow: dict[str, str] = {}
    deny_cidrs: list[Network] = []
    licensed: list[Network] = []
    for i, item in enumerate(deny_rules(policy)):
        r = item.rule
        if r.restricted:
            findings.append(restricted_finding(item, TARGET, " without TLS inspection"))
        if r.network is not None:
            deny_cidrs.append(r.network)
            if r.port is not None:
                findings.append(
                    Finding(item.setting, r.text, "narrowed", "the range is refused on every port")
                )
        rx = authority_regex(r)
        if rx is not None:
            deny[f"deny-{i}"] = rx
    if mode not in ("off",):
        for i, item in enumerate(allow_rules(policy)):
            _allow(i, item, policy, allow, licensed, findings)
    findings += origins_dropped(policy, "private origins are not exported")
    if policy.ports:
        allow = {k: _with_ports(v, policy.ports) for k, v in allow.items()}
    findings.append(
        Finding(
            "guards",
            None,
            "unsupported",
            "envoy resolves names without an address filter: the address "
            "guard is the nftables rules in the header, on envoy's host",
        )
    )
    filters = [_rbac("DENY", deny)] if deny else []
    if mode not in ("allow", "learn"):
        filters.append(_rbac("ALLOW", allow))
    filters += [
        {
            "name": "envoy.filters.http.dynamic_forward_proxy",
            "typed_config": {
                "@type": f"{_T}.filters.http.dynamic_forward_proxy.v3.FilterConfig",
                "dns_cache_config": dict(_DNS_CACHE),
            },
        },
        {
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": f"{_T}.filters.http.router.v3.Router"},
        },
    ]
    hcm = {
        "@type": f"{_T}.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "egressd",
        "upgrade_configs": [{"upgrade_type": "CONNECT"}],
        "route_config": {
            "name": "egressd",
            "virtual_hosts": [
                {
                    "name": "forward",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"connect_matcher": {}},
                            "route": {
                                "cluster": "egressd_dfp",
                                "upgrade_configs": [{"upgrade_type": "CONNECT", "connect_config": {}}],
                            },
                        },
                        {"match": {"prefix": "/"}, "route": {"cluster": "egressd_dfp"}},
                    ],
                }
            ],
        },
        "http_filters": filters,
    }
    bootstrap = {
        "static_resources": {
            "listeners": [
                {
                    "name": "egressd",
                    "address": {"socket_address": {"address": "0.0.0.0", "port_value": port}},
                    "filter_chains": [
                        {
                            "filters": [
                                {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "egressd_dfp",
                    "connect_timeout": f"{policy.limits.connect_timeout:g}s",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "cluster_type": {
                        "name": "envoy.clusters.dynamic_forward_proxy",
                        "typed_config": {
                            "@type": f"{_T}.clusters.dynamic_forward_proxy.v3.ClusterConfig",
                            "dns_cache_config": dict(_DNS_CACHE),
                        },
                    },
                }
            ],
        }
    }
    head = [
        f"# egressd policy export --to envoy (from {policy.source}, mode {mode})",
        "# The address guard, on envoy's host (envoy has no filter of resolved addresses):",
        *(f"#   {line}" for line in _nft(policy, deny_cidrs, licensed)),
    ]
    return Export(TARGET, "\n".join(head) + "\n" + yaml.safe_dump(bootstrap, sort_keys=False), findings)


def _with_ports(regex: str, ports: tuple[int, ...]) -> str:
    """Narrow a port-free allow regex to the policy's ports (no port on plain HTTP means 80)."""
    alternatives = "|".join(f":{p}" for p in ports) + ("|" if 80 in ports else "")
    return regex.replace(r"(:[0-9]+)?", f"(?:{alternatives})")


def _allow(
    i: int,
    item: Rule,
    policy: Policy,
    allow: dict[str, str],
    licensed: list[Network],
    findings: list[Finding],
) -> None:
    r = item.rule
    if r.restricted:
        findings.append(restricted_finding(item, TARGET, " without TLS inspection"))
        return
    if policy.ports and r.port is not None and r.port not in policy.ports:
        return  # egressd refuses it too (`ports`)
    if r.network is not None:
        licensed.append(r.network)
    rx = authority_regex(r)
    if rx is None:
        findings.append(
            Finding(
                item.setting,
                r.text,
                "dropped",
                "an address range is not matched on :authority (only single addresses are); left out",
                (item.decides,),
            )
        )
        return
    if r.network is not None:
        findings.append(
            Finding(
                item.setting,
                r.text,
                "narrowed",
                "only the address's canonical spelling is matched",
                (item.decides,),
            )
        )
    allow[f"allow-{i}"] = rx
