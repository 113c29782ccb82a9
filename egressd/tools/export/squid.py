"""Squid: an include file of ``acl`` and ``http_access`` lines (Debian: /etc/squid/conf.d/egressd.conf).

Why this shape: Squid evaluates ``http_access`` top to bottom, first match wins, so egressd's order
maps onto it directly — always-refused addresses, deny rules, loopback, the private-address guard,
ports, allow rules, origins, then the mode. The file ends in ``deny all`` (or ``allow all`` for mode
allow), so nothing after the include is reached.

Matching, checked against Debian's squid by tests/e2e/test_export_squid.py:
- ``example.com`` (name and subdomains) is ``dstdomain -n .example.com``: exact.
- ``*.example.com`` (subdomains only) is ``dstdom_regex -n -i \\.example\\.com$``: ``.example.com`` in
  ``dstdomain`` would match the name itself too, which would be wider.
- IP/CIDR rules are ``dst``: for a deny that also refuses names resolving into the range (as
  egressd's address filter does); for an allow, Squid's ``dst`` would also admit any NAME resolving
  there, so the allow also requires the target to be written as an address.
- The guard: ``dst`` on the forbidden and the private ranges (names are resolved for it), the latter
  unless ``private.allow``, an IP/CIDR allow rule or a private origin licenses the address.
"""

from __future__ import annotations

import re
from ipaddress import IPv4Network, IPv6Network, collapse_addresses

from egressd.policy import Policy
from egressd.tools.export.common import (
    Rule,
    allow_rules,
    deny_rules,
    mode_of,
    policy_findings,
    restricted_finding,
)
from egressd.tools.export.guards import FORBIDDEN, LOOPBACK, MAPPED_V4, PRIVATE, Network
from egressd.tools.export.report import Export, Finding

__all__ = ["export_squid"]

TARGET = "squid"
# A host written as an address: dotted (inet_aton forms, each part decimal/octal or 0x-hex, as glibc
# reads them) or IPv6 (colons cannot appear in a DNS name).
_LITERAL_V4 = r"^((0x[0-9a-f]*|[0-9]+)\.){0,3}(0x[0-9a-f]*|[0-9]+)$"
_LITERAL_V6 = r"^\[?[0-9a-f:.]*:[0-9a-f:.]*\]?$"


def _addresses(networks: tuple[Network, ...]) -> str:
    """Squid keeps IPv4 as mapped IPv6 inside: a mapped range in a list would match every IPv4."""
    kept = [n for n in networks if n.version == 4 or not n.subnet_of(MAPPED_V4)]  # type: ignore[arg-type]
    # Squid ignores (with a warning) a network inside another of the same list: collapse them.
    v4 = collapse_addresses(n for n in kept if isinstance(n, IPv4Network))
    v6 = collapse_addresses(n for n in kept if isinstance(n, IPv6Network))
    return " ".join(str(n) for n in [*v4, *v6])


class _Conf:
    """The lines being written, with one ACL name per rule."""

    def __init__(self) -> None:
        self.acls: list[str] = []
        self.access: list[str] = []

    def acl(self, name: str, kind: str, *values: str) -> str:
        self.acls.append(f"acl {name} {kind} {' '.join(values)}")
        return name


def _host_acls(conf: _Conf, name: str, item: Rule, *, literal_only: bool) -> list[str]:
    """ACL names whose conjunction matches the rule's hosts and port."""
    r = item.rule
    out: list[str] = []
    if r.kind == "name":
        out.append(conf.acl(name, "dstdomain", "-n", f".{r.name}"))
    elif r.kind == "wildcard":
        out.append(conf.acl(name, "dstdom_regex", "-n", "-i", re.escape(f".{r.name}") + "$"))
    else:
        out.append(conf.acl(name, "dst", str(r.network)))
        if literal_only:
            lit = (
                "egressd_literal_v4"
                if r.network is not None and r.network.version == 4
                else "egressd_literal_v6"
            )
            out.append(lit)
    if r.port is not None:
        out.append(conf.acl(f"{name}_port", "port", str(r.port)))
    return out


