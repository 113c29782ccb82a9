"""Smokescreen: its ACL file (``--egress-acl-file``), version v1.

Why this shape (from stripe/smokescreen pkg/smokescreen/acl/v1, acl.go and yaml_loader.go): a
service's ``allowed_domains`` are checked BEFORE ``global_deny_list`` (they override it), then
``global_allow_list``, then the rule's action. egressd's "deny always wins" therefore needs the
allows in ``global_allow_list`` and a ``default`` rule with no domains of its own, so every client
(any role) gets deny-then-allow-then-mode. A plain glob matches one name exactly and ``*.x`` its
subdomains only (not x), so ``example.com`` becomes both. The ACL has no ports, paths or address
ranges: those rules are dropped (narrower); deny ranges and the address guard are Smokescreen
command-line flags (``--deny-range``/``--allow-range``), printed in the header and the report.
"""

from __future__ import annotations

import ipaddress

import yaml

from egressd.policy import Policy
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

__all__ = ["export_smokescreen"]

TARGET = "smokescreen"
_ACTIONS = {"enforce": "enforce", "ask": "enforce", "allow": "open", "learn": "report", "off": "enforce"}


def _globs(item: Rule) -> list[str]:
    r = item.rule
    if r.kind == "name":
        return [str(r.name), f"*.{r.name}"]
    if r.kind == "wildcard":
        return [f"*.{r.name}"]
    assert r.network is not None
    if r.network.num_addresses == 1:
        return [str(r.network.network_address)]
    return []


def _deny(item: Rule, findings: list[Finding], flags: list[str]) -> list[str]:
    r = item.rule
    if r.restricted:
        findings.append(restricted_finding(item, TARGET))
    if r.network is not None:
        if r.port is not None:
            findings.append(
                Finding(
                    item.setting,
                    r.text,
                    "narrowed",
                    "smokescreen has no ports: the range is denied on every port",
                )
            )
        flags.append(f"--deny-range={r.network}")
        return []
    if r.port is not None:
        findings.append(
            Finding(
                item.setting, r.text, "narrowed", "smokescreen has no ports: the name is denied on every port"
            )
        )
    return _globs(item)


def _allow(item: Rule, findings: list[Finding], flags: list[str], ports: tuple[int, ...]) -> list[str]:
    r = item.rule
    if r.restricted:
        findings.append(restricted_finding(item, TARGET))
        return []
    if r.port is not None and ports != (r.port,):  # `host:443` under `ports: [443]` is exact
        findings.append(
            Finding(
                item.setting,
                r.text,
                "dropped",
                "smokescreen has no per-host ports: an allow on every port "
                "would be wider, so the rule is left out",
                (item.decides,),
            )
        )
        return []
    if r.network is not None:
        flags.append(f"--allow-range={r.network}")  # egressd: the rule licenses private addresses too
        if r.network.version == 6:
            findings.append(
                Finding(
                    item.setting,
                    r.text,
                    "dropped",
                    "smokescreen refuses every destination written as an IPv6 address; "
                    "only names resolving to it are admitted (by their own allow rules)",
                    (item.decides,),
                )
            )
            return []
        if r.network.num_addresses == 1:
            findings.append(
                Finding(
                    item.setting,
                    r.text,
                    "narrowed",
                    "only the address's canonical spelling is matched (smokescreen reads other "
                    "spellings of an address as names)",
                    (item.decides,),
                )
            )
        if r.network.num_addresses > 1:
            findings.append(
                Finding(
                    item.setting,
                    r.text,
                    "narrowed",
                    "smokescreen's ACL names hosts, not ranges: only names "
                    "resolving into the range are admitted (by their own allow rules), not literals in it",
                    (item.decides,),
                )
            )
    return _globs(item)


