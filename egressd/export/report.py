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
        return [f.line() for f in self.findings]

    def report_data(self) -> dict[str, object]:
        """Machine-readable report (``--report-json``)."""
        return {
            "target": self.target,
            "wider": False,  # by construction: an export that would be wider raises ExportRefused
            "findings": [asdict(f) | {"decides": list(f.decides)} for f in self.findings],
        }

    def report_json(self) -> str:
        return json.dumps(self.report_data(), indent=2, sort_keys=True) + "\n"
