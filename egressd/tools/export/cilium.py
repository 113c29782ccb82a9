"""Cilium: one ``CiliumNetworkPolicy`` (cilium.io/v2) for the pods of a namespace.

Why this shape: Cilium enforces at L3/L4 in the kernel and learns which addresses a name has by
proxying DNS, so ``toFQDNs`` rules only ever match if the pods' DNS goes through Cilium's DNS proxy:
the first egress rule allows kube-dns with ``rules.dns: [{matchPattern: "*"}]``. Deny rules cannot
name hosts (``egressDeny`` has no ``toFQDNs``), so an allow that covers a denied name is narrowed
or dropped instead; address deny rules and egressd's address guard are ``egressDeny`` CIDR sets
(deny wins in Cilium too). Cilium's ``*`` matches within one label, so ``*.example.com`` admits
one level of subdomain only (narrower than egressd's any depth).
"""

from __future__ import annotations

from ipaddress import IPv4Network, IPv6Network
from typing import Any

import yaml

from egressd.policy import HostRule, Policy
from egressd.tools.export.common import (
    Rule,
    allow_rules,
    denied_below,
    deny_rules,
    mode_of,
    origins_dropped,
    policy_findings,
    restricted_finding,
)
from egressd.tools.export.guards import FORBIDDEN, PRIVATE, Network
from egressd.tools.export.report import Export, Finding

__all__ = ["KUBE_DNS_RULE", "export_cilium"]

TARGET = "cilium"
KUBE_DNS_RULE: dict[str, Any] = {
    "toEndpoints": [
        {"matchLabels": {"k8s:io.kubernetes.pod.namespace": "kube-system", "k8s:k8s-app": "kube-dns"}}
    ],
    "toPorts": [
        {
            "ports": [{"port": "53", "protocol": "UDP"}, {"port": "53", "protocol": "TCP"}],
            "rules": {"dns": [{"matchPattern": "*"}]},
        }
    ],
}


def _ports(rule: HostRule, policy: Policy) -> list[dict[str, Any]] | None:
    """toPorts for a rule: its own port, else the policy's ports, else None (every port)."""
    if rule.port is not None:
        return [{"ports": [{"port": str(rule.port), "protocol": "TCP"}]}]
    if policy.ports:
        return [{"ports": [{"port": str(p), "protocol": "TCP"} for p in policy.ports]}]
    return None


def _apex_denied(rule: HostRule, denies: list[Rule]) -> bool:
    """Some deny rule (any port, any path) matches the allow rule's own name."""
    name = str(rule.name)
    for item in denies:
        d = item.rule
        if d.name is None:
            continue
        if (d.kind == "name" and (name == d.name or name.endswith("." + d.name))) or (
            d.kind == "wildcard" and name.endswith("." + d.name)
        ):
            return True
    return False


def _fqdn_rule(
    item: Rule, policy: Policy, denies: list[Rule], findings: list[Finding]
) -> dict[str, Any] | None:
    r = item.rule
    whole, some = denied_below(r, denies)
    if whole:
        return None  # egressd refuses all of it too
    selectors: list[dict[str, str]] = []
    if r.kind == "name" and not (some and _apex_denied(r, denies)):
        selectors.append({"matchName": str(r.name)})
    if some:
        findings.append(
            Finding(
                item.setting,
                r.text,
                "narrowed" if selectors else "dropped",
                "cilium cannot deny names: a deny "
                "rule names hosts under this one, so its subdomains are left out",
                (item.decides,),
            )
        )
    else:
        selectors.append({"matchPattern": f"*.{r.name}"})
        findings.append(
            Finding(
                item.setting,
                r.text,
                "narrowed",
                "cilium's '*' matches one label: deeper subdomains are refused",
                (item.decides,),
            )
        )
    if not selectors:
        return None
    out: dict[str, Any] = {"toFQDNs": selectors}
    ports = _ports(r, policy)
    if ports:
        out["toPorts"] = ports
    return out


def _cidr_rule(rule: HostRule, policy: Policy, deny: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"toCIDRSet": [{"cidr": str(rule.network)}]}
    ports = (
        _ports(rule, policy)
        if not deny
        else ([{"ports": [{"port": str(rule.port), "protocol": "TCP"}]}] if rule.port is not None else None)
    )
    if ports:
        out["toPorts"] = ports
    return out


