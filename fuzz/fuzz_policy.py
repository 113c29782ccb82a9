"""Fuzz policy loading (YAML and JSON files) and the guarantees a loaded policy must keep.

Properties checked for every input (read as a .json file when it starts with '{', else .yaml):
- load_policy raises nothing but PolicyError, and its message starts with the file name;
- a policy that loads decides every probe without an internal error (also for each profile);
- whatever it says: always-refused addresses stay refused, every plain deny rule refuses its host
  (and a subdomain), loopback.allow: false refuses loopback, mode: off refuses everything.

    .venv/bin/python fuzz/fuzz_policy.py -max_total_time=600          # a long run
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from _common import instrumented, main

with instrumented():
    from egressd.policy import Client, PolicyError, decide, load_policy

_DIR = Path(tempfile.mkdtemp(prefix="egressd-fuzz-policy-"))
PROBES = ("example.com:443", "127.0.0.1:80", "localhost:8080", "[::1]:80", "http://10.1.2.3/x", "a.test:80")
ALWAYS_REFUSED = ("169.254.169.254:80", "[::ffff:a9fe:a9fe]:80", "0.0.0.0:443", "[fe80::1]:443", "[::]:80")


def _refused(policy: object, target: str, profile: str | None = None) -> bool:
    decision = decide(target, Client(profile=profile), policy)  # type: ignore[arg-type]
    assert decision.reason != "internal_error", (target, decision.detail)
    return not decision.allowed


def test_one_input(data: bytes) -> None:
    path = _DIR / ("policy.json" if data.lstrip().startswith(b"{") else "policy.yaml")
    path.write_bytes(data)
    try:
        policy = load_policy(path)
    except PolicyError as exc:
        assert str(exc).startswith(str(path)) or str(exc).startswith("EGRESSD_MODE"), exc
        return
    for profile in (None, *policy.profiles):
        for target in PROBES:
            _refused(policy, target, profile)
        for target in ALWAYS_REFUSED:
            assert _refused(policy, target, profile), (target, profile)
    for rule in policy.deny.rules:
        if rule.restricted:
            continue
        port = rule.port or 443
        if rule.name is not None:
            assert _refused(policy, f"{rule.name}:{port}"), rule
            if rule.kind == "name":
                assert _refused(policy, f"sub.{rule.name}:{port}"), rule
        elif rule.network is not None:
            host = rule.network.network_address
            assert _refused(policy, f"[{host}]:{port}" if host.version == 6 else f"{host}:{port}"), rule
    if not policy.loopback.allow:
        for target in ("127.0.0.1:80", "localhost:80", "[::1]:80", "0x7f.1:80"):
            assert _refused(policy, target), target
    if policy.mode == "off":
        for target in PROBES:
            assert _refused(policy, target), target


if __name__ == "__main__":
    main(test_one_input, "policy")
