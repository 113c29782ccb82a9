"""The one target table every export is checked on, and what egressd decides for each row.

Why one table: the Squid export is run on the real Squid with these rows (tests/e2e/test_export_squid.py);
Envoy and Smokescreen cannot be installed here, so their evaluators (tests/unit/test_export_envoy.py,
tests/unit/test_export_smokescreen.py) decide the SAME rows, and the differences per target kind are
compared with what the export's loss report says (egressd.tools.export.report.LOSSES).

egressd's side here is its own pure functions, the ones the proxy runs: the decision, then, for a
name, resolution by this table's DNS and the filter of resolved addresses.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from egressd.policy import (
    AddressClass,
    Client,
    Decision,
    HostRule,
    Policy,
    classify,
    decide,
    decide_written,
    filter_addresses,
    parse_policy,
    parse_target,
)
from egressd.policy.hosts import TargetError
from egressd.tools.export.report import LOSSES

from .spellings import ALLOWED_V4, CASES, DNS_NAMES, POLICY

FRONTS = ("get", "connect")

# The export's own rule kinds, next to the corpus policy's (names resolve to the allowed server).
EXTRA_ALLOW = """\
  - "*.wild.test"   # subdomains only: squid's .wild.test would match wild.test too
  - porty.test:1    # another port than the servers'
  - {host: pathy.test, paths: [/ok]}   # needs the path: dropped by the export
  - cidr.test
  - cidrdenied.test
  - 192.0.2.0/24    # licenses cidr.test's private address
"""
EXTRA_DENY = """\
  - 192.0.2.128/25  # deny wins for names resolving into it too (cidrdenied.test)
  - "*.sub.wild.test"
"""
EXTRA_NAMES = {
    "wild.test": ALLOWED_V4,
    "a.wild.test": ALLOWED_V4,
    "x.y.wild.test": ALLOWED_V4,
    "q.sub.wild.test": ALLOWED_V4,
    "sub.wild.test": ALLOWED_V4,
    "porty.test": ALLOWED_V4,
    "pathy.test": ALLOWED_V4,
    "cidr.test": "192.0.2.1",
    "cidrdenied.test": "192.0.2.200",
    # allowed names resolving where the address guard refuses: never connected to, by either
    "meta.allowed.test": "169.254.169.254",
    "loop.allowed.test": "127.0.0.1",
    "loop6.allowed.test": "::1",
    "private.allowed.test": "10.1.2.3",
    "mixed.allowed.test": "192.0.2.1",  # private, but licensed by the 192.0.2.0/24 rule: both admit it
}
EXTRA_HOSTS = [*EXTRA_NAMES, "192.0.2.1", "192.0.2.200"]
NAMES = {**DNS_NAMES, **EXTRA_NAMES}
HOSTS = list(dict.fromkeys([c.host for c in CASES if len(c.host.encode()) <= 255] + EXTRA_HOSTS))
INNER_PATH = "/tunnel"  # what tests.support.corpus.tunnel_get asks inside a tunnel


def policy_text() -> str:
    return POLICY.replace("allow:\n", "allow:\n" + EXTRA_ALLOW, 1).replace(
        "deny:\n", "deny:\n" + EXTRA_DENY, 1
    )


def resolve(name: str) -> list[str]:
    """The table's DNS: case-insensitive, one trailing dot; an unknown name has no address."""
    key = name.lower().removesuffix(".")
    return [NAMES[key]] if key in NAMES else []


def literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address a host is, in its strict (canonical-only) spelling: what engines that do not
    read legacy forms see; None for a name."""
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return None


@dataclass(frozen=True)
class Outcome:
    allowed: bool
    rule: str | None  # the egressd rule that allowed (or refused) it
    reason: str


def decision(policy: Policy, host: str, front: str, port: int) -> Decision:
    """egressd's pure decision for the target as this front sends it."""
    target = f"http://{host}:{port}/spell" if front == "get" else f"{host}:{port}"
    return decide(target, Client(), policy)


def egressd_outcome(policy: Policy, host: str, front: str, port: int) -> Outcome:
    """What egressd does with the row: the decision, an inspected tunnel's inner request, then the
    filter of the name's resolved addresses."""
    if front_refuses(host):
        return Outcome(False, None, "bad_request")
    d = decision(policy, host, front, port)
    if d.allowed and front == "connect" and d.needs_inspection and d.target is not None:
        d = decide_written(d.target.host.text, port, Client(), policy, scheme="https", path=INNER_PATH)
    if not d.allowed:
        return Outcome(False, d.rule, d.reason)
    if d.needs_resolution and d.target is not None and d.target.host.name is not None:
        kept, _ = filter_addresses(d, resolve(d.target.host.name), policy)
        if not kept:
            return Outcome(False, d.rule, "resolved_forbidden")
    return Outcome(True, d.rule, d.reason)


def predicted(findings: list[dict[str, object]], rule: str | None) -> bool:
    """A finding names the egressd rule that allowed this target as one the target may refuse."""
    decides = [str(d) for f in findings for d in f["decides"]]  # type: ignore[attr-defined]
    return rule is not None and any(rule == d or rule.startswith(d + " ") for d in decides)


def front_refuses(host: str) -> bool:
    """egressd's wire readers refuse a raw non-ASCII, space or control character in a host (the
    corpus records it: tests/support/spellings.py, INVALID)."""
    return not host.isascii() or any(ch.isspace() or ord(ch) < 0x21 or ord(ch) == 0x7F for ch in host)