def _origin_acls(conf: _Conf, i: int, policy: Policy) -> list[str]:
    origin = policy.private.origins[i]
    name = f"egressd_origin_{i}"
    host = origin.host
    if host.ip is not None:
        acls = [
            conf.acl(name, "dst", str(host.ip)),
            "egressd_literal_v4" if host.ip.version == 4 else "egressd_literal_v6",
        ]
    else:
        acls = [conf.acl(name, "dstdomain", "-n", str(host.name))]
    acls.append(conf.acl(f"{name}_port", "port", str(origin.port)))
    acls.append("egressd_connect" if origin.scheme == "https" else "egressd_http")
    return acls


def export_squid(policy: Policy) -> Export:
    """The Squid include file for ``policy`` and what it could not say exactly."""
    findings = policy_findings(policy, TARGET)
    findings.append(
        Finding(
            "target",
            None,
            "unsupported",
            "squid reads some spellings egressd refuses as unparseable (trailing dots, a name in brackets, "
            "userinfo before '@') as the host they name, and decides that host by these rules",
        )
    )
    conf = _Conf()
    conf.acl("egressd_forbidden", "dst", _addresses(FORBIDDEN))
    conf.acl("egressd_loopback", "dst", _addresses(LOOPBACK))
    conf.acl("egressd_loopback_name", "dstdomain", "-n", ".localhost")
    conf.acl("egressd_private", "dst", _addresses(PRIVATE + LOOPBACK))
    conf.acl("egressd_literal_v4", "dstdom_regex", "-n", "-i", _LITERAL_V4)
    conf.acl("egressd_literal_v6", "dstdom_regex", "-n", "-i", _LITERAL_V6)
    conf.acl("egressd_connect", "method", "CONNECT")
    conf.acl("egressd_http", "proto", "HTTP")
    mode = mode_of(policy)
    access = conf.access
    access.append("http_access deny egressd_forbidden")
    if mode == "off":
        access.append("http_access deny all")
        return Export(TARGET, _render(policy, conf), findings)

    for i, item in enumerate(deny_rules(policy)):
        if item.rule.restricted:
            findings.append(restricted_finding(item, TARGET, " without ssl-bump"))
        acls = _host_acls(conf, f"egressd_deny_{i}", item, literal_only=False)
        access.append(f"http_access deny {' '.join(acls)}")
    access.append("http_access deny egressd_loopback")
    access.append("http_access deny egressd_loopback_name")

    allows: list[list[str]] = []
    licenses: list[str] = []
    for i, item in enumerate(allow_rules(policy)):
        if item.rule.restricted:
            findings.append(restricted_finding(item, TARGET, " without ssl-bump"))
            continue
        name = f"egressd_allow_{i}"
        acls = _host_acls(conf, name, item, literal_only=True)
        allows.append(acls)
        if item.rule.kind in ("ip", "cidr"):
            lic = [a for a in acls if not a.startswith("egressd_literal")]
            licenses.append(conf.acl(f"{name}_license", "all-of", *lic) if len(lic) > 1 else lic[0])
    origins = [_origin_acls(conf, i, policy) for i in range(len(policy.private.origins))]
    for i, acls in enumerate(origins):
        licenses.append(conf.acl(f"egressd_origin_{i}_license", "all-of", *acls))

    if not policy.private.allow:
        if licenses:
            conf.acl("egressd_license", "any-of", *licenses)
            access.append("http_access deny egressd_private !egressd_license")
        else:
            access.append("http_access deny egressd_private")
    if policy.ports:
        conf.acl("egressd_ports", "port", *(str(p) for p in policy.ports))
        access.append("http_access deny !egressd_ports")
    for acls in allows + origins:
        access.append(f"http_access allow {' '.join(acls)}")
    access.append("http_access allow all" if mode in ("allow", "learn") else "http_access deny all")
    return Export(TARGET, _render(policy, conf), findings)


def _render(policy: Policy, conf: _Conf) -> str:
    head = [
        f"# egressd policy export --to squid (from {policy.source}, mode {mode_of(policy)})",
        "# An include file: its http_access lines end in deny/allow all, so put it before any other",
        "# http_access line (Debian's squid.conf includes /etc/squid/conf.d/*.conf there).",
        "# Squid resolves names itself and does not pin: see docs/scale.md for what that loses.",
    ]
    return "\n".join([*head, *conf.acls, *conf.access]) + "\n"
