"""Istio: ServiceEntries for the allowed names, AuthorizationPolicies on the egress gateway, and a
Kubernetes NetworkPolicy that keeps egressd's address guard on the gateway's pods.

Why this shape: with ``outboundTrafficPolicy: REGISTRY_ONLY`` only ServiceEntry hosts leave the
mesh, and routed through the egress gateway they are decided there: a DENY AuthorizationPolicy
(Istio evaluates DENY before ALLOW, so deny wins as in egressd) and an ALLOW one, each matching
plain HTTP by ``hosts`` and TLS by ``connection.sni``. Istio resolves names itself and has no
address filter, so the always-refused and private ranges (and deny CIDRs) are refused at L3 for the
gateway's pods by a NetworkPolicy (``ipBlock`` with ``except``), which the CNI enforces.
The Gateway/VirtualService that route through the egress gateway are the mesh's own, not exported.
"""

from __future__ import annotations

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
from egressd.tools.export.guards import FORBIDDEN, LOOPBACK, PRIVATE
from egressd.tools.export.report import Export, Finding

__all__ = ["GATEWAY_LABELS", "export_istio"]

TARGET = "istio"
GATEWAY_LABELS = {"istio": "egressgateway"}
DEFAULT_PORTS = (80, 443)


def _hosts(rule: HostRule) -> list[str]:
    return [str(rule.name), f"*.{rule.name}"] if rule.kind == "name" else [f"*.{rule.name}"]


def _ports(rule: HostRule, policy: Policy) -> tuple[int, ...]:
    if rule.port is not None:
        return (rule.port,)
    return policy.ports or DEFAULT_PORTS


def _rules(hosts: list[str], ports: tuple[int, ...] | None) -> list[dict[str, Any]]:
    """One rule for plain HTTP (Host header) and one for TLS passthrough (SNI)."""
    op: dict[str, Any] = {"hosts": list(hosts)}  # copies: no YAML anchors in the output
    sni: dict[str, Any] = {"when": [{"key": "connection.sni", "values": list(hosts)}]}
    if ports:
        op["ports"] = [str(p) for p in ports]
        sni["to"] = [{"operation": {"ports": [str(p) for p in ports]}}]
    return [{"to": [{"operation": op}]}, sni]


def _service_entry(i: int, item: Rule, ports: tuple[int, ...]) -> dict[str, Any]:
    r = item.rule
    spec: dict[str, Any] = {
        "hosts": _hosts(r),
        "location": "MESH_EXTERNAL",
        "ports": [
            {
                "number": p,
                "name": f"{'https' if p == 443 else 'tcp' if p != 80 else 'http'}-{p}",
                "protocol": "TLS" if p == 443 else "HTTP" if p == 80 else "TCP",
            }
            for p in ports
        ],
        "resolution": "NONE",  # wildcard hosts need NONE; the gateway forwards by SNI/Host
    }
    return {
        "apiVersion": "networking.istio.io/v1",
        "kind": "ServiceEntry",
        "metadata": {"name": f"egressd-allow-{i}"},
        "spec": spec,
    }


def _policy(name: str, action: str, rules: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "security.istio.io/v1",
        "kind": "AuthorizationPolicy",
        "metadata": {"name": name, "namespace": "istio-system"},
        "spec": {"selector": {"matchLabels": dict(GATEWAY_LABELS)}, "action": action, "rules": rules},
    }


def _network_policy(policy: Policy, deny_cidrs: list[str]) -> dict[str, Any]:
    """The gateway pods may reach global addresses only (plus kube-dns)."""
    refused = FORBIDDEN + LOOPBACK + (PRIVATE if not policy.private.allow else ())
    blocks = []
    for everything in ("0.0.0.0/0", "::/0"):
        version = 6 if ":" in everything else 4
        excepts = [str(n) for n in refused if n.version == version]
        excepts += [c for c in deny_cidrs if (":" in c) == (version == 6)]
        blocks.append({"ipBlock": {"cidr": everything, "except": excepts}})
    dns = {
        "to": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
            }
        ],
        "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
    }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "egressd-gateway-guard", "namespace": "istio-system"},
        "spec": {
            "podSelector": {"matchLabels": dict(GATEWAY_LABELS)},
            "policyTypes": ["Egress"],
            "egress": [dns, {"to": blocks}],
        },
    }


def export_istio(policy: Policy) -> Export:
    """ServiceEntry + AuthorizationPolicy (+ the guard's NetworkPolicy) for ``policy``."""
    findings = policy_findings(policy, TARGET)
    mode = mode_of(policy)
    docs: list[dict[str, Any]] = []
    deny_hosts: list[dict[str, Any]] = []
    deny_cidrs: list[str] = []
    for item in deny_rules(policy):
        r = item.rule
        if r.restricted:
            findings.append(restricted_finding(item, TARGET, " in TLS passthrough"))
        if r.network is not None:
            deny_cidrs.append(str(r.network))
            if r.port is not None:
                findings.append(
                    Finding(item.setting, r.text, "narrowed", "the range is refused on every port")
                )
            continue
        deny_hosts += _rules(_hosts(r), (r.port,) if r.port is not None else None)
    allows: list[dict[str, Any]] = []
    if mode in ("allow", "learn"):
        findings.append(
            Finding(
                "mode",
                mode,
                "denied",
                "istio with REGISTRY_ONLY routes only ServiceEntry hosts: hosts that "
                "mode allow admits are refused",
                ("mode: allow",),
            )
        )
    if mode != "off":
        for i, item in enumerate(allow_rules(policy)):
            r = item.rule
            if r.restricted:
                findings.append(restricted_finding(item, TARGET, " in TLS passthrough"))
                continue
            if r.network is not None:
                findings.append(
                    Finding(
                        item.setting,
                        r.text,
                        "dropped",
                        "a ServiceEntry names hosts; an address rule is "
                        "left out (names resolving into the range are not licensed either)",
                        (item.decides,),
                    )
                )
                continue
            ports = _ports(r, policy)
            if r.port is None and not policy.ports:
                findings.append(
                    Finding(
                        item.setting,
                        r.text,
                        "narrowed",
                        "a ServiceEntry lists its ports: only 80 and 443 are exported",
                        (item.decides,),
                    )
                )
            docs.append(_service_entry(i, item, ports))
            allows += _rules(_hosts(r), ports)
    findings += origins_dropped(policy, "private origins are not exported")
    if deny_hosts:
        docs.append(_policy("egressd-deny", "DENY", deny_hosts))
    # An ALLOW policy with no rules matches nothing: the gateway then refuses everything (mode off).
    docs.append(_policy("egressd-allow", "ALLOW", allows))
    docs.append(_network_policy(policy, deny_cidrs))
    head = (
        f"# egressd policy export --to istio (from {policy.source}, mode {mode}); needs meshConfig "
        "outboundTrafficPolicy REGISTRY_ONLY and routing through the egress gateway\n"
    )
    return Export(TARGET, head + yaml.safe_dump_all(docs, sort_keys=False), findings)
