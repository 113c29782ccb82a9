"""Host patterns of other tools as egressd rules: the same hosts or fewer, never more.

The tools egressd imports from (sandbox-runtime, Smokescreen, allowlist files) share one pattern
language: `example.com` is that name EXACTLY, `*.example.com` its subdomains only. egressd's
`example.com` also matches every subdomain, and egressd has no exact-only rule, so an exact name
`e` becomes `allow: e` plus `deny: *.e` — unless a wildcard of the same list already admits all of
e's subdomains. Deny wins in egressd, so such a deny also refuses other allowed names below `e`:
each of those is reported (narrowed), never admitted by widening.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from egressd.policy import TargetError, canonical_host
from egressd.policy.ports import port_number
from egressd.tools.export.report import Finding

__all__ = ["Pattern", "Translation", "parse_pattern", "translate"]


@dataclass(frozen=True)
class Pattern:
    """One usable pattern: an exact name, a subdomains-only wildcard, or one IP address."""

    kind: str  # "exact" | "below" | "ip"
    host: str  # canonical: IDNA name, or the address
    port: int | None = None
    source: str = ""  # where it came from, for findings ("network.allowedDomains[3]")
    text: str = ""  # as written

    def rule(self) -> str:
        if self.port is None:
            return f"*.{self.host}" if self.kind == "below" else self.host
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"*.{host}:{self.port}" if self.kind == "below" else f"{host}:{self.port}"


@dataclass
class Translation:
    """egressd allow and deny rules plus what could not be said exactly."""

    allow: list[str] = field(default_factory=list)
    deny: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)


def _under(name: str, parent: str) -> bool:
    return name.endswith("." + parent)


def parse_pattern(
    text: object, source: str, findings: list[Finding], *, ports: bool = False
) -> Pattern | None:
    """A pattern, or None with a finding saying why it was left out (dropped: fewer hosts)."""

    def drop(why: str) -> None:
        findings.append(Finding(source, repr(text) if not isinstance(text, str) else text, "dropped", why))

    if not isinstance(text, str) or not text.strip():
        drop("not a host name")
        return None
    raw = text.strip()
    port: int | None = None
    if ports and raw.count(":") == 1 and not raw.startswith("["):
        raw, _, port_text = raw.partition(":")
        port = port_number(port_text)
        if port is None:
            drop("not a valid port")
            return None
    below = raw.startswith("*.")
    if raw.startswith("."):  # `.example.com`: read as its subdomains (the narrower reading)
        findings.append(
            Finding(source, text, "narrowed", "a leading '.' is read as the subdomains only (as `*.name`)")
        )
        below, raw = True, "*" + raw
    body = raw[2:] if below else raw
    if "*" in body or not body:
        drop(
            "a wildcard other than a leading '*.' has no egressd rule (and '*' alone would admit everything)"
        )
        return None
    if any(c in body for c in "/@?#% \t"):
        drop("not a host name (a URL, path, user or space)")
        return None
    try:
        host = canonical_host(body)
    except TargetError as exc:
        drop(f"not a valid host: {exc.reason}")
        return None
    if host.ip is not None:
        if below:
            drop("a wildcard cannot apply to an IP address")
            return None
        try:
            plain = str(ipaddress.ip_address(body.strip("[]"))) == str(host.ip)
        except ValueError:
            plain = False
        if not plain:
            drop(f"an address in a legacy spelling (egressd reads it as {host.ip}); write it plainly")
            return None
        return Pattern("ip", str(host.ip), port, source, text)
    if host.name != body.lower().rstrip("."):
        findings.append(
            Finding(
                source,
                text,
                "normalised",
                f"read as {host.name}, the spelling clients send (egressd matches the name in either)",
            )
        )
    if below and "." not in str(host.name):
        drop("a wildcard over a top-level domain is far wider than any service needs")
        return None
    return Pattern("below" if below else "exact", str(host.name), port, source, text)


def _covers_below(pattern: Pattern, name: str) -> bool:
    """Every subdomain of `name` is matched by the wildcard `pattern` (same port or any)."""
    return pattern.kind == "below" and (pattern.host == name or _under(name, pattern.host))


def _port_overlaps(one: Pattern, other: Pattern) -> bool:
    return one.port is None or other.port is None or one.port == other.port


def translate(allowed: list[Pattern], denied: list[Pattern]) -> Translation:
    """egressd rules admitting the allowed patterns' hosts, or fewer, and refusing the denied ones."""
    out = Translation()
    for item in denied:
        out.deny.append(item.rule())
        if item.kind == "exact":
            out.findings.append(
                Finding(
                    item.source,
                    item.text,
                    "narrowed",
                    f"egressd's deny {item.rule()!r} also refuses the subdomains of {item.host}",
                )
            )
    # exact names whose subdomains no wildcard of the list admits: `*.name` is denied
    fenced = [
        item
        for item in allowed
        if item.kind == "exact"
        and not any(_covers_below(o, item.host) and o.port in (None, item.port) for o in allowed)
    ]
    for item in allowed:
        fence = next((f for f in fenced if _under(item.host, f.host) and _port_overlaps(f, item)), None)
        if fence is not None:
            out.findings.append(
                Finding(
                    item.source,
                    item.text,
                    "dropped",
                    f"below the exact name {fence.host!r}, whose subdomains are denied (deny wins in "
                    f"egressd): an exact name and names below it cannot both be said exactly",
                )
            )
            continue
        out.allow.append(item.rule())
        if item in fenced:
            subdomains = Pattern("below", item.host, item.port).rule()
            out.deny.append(subdomains)
            out.findings.append(
                Finding(
                    item.source,
                    item.text,
                    "narrowed",
                    f"egressd's rule {item.rule()!r} also matches subdomains: {subdomains!r} is denied so "
                    f"only {item.host} is admitted (write {item.host!r} in egressd to admit both)",
                )
            )
    out.allow = list(dict.fromkeys(out.allow))
    out.deny = list(dict.fromkeys(out.deny))
    return out
