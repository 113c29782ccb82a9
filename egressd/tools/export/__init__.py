"""``egressd policy export``: one policy written for the engines fleets already run.

Pure: a Policy in, the target's configuration text and a report out (no I/O). Faithful or narrower,
never wider: whatever a target cannot express exactly is dropped, narrowed or refused, and said in
the report (see report.py); an export that could only be wider raises ExportRefused.
"""

from __future__ import annotations

from collections.abc import Callable

from egressd.policy import Policy
from egressd.tools.export.report import Export, ExportRefused, Finding

__all__ = ["TARGETS", "Export", "ExportRefused", "Finding", "export_policy"]


def _squid(policy: Policy) -> Export:
    from egressd.tools.export.squid import export_squid

    return export_squid(policy)


def _smokescreen(policy: Policy) -> Export:
    from egressd.tools.export.smokescreen import export_smokescreen

    return export_smokescreen(policy)


def _cilium(policy: Policy) -> Export:
    from egressd.tools.export.cilium import export_cilium

    return export_cilium(policy)


def _istio(policy: Policy) -> Export:
    from egressd.tools.export.istio import export_istio

    return export_istio(policy)


def _envoy(policy: Policy) -> Export:
    from egressd.tools.export.envoy import export_envoy

    return export_envoy(policy)


TARGETS: dict[str, Callable[[Policy], Export]] = {
    "squid": _squid,
    "smokescreen": _smokescreen,
    "cilium": _cilium,
    "istio": _istio,
    "envoy": _envoy,
}


def export_policy(policy: Policy, target: str) -> Export:
    """Export ``policy`` to ``target``; raises ExportRefused when only a wider export is possible."""
    result = TARGETS[target](policy)
    if any(f.action == "refused" for f in result.findings):
        raise ExportRefused(target, result.findings)
    return result