def _carve(flags: list[str]) -> list[str]:
    """Smokescreen checks --allow-range before --deny-range: an allowed range would lift a deny
    range inside it, where egressd's deny wins. Allow only what is left of each range."""
    denied = [ipaddress.ip_network(f.split("=", 1)[1]) for f in flags if f.startswith("--deny-range=")]
    out: list[str] = []
    for flag in flags:
        if not flag.startswith("--allow-range="):
            out.append(flag)
            continue
        parts = [ipaddress.ip_network(flag.split("=", 1)[1])]
        for deny in denied:
            parts = [
                rest
                for part in parts
                for rest in (
                    ([] if part.subnet_of(deny) else part.address_exclude(deny))  # type: ignore[arg-type]
                    if part.version == deny.version and part.overlaps(deny)  # type: ignore[arg-type]
                    else [part]
                )
            ]
        out += [f"--allow-range={p}" for p in ipaddress.collapse_addresses(parts)]  # type: ignore[arg-type]
    return out


def export_smokescreen(policy: Policy) -> Export:
    """The Smokescreen ACL for ``policy``, its required flags, and what it could not say exactly."""
    findings = policy_findings(policy, TARGET)
    mode = mode_of(policy)
    if policy.ports:
        findings.append(
            Finding(
                "ports",
                str(list(policy.ports)),
                "unsupported",
                "smokescreen's ACL has no ports: they are the nftables rule in the header, on its host",
            )
        )
    flags: list[str] = []
    deny: list[str] = []
    allow: list[str] = []
    for item in deny_rules(policy):
        deny += _deny(item, findings, flags)
    if mode != "off":
        for item in allow_rules(policy):
            allow += _allow(item, findings, flags, policy.ports)
    findings += origins_dropped(policy, "smokescreen has no exact origins (scheme, port): left out")
    guard = FORBIDDEN + LOOPBACK + ((), PRIVATE)[not policy.private.allow]
    flags = _carve(flags)
    licensed = [ipaddress.ip_network(f.split("=", 1)[1]) for f in flags if f.startswith("--allow-range=")]
    guard_flags = [f"--deny-range={n}" for n in guard]
    findings.append(
        Finding(
            "guards",
            None,
            "unsupported",
            "the address guard is smokescreen's command line, not its ACL: run "
            "it with the flags in the header (" + " ".join(guard_flags[:3]) + " ...)",
        )
    )
    for net in licensed:
        if any(net.overlaps(f) for f in FORBIDDEN + LOOPBACK if net.version == f.version):  # type: ignore[arg-type]
            findings.append(
                Finding(
                    "allow",
                    str(net),
                    "refused",
                    "smokescreen's --allow-range would lift its deny ranges, "
                    "and this range overlaps an always-refused or loopback range egressd never lifts",
                )
            )
    data = {
        "version": "v1",
        "services": [],
        "default": {"project": "egressd", "action": _ACTIONS.get(mode, "enforce"), "allowed_domains": []},
        "global_deny_list": list(dict.fromkeys(deny)),
        "global_allow_list": list(dict.fromkeys(allow)),
    }
    head = [
        f"# egressd policy export --to smokescreen (from {policy.source}, mode {mode})",
        "# Run smokescreen with --egress-acl-file=THIS_FILE and these flags (the address guard):",
        *(f"#   {flag}" for flag in [*guard_flags, *flags]),
    ]
    if policy.ports:
        wanted = ", ".join(str(p) for p in policy.ports)
        head += [
            "# and on its host, for its user, only these ports (egressd's `ports`):",
            "#   nft add table inet egressd_guard",
            "#   nft add chain inet egressd_guard out '{ type filter hook output priority 0; }'",
            "#   (accept DNS over TCP to your resolver before it)",
            f"#   nft add rule inet egressd_guard out meta skuid smokescreen tcp dport != {{ {wanted} }} "
            "drop",
        ]
    text = "\n".join(head) + "\n" + yaml.safe_dump(data, sort_keys=False)
    return Export(TARGET, text, findings)
