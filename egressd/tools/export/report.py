"""What an export could not say exactly: one finding per rule or setting, and what was done instead.

Why a report at all: every target speaks a narrower language than egressd's policy. An export is
only trustworthy if each place where it differs is said, and said in a form a test (or a CI gate)
can read: the Squid differential test accepts a difference only when a finding predicted it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Literal

__all__ = ["Action", "Export", "ExportRefused", "Finding"]

# narrowed: the rule is kept but matches less; dropped: the rule is left out (its hosts are refused);
# denied: an allowance became a refusal (mode ask, loopback); refused: no output could be made that is
# not wider; unsupported: a feature with no counterpart that does not widen anything (learn, audit);
# normalised (imports): the same host in egressd's spelling (IDNA, case, trailing dot).
Action = Literal["narrowed", "dropped", "denied", "refused", "unsupported", "normalised"]


@dataclass(frozen=True)
class Finding:
    """One difference between the policy and the exported configuration."""

    setting: str  # where in the policy: "allow[2]", "mode", "loopback.allow", "profiles.ci"
    rule: str | None  # the rule or value as written
    action: Action
    detail: str
    # The egressd decision rules (``Decision.rule``) whose allows the target may refuse instead.
    decides: tuple[str, ...] = ()

    def line(self) -> str:
        """One human line for stderr."""
        where = f"{self.setting} {self.rule!r}" if self.rule is not None else self.setting
        return f"{self.action}: {where}: {self.detail}"


class ExportRefused(Exception):
    """The policy cannot be exported to this target without widening it."""

    def __init__(self, target: str, findings: list[Finding]) -> None:
        refused = [f for f in findings if f.action == "refused"]
        super().__init__(
            f"cannot export to {target} without widening the policy: " + "; ".join(f.line() for f in refused)
        )
        self.target = target
        self.findings = findings


@dataclass
class Export:
    """The exported configuration text and the findings about it."""

    target: str
    text: str
    findings: list[Finding] = field(default_factory=list)

    def report_lines(self) -> list[str]:
        """The findings, then what the engine decides differently per kind of target."""
        return [f.line() for f in self.findings] + [f"differs: {line}" for line in loss_lines(self.target)]

    def report_data(self) -> dict[str, object]:
        """Machine-readable report (``--report-json``)."""
        return {
            "target": self.target,
            "wider": False,  # by construction: an export that would be wider raises ExportRefused
            "findings": [asdict(f) | {"decides": list(f.decides)} for f in self.findings],
            "kinds": {
                kind: [{"how": loss.how, "detail": loss.detail} for loss in losses]
                for kind, losses in LOSSES.get(self.target, {}).items()
            },
        }

    def report_json(self) -> str:
        return json.dumps(self.report_data(), indent=2, sort_keys=True) + "\n"


# -- what each engine decides differently, per kind of target ----------------------------------------
# The kinds of target, as the differential tests classify the rows of their one target table.
TARGET_KINDS: dict[str, str] = {
    "name": "a name as written in the policy, or a subdomain of a name rule",
    "name spelling": "the same name in another spelling egressd reads (case, one trailing dot)",
    "wildcard": "a name under a `*.` rule",
    "port rule": "a name whose rule has a port",
    "path rule": "a name whose rule has paths or methods",
    "address": "an IP literal in its canonical spelling",
    "address spelling": "an IP literal in another spelling (legacy IPv4 forms, mapped or long IPv6)",
    "address in a range": "an IP literal inside a CIDR rule",
    "name to a guarded address": "a name that resolves to a private, loopback or metadata address",
    "loopback": "127.0.0.0/8, ::1, localhost, in any spelling",
    "unparseable": "a spelling egressd refuses as unparseable (userinfo, bad punycode, empty labels)",
}

NARROWER = "narrower"  # refuses some targets of this kind that egressd admits (never the reverse)
READS = "reads the host it names"  # admits a spelling egressd refuses, as the host egressd admits
WIDER = "wider, outside its file"  # what the engine's nature cannot refuse (reported; the fix is elsewhere)


@dataclass(frozen=True)
class Loss:
    """How one engine decides one kind of target differently from egressd, and why."""

    how: str  # NARROWER, READS or WIDER
    detail: str
    # True: the differential test of this engine sees it on its target table (tests/support/
    # export_targets.py); False: it needs a policy or request that table does not have.
    in_table: bool = True


def _central(name: str) -> tuple[Loss, ...]:
    return (
        Loss(
            NARROWER,
            f"with loopback.allow: {name} is a central proxy, its loopback is not the child's",
            False,
        ),
    )


_PATH = Loss(NARROWER, "a path/method allow is left out: the engine does not see paths", False)
_READS_NAMED = Loss(READS, "userinfo, brackets or trailing dots: decides the host they name")
LOSSES: dict[str, dict[str, tuple[Loss, ...]]] = {
    "squid": {
        "path rule": (Loss(NARROWER, "a path/method allow is left out (needs ssl-bump)", False),),
        "loopback": _central("squid"),
        "unparseable": (_READS_NAMED,),
    },
    "smokescreen": {
        "port rule": (
            Loss(NARROWER, "a host:port allow is left out unless its port is the policy's only one", False),
        ),
        "path rule": (_PATH,),
        "address": (Loss(NARROWER, "an IPv6 address is refused as a destination"),),
        "address spelling": (
            Loss(NARROWER, "only Go's spelling of an address (dotted decimal, canonical IPv6) matches"),
        ),
        "address in a range": (
            Loss(NARROWER, "a CIDR allow admits names resolving into it, not literals in it"),
        ),
        "loopback": _central("smokescreen"),
        "unparseable": (Loss(READS, "a name in brackets: decides the name"),),
    },
    "envoy": {
        "path rule": (_PATH,),
        "address spelling": (Loss(NARROWER, "the RBAC regex matches an address's canonical spelling only"),),
        "address in a range": (
            Loss(NARROWER, "a CIDR allow is left out (:authority regexes match single addresses)"),
        ),
        "loopback": _central("envoy"),
        "unparseable": (
            Loss(READS, "userinfo in an absolute URL: decides the host after '@'"),
            Loss(
                READS, "labels egressd cannot read (bad punycode) under an allowed name pass the regex", False
            ),
        ),
    },
    "cilium": {
        "name": (
            Loss(WIDER, "decides by address: another name on an allowed name's address is reachable", False),
            Loss(NARROWER, "a name rule with a deny under it loses its subdomains", False),
        ),
        "wildcard": (Loss(NARROWER, "`*` is one label deep: deeper subdomains are refused", False),),
        "path rule": (_PATH,),
        "loopback": (
            Loss(WIDER, "with loopback.allow false: a pod's own loopback never reaches cilium", False),
        ),
        "unparseable": (
            Loss(READS, "the pod's resolver reads the spelling; cilium decides the address", False),
        ),
    },
    "istio": {
        "name": (Loss(NARROWER, "a rule without a port admits 80 and 443 only", False),),
        "path rule": (_PATH,),
        "address": (Loss(NARROWER, "address rules are left out (a ServiceEntry names hosts)", False),),
        "address spelling": (Loss(NARROWER, "address rules are left out", False),),
        "address in a range": (Loss(NARROWER, "address rules are left out", False),),
        "name to a guarded address": (
            Loss(NARROWER, "a name resolving into an allowed range is refused", False),
        ),
        "loopback": _central("the egress gateway"),
    },
}


def loss_lines(target: str) -> list[str]:
    """One line per kind of target the engine decides differently (the report's table)."""
    return [
        f"{kind}: {loss.how}: {loss.detail}"
        for kind in TARGET_KINDS
        for loss in LOSSES.get(target, {}).get(kind, ())
    ]
