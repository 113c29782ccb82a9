"""What a workload produces: metrics, each with the runs of every target (or why a target has none)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Literal

Better = Literal["higher", "lower"]


@dataclass
class Metric:
    key: str  # "w1.raw": stable id, used by the goals
    workload: str  # "1. Tunnel throughput"
    title: str  # "raw TCP through one tunnel"
    unit: str
    better: Better
    main: bool = True  # False: a diagnostic (proxy CPU per op, core load, ...), in its own table
    ratio_to_direct: bool = True  # False where direct is no reference (added latency, RSS)
    sandbox: bool = False  # a sandbox workload's: its targets are the wrappers (peers.SANDBOX_TARGETS)
    runs: dict[str, list[float]] = field(default_factory=dict)
    na: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, target: str, value: float | None) -> None:
        if value is not None:
            self.runs.setdefault(target, []).append(float(value))

    def unavailable(self, target: str, reason: str) -> None:
        if target not in self.runs:
            self.na.setdefault(target, reason)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def median(self, target: str) -> float | None:
        values = self.runs.get(target)
        return statistics.median(values) if values else None

    def summary(self, target: str) -> dict[str, Any]:
        values = self.runs.get(target)
        if not values:
            return {"na": self.na.get(target, "not measured")}
        return {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
            "runs": values,
        }

    def ratio(self, target: str, reference: str) -> float | None:
        """median(target) / median(reference): the plain ratio (read it with `better`)."""
        a, b = self.median(target), self.median(reference)
        if a is None or b is None or a <= 0 or b <= 0:  # e.g. an added latency below the noise
            return None
        return a / b
