"""Workload 8: the decision with a 100,000-rule allowlist, timed per decision.

Run in its own process on the proxy core (`python -m bench.decision --rules 100000`), printing JSON.
The allowlist mixes names (with and without a port), wildcards, IPv4 and IPv6 CIDRs. Every case is
timed timeit-style (a loop of `number` calls, `repeat` times; the median loop gives µs per call),
with the 100,000-rule policy and with a 10-rule one for comparison. Timed is what the pipeline's
decide step computes for a CONNECT it has not decided before: `decide_written` on the host and port
as the client wrote them, canonicalisation included (the step's remembered decisions are not used
here); `large_from_string` is `decide("host:port")`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import timeit
from typing import Any


def allow_rules(n: int) -> list[str]:
    """n distinct rules: 50% names, 5% name:port, 25% wildcards, 15% IPv4 /24s, 5% IPv6 /48s."""
    rules: list[str] = []
    kinds = [("name", 50), ("port", 5), ("wild", 25), ("v4", 15), ("v6", 5)]
    counts = {k: n * share // 100 for k, share in kinds}
    counts["name"] += n - sum(counts.values())
    rules += [f"svc{i}.team{i % 997}.example{i % 89}.com" for i in range(counts["name"])]
    rules += [f"api{i}.svc.example.org:443" for i in range(counts["port"])]
    rules += [f"*.w{i}.corp{i % 101}.net" for i in range(counts["wild"])]
    rules += [f"10.{(i >> 8) & 255}.{i & 255}.0/24" for i in range(counts["v4"])]
    rules += [f"2001:db8:{i:x}::/48" for i in range(counts["v6"])]
    return rules


def cases(n: int) -> dict[str, tuple[str, int]]:
    """Targets (host, port): hits spread through the allowlist, misses, loopback."""
    name_i = max(0, n * 50 // 100 - 7)
    wild_i = max(0, n * 25 // 100 - 3)
    v4_i = max(0, n * 15 // 100 - 5)
    return {
        "hit: exact name": (f"svc{name_i}.team{name_i % 997}.example{name_i % 89}.com", 443),
        "hit: subdomain of a name": (f"a.b.svc{name_i}.team{name_i % 997}.example{name_i % 89}.com", 443),
        "hit: wildcard": (f"x.w{wild_i}.corp{wild_i % 101}.net", 443),
        "hit: IPv4 in a CIDR": (f"10.{(v4_i >> 8) & 255}.{v4_i & 255}.42", 5432),
        "miss: name": ("nothere.example.org", 443),
        "miss: IPv4": ("203.0.113.9", 443),
        "loopback": ("127.0.0.1", 8080),
    }


def _per_call(fn: Any, number: int, repeat: int) -> list[float]:
    """µs per call of each of `repeat` loops of `number` calls."""
    return [t / number * 1e6 for t in timeit.Timer(fn).repeat(repeat=repeat, number=number)]


def measure(n_rules: int, repeat: int = 5, budget: float = 0.05) -> dict[str, Any]:
    from egressd.policy import Client, decide, decide_written, parse_policy

    out: dict[str, Any] = {"rules": n_rules, "repeat": repeat, "cases": {}}
    for label, count in (("large", n_rules), ("small", 10)):
        rules = allow_rules(count)
        t0 = time.perf_counter()
        policy = parse_policy({"version": 1, "mode": "enforce", "allow": rules}, f"bench:{count} rules")
        out[f"{label}_policy_load_s"] = time.perf_counter() - t0
        client = Client()

        def written(host: str, port: int, c: Any = client, p: Any = policy) -> Any:
            return decide_written(host, port, c, p, scheme="connect", method="CONNECT")

        def from_string(text: str, c: Any = client, p: Any = policy) -> Any:
            return decide(text, c, p)

        for case, (host, port) in cases(count).items():
            text = f"{host}:{port}"
            decision = written(host, port)
            probe = timeit.Timer(lambda h=host, n=port: written(h, n)).timeit(200) / 200
            calls = max(500, int(budget / max(probe, 1e-9)))
            entry = out["cases"].setdefault(case, {"target": text})
            entry[f"{label}_runs_us"] = _per_call(lambda h=host, n=port: written(h, n), calls, repeat)
            if label == "large":
                entry["large_from_string_runs_us"] = _per_call(lambda s=text: from_string(s), calls, repeat)
                entry["reason"] = decision.reason
                entry["allowed"] = decision.allowed
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rules", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    json.dump(measure(args.rules, args.repeat), sys.stdout)


if __name__ == "__main__":
    main()
