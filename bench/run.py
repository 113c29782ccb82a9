"""egressd's benchmark against direct, tinyproxy, Squid, mitmproxy, srt and egressd at an earlier commit
(egressd-before): one command (see bench/README.md).

    .venv/bin/python bench/run.py                    # the full run (about 45 minutes on 2 cores)
    .venv/bin/python bench/run.py --quick            # a smoke run (a few minutes)
    .venv/bin/python bench/run.py --only setup,latency --repeats 5

Writes bench/results/<timestamp>/results.json, results.md and ratios.png.
"""

from __future__ import annotations

import sys
from pathlib import Path

_BENCH = Path(__file__).resolve().parent
_REPO = _BENCH.parent
# run as a script: import the bench as the package `bench`, never its modules as top-level names
if sys.path and Path(sys.path[0]).resolve() == _BENCH:
    sys.path[0] = str(_REPO)
elif str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import argparse  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402
from typing import Any  # noqa: E402

from bench import before, config, loadgen, npmjob, peers, profile, report, system, upstream  # noqa: E402
from bench.certs import make_certs  # noqa: E402
from bench.model import Metric  # noqa: E402
from bench.workloads import RUNNERS, Context  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/run.py",
        description=(
            "Benchmark egressd against direct, tinyproxy, Squid, mitmproxy, srt and egressd at an "
            "earlier commit (egressd-before)."
        ),
        epilog=f"workloads: {', '.join(f'{i}={w}' for i, w in enumerate(config.WORKLOADS, 1))}",
    )
    p.add_argument("--quick", action="store_true", help="smaller sizes, shorter windows: a smoke run")
    p.add_argument(
        "--only",
        action="append",
        metavar="WORKLOAD",
        help=f"run only these (names or 1-{len(config.WORKLOADS)}, comma-separated)",
    )
    p.add_argument("--out", type=Path, default=_BENCH / "results", help="results parent directory")
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "egressd-bench",
        help="where the npm job's tarballs, sandbox-runtime (srt) and egressd-before are kept between runs",
    )
    p.add_argument(
        "--before",
        default=before.DEFAULT_COMMIT,
        metavar="COMMIT",
        help=f"the egressd-before peer: egressd at this commit, in its own venv in the cache dir "
        f"(default {before.DEFAULT_COMMIT}, the engine with its native C front)",
    )
    p.add_argument("--no-before", action="store_true", help="no egressd-before peer")
    p.add_argument("--repeats", type=int, help="runs per figure (default 3)")
    p.add_argument("--throughput-bytes", type=config.parse_size, help="workload 1 size, e.g. 1G")
    p.add_argument("--big-bytes", type=config.parse_size, help="workload 5 response size, e.g. 256M")
    p.add_argument("--rate-seconds", type=float, help="measuring window of rate workloads")
    p.add_argument("--latency-rate", type=float, help="CONNECT/s offered at concurrency 100 (workload 3)")
    p.add_argument("--idle-tunnels", type=int, help="workload 6 tunnel count")
    p.add_argument("--decision-rules", type=int, help="workload 8 allowlist size")
    p.add_argument("--job-repeats", type=int, help="npm ci runs per target")
    p.add_argument("--no-pin", action="store_true", help="do not pin proxies and load to separate cores")
    p.add_argument(
        "--no-netns", action="store_true", help="stay in this network namespace (loopback only still)"
    )
    p.add_argument("--no-install", action="store_true", help="do not apt-get/pip install anything")
    p.add_argument(
        "--egressd-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for every egressd started, egressd-before's too (e.g. EGRESSD_UVLOOP=0)",
    )
    p.add_argument(
        "--egressd-args",
        default="",
        metavar="ARGS",
        help="extra options for the `egressd run` under test (not egressd-before), shell-split, "
        "e.g. --egressd-args='--metrics 127.0.0.1:0' to compare with metrics on",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also sample egressd with py-spy in every workload (results/profiles/); adds some load",
    )
    return p.parse_args(argv)