def _rules_naming(policy: Policy, name: str) -> list[HostRule]:
    out = []
    for rule in (*policy.allow.rules, *policy.deny.rules):
        if rule.name is None:
            continue
        if (rule.kind == "name" and name == rule.name) or name.endswith("." + rule.name):
            out.append(rule)
    return out


def target_kind(policy: Policy, host: str, port: int) -> str:
    """The row's kind, as the loss report (egressd.tools.export.report.LOSSES) names them."""
    if front_refuses(host):
        return "unparseable"
    try:
        parsed = parse_target(f"{host}:{port}")
    except TargetError:
        return "unparseable"
    ip = parsed.host.ip
    if ip is not None:
        if ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback):
            return "loopback"
        if host.removeprefix("[").removesuffix("]").lower() != str(ip):
            return "address spelling"
        ranges = [r for r in (*policy.allow.rules, *policy.deny.rules) if r.network is not None]
        if any(r.network.num_addresses > 1 and ip in r.network for r in ranges):  # type: ignore[union-attr]
            return "address in a range"
        return "address"
    name = parsed.host.name or ""
    if name == "localhost" or name.endswith(".localhost"):
        return "loopback"
    if host != name:
        return "name spelling"
    rules = _rules_naming(policy, name)
    if any(r.restricted for r in rules):
        return "path rule"
    if any(r.port is not None for r in rules):
        return "port rule"
    if any(r.kind == "wildcard" for r in rules):
        return "wildcard"
    singles = {
        r.network.network_address for r in policy.allow.rules if r.network and r.network.num_addresses == 1
    }
    resolved = [literal(a) for a in resolve(name)]
    if rules and any(
        a is not None and classify(a) is not AddressClass.GLOBAL and a not in singles for a in resolved
    ):
        return "name to a guarded address"  # the guard decides it: refused, or licensed by a range
    return "name"


def same_host_reading(host: str) -> str:
    """The host a spelling egressd refuses as unparseable names, as engines with laxer readers take
    it: userinfo before '@' dropped, brackets around a name dropped, trailing dots stripped,
    lowercased; a name with a label egressd cannot read (bad punycode, a leading dot) is read as a
    subdomain of the labels after it (the engine matches it as one)."""
    reading = host.rpartition("@")[2].rstrip(".").lower()
    if reading.startswith("[") and reading.endswith("]") and ":" not in reading:
        reading = reading[1:-1]
    labels = reading.split(".")
    for i in range(len(labels)):
        candidate = ".".join(labels[i:])
        try:
            parse_target(f"{candidate}:1")
        except TargetError:
            continue
        return candidate if i == 0 else "sub." + candidate
    return reading


Decides = Callable[[str, str, int], tuple[bool, str]]  # (front, host, port) -> (allowed, why)


def differential(policy: Policy, decides: Decides, findings: list[dict[str, Any]], port: int) -> list[Any]:
    """Every row of the table, both fronts, through egressd and the engine; the differences as
    (kind, front, host, egressd's rule, egressd allowed, engine allowed, why, explained)."""
    rows = []
    for front in FRONTS:
        for host in HOSTS:
            mine = egressd_outcome(policy, host, front, port)
            theirs, why = decides(front, host, port)
            if mine.allowed == theirs:
                continue
            if theirs:  # wider, unless it is a spelling egressd refuses read as a host egressd admits
                reading = same_host_reading(host)
                explained = reading != host and egressd_outcome(policy, reading, front, port).allowed
            else:
                explained = predicted(findings, mine.rule)
            kind = target_kind(policy, host, port)
            rows.append((kind, front, host, mine.rule, mine.allowed, theirs, why, explained))
    return rows


def check_differential(engine: str, load: Callable[[str], Decides], port: int) -> None:
    """The table's policy exported to ``engine``, decided by ``load(exported text)`` and by egressd:
    every difference narrower and predicted (or the same host read), and per kind of target exactly
    what the loss report says."""
    from egressd.tools.export import export_policy

    policy = parse_policy(yaml.safe_load(policy_text()), "table")
    result = export_policy(policy, engine)
    findings = [dataclasses.asdict(f) for f in result.findings]
    rows = differential(policy, load(result.text), findings, port)
    print(f"{engine}: {2 * len(HOSTS)} rows, {len(rows)} differences")
    for kind, front, host, rule, mine, theirs, why, ok in sorted(rows):
        print(
            f"  {kind:26} {front:7} {host!r:32} egressd={mine} {engine}={theirs} ({why}) rule={rule} ok={ok}"
        )
    assert all(ok for *_, ok in rows), "unexplained differences (wider, or not predicted by the report)"
    seen: dict[str, set[str]] = {}
    for kind, _front, _host, _rule, mine, _theirs, _why, _ok in rows:
        seen.setdefault(kind, set()).add("narrower" if mine else "reads the host it names")
    assert seen == measured_losses(engine), "the loss report says otherwise"


MEASURED = ("squid", "smokescreen", "envoy")  # the engines whose differential runs in the tests


def measured_losses(target: str) -> dict[str, set[str]]:
    """Per kind, the differences the differential test of ``target`` must see on its table."""
    out: dict[str, set[str]] = {}
    for kind, losses in LOSSES.get(target, {}).items():
        hows = {loss.how for loss in losses if loss.in_table}
        if hows:
            out[kind] = hows
    return out
