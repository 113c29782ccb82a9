"""policy_to_data gives the file format back: loading it again yields an equal policy."""

from __future__ import annotations

import pytest

from egressd.policy import builtin_policy_path, load_policy, parse_policy
from egressd.policy.dump import policy_to_data

RICH = {
    "version": 1,
    "mode": "ask",
    "allow": [
        "up.test",
        "*.wild.test",
        "198.51.100.0/24:8080",
        "[2001:db8::1]:443",
        {"host": "api.test", "paths": ["/v1/read"], "methods": ["GET"]},
        {"host": "ws.test", "paths": ["/socket/"], "methods": ["GET"], "websocket": True},
    ],
    "deny": ["bad.up.test"],
    "loopback": {"allow": True, "ports": [11434]},
    "private": {"allow": False, "origins": ["http://192.168.1.10:8080"]},
    "builtin": [
        {"host": "registry.test", "paths": ["/pkg/"], "methods": ["GET", "HEAD"]},
        {"host": "live.test", "paths": ["/feed/"], "methods": ["GET"], "websocket": True},
    ],
    "inspect": ["inspect.test"],
    "ports": [80, 443],
    "credentials": {"strip_on_host_change": ["authorization", "x-api-key"]},
    "limits": {
        "connect_timeout": 3,
        "dns_timeout": 2,
        "idle_timeout": 60,
        "max_response_bytes": 1000,
        "header_timeout": 5,
        "max_connections": 100,
        "requests_per_second": 2.5,
        "burst": 10,
    },
    "timeouts": {"response": 45},
    "resolver": {"nameservers": ["127.0.0.1:5353", "[::1]:53"]},
    "profiles": {"ci": {"allow": ["up.test"], "deny": [], "ports": [443]}},
    "websocket": False,
    "audit": {"on_failure": "continue", "max_queue_bytes": 65536},
}


@pytest.mark.parametrize("name", ["default", "npm", "pypi", "github"])
def test_presets_round_trip(name: str) -> None:
    policy = load_policy(builtin_policy_path(name))
    assert parse_policy(policy_to_data(policy), "<dump>") == policy


def test_rich_policy_round_trips() -> None:
    policy = parse_policy(RICH, "<rich>")
    again = parse_policy(policy_to_data(policy), "<dump>")
    assert again == policy
    assert policy_to_data(again) == policy_to_data(policy)
