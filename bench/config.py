"""Sizes and durations of every workload: the full run and the --quick smoke run."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

MiB = 1024 * 1024
GiB = 1024 * MiB

# Every workload, in run order. Names are what --only takes (numbers work too).
WORKLOADS: tuple[str, ...] = (
    "throughput",  # 1
    "setup",  # 2
    "latency",  # 3
    "http",  # 4
    "intercept",  # 5
    "idle",  # 6
    "exec",  # 7
    "decision",  # 8
    "job",  # 9
    "sandbox-throughput",  # 10: egressd sandbox vs egressd exec vs srt, measured from inside
    "sandbox-setup",  # 11
    "sandbox-latency",  # 12
    "sandbox-true",  # 13
)
SANDBOX_WORKLOADS = frozenset(w for w in WORKLOADS if w.startswith("sandbox-"))
# the workloads srt takes part in: its proxy (peers.SrtPeer) or its sandbox
SRT_WORKLOADS = frozenset({"throughput", "setup", "latency", "http", "idle", "job"} | SANDBOX_WORKLOADS)


@dataclass(frozen=True)
class Sizes:
    repeats: int = 3  # runs of every (workload, target); medians and min-max are over these
    throughput_bytes: int = GiB  # 1: bytes through one tunnel
    rate_seconds: float = 3.0  # 2, 4, 5: measuring window of each rate run
    warmup_seconds: float = 0.5  # 2, 3, 4, 5: discarded start of each run
    setup_concurrency: tuple[int, ...] = (10, 100)  # 2
    latency_c1_samples: int = 1000  # 3: CONNECTs measured back to back at concurrency 1
    latency_seconds: float = 5.0  # 3: window of the paced run at concurrency 100
    latency_rate: float = 100.0  # 3: offered CONNECTs/s at concurrency 100 (Poisson arrivals)
    latency_concurrency: int = 100  # 3
    http_connections: int = 32  # 4: wrk connections
    https_connections: int = 16  # 5: keep-alive TLS connections
    big_response_bytes: int = 256 * MiB  # 5
    idle_tunnels: int = 10_000  # 6 (capped by the fd hard limit: a proxy needs 2 fds per tunnel)
    idle_hold_seconds: float = 3.0  # 6: how long the tunnels sit idle before the check
    idle_open_concurrency: int = 200  # 6: CONNECTs in flight while opening
    exec_runs: int = 7  # 7, 13: `egressd exec -- true` (13: and sandbox, srt) runs per repeat
    decision_rules: int = 100_000  # 8
    job_repeats: int = 7  # 9: npm ci runs per target (~5 s each on tmpfs: 7 for a steady median)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


FULL = Sizes()

QUICK = replace(
    FULL,
    repeats=1,
    throughput_bytes=64 * MiB,
    rate_seconds=1.0,
    warmup_seconds=0.2,
    latency_c1_samples=200,
    latency_seconds=1.5,
    big_response_bytes=32 * MiB,
    idle_tunnels=1000,
    idle_hold_seconds=0.5,
    exec_runs=3,
    job_repeats=1,
)


def parse_size(text: str) -> int:
    """`64M`, `1G`, `512k` or a byte count."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    factor = {"K": 1024, "M": MiB, "G": GiB}.get(text[-1:], 1)
    number = text[:-1] if factor != 1 else text
    return int(float(number) * factor)


def select_workloads(only: list[str] | None) -> list[str]:
    """--only accepts names or numbers (1-13), repeated or comma-separated."""
    if not only:
        return list(WORKLOADS)
    chosen: list[str] = []
    for item in only:
        for part in item.split(","):
            part = part.strip().lower()
            if not part:
                continue
            if part.isdigit() and 1 <= int(part) <= len(WORKLOADS):
                part = WORKLOADS[int(part) - 1]
            if part not in WORKLOADS:
                raise ValueError(
                    f"unknown workload {part!r}; choose from {', '.join(WORKLOADS)} or 1-{len(WORKLOADS)}"
                )
            if part not in chosen:
                chosen.append(part)
    return [w for w in WORKLOADS if w in chosen]