def sizes_from(args: argparse.Namespace) -> config.Sizes:
    sizes = config.QUICK if args.quick else config.FULL
    overrides: dict[str, Any] = {}
    for arg, field in (
        ("repeats", "repeats"),
        ("throughput_bytes", "throughput_bytes"),
        ("big_bytes", "big_response_bytes"),
        ("rate_seconds", "rate_seconds"),
        ("latency_rate", "latency_rate"),
        ("idle_tunnels", "idle_tunnels"),
        ("decision_rules", "decision_rules"),
        ("job_repeats", "job_repeats"),
    ):
        value = getattr(args, arg)
        if value is not None:
            overrides[field] = value
    return replace(sizes, **overrides)


# the workloads egressd-before takes part in (not the decision function, not the sandbox workloads)
BEFORE_WORKLOADS = frozenset({"throughput", "setup", "latency", "http", "intercept", "idle", "exec", "job"})


def prepare(
    args: argparse.Namespace, workloads: list[str]
) -> tuple[str, list[npmjob.Package] | None, list[str], tuple[Path | None, str], before.Before | None]:
    """Everything that needs the network (package registries only), before the bench leaves it."""
    notes: list[str] = []
    srt: tuple[Path | None, str] = (None, "not needed by these workloads")
    if not args.no_install:
        system.ensure_debian_tools([b for b in system.DEBIAN_TOOLS if b != "npm"])
        still = system.ensure_pypi_tools(["matplotlib", "uvloop"])
        notes += [
            f"{m} is not installed: {'no chart' if m == 'matplotlib' else 'plain asyncio loop'}"
            for m in still
        ]
        if args.profile and not (Path(sys.executable).parent / "py-spy").exists():
            system.ensure_pypi_tools(["py_spy"])
    npm = shutil.which("npm") or ""
    packages = None
    if "job" in workloads:
        if not npm and not args.no_install:
            system.ensure_debian_tools(["npm"])
            npm = shutil.which("npm") or ""
        if npm:
            packages = npmjob.prepare(args.cache_dir, npm)
        else:
            notes.append("npm is missing: workload 9 not run")
    if config.SRT_WORKLOADS & set(workloads):
        if not npm and not args.no_install:
            system.ensure_debian_tools(["npm"])
            npm = shutil.which("npm") or ""
        srt = system.ensure_srt(args.cache_dir, npm, install=not args.no_install)
        if srt[0] is None:
            notes.append(f"srt is not available: {srt[1]}")
    earlier = None
    if not args.no_before and BEFORE_WORKLOADS & set(workloads):
        earlier = before.prepare(args.cache_dir, args.before, install=not args.no_install)
        if earlier.bin is None:
            notes.append(f"egressd-before is not available: {earlier.why}")
    return npm, packages, notes, srt, earlier


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        workloads = config.select_workloads(args.only)
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    sizes = sizes_from(args)
    for item in args.egressd_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"bench: --egressd-env wants KEY=VALUE, not {item!r}", file=sys.stderr)
            return 2
        peers.EGRESSD_EXTRA_ENV[key] = value
    peers.EGRESSD_EXTRA_ARGS[:] = shlex.split(args.egressd_args)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    t_start = time.monotonic()
    out = args.out / time.strftime("%Y%m%d-%H%M%S")
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    system.log(f"results in {out}")

    npm, packages, notes, (srt, srt_why), earlier = prepare(args, workloads)
    cpu_at_start = system.machine_cpu()
    netns = "this process' namespace (--no-netns); loopback addresses only"
    if not args.no_netns:
        netns = system.enter_netns()
    soft, hard = system.raise_fd_limit()
    pin = not args.no_pin and system.can_pin()
    proxy_cpu = system.PROXY_CPU if pin else None
    if pin:
        system.pin_self(system.LOAD_CPU)
        pinning = (
            f"Pinning: every proxy on core {system.PROXY_CPU}; load generators, upstream servers and the "
            f"bench on core {system.LOAD_CPU}."
        )
    else:
        pinning = "Pinning: off."
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        os.environ.pop(var, None)
        os.environ.pop(var.lower(), None)

    meta: dict[str, Any] = {
        "started": started,
        "mode": "quick" if args.quick else "full",
        "workloads": workloads,
        "sizes": sizes.as_dict(),
        "machine": (
            f"{os.cpu_count()} cores, {_mem_gib()} GiB, {platform.platform()}, "
            f"Python {platform.python_version()}"
        ),
        "pinning": pinning,
        "netns": netns,
        "fd_limit": [soft, hard],
        "event_loop": loadgen.event_loop_name(),
        "loadavg_start": _loadavg(),
        "prepare_notes": notes,
        "egressd_before": earlier.as_dict() if earlier is not None else None,
        "results_dir": str(out),
    }
    certs = make_certs(work / "certs")
    registry_root = work / "registry"
    tls_load = loadgen.native_tls_load_binary()
    if tls_load is None:
        notes.append("bench/tls_load.c did not build (cc, libssl-dev?): workload 1's TLS uses Python's ssl")
    up = upstream.start(
        work / "upstream",
        certs,
        registry_root,
        sizes.big_response_bytes,
        system.LOAD_CPU if pin else None,
        tls_load,
    )
    meta["upstreams"] = upstream.describe(up)
    ctx = Context(
        sizes,
        work,
        up,
        certs,
        proxy_cpu,
        args.cache_dir,
        npm,
        packages,
        registry_root=registry_root,
        srt=srt,
        srt_why=srt_why,
        before=earlier,
    )
    if args.profile:
        ctx.profile_dir = out / "profiles"
    if packages:
        count = npmjob.build_registry(
            args.cache_dir, registry_root, f"https://127.0.0.1:{up.registry_port}/", packages
        )
        meta["npm_job"] = {"packages": count, "project": str(npmjob.PROJECT)}
    metrics: list[Metric] = []
    try:
        for name in workloads:
            system.log(f"workload {config.WORKLOADS.index(name) + 1}: {name}")
            t0 = time.monotonic()
            ctx.workload = name
            try:
                metrics += RUNNERS[name](ctx)
            except Exception as e:  # noqa: BLE001 - one broken workload must not lose the others
                system.log(f"workload {name} failed: {type(e).__name__}: {e}")
                meta.setdefault("failed_workloads", {})[name] = f"{type(e).__name__}: {e}"
            meta.setdefault("workload_seconds", {})[name] = round(time.monotonic() - t0, 1)
            meta["peers"] = ctx.peer_configs
            meta["egressd_sources"] = ctx.egressd_sources
            report.write(metrics, meta, out, with_chart=False)  # partial results survive a crash
    finally:
        up.stop()
    meta["loadavg_end"] = _loadavg()
    meta["duration_s"] = round(time.monotonic() - t_start, 1)
    meta["peers"] = ctx.peer_configs
    meta["egressd_sources"] = ctx.egressd_sources
    meta["egressd_env"] = dict(peers.EGRESSD_EXTRA_ENV)
    meta["egressd_args"] = list(peers.EGRESSD_EXTRA_ARGS)
    if ctx.profile_dir is not None and ctx.profile_dir.exists():
        for raw in sorted(ctx.profile_dir.glob("*.txt")):
            if not raw.name.endswith(".summary.txt"):
                raw.with_suffix(".summary.txt").write_text(profile.summarize(raw))
        meta["profiles"] = str(ctx.profile_dir)
    meta.update(_other_load(cpu_at_start))
    report.write(metrics, meta, out)
    shutil.rmtree(work / "upstream" / "www", ignore_errors=True)
    system.log(f"done in {meta['duration_s']} s: {out / 'results.md'}")
    print((out / "results.md").read_text())
    return 0


def _other_load(start: tuple[float, float, float]) -> dict[str, Any]:
    """CPU used by processes outside the bench during the run (other tenants of a shared machine)."""
    busy0, wall0, bench0 = start
    busy1, wall1, bench1 = system.machine_cpu()
    wall = wall1 - wall0
    other = max(0.0, (busy1 - busy0) - (bench1 - bench0))
    cores = os.cpu_count() or 1
    return {
        "other_cpu_s": round(other, 1),
        "other_cpu_share": round(other / (wall * cores), 3) if wall > 0 else 0.0,
        "bench_cpu_s": round(bench1 - bench0, 1),
    }


def _mem_gib() -> int:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30))
    except (ValueError, OSError):
        return 0


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in system.load_average())


if __name__ == "__main__":
    sys.exit(main())
