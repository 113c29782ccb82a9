"""A/B of egressd's user-space instructions per operation, under callgrind.

    .venv/bin/python -m bench.instructions                                   # this tree's egressd
    .venv/bin/python -m bench.instructions --a-env PYTHONPATH=/path/to/other/checkout
    .venv/bin/python -m bench.instructions --b-args "--audit /tmp/audit.jsonl"   # an option's cost
    .venv/bin/python -m bench.instructions --workload close     # plain-HTTP GETs, Connection: close

An operation is what bench.ab's `--workload` says: a tunnel (CONNECT + GET + close, the default),
an absolute-form GET kept alive, or one with `Connection: close`.

Why: CPU time on a shared 2-core machine moves ±10 % between runs of one build, more than most
single changes to the set-up path save, so bench.ab needs many rounds to see them. Instructions
counted by valgrind's callgrind do not move with the machine's load (two runs of one build agree to
within 1 %), so one run of A and one of B tell a change's effect on egressd's own work. They leave
out the kernel's share (the two TCP connections of a tunnel: about a third of its CPU) and cache
misses: confirm a change with bench.ab and the full bench before trusting a figure. Needs valgrind
(`apt-get install valgrind`); egressd runs ~50× slower under it, so a few hundred operations suffice.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.ab import add_sides, operations, proxy_of, upstream


def total_instructions(out_dir: Path) -> int:
    """The instructions counted while collection was on: the largest total of the dumps."""
    best = 0
    for dump in out_dir.glob("callgrind.out*"):
        for line in dump.read_text(errors="replace").splitlines():
            if line.startswith(("summary:", "totals:")):
                best = max(best, int(line.split()[1]))
    return best


def _interpreter(script: str) -> str:
    """The Python an installed `egressd` script runs with (its #! line): its own venv's."""
    first = Path(script).read_text(errors="replace").split("\n", 1)[0]
    return first[2:].strip() if first.startswith("#!") else sys.executable


def _callgrind(pid: int, *flags: str) -> None:
    subprocess.run(["callgrind_control", *flags, str(pid)], capture_output=True, check=True)


async def measure(
    egressd: str,
    env: dict[str, str],
    up: int,
    count: int,
    concurrency: int,
    extra: list[str] | None = None,
    workload: str = "connect",
) -> float:
    """Instructions per operation of one `egressd run` under callgrind, counted only over `count`
    operations after a warm-up (imports, the first connections, the memories filling)."""
    with tempfile.TemporaryDirectory(prefix="egressd-callgrind-") as tmp:
        out = Path(tmp)
        proc = subprocess.Popen(
            [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={out}/callgrind.out.%p",
                _interpreter(egressd),
                egressd,
                "run",
                *(extra or []),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **env},
        )
        try:
            port, auth = proxy_of(proc)
            await operations(workload, port, auth, up, 300, concurrency)  # warm-up
            await asyncio.sleep(2)
            _callgrind(proc.pid, "-i", "on")
            await operations(workload, port, auth, up, count, concurrency)
            _callgrind(proc.pid, "-i", "off")
            _callgrind(proc.pid, "-d")  # dump what was counted
        finally:
            proc.terminate()
            proc.wait(60)
        return total_instructions(out) / count


async def main(args: argparse.Namespace) -> None:
    server = await upstream()
    up = server.sockets[0].getsockname()[1]
    sides = {
        "A": (args.a_egressd, dict(v.split("=", 1) for v in args.a_env), shlex.split(args.a_args)),
        "B": (args.b_egressd, dict(v.split("=", 1) for v in args.b_env), shlex.split(args.b_args)),
    }
    counts: dict[str, list[float]] = {"A": [], "B": []}
    for _ in range(args.rounds):
        for name, (egressd, env, extra) in sides.items():
            per_op = await measure(egressd, env, up, args.count, args.concurrency, extra, args.workload)
            counts[name].append(per_op)
            setting = shlex.join([*(f"{k}={v}" for k, v in env.items()), egressd, "run", *extra])
            print(f"{name} {setting}: {per_op / 1000:.1f} k instructions per operation ({args.workload})")
    a, b = min(counts["A"]), min(counts["B"])
    change = f"{b / a:.3f} ({a / 1000:.1f} k -> {b / 1000:.1f} k)"
    print(f"B / A ({args.workload}): instructions per operation {change}")
    server.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.instructions", description=__doc__.split("\n\n")[0])
    add_sides(p)
    p.add_argument("--a-args", default="", help="options of egressd run for A (default: none)")
    p.add_argument("--b-args", default="", help='options of egressd run for B: "--audit /tmp/a.jsonl"')
    p.add_argument("--count", type=int, default=500, help="operations counted (after 300 of warm-up)")
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1, help="runs of each of A and B (the lowest counts)")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
