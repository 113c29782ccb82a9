"""What every target shares: the walk over the policy's rules and the findings most targets make.

Why one place: "faithful or narrower" is decided per rule kind (restricted, port, IP, wildcard) in
the same way for every target; each target module only says how it writes what it can express.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from egressd.policy import HostRule, Policy
from egressd.tools.export.report import Finding

__all__ = [
    "Rule",
    "allow_rules",
    "deny_rules",
    "denied_below",
    "mode_of",
    "origins_dropped",
    "policy_findings",
    "restricted_finding",
]


@dataclass(frozen=True)
class Rule:
    """A policy rule with where it was written, as the report names it."""

    setting: str  # "allow[3]"
    rule: HostRule

    @property
    def decides(self) -> str:
        """The egressd decision rule (``Decision.rule``) this rule produces."""
        prefix = self.setting.partition("[")[0]
        return f"{prefix}: {self.rule.text}"


def _rules(policy: Policy, key: str) -> Iterator[Rule]:
    ruleset = policy.allow if key == "allow" else policy.deny
    for i, rule in enumerate(ruleset.rules):
        yield Rule(f"{key}[{i}]", rule)


def allow_rules(policy: Policy) -> list[Rule]:
    """The allow rules a target can write: a rule scoped by `exe` is left out (no target knows
    which program opened a connection, and a host-level allow would be wider)."""
    return [item for item in _rules(policy, "allow") if not item.rule.exe]


def deny_rules(policy: Policy) -> list[Rule]:
    return list(_rules(policy, "deny"))


def mode_of(policy: Policy) -> str:
    """The mode as a plain string (``learn`` may come from newer policies: it allows like ``allow``)."""
    return str(policy.mode)


def restricted_finding(item: Rule, target: str, how: str = "") -> Finding:
    """A path/method rule: an allow is dropped (a host-level allow would be wider), a deny widened
    to the whole host (narrower)."""
    r = item.rule
    if item.setting.startswith("deny"):
        return Finding(
            item.setting,
            r.describe(),
            "narrowed",
            f"{target} does not see paths/methods{how}: the deny applies to every request to {r.text}",
        )
    return Finding(
        item.setting,
        r.describe(),
        "dropped",
        f"{target} does not see paths/methods{how}: a host-level allow of {r.text} would be wider, "
        "so the rule is left out (its requests are refused)",
        (item.decides,),
    )


def denied_below(rule: HostRule, denies: list[Rule]) -> tuple[bool, bool]:
    """For a name/wildcard allow rule, against the name deny rules: (every host it admits is denied,
    some host it admits is denied). A deny with a port or a path counts only for the second."""
    if rule.name is None:
        return False, False
    whole = some = False
    for item in denies:
        d = item.rule
        if d.name is None:
            continue
        covers = (d.kind == "name" and rule.name == d.name) or rule.name.endswith("." + d.name)
        inside = d.name == rule.name or d.name.endswith("." + rule.name)
        if covers:
            whole = whole or (d.port is None and not d.restricted)
            some = True
        elif inside:
            some = True
    return whole, some


def origins_dropped(policy: Policy, why: str) -> list[Finding]:
    """Private exact origins the target cannot keep (scheme and port together): left out."""
    return [
        Finding(f"private.origins[{i}]", str(o), "dropped", why, (f"private.origins: {o}",))
        for i, o in enumerate(policy.private.origins)
    ]


def policy_findings(policy: Policy, target: str, *, central: bool = True) -> list[Finding]:
    """Findings about settings no target expresses: mode ask/learn, profiles, built-in allowances,
    inspection, limits, loopback on a central proxy."""
    out: list[Finding] = []
    for item in _rules(policy, "allow"):
        if item.rule.exe:
            out.append(
                Finding(
                    item.setting,
                    item.rule.describe(),
                    "dropped",
                    f"{target} does not know which program opened a connection: a host-level allow of "
                    f"{item.rule.text} would be wider, so the rule is left out (its connections are refused)",
                    (item.decides,),
                )
            )
        if item.rule.private and not policy.private.allow:
            out.append(
                Finding(
                    item.setting,
                    item.rule.describe(),
                    "narrowed",
                    f"{target} cannot let one rule's names resolve to private addresses: exported as a "
                    f"plain allow of {item.rule.text}, whose private addresses are refused there",
                    (item.decides,),
                )
            )
    mode = mode_of(policy)
    if mode == "ask":
        out.append(
            Finding(
                "mode",
                "ask",
                "denied",
                f"{target} has no approver: what would be asked is refused",
                ("mode: ask",),
            )
        )
    if mode == "learn":
        out.append(
            Finding(
                "mode",
                "learn",
                "unsupported",
                f"{target} cannot learn: unlisted hosts are allowed (as in mode allow) but not recorded",
            )
        )
    for name in policy.profiles:
        out.append(
            Finding(
                f"profiles.{name}",
                None,
                "unsupported",
                f"per-child profiles have no counterpart in {target}: the export is the policy of a "
                f"child without a profile; a child run with profile {name} was narrower (export a "
                "policy per profile)",
            )
        )
    for i, allowance in enumerate(policy.builtin):
        out.append(
            Finding(
                f"builtin[{i}]",
                f"{allowance.host} {','.join(allowance.paths)}",
                "dropped",
                f"built-in allowances admit fixed paths only; {target} does not see paths, and a host-level "
                "allow would be wider: left out",
                (f"builtin: {allowance.host}",),
            )
        )
    if policy.loopback.allow and central:
        out.append(
            Finding(
                "loopback.allow",
                "true",
                "denied",
                f"{target} is a central proxy: its loopback is not the child's machine, so loopback targets "
                "(127.0.0.0/8, ::1, localhost) are refused",
                ("loopback.allow",),
            )
        )
    if policy.private.allow:
        out.append(
            Finding(
                "private.allow",
                "true",
                "unsupported",
                "names may resolve to private addresses (as in egressd); always-refused ones stay refused",
            )
        )
    return out