def _guard(policy: Policy, licensed: list[Network]) -> list[dict[str, Any]]:
    """egressDeny CIDR sets: always-refused ranges, and private ones less the licensed ranges."""
    sets: list[dict[str, Any]] = [{"cidr": str(n)} for n in FORBIDDEN]
    if not policy.private.allow:
        for net in PRIVATE:
            same = [a for a in licensed if a.version == net.version]
            if any(net.subnet_of(a) for a in same):  # type: ignore[arg-type]
                continue
            inside = [str(a) for a in same if a.subnet_of(net)]  # type: ignore[arg-type]
            sets.append({"cidr": str(net), **({"except": inside} if inside else {})})
    return sets


def export_cilium(policy: Policy, name: str = "egressd") -> Export:
    """The CiliumNetworkPolicy for ``policy`` and what it could not say exactly."""
    findings = policy_findings(policy, TARGET, central=False)
    findings.append(
        Finding(
            "target",
            None,
            "unsupported",
            "cilium decides by address at L3/L4: once an allowed name resolved, "
            "another name on the same address (a CDN) is reachable too; egressd decides by name and SNI",
        )
    )
    mode = mode_of(policy)
    if not policy.loopback.allow:
        findings.append(
            Finding(
                "loopback.allow",
                "false",
                "unsupported",
                "a pod's own loopback never leaves the pod: cilium "
                "cannot refuse it (run the child under egressd's sandbox for that)",
            )
        )
    denies = deny_rules(policy)
    egress: list[dict[str, Any]] = [KUBE_DNS_RULE]
    deny: list[dict[str, Any]] = []
    licensed: list[IPv4Network | IPv6Network] = []
    for item in denies:
        r = item.rule
        if r.restricted:
            findings.append(restricted_finding(item, TARGET, " at L3/L4"))
        if r.network is not None:
            deny.append(_cidr_rule(r, policy, deny=True))
        elif mode in ("allow", "learn"):
            findings.append(
                Finding(
                    item.setting,
                    r.text,
                    "refused",
                    "cilium cannot deny a name, and mode allow admits every other host",
                )
            )
    if mode in ("allow", "learn"):
        egress.append({"toEntities": ["world"]} | ({"toPorts": _ports_all(policy)} if policy.ports else {}))
    elif mode != "off":
        for item in allow_rules(policy):
            r = item.rule
            if r.restricted:
                findings.append(restricted_finding(item, TARGET, " without L7 TLS interception"))
                continue
            if r.network is not None:
                egress.append(_cidr_rule(r, policy))
                if r.port is None:
                    licensed.append(r.network)
                else:
                    findings.append(
                        Finding(
                            item.setting,
                            r.text,
                            "narrowed",
                            "a name resolving into this range is not "
                            "licensed on this port (cilium's deny has no per-port exception)",
                            (item.decides,),
                        )
                    )
                continue
            fqdn = _fqdn_rule(item, policy, denies, findings)
            if fqdn is not None:
                egress.append(fqdn)
    findings += origins_dropped(
        policy, "cilium works at L4: it cannot keep an origin's scheme, so the exact origin is left out"
    )
    deny.insert(0, {"toCIDRSet": _guard(policy, licensed)})
    spec: dict[str, Any] = {
        "description": f"egressd policy export --to cilium (from {policy.source}, mode {mode})",
        "endpointSelector": {},
    }
    if mode == "off":
        spec["egressDeny"] = [{"toEntities": ["all"]}]
    else:
        spec["egress"] = egress
        spec["egressDeny"] = deny
    doc = {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"name": name},
        "spec": spec,
    }
    head = f"# egressd policy export --to cilium (from {policy.source}); kubectl -n NAMESPACE apply -f -\n"
    return Export(TARGET, head + yaml.safe_dump(doc, sort_keys=False), findings)


def _ports_all(policy: Policy) -> list[dict[str, Any]]:
    return [{"ports": [{"port": str(p), "protocol": "TCP"} for p in policy.ports]}]
