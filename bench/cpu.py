"""Proxy CPU per operation of egressd and its peers, three workloads, in one run.

    .venv/bin/python -m bench.cpu                          # tinyproxy, Squid, mitmproxy, srt, egressd
    .venv/bin/python -m bench.cpu --repeats 7 --seconds 3 --json /tmp/cpu.json
    .venv/bin/python -m bench.cpu --only tinyproxy,egressd --workloads keepalive
    .venv/bin/python -m bench.cpu --profile /tmp/egressd-profiles   # py-spy samples of egressd

The workloads, each with 10 clients at once against a fast keep-alive origin on loopback
(bench.upstream.SmallOrigin on uvloop):

- `connect`: CONNECT + `GET /small` + close, closed loop (bench/connect_load.c);
- `keepalive`: absolute-form `GET /small` on kept-alive connections (wrk -c10);
- `close`: the same with `Connection: close`, a new connection for every request (wrk -c10).

Every proxy runs on the proxy core, the load and the origin on the other (as bench/run.py pins
them); all are started once and visited in turns, in an order rotated by the run, so drift in the
machine's load falls on all alike. The CPU per operation is the proxy's process tree's CPU time
over the window divided by the operations completed in it; its median over the runs is printed
with the rate, egressd ÷ each peer, and the goals: egressd's CPU per operation at most 1.8× (a
tunnel), 1.7× (keep-alive GETs) and 4× (`Connection: close` GETs) tinyproxy's, and egressd's rate
at least 1.5× srt's on every workload. Needs root (a network namespace of its own) like bench/run.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench import loadgen, peers, profile, system

HOST = "127.0.0.1"
# workload -> (what one operation is, the most egressd's CPU per operation may be ÷ tinyproxy's)
WORKLOADS: dict[str, tuple[str, float]] = {
    "connect": ("CONNECT + GET + close", 1.8),
    "keepalive": ("plain-HTTP GET, keep-alive", 1.7),
    "close": ("plain-HTTP GET, Connection: close", 4.0),
}
SRT_GOAL = 1.5  # egressd's rate ÷ srt's, at least, on every workload
NAMES = (peers.TINYPROXY, peers.SQUID, peers.MITMPROXY, peers.SRT, peers.EGRESSD)
LABELS = {peers.SQUID: "Squid"}


@dataclass
class Figures:
    """Every run of one (workload, proxy): CPU µs per operation and operations per second."""

    cpu_us: list[float] = field(default_factory=list)
    rate: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def median(self, which: str) -> float | None:
        values = getattr(self, which)
        return statistics.median(values) if values else None


def measure(
    workload: str, proxy: peers.Proxy, up_port: int, concurrency: int, seconds: float, work: Path
) -> tuple[float, float, str]:
    """(operations/s, CPU µs per operation, errors) of one run."""
    if workload == "connect":
        native = loadgen.native_connect_load_binary()
        size = {"concurrency": concurrency, "seconds": seconds, "warmup": 0.5}
        if native is not None:
            r = loadgen.connect_load_native(native, proxy, HOST, up_port, **size)
        else:
            r = loadgen.run_async(loadgen.connect_load(proxy, HOST, up_port, **size))
        why = f"{r.errors} failed ({r.first_error})" if r.errors else ""
        return r.rate, (r.proxy_cpu / r.ops * 1e6 if r.ops else float("nan")), why
    w = loadgen.run_wrk(
        proxy,
        HOST,
        up_port,
        keepalive=workload == "keepalive",
        connections=concurrency,
        seconds=seconds,
        script=work / f"wrk-{proxy.name}-{workload}.lua",
    )
    bad = {k: v for k, v in w.errors.items() if v}
    return w.rate, (w.proxy_cpu / w.requests * 1e6 if w.requests else float("nan")), str(bad) if bad else ""


class Profiler:
    """py-spy on egressd while one workload runs (`--profile`): collapsed stacks and a summary."""

    def __init__(self, out: Path | None) -> None:
        self.out = out
        self.proc: subprocess.Popen[bytes] | None = None
        self.file: Path | None = None

    def start(self, pid: int | None, workload: str) -> None:
        if self.out is None or pid is None:
            return
        py_spy = peers.VENV_BIN / "py-spy"
        self.out.mkdir(parents=True, exist_ok=True)
        self.file = self.out / f"{workload}-egressd.txt"
        argv = [str(py_spy), "record", "--pid", str(pid), "--nonblocking", "--rate", "200"]
        argv += ["--format", "raw", "--output", str(self.file)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.proc is None or self.file is None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if self.file.exists():
            summary = profile.summarize(self.file)
            self.file.with_suffix(".summary.txt").write_text(summary)
            print(summary)
        self.proc = None


def run(args: argparse.Namespace) -> dict[str, dict[str, Figures]]:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.profile is not None:
        system.ensure_pypi_tools(["py_spy"])  # before the namespace, where no index is reachable
    srt, why = system.ensure_srt(args.cache_dir, system.which("npm") or "", install=True)
    system.log(system.enter_netns())
    system.raise_fd_limit()
    pin = system.can_pin() and not args.no_pin
    cpu = system.PROXY_CPU if pin else None
    if pin:
        system.pin_self(system.LOAD_CPU)
    made: dict[str, peers.Peer] = {
        peers.TINYPROXY: peers.TinyproxyPeer(work, cpu),
        peers.SQUID: peers.SquidPeer(work, cpu),
        peers.MITMPROXY: peers.MitmPassthroughPeer(work, cpu),
        peers.SRT: peers.SrtPeer(work, cpu, srt, why),
        peers.EGRESSD: peers.EgressdPeer(work, cpu),
    }
    chosen = [n for n in NAMES if n in args.only]
    up_port = system.free_port()
    origin = subprocess.Popen(
        system.pinned([sys.executable, "-m", "bench.floor", "upstream", str(up_port)], system.LOAD_CPU)
        if pin
        else [sys.executable, "-m", "bench.floor", "upstream", str(up_port)]
    )
    system.wait_port(HOST, up_port, proc=origin)
    running: dict[str, peers.Proxy] = {}
    figures: dict[str, dict[str, Figures]] = {}
    try:
        for name in chosen:
            try:
                running[name] = made[name].start()
            except Exception as e:  # noqa: BLE001 - reported, never faked
                system.log(f"{name}: could not start: {e}")
        names = [n for n in chosen if n in running]
        for workload in args.workloads:
            table = figures.setdefault(workload, {n: Figures() for n in names})
            for name in names:  # a warm-up of each, not counted
                measure(workload, running[name], up_port, args.concurrency, 1.0, work)
            profiler = Profiler(args.profile)
            profiler.start(running[peers.EGRESSD].pid if peers.EGRESSD in running else None, workload)
            try:
                for r in range(args.repeats):
                    for name in names[r % len(names) :] + names[: r % len(names)]:
                        rate, per_op, errors = measure(
                            workload, running[name], up_port, args.concurrency, args.seconds, work
                        )
                        table[name].rate.append(rate)
                        table[name].cpu_us.append(per_op)
                        if errors:
                            table[name].errors.append(f"run {r + 1}: {errors}")
                        system.log(f"{workload} {name}: {rate:,.0f}/s, {per_op:.0f} CPU µs per operation")
            finally:
                profiler.stop()
    finally:
        for proxy in running.values():
            proxy.stop()
        origin.kill()
        origin.wait()
    return figures


def _cells(table: dict[str, Figures], names: list[str], which: str, fmt: Callable[[float], str]) -> str:
    """Each proxy's median and min–max of one figure, as markdown cells."""
    out = []
    for name in names:
        values = getattr(table[name], which) if name in table else []
        ok = [v for v in values if v == v]  # not NaN (a run without one operation)
        out.append(f"{fmt(statistics.median(ok))} ({fmt(min(ok))}–{fmt(max(ok))})" if ok else "n/a")
    return " | ".join(out)


