"""What a running session shows of itself: `egressd ps` (the control API's /v1/info) and the policy
the dashboard lists (/v1/policy)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from egressd.policy import Policy, PolicyError


class Shown(Protocol):
    """What these read of a running session (egressd.session.root.ProxySession), so the root can
    hand them itself without this module importing the root back."""

    policy: Policy
    policy_paths: Sequence[str]
    command: Sequence[str]
    started: float
    control: Any
    approvals: Any
    proxy: Any
    source: Any
    options: Any


def ps_info(session: Shown) -> dict[str, Any]:
    """What `egressd ps` shows of this instance."""
    from egressd import __version__

    policy = session.policy
    control = session.control
    counts = control.counts if control is not None else None
    children = control.children if control is not None else None
    approvals = session.approvals
    broker = approvals.broker if approvals is not None else None
    proxy = session.proxy
    return {
        "pid": os.getpid(),
        "command": list(session.command),
        "policy": " + ".join(session.policy_paths) or "built-in default",
        "policies": list(session.policy_paths),
        "policy_writable": session.source.writable,
        "mode": policy.mode,
        "ask_timeout": policy.ask_timeout,
        "started": session.started,
        "version": __version__,
        "socket": str(control.path) if control is not None else None,
        "counts": {
            "decisions": counts.decisions if counts else 0,
            "allowed": counts.allowed if counts else 0,
            "refused": counts.refused if counts else 0,
            "pending": len(broker.pending()) if broker else 0,
            "grants": len(proxy.grants.list()) if proxy else 0,
            "connections": proxy.active() if proxy else 0,
        },
        "clients": counts.clients() if counts else {},
        "children": children.list() if children is not None else [],
        "approvers": {
            "terminal": approvals is not None and approvals.prompter is not None,
            "approve_all": session.options.approve_all,
            "can_answer": broker.can_answer() if broker else False,
        },
    }


def policy_info(session: Shown) -> dict[str, Any]:
    """The effective policy (overrides applied) and the file's own allow/deny lists, which are
    the rules the dashboard can remove."""
    from egressd.policy.dump import policy_to_data

    own: dict[str, list[Any]] = {"allow": [], "deny": []}
    writable = session.source.writable
    if writable and session.source.path is not None:
        raw = load_policy_data(session.source.path)
        for which in ("allow", "deny"):
            entries = raw.get(which) if isinstance(raw, dict) else None
            own[which] = [e for e in entries if isinstance(e, str)] if isinstance(entries, list) else []
    return {
        "source": " + ".join(session.policy_paths) or "built-in default",
        "writable": writable,
        "effective": policy_to_data(session.policy),
        "file": own,
    }


def load_policy_data(path: str | os.PathLike[str]) -> Any:
    """The policy file as plain data (None when unreadable or not a policy's mapping), for listing
    the rules it holds itself — the reload reports a broken file, this only shows less. Decoded
    like the loader decodes it, so a file the loader refuses (duplicate keys) lists nothing."""
    from egressd.policy.loader import policy_data

    source = os.fspath(path)
    try:
        return policy_data(Path(source).read_bytes(), source)
    except (OSError, PolicyError):
        return None
