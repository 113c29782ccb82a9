"""Helpers that several test modules use (so none imports another), from the tests of: Every export,
for every shipped policy and the export test policies, against its target's schema."""

from __future__ import annotations

from pathlib import Path

from egressd.policy import Policy, load_policy, parse_policy

POLICIES = sorted((Path(__file__).parents[2] / "policies").glob("*.yaml"))


RICH = {
    "version": 1,
    "mode": "enforce",
    "allow": [
        "allowed.test",
        "*.wild.test",
        "port.test:8443",
        "198.51.100.1",
        "2001:db8::1",
        "192.0.2.0/24",
        {"host": "api.test", "paths": ["/v1"], "methods": ["GET"]},
    ],
    "deny": ["denied.test", "bad.allowed.test", {"host": "paths.test", "paths": ["/x"]}, "10.9.0.0/16"],
    "private": {"origins": ["http://192.168.1.10:8080"]},
    "loopback": {"allow": False},
    "profiles": {"ci": {"allow": ["allowed.test"]}},
}


def _policies() -> list[tuple[str, Policy]]:
    out = [(p.name, load_policy(p)) for p in POLICIES]
    out.append(("rich", parse_policy(RICH, "rich")))
    for mode in ("ask", "learn", "allow", "off"):
        out.append((f"rich-{mode}", parse_policy({**RICH, "mode": mode, "deny": ["10.9.0.0/16"]}, mode)))
    out.append(("ports", parse_policy({**RICH, "ports": [80, 443]}, "ports")))
    return out