def _ratio(table: dict[str, Figures], which: str, of: str, to: str) -> float | None:
    mine, theirs = (table[n].median(which) if n in table else None for n in (of, to))
    return mine / theirs if mine and theirs else None


def report(figures: dict[str, dict[str, Figures]], repeats: int, concurrency: int) -> str:
    """The tables and the goals, as markdown."""
    out: list[str] = []
    names = [n for n in NAMES if any(n in t for t in figures.values())]
    head = " | ".join(LABELS.get(n, n) for n in names)
    rule = "|---" * (len(names) + 3) + "|"
    out.append(f"Proxy CPU per operation, µs (median of {repeats}, min–max), {concurrency} clients:\n")
    out += [f"| workload | {head} | egressd ÷ tinyproxy | goal |", rule]
    goals: list[tuple[str, bool | None]] = []
    for workload, table in figures.items():
        what, bound = WORKLOADS[workload]
        ratio = _ratio(table, "cpu_us", peers.EGRESSD, peers.TINYPROXY)
        met = None if ratio is None else ratio <= bound
        goals.append((f"{what}: CPU per operation ≤ {bound:g}× tinyproxy's", met))
        shown = f"{ratio:.2f}×" if ratio is not None else "n/a"
        cells = _cells(table, names, "cpu_us", lambda v: f"{v:.0f}")
        out.append(f"| {what} | {cells} | {shown} | {_mark(met)} ≤ {bound:g}× |")
    out.append(f"\nOperations per second (median of {repeats}, min–max):\n")
    out += [f"| workload | {head} | egressd ÷ srt | goal |", rule]
    for workload, table in figures.items():
        what, _ = WORKLOADS[workload]
        ratio = _ratio(table, "rate", peers.EGRESSD, peers.SRT)
        met = None if ratio is None else ratio >= SRT_GOAL
        goals.append((f"{what}: rate ≥ {SRT_GOAL:g}× srt's", met))
        shown = f"{ratio:.2f}×" if ratio is not None else "n/a"
        cells = _cells(table, names, "rate", lambda v: f"{v:,.0f}")
        out.append(f"| {what} | {cells} | {shown} | {_mark(met)} ≥ {SRT_GOAL:g}× |")
    out.append("\nGoals:\n")
    out += [f"- {_mark(met)} {goal}" for goal, met in goals]
    notes = [
        f"- {workload} {name}: {error}"
        for workload, table in figures.items()
        for name, f in table.items()
        for error in f.errors
    ]
    if notes:
        out.append("\nErrors (a failed operation is not counted; tinyproxy closes every client connection,")
        out.append("which wrk counts as a read error on keep-alive):\n")
        out += notes
    return "\n".join(out) + "\n"


def _mark(met: bool | None) -> str:
    return "n/a" if met is None else "✔" if met else "✘"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench.cpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=5, help="runs of every (workload, proxy)")
    p.add_argument("--seconds", type=float, default=3.0, help="the measured window of each run")
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--only", default=",".join(NAMES), help=f"proxies, of {', '.join(NAMES)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {', '.join(WORKLOADS)}")
    p.add_argument("--work", default="/tmp/egressd-bench-cpu", help="peers' configs and logs")
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "egressd-bench",
        help="where sandbox-runtime (srt) is installed once",
    )
    p.add_argument("--profile", type=Path, help="py-spy egressd per workload into this directory")
    p.add_argument("--json", type=Path, help="also write every run's figures here")
    p.add_argument("--no-pin", action="store_true", help="do not pin the proxies and the load to cores")
    args = p.parse_args(argv)
    args.only = [n.strip() for n in args.only.split(",") if n.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in args.workloads:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r}")
    return args


def main() -> None:
    args = parse_args()
    started = time.monotonic()
    load = os.getloadavg()
    figures = run(args)
    text = report(figures, args.repeats, args.concurrency)
    after = os.getloadavg()
    print(text)
    took = time.monotonic() - started
    print(f"load average {load[0]:.1f} at the start, {after[0]:.1f} at the end; {took:.0f} s")
    if args.json is not None:
        data = {w: {n: f.__dict__ for n, f in t.items()} for w, t in figures.items()}
        args.json.write_text(json.dumps({"figures": data, "load": [load, after]}, indent=1))


if __name__ == "__main__":
    main()
