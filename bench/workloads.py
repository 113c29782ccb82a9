"""The nine workloads of issue 7 and the four sandbox workloads (10-13). Each returns Metrics; none
asserts a time, every failure is recorded.

Proxies are started fresh for each workload (for each run in workload 6) and all run on the proxy
core; each run visits the targets in a rotated order so no target is always first. The sandbox
workloads start a wrapper (egressd exec, egressd sandbox, srt) per run, on the proxy core, with the
client (bench/sandbox_client.py) inside it on the load core.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import loadgen, npmjob, system
from bench.attach import exec_attach
from bench.before import Before
from bench.certs import Certs, client_context
from bench.config import Sizes
from bench.model import Better, Metric
from bench.peers import (
    DIRECT,
    EGRESSD,
    EGRESSD_BEFORE,
    EGRESSD_EXTRA_ENV,
    EXEC,
    MITMPROXY,
    SANDBOX_TARGETS,
    SQUID,
    SRT,
    TARGETS,
    TINYPROXY,
    VENV_BIN,
    DirectPeer,
    EgressdBeforePeer,
    EgressdPeer,
    MitmInterceptPeer,
    NotAvailable,
    Peer,
    Proxy,
    Wrapper,
    egressd_source_state,
    make_peers,
    make_wrappers,
)
from bench.upstream import Upstreams

HOST = "127.0.0.1"
SETTLE = 0.2  # seconds between runs


@dataclass
class Context:
    sizes: Sizes
    work: Path
    up: Upstreams
    certs: Certs
    proxy_cpu: int | None
    cache: Path
    npm: str
    packages: list[npmjob.Package] | None = None
    peer_configs: dict[str, dict[str, str]] = field(default_factory=dict)
    registry_root: Path | None = None
    profile_dir: Path | None = None  # --profile: py-spy samples egressd during every workload
    workload: str = ""
    egressd_sources: dict[str, list[str]] = field(default_factory=dict)  # source state -> workloads
    srt: Path | None = None  # the installed sandbox-runtime package
    srt_why: str = "not installed"  # why there is none
    before: Before | None = None  # egressd at an earlier commit (None: --no-before)

    def peers(self, workload: str) -> dict[str, Peer]:
        return make_peers(self.work / "peers" / workload, self.proxy_cpu, self.srt, self.srt_why, self.before)


def _rotated(names: Sequence[str], run: int) -> list[str]:
    k = run % len(names)
    return list(names[k:]) + list(names[:k])


class Fleet:
    """The targets of one workload, started together, restarted if one dies, stopped together."""

    def __init__(self, ctx: Context, peers: dict[str, Peer]) -> None:
        self.ctx = ctx
        self.peers = peers
        self.proxies: dict[str, Proxy] = {}
        self.unavailable: dict[str, str] = {}
        self.profilers: list[subprocess.Popen[bytes]] = []

    def start(self) -> Fleet:
        for name, peer in self.peers.items():
            self._start(name, peer)
        return self

    def _start(self, name: str, peer: Peer) -> None:
        try:
            self.proxies[name] = peer.start()
        except NotAvailable as e:
            self.unavailable[name] = str(e)
            return
        except Exception as e:  # noqa: BLE001 - recorded, never faked
            self.unavailable[name] = f"error: could not start: {e}"
            system.log(f"{name}: could not start: {e}")
            return
        key = f"{name} (intercepting)" if _intercepting(peer) else name
        if isinstance(peer, EgressdPeer) and peer.name == EGRESSD:  # the tree under test
            seen = self.ctx.egressd_sources.setdefault(peer.source_state, [])
            if self.ctx.workload not in seen:
                seen.append(self.ctx.workload)
        if self.ctx.profile_dir is not None and name == EGRESSD:
            self._profile(self.proxies[name], key)
        if key not in self.ctx.peer_configs:
            self.ctx.peer_configs[key] = {
                "description": peer.description,
                "version": peer.version(),
                "config": peer.config_text,
            }

    def get(self, name: str) -> Proxy | str:
        """The running proxy, or why there is none."""
        if name in self.unavailable:
            return self.unavailable[name]
        proxy = self.proxies[name]
        if not proxy.alive():
            system.log(f"{name} died (exit {proxy.proc.returncode if proxy.proc else '?'}); restarting it")
            self._start(name, self.peers[name])
            if name in self.unavailable:
                return self.unavailable[name]
            proxy = self.proxies[name]
        return proxy

    def _profile(self, proxy: Proxy, key: str) -> None:
        """py-spy on the running egressd (non-blocking sampling, from the load core)."""
        assert self.ctx.profile_dir is not None and proxy.pid is not None
        py_spy = VENV_BIN / "py-spy"
        if not py_spy.exists():
            system.log("--profile: py-spy is not installed")
            return
        self.ctx.profile_dir.mkdir(parents=True, exist_ok=True)
        stem = f"{self.ctx.workload}-{key.replace(' ', '-').replace('(', '').replace(')', '')}"
        n = sum(1 for _ in self.ctx.profile_dir.glob(f"{stem}*.txt"))
        out = self.ctx.profile_dir / f"{stem}{'-' + str(n + 1) if n else ''}.txt"
        argv = [str(py_spy), "record", "--pid", str(proxy.pid), "--nonblocking", "--rate", "200"]
        argv += ["--format", "raw", "--output", str(out)]
        log = open(self.ctx.profile_dir / "py-spy.log", "ab")  # noqa: SIM115 - handed to the child
        self.profilers.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log))
        log.close()

    def stop(self) -> None:
        for profiler in self.profilers:
            profiler.send_signal(signal.SIGINT)
        for profiler in self.profilers:
            try:
                profiler.wait(timeout=30)
            except subprocess.TimeoutExpired:
                profiler.kill()
        for proxy in self.proxies.values():
            with contextlib.suppress(Exception):
                proxy.stop()


def _intercepting(peer: Peer) -> bool:
    return isinstance(peer, MitmInterceptPeer) or (isinstance(peer, EgressdPeer) and peer.intercept)


@contextlib.contextmanager
def fleet(ctx: Context, peers: dict[str, Peer]) -> Iterator[Fleet]:
    running = Fleet(ctx, peers).start()
    try:
        yield running
    finally:
        running.stop()


def _each_run(
    ctx: Context,
    running: Fleet,
    metrics: Sequence[Metric],
    measure: Callable[[str, Proxy, int], None],
    repeats: int | None = None,
    targets: Sequence[str] = TARGETS,
    first_run: int = 0,
) -> None:
    """Call measure(target, proxy, run) for every run and target; failures become notes/n-a."""
    runs = range(first_run, first_run + (repeats or ctx.sizes.repeats))
    targets = [t for t in targets if t in running.peers]  # e.g. no egressd-before with --no-before
    _visit(metrics, targets, runs, running.get, measure)


def _visit[T](
    metrics: Sequence[Metric],
    targets: Sequence[str],
    runs: range,
    get: Callable[[str], T | str],
    measure: Callable[[str, T, int], None],
) -> None:
    """measure(target, get(target), run) for every run and target, in an order rotated by the run;
    get() answering a str (why the target cannot run) and failed runs become notes/n-a."""
    for run in runs:
        for name in _rotated(targets, run):
            item = get(name)
            if isinstance(item, str):
                for m in metrics:
                    m.unavailable(name, item)
                continue
            try:
                measure(name, item, run)
            except Exception as e:  # noqa: BLE001 - a failed run is recorded, not faked
                msg = f"{name}: run {run + 1} failed: {type(e).__name__}: {e}"
                system.log(msg)
                for m in metrics:
                    m.note(msg[:300])
                    m.unavailable(name, f"error: {type(e).__name__}: {str(e)[:120]}")
            time.sleep(SETTLE)


class LoadWindow:
    """How much CPU the load side (this process, its waited children such as wrk, nginx and the sink/echo
    servers) used during a run, as a fraction of one core, and how busy each core was overall.

    A load side at >= 90 % of its core means the figure is bounded by the generator and the upstream,
    not by the proxy (the report marks it). Core busy counts everything on the core, other tenants too.
    """

    def __init__(self, ctx: Context) -> None:
        self.pids = [proc.pid for proc in ctx.up.processes]
        self.pinned = ctx.proxy_cpu is not None

    def _cpu(self) -> float:
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        total = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
        return total + sum(system.cpu_seconds(pid) for pid in self.pids)

    def start(self) -> LoadWindow:
        self.t0 = time.perf_counter()
        self.cpu0 = self._cpu()
        self.cores = system.CoreBusy().start()
        return self

    def stop(self) -> dict[str, float]:
        wall = time.perf_counter() - self.t0
        out = {"load_side_cpu": round((self._cpu() - self.cpu0) / wall, 3) if wall > 0 else 0.0}
        busy = self.cores.stop()
        if self.pinned:
            out["load_core_busy"] = round(busy.get(system.LOAD_CPU, 0.0), 3)
            out["proxy_core_busy"] = round(busy.get(system.PROXY_CPU, 0.0), 3)
        return out


def _note_load(metric: Metric, target: str, load: dict[str, float]) -> None:
    """Keep the load-side figures per run; the report flags generator-bound medians."""
    for key, value in load.items():
        metric.extra.setdefault(key, {}).setdefault(target, []).append(value)


# -- 1. tunnel throughput ---------------------------------------------------------------------------
def tunnel_throughput(ctx: Context) -> list[Metric]:
    wl = "1. Tunnel throughput"
    size = ctx.sizes.throughput_bytes
    mib = size // (1024 * 1024)
    raw = Metric("w1.raw", wl, f"raw TCP, {mib} MiB through one CONNECT tunnel", "MiB/s", "higher")
    tls = Metric("w1.tls", wl, f"TLS, {mib} MiB through one CONNECT tunnel", "MiB/s", "higher")
    raw_cpu = Metric(
        "w1.raw.cpu", wl, "proxy CPU per GiB relayed (raw TCP)", "CPU s/GiB", "lower", main=False
    )
    tls_cpu = Metric("w1.tls.cpu", wl, "proxy CPU per GiB relayed (TLS)", "CPU s/GiB", "lower", main=False)
    gib = size / (1 << 30)

    def measure(name: str, proxy: Proxy, run: int) -> None:
        load = LoadWindow(ctx).start()
        r = loadgen.throughput(proxy, HOST, ctx.up.sink_port, size, None)
        _note_load(raw, name, load.stop())
        raw.add(name, r.mib_per_s)
        if not proxy.direct:
            raw_cpu.add(name, r.proxy_cpu / gib)
        time.sleep(SETTLE)
        load = LoadWindow(ctx).start()
        if ctx.up.tls_load is not None:  # C client and sink: Python's ssl on both ends is the limit
            t = loadgen.tls_throughput_native(
                ctx.up.tls_load, proxy, HOST, ctx.up.tls_sink_port, size, ctx.certs.ca
            )
        else:
            t = loadgen.throughput(proxy, HOST, ctx.up.tls_sink_port, size, ctx.certs.client_context())
        _note_load(tls, name, load.stop())
        tls.add(name, t.mib_per_s)
        if not proxy.direct:
            tls_cpu.add(name, t.proxy_cpu / gib)

    with fleet(ctx, ctx.peers("throughput")) as running:
        _each_run(ctx, running, [raw, tls], measure)
    for m in (raw_cpu, tls_cpu):
        m.unavailable(DIRECT, "no proxy")
    return [raw, tls, raw_cpu, tls_cpu]


# -- 2. tunnel setup rate ---------------------------------------------------------------------------
def tunnel_setup(ctx: Context) -> list[Metric]:
    wl = "2. Tunnel setup rate"
    out: list[Metric] = []
    # the C generator when it builds: the Python one spends more CPU per tunnel than the proxies
    native = loadgen.native_connect_load_binary()
    with fleet(ctx, ctx.peers("setup")) as running:
        for conc in ctx.sizes.setup_concurrency:
            rate = Metric(
                f"w2.c{conc}", wl, f"CONNECT + GET + close, concurrency {conc}", "tunnels/s", "higher"
            )
            cpu = Metric(
                f"w2.c{conc}.cpu",
                wl,
                f"proxy CPU per tunnel, concurrency {conc}",
                "CPU µs",
                "lower",
                main=False,
            )
            p50 = Metric(
                f"w2.c{conc}.p50",
                wl,
                f"time to tunnel, p50, saturated, concurrency {conc}",
                "ms",
                "lower",
                main=False,
            )
            p99 = Metric(
                f"w2.c{conc}.p99",
                wl,
                f"time to tunnel, p99, saturated, concurrency {conc}",
                "ms",
                "lower",
                main=False,
            )

            def measure(
                name: str,
                proxy: Proxy,
                run: int,
                conc: int = conc,
                rate: Metric = rate,
                cpu: Metric = cpu,
                p50: Metric = p50,
                p99: Metric = p99,
            ) -> None:
                load = LoadWindow(ctx).start()
                size = {
                    "concurrency": conc,
                    "seconds": ctx.sizes.rate_seconds,
                    "warmup": ctx.sizes.warmup_seconds,
                }
                if native is not None:
                    r = loadgen.connect_load_native(native, proxy, HOST, ctx.up.http_port, **size)
                else:
                    r = loadgen.run_async(loadgen.connect_load(proxy, HOST, ctx.up.http_port, **size))
                _note_load(rate, name, load.stop())
                if r.errors:
                    rate.note(f"{name}: {r.errors} failed tunnels in run {run + 1} ({r.first_error})")
                rate.add(name, r.rate)
                if not proxy.direct and r.ops:
                    cpu.add(name, r.proxy_cpu / r.ops * 1e6)
                if r.latencies:
                    p50.add(name, _pct(r.latencies, 50) * 1e3)
                    p99.add(name, _pct(r.latencies, 99) * 1e3)

            _each_run(ctx, running, [rate, cpu, p50, p99], measure)
            cpu.unavailable(DIRECT, "no proxy")
            out += [rate, cpu, p50, p99]
    return out


def _pct(values: Sequence[float], pct: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))
    return ordered[index]


# -- 3. added latency per CONNECT -------------------------------------------------------------------
def connect_latency(ctx: Context) -> list[Metric]:
    wl = "3. Added latency per CONNECT"
    c100 = ctx.sizes.latency_concurrency
    rate = ctx.sizes.latency_rate
    setups = {
        "c1": ("concurrency 1 (back to back)", 1, None),
        f"c{c100}": (f"concurrency {c100} ({rate:g} CONNECT/s offered, Poisson)", c100, rate),
    }
    metrics: dict[str, dict[str, Metric]] = {}
    for key, (label, _, _) in setups.items():
        metrics[key] = {
            "p50": Metric(f"w3.{key}.p50", wl, f"time to tunnel p50, {label}", "ms", "lower", main=False),
            "p99": Metric(f"w3.{key}.p99", wl, f"time to tunnel p99, {label}", "ms", "lower", main=False),
            "added_p50": Metric(
                f"w3.{key}.added_p50",
                wl,
                f"added p50 vs direct connect, {label}",
                "ms",
                "lower",
                ratio_to_direct=False,
            ),
            "added_p99": Metric(
                f"w3.{key}.added_p99",
                wl,
                f"added p99 vs direct connect, {label}",
                "ms",
                "lower",
                ratio_to_direct=False,
            ),
        }
    direct_runs: dict[tuple[str, int], dict[str, float]] = {}
    pending: list[tuple[str, str, int, dict[str, float]]] = []

    def measure(name: str, proxy: Proxy, run: int) -> None:
        for key, (_, conc, offered) in setups.items():
            r = loadgen.run_async(
                loadgen.connect_load(
                    proxy,
                    HOST,
                    ctx.up.http_port,
                    concurrency=conc,
                    seconds=None if offered is None else ctx.sizes.latency_seconds,
                    samples=ctx.sizes.latency_c1_samples if offered is None else None,
                    warmup=ctx.sizes.warmup_seconds,
                    rate=offered,
                )
            )
            m = metrics[key]
            if not r.latencies:
                raise loadgen.ProxyError(f"no CONNECT completed ({r.errors} errors: {r.first_error})")
            if r.errors:
                m["added_p50"].note(f"{name}: {r.errors} failed CONNECTs in run {run + 1} ({r.first_error})")
            figures = {"p50": _pct(r.latencies, 50) * 1e3, "p99": _pct(r.latencies, 99) * 1e3}
            m["p50"].add(name, figures["p50"])
            m["p99"].add(name, figures["p99"])
            m["p50"].extra.setdefault("samples", {}).setdefault(name, []).append(len(r.latencies))
            if proxy.direct:
                direct_runs[(key, run)] = figures
            else:
                pending.append((name, key, run, figures))
            time.sleep(SETTLE)

    with fleet(ctx, ctx.peers("latency")) as running:
        _each_run(ctx, running, [m for group in metrics.values() for m in group.values()], measure)
    for name, key, run, figures in pending:  # added = proxy - direct, paired by run
        base = direct_runs.get((key, run))
        if base is None:
            continue
        metrics[key]["added_p50"].add(name, figures["p50"] - base["p50"])
        metrics[key]["added_p99"].add(name, figures["p99"] - base["p99"])
    for group in metrics.values():
        group["added_p50"].unavailable(DIRECT, "the reference")
        group["added_p99"].unavailable(DIRECT, "the reference")
    ordered = []
    for group in metrics.values():
        ordered += [group["added_p50"], group["added_p99"]]
    for group in metrics.values():
        ordered += [group["p50"], group["p99"]]
    return ordered


# -- 4. plain-HTTP GETs -----------------------------------------------------------------------------
def http_gets(ctx: Context) -> list[Metric]:
    wl = "4. Plain-HTTP GETs"
    conns = ctx.sizes.http_connections
    out: list[Metric] = []
    with fleet(ctx, ctx.peers("http")) as running:
        for keepalive in (True, False):
            tag = "keepalive" if keepalive else "close"
            label = "with keep-alive" if keepalive else "without keep-alive (Connection: close)"
            rate = Metric(f"w4.{tag}", wl, f"GET /small (128 B) {label}, wrk -c{conns}", "req/s", "higher")
            cpu = Metric(f"w4.{tag}.cpu", wl, f"proxy CPU per GET {label}", "CPU µs", "lower", main=False)

            def measure(
                name: str,
                proxy: Proxy,
                run: int,
                keepalive: bool = keepalive,
                rate: Metric = rate,
                cpu: Metric = cpu,
            ) -> None:
                load = LoadWindow(ctx).start()
                r = loadgen.run_wrk(
                    proxy,
                    HOST,
                    ctx.up.http_port,
                    keepalive=keepalive,
                    connections=conns,
                    seconds=ctx.sizes.rate_seconds,
                    script=ctx.work / f"wrk-{name}.lua",
                )
                _note_load(rate, name, load.stop())
                bad = {k: v for k, v in r.errors.items() if v}
                if bad:
                    rate.note(f"{name}: wrk errors in run {run + 1}: {bad}")
                rate.add(name, r.rate)
                if not proxy.direct and r.requests:
                    cpu.add(name, r.proxy_cpu / r.requests * 1e6)

            _each_run(ctx, running, [rate, cpu], measure)
            cpu.unavailable(DIRECT, "no proxy")
            out += [rate, cpu]
    for m in out:
        if m.main and any(TINYPROXY in n and "read" in n for n in m.notes):
            m.note(
                "tinyproxy closes the client connection after every response: "
                "wrk counts a read error and reconnects"
            )
    return out


# -- 5. intercepted HTTPS ---------------------------------------------------------------------------
def intercepted_https(ctx: Context) -> list[Metric]:
    wl = "5. Intercepted HTTPS"
    big_mib = ctx.sizes.big_response_bytes // (1024 * 1024)
    conns = ctx.sizes.https_connections
    rate = Metric("w5.rate", wl, f"HTTPS GET /small, {conns} keep-alive connections", "req/s", "higher")
    tput = Metric("w5.big", wl, f"one {big_mib} MiB HTTPS response", "MiB/s", "higher")
    peak = Metric(
        "w5.big.rss",
        wl,
        f"proxy peak RSS during the {big_mib} MiB response",
        "MiB",
        "lower",
        ratio_to_direct=False,
    )
    cpu = Metric("w5.rate.cpu", wl, "proxy CPU per intercepted request", "CPU µs", "lower", main=False)
    work = ctx.work / "peers" / "intercept"
    peers: dict[str, Peer] = {
        DIRECT: DirectPeer(work, ctx.proxy_cpu),
        MITMPROXY: MitmInterceptPeer(work, ctx.proxy_cpu, ctx.certs.ca),
    }
    if ctx.before is not None:
        peers[EGRESSD_BEFORE] = EgressdBeforePeer(
            work, ctx.proxy_cpu, ctx.before, intercept=True, upstream_ca=ctx.certs.ca
        )
    peers[EGRESSD] = EgressdPeer(work, ctx.proxy_cpu, intercept=True, upstream_ca=ctx.certs.ca)

    def measure(name: str, proxy: Proxy, run: int) -> None:
        if proxy.direct:
            context: ssl.SSLContext = ctx.certs.client_context()
        else:
            assert proxy.ca is not None
            context = client_context(proxy.ca)  # trusts ONLY the proxy's CA: no interception, no handshake
        load = LoadWindow(ctx).start()
        r = loadgen.run_async(
            loadgen.https_requests(
                proxy,
                HOST,
                ctx.up.https_port,
                context,
                connections=conns,
                seconds=ctx.sizes.rate_seconds,
                warmup=ctx.sizes.warmup_seconds,
            )
        )
        _note_load(rate, name, load.stop())
        if r.errors:
            rate.note(f"{name}: {r.errors} errors in run {run + 1} ({r.first_error})")
        if r.ops:
            rate.add(name, r.ops / r.seconds)
            if not proxy.direct:
                cpu.add(name, r.proxy_cpu / r.ops * 1e6)
        else:  # e.g. the handshakes (and a lazily started mitmproxy) took the whole window
            rate.note(f"{name}: no request completed in run {run + 1}'s window (warm-up + {r.seconds:g} s)")
        time.sleep(SETTLE)
        load = LoadWindow(ctx).start()
        b = loadgen.big_response(proxy, HOST, ctx.up.https_port, context)
        _note_load(tput, name, load.stop())
        tput.add(name, b.mib_per_s)
        if b.peak_rss is not None:
            peak.add(name, b.peak_rss / (1024 * 1024))

    with fleet(ctx, peers) as running:
        _each_run(ctx, running, [rate, tput, peak, cpu], measure, targets=list(peers))
    for m in (rate, tput, peak, cpu):
        for name in (TINYPROXY, SQUID):
            m.unavailable(name, "n/a (does not intercept TLS)")
        m.unavailable(SRT, "n/a (not configured: srt terminates TLS only with network.tlsTerminate)")
    peak.unavailable(DIRECT, "no proxy")
    cpu.unavailable(DIRECT, "no proxy")
    return [rate, tput, peak, cpu]


# -- 6. idle tunnels --------------------------------------------------------------------------------
def idle_tunnels(ctx: Context) -> list[Metric]:
    wl = "6. Idle tunnels"
    limit = system.fd_limit()
    count = min(ctx.sizes.idle_tunnels, (limit - 300) // 2)
    rss = Metric(
        "w6.rss", wl, f"proxy RSS per idle tunnel ({count:,} tunnels)", "KiB", "lower", ratio_to_direct=False
    )
    works = Metric(
        "w6.working", wl, f"tunnels still working after {ctx.sizes.idle_hold_seconds:g} s idle", "%", "higher"
    )
    total = Metric("w6.rss_total", wl, f"proxy RSS with {count:,} tunnels open", "MiB", "lower", main=False)
    opened = Metric(
        "w6.open",
        wl,
        f"time to open {count:,} tunnels ({ctx.sizes.idle_open_concurrency} at a time)",
        "s",
        "lower",
        main=False,
    )
    if count < ctx.sizes.idle_tunnels:
        rss.note(
            f"{count:,} tunnels, not {ctx.sizes.idle_tunnels:,}: the hard RLIMIT_NOFILE here is {limit} "
            "and cannot be raised (a proxy needs 2 fds per tunnel)"
        )
    for run in range(ctx.sizes.repeats):  # fresh proxies per run: RSS deltas from a clean process
        with fleet(ctx, ctx.peers(f"idle-{run + 1}")) as running:

            def measure(name: str, proxy: Proxy, _run: int) -> None:
                load = LoadWindow(ctx).start()
                r = loadgen.run_async(
                    loadgen.idle_tunnels(
                        proxy,
                        HOST,
                        ctx.up.echo_port,
                        count=count,
                        hold=ctx.sizes.idle_hold_seconds,
                        open_concurrency=ctx.sizes.idle_open_concurrency,
                    )
                )
                _note_load(opened, name, load.stop())
                if r.opened < count:
                    rss.note(
                        f"{name}: only {r.opened:,} of {count:,} tunnels opened in run {_run + 1} "
                        f"({r.first_error})"
                    )
                works.add(name, 100.0 * r.working / count)
                opened.add(name, r.open_seconds)
                if r.rss_per_tunnel is not None:
                    rss.add(name, r.rss_per_tunnel / 1024)
                if r.rss_open is not None:
                    total.add(name, r.rss_open / (1024 * 1024))

            _each_run(ctx, running, [rss, works, total, opened], measure, repeats=1, first_run=run)
    rss.unavailable(DIRECT, "no proxy")
    total.unavailable(DIRECT, "no proxy")
    return [rss, works, total, opened]


def _record_source(ctx: Context) -> None:
    seen = ctx.egressd_sources.setdefault(egressd_source_state(), [])
    if ctx.workload not in seen:
        seen.append(ctx.workload)


# -- 7. egressd exec -- true ------------------------------------------------------------------------
_wall = system.wall


def _wall_before(m: Metric, argv: list[str], env: dict[str, str], run: int) -> list[str] | None:
    """One timed `egressd exec -- true` of egressd-before into m; None (no more) when it fails."""
    try:
        m.add(EGRESSD_BEFORE, _wall(argv, env))
    except subprocess.CalledProcessError as e:
        m.note(f"egressd-before: run {run + 1} failed: {e}")
        m.unavailable(EGRESSD_BEFORE, f"error: {e}")
        return None
    return argv


def exec_true(ctx: Context) -> list[Metric]:
    wl = "7. egressd exec -- true"
    main = Metric(
        "w7.exec",
        wl,
        "`egressd exec -- true` wall time (direct: `true`)",
        "s",
        "lower",
        ratio_to_direct=False,
    )
    py = str(VENV_BIN / "python")
    breakdown = {
        "w7.python": ("`python -c pass` (interpreter start)", [py, "-c", "pass"]),
        "w7.import_cli": ("`python -c 'import egressd.cli'`", [py, "-c", "import egressd.cli"]),
        "w7.import_engine": (
            "`python -c` importing the engine (mitmproxy master, proxyserver, addons)",
            [
                py,
                "-c",
                "import egressd.session.proxy, mitmproxy.master, mitmproxy.addons.proxyserver, "
                "egressd.addons.policy_gate",
            ],
        ),
        "w7.version": ("`egressd --version`", [str(VENV_BIN / "egressd"), "--version"]),
    }
    parts = {k: Metric(k, wl, title, "s", "lower", main=False) for k, (title, _) in breakdown.items()}
    env = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY")}
    env["XDG_CONFIG_HOME"] = str(ctx.work / "exec-config")
    env.update(EGRESSD_EXTRA_ENV)
    _record_source(ctx)
    egressd = system.pinned([str(VENV_BIN / "egressd"), "exec", "--", "true"], ctx.proxy_cpu)
    true = system.which("true") or "/bin/true"
    # egressd-before's own `egressd exec -- true` (its venv, its config dir), for comparison
    before: list[str] | None = None
    before_env = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    before_env["XDG_CONFIG_HOME"] = str(ctx.work / "exec-config-before")
    if ctx.before is not None and ctx.before.bin is not None:
        before = system.pinned([str(ctx.before.bin / "egressd"), "exec", "--", "true"], ctx.proxy_cpu)
    elif ctx.before is not None:
        main.unavailable(EGRESSD_BEFORE, f"n/a (egressd at {ctx.before.short}: {ctx.before.why})")
    for name in (TINYPROXY, SQUID, MITMPROXY):
        main.unavailable(name, "n/a (no wrapper command)")
    main.unavailable(SRT, "see workload 13 (`srt true`)")
    # an installed egressd has its bytecode compiled (pip compiles a wheel's modules); an editable
    # checkout may not (PYTHONDONTWRITEBYTECODE): every start would then compile ~100 modules
    _compile_bytecode(VENV_BIN / "python", Path(__file__).resolve().parent.parent / "egressd", env)
    if before is not None and ctx.before is not None and ctx.before.root is not None:
        assert ctx.before.bin is not None
        _compile_bytecode(ctx.before.bin / "python", ctx.before.root / "egressd", before_env)
    with contextlib.suppress(Exception):
        _wall(egressd, env)  # warm the page cache once
        if before is not None:
            _wall(before, before_env)
    for run in range(ctx.sizes.repeats):
        try:
            for i in range(ctx.sizes.exec_runs):
                if before is not None and i % 2:  # egressd and egressd-before take turns going first
                    before = _wall_before(main, before, before_env, run)
                main.add(EGRESSD, _wall(egressd, env))
                main.add(DIRECT, _wall([true]))
                if before is not None and not i % 2:
                    before = _wall_before(main, before, before_env, run)
            for key, (_, argv) in breakdown.items():
                parts[key].add(
                    EGRESSD,
                    statistics.median(_wall(system.pinned(argv, ctx.proxy_cpu), env) for _ in range(3)),
                )
        except subprocess.CalledProcessError as e:
            main.note(f"run {run + 1} failed: {e}")
            main.unavailable(EGRESSD, f"error: {e}")
    return [main, *parts.values()]


def _compile_bytecode(python: Path, package: Path, env: dict[str, str]) -> None:
    if package.is_dir():
        argv = [str(python), "-m", "compileall", "-q", str(package)]
        subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, check=False, timeout=300)


# -- 8. the decision function -----------------------------------------------------------------------
def decision(ctx: Context) -> list[Metric]:
    wl = "8. Decision, 100,000-rule allowlist"
    argv = system.pinned(
        [
            sys.executable,
            "-m",
            "bench.decision",
            "--rules",
            str(ctx.sizes.decision_rules),
            "--repeat",
            str(max(5, ctx.sizes.repeats)),
        ],
        ctx.proxy_cpu,
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    _record_source(ctx)
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900, check=False)
    if out.returncode != 0:
        m = Metric("w8.decide", wl, "decide()", "µs", "lower")
        m.unavailable(EGRESSD, f"error: {out.stderr.strip()[-200:]}")
        return [m]
    data: dict[str, Any] = json.loads(out.stdout)
    metrics = []
    rules = data["rules"]
    for case, entry in data["cases"].items():
        m = Metric(
            f"w8.{case.split(':')[0].replace(' ', '_')}.{len(metrics)}",
            wl,
            f"decide() per call, {case} ({entry['target']} → {entry['reason']})",
            "µs",
            "lower",
            ratio_to_direct=False,
        )
        for v in entry["large_runs_us"]:
            m.add(EGRESSD, v)
        m.extra = {
            "rules": rules,
            "10_rules_median_us": statistics.median(entry["small_runs_us"]),
            "from_string_median_us": statistics.median(entry["large_from_string_runs_us"]),
        }
        for name in (DIRECT, TINYPROXY, SQUID, MITMPROXY, SRT):
            m.unavailable(name, "n/a")
        if ctx.before is not None:
            m.unavailable(EGRESSD_BEFORE, "not measured (decide() of the tree under test only)")
        metrics.append(m)
    load = Metric(
        "w8.load", wl, f"loading a {rules:,}-rule policy", "s", "lower", main=False, ratio_to_direct=False
    )
    load.add(EGRESSD, data["large_policy_load_s"])
    metrics.append(load)
    return metrics


# -- 9. the real job --------------------------------------------------------------------------------
def real_job(ctx: Context) -> list[Metric]:
    wl = "9. Real job: npm ci"
    m = Metric("w9.npm", wl, "`npm ci` wall time", "s", "lower")
    cpu = Metric("w9.npm.cpu", wl, "proxy CPU during `npm ci`", "CPU s", "lower", main=False)
    if ctx.packages is None:
        m.unavailable(DIRECT, "not prepared")
        return [m]
    registry = f"https://{HOST}:{ctx.up.registry_port}/"
    m.title = f"`npm ci` of {len(ctx.packages)} packages (jest) from a local HTTPS registry"
    scratch = _job_scratch(ctx)
    m.note(f"npm's project copy, node_modules and cache are written below {scratch.parent}")

    def measure(name: str, proxy: Proxy, run: int) -> None:
        r = npmjob.run_job(ctx.npm, registry, ctx.certs.ca, proxy, scratch)
        m.add(name, r.seconds)
        m.extra.setdefault("installed", {}).setdefault(name, []).append(r.installed)
        if not proxy.direct:
            cpu.add(name, r.proxy_cpu)

    try:
        try:
            m.extra["proxy_check"] = npmjob.check_uses_proxy(
                ctx.npm, registry, ctx.certs.ca, scratch, system.free_port()
            )
        except RuntimeError as e:
            m.note(str(e))
        # one untimed run first, so that no target's first run meets a machine the others never see
        try:
            warm = npmjob.run_job(ctx.npm, registry, ctx.certs.ca, Proxy(DIRECT, None), scratch)
            m.note(f"one untimed warm-up run (direct, {warm.seconds:.1f} s) before the timed runs")
        except RuntimeError as e:
            m.note(f"warm-up run failed: {e}"[:300])
        with fleet(ctx, ctx.peers("job")) as running:
            _each_run(ctx, running, [m, cpu], measure, repeats=ctx.sizes.job_repeats)
    finally:
        shutil.rmtree(scratch.parent, ignore_errors=True)
    cpu.unavailable(DIRECT, "no proxy")
    return [m, cpu]


def _job_scratch(ctx: Context) -> Path:
    """Where `npm ci` writes (project copy, node_modules, npm cache): tmpfs when there is one.

    On disk, dirty-page writeback from one run throttles the next: the first runs of a workload took
    5 s and the later ones 12 s whatever the proxy, which measured the disk, not the proxies."""
    shm = Path("/dev/shm")
    try:
        usage = shutil.disk_usage(shm)
        on_tmpfs = any(
            line.split()[1] == str(shm) and line.split()[2] == "tmpfs"
            for line in Path("/proc/mounts").read_text().splitlines()
        )
    except OSError:
        on_tmpfs = False
    if on_tmpfs and usage.free > 2 << 30:
        return Path(tempfile.mkdtemp(prefix="egressd-bench-npm-", dir=shm)) / "scratch"
    directory = ctx.work / "npm-job"
    directory.mkdir(parents=True, exist_ok=True)
    return directory / "scratch"


# -- 10-13. the sandbox workloads ---------------------------------------------------------------------
class _Sandboxes:
    """The three wrappers of one sandbox workload, a scratch working directory for their children, and
    how to run the client (bench/sandbox_client.py) inside one of them."""

    def __init__(self, ctx: Context, workload: str, ports: Sequence[int]) -> None:
        self.ctx = ctx
        self.work = ctx.work / "peers" / workload
        self.wrappers = make_wrappers(self.work, ctx.proxy_cpu, ports, ctx.srt, ctx.srt_why)
        # egressd's bytecode compiled, as an installed egressd has it (see exec_true): a checkout's
        # stale bytecode would otherwise be compiled again by every start
        _compile_bytecode(
            VENV_BIN / "python", Path(__file__).resolve().parent.parent / "egressd", dict(os.environ)
        )
        # a fresh empty directory: the sandboxes make the working directory writable to the child
        self.cwd = Path(tempfile.mkdtemp(prefix="egressd-bench-sandbox-"))
        _record_source(ctx)
        for name, wrapper in self.wrappers.items():
            if isinstance(wrapper, Wrapper):
                key = f"{name} (sandbox workloads)"
                ctx.peer_configs.setdefault(
                    key,
                    {
                        "description": wrapper.description,
                        "version": wrapper.version,
                        "config": wrapper.config_text,
                    },
                )

    def close(self) -> None:
        shutil.rmtree(self.cwd, ignore_errors=True)

    def client(self, *args: str) -> list[str]:
        """The client's argv inside a wrapper, on the load core."""
        load_cpu = system.LOAD_CPU if self.ctx.proxy_cpu is not None else None
        repo = str(Path(__file__).resolve().parent.parent)
        argv = ["env", f"PYTHONPATH={repo}", str(VENV_BIN / "python"), "-m", "bench.sandbox_client", *args]
        return system.pinned(argv, load_cpu)

    def run(self, wrapper: Wrapper, child: Sequence[str], timeout: float = 600) -> dict[str, Any]:
        """Run child inside wrapper; the client's SANDBOX_RESULT, or an error naming what went wrong."""
        out = subprocess.run(
            wrapper.argv(child),
            cwd=self.cwd,
            env=wrapper.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        for line in out.stdout.splitlines():
            if line.startswith("SANDBOX_RESULT "):
                result: dict[str, Any] = json.loads(line.removeprefix("SANDBOX_RESULT "))
                return result
        why = (out.stderr.strip() or out.stdout.strip() or f"exit {out.returncode}").splitlines()
        raise RuntimeError(f"{wrapper.name}: exit {out.returncode}: {' / '.join(why[-3:])}"[:400])

    def wall(self, wrapper: Wrapper, child: Sequence[str]) -> float:
        """Wall time of child run inside wrapper (its output discarded); an error if it fails."""
        t0 = time.perf_counter()
        out = subprocess.run(
            wrapper.argv(child),
            cwd=self.cwd,
            env=wrapper.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
        wall = time.perf_counter() - t0
        if out.returncode != 0:
            raise RuntimeError(f"{wrapper.name}: exit {out.returncode}: {out.stderr.strip()[-200:]}")
        return wall

    def each_run(
        self,
        metrics: Sequence[Metric],
        measure: Callable[[str, Wrapper, int], None],
        repeats: int | None = None,
    ) -> None:
        """measure(target, wrapper, run) for every run and target, rotated; failures become notes/n-a."""
        runs = range(repeats or self.ctx.sizes.repeats)
        _visit(metrics, SANDBOX_TARGETS, runs, self.wrappers.__getitem__, measure)


@contextlib.contextmanager
def sandboxes(ctx: Context, workload: str, ports: Sequence[int]) -> Iterator[_Sandboxes]:
    boxes = _Sandboxes(ctx, workload, ports)
    try:
        yield boxes
    finally:
        boxes.close()


def _sandbox_metric(key: str, workload: str, title: str, unit: str, better: Better, **kw: Any) -> Metric:
    return Metric(key, workload, title, unit, better, sandbox=True, ratio_to_direct=False, **kw)


# -- 10. tunnel throughput from inside --------------------------------------------------------------
def sandbox_throughput(ctx: Context) -> list[Metric]:
    wl = "10. Sandbox: tunnel throughput"
    mib = ctx.sizes.big_response_bytes // (1024 * 1024)
    m = _sandbox_metric(
        "sb1.download",
        wl,
        f"one {mib} MiB HTTP download through one CONNECT tunnel, from inside",
        "MiB/s",
        "higher",
    )

    def measure(name: str, wrapper: Wrapper, run: int) -> None:
        r = boxes.run(wrapper, boxes.client("download", HOST, str(ctx.up.http_port), "/big"))
        m.add(name, r["bytes"] / (1024 * 1024) / r["seconds"])

    with sandboxes(ctx, "sandbox-throughput", [ctx.up.http_port]) as boxes:
        boxes.each_run([m], measure)
    m.note("the client's wrapper starts afresh for every run; only the download is timed")
    return [m]


# -- 11. set-up rate from inside ----------------------------------------------------------------------
def sandbox_setup(ctx: Context) -> list[Metric]:
    wl = "11. Sandbox: tunnel setup rate"
    native = loadgen.native_connect_load_binary()
    binary = ""
    if native is not None:  # /tmp is private in egressd's sandbox: the client runs a copy from the work dir
        copy = ctx.work / "bin" / native.name
        copy.parent.mkdir(parents=True, exist_ok=True)
        if not copy.exists():
            shutil.copy2(native, copy)
        binary = str(copy)
    out: list[Metric] = []
    with sandboxes(ctx, "sandbox-setup", [ctx.up.http_port]) as boxes:
        for conc in ctx.sizes.setup_concurrency:
            rate = _sandbox_metric(
                f"sb2.c{conc}",
                wl,
                f"CONNECT + GET + close from inside, concurrency {conc}",
                "tunnels/s",
                "higher",
            )
            p50 = _sandbox_metric(
                f"sb2.c{conc}.p50",
                wl,
                f"time to tunnel p50, saturated, concurrency {conc}",
                "ms",
                "lower",
                main=False,
            )
            p99 = _sandbox_metric(
                f"sb2.c{conc}.p99",
                wl,
                f"time to tunnel p99, saturated, concurrency {conc}",
                "ms",
                "lower",
                main=False,
            )

            def measure(
                name: str,
                wrapper: Wrapper,
                run: int,
                conc: int = conc,
                rate: Metric = rate,
                p50: Metric = p50,
                p99: Metric = p99,
            ) -> None:
                args = [str(conc), str(ctx.sizes.warmup_seconds), str(ctx.sizes.rate_seconds)]
                r = boxes.run(wrapper, boxes.client("setup", HOST, str(ctx.up.http_port), *args, binary))
                if r["errors"]:
                    rate.note(f"{name}: {r['errors']} failed tunnels in run {run + 1} ({r['error']})")
                rate.add(name, r["ops"] / r["seconds"])
                if "p50" in r:
                    p50.add(name, r["p50"] * 1e3)
                    p99.add(name, r["p99"] * 1e3)

            boxes.each_run([rate, p50, p99], measure)
            out += [rate, p50, p99]
    if not binary:
        out[0].note("bench/connect_load.c did not build: the Python generator ran inside")
    return out


# -- 12. added latency per CONNECT from inside --------------------------------------------------------
def sandbox_latency(ctx: Context) -> list[Metric]:
    wl = "12. Sandbox: latency per CONNECT"
    samples = ctx.sizes.latency_c1_samples
    label = f"concurrency 1, {samples:,} back to back, from inside"
    added = {
        q: _sandbox_metric(
            f"sb3.added_{q}", wl, f"added {q} over egressd exec (same run), {label}", "ms", "lower"
        )
        for q in ("p50", "p99")
    }
    raw = {
        q: _sandbox_metric(f"sb3.{q}", wl, f"time to tunnel {q}, {label}", "ms", "lower")
        for q in ("p50", "p99")
    }
    runs: dict[tuple[str, int], dict[str, float]] = {}

    def measure(name: str, wrapper: Wrapper, run: int) -> None:
        warmup = str(ctx.sizes.warmup_seconds)
        r = boxes.run(wrapper, boxes.client("latency", HOST, str(ctx.up.http_port), str(samples), warmup))
        if r["errors"]:
            raw["p50"].note(f"{name}: {r['errors']} failed CONNECTs in run {run + 1} ({r['error']})")
        for q in ("p50", "p99"):
            raw[q].add(name, r[q] * 1e3)
        runs[(name, run)] = {q: r[q] * 1e3 for q in ("p50", "p99")}

    with sandboxes(ctx, "sandbox-latency", [ctx.up.http_port]) as boxes:
        boxes.each_run([*added.values(), *raw.values()], measure)
    for (name, run), figures in runs.items():  # added = target - egressd exec, paired by run
        base = runs.get((EXEC, run))
        if name != EXEC and base is not None:
            for q in ("p50", "p99"):
                added[q].add(name, figures[q] - base[q])
    for m in added.values():
        m.unavailable(EXEC, "the reference")
    return [*added.values(), *raw.values()]


# -- 13. `egressd sandbox -- true` vs `srt true` vs `egressd exec -- true` ------------------------------
def sandbox_true(ctx: Context) -> list[Metric]:
    wl = "13. Sandbox: `-- true` wall time"
    m = _sandbox_metric(
        "sb4.true",
        wl,
        "`egressd sandbox -- true`, `srt true`, `egressd exec -- true`: wall time",
        "s",
        "lower",
    )
    true = system.which("true") or "/bin/true"
    with sandboxes(ctx, "sandbox-true", [ctx.up.http_port]) as boxes:
        for name in SANDBOX_TARGETS:  # warm the page cache once each
            wrapper = boxes.wrappers[name]
            if isinstance(wrapper, Wrapper):
                with contextlib.suppress(Exception):
                    boxes.wall(wrapper, [true])

        def measure(name: str, wrapper: Wrapper, run: int) -> None:
            m.add(name, boxes.wall(wrapper, [true]))

        # exec_runs rounds per repeat, each visiting the three targets in a rotated order
        boxes.each_run([m], measure, repeats=ctx.sizes.repeats * ctx.sizes.exec_runs)
    return [m]


RUNNERS: dict[str, Callable[[Context], list[Metric]]] = {
    "throughput": tunnel_throughput,
    "setup": tunnel_setup,
    "latency": connect_latency,
    "http": http_gets,
    "intercept": intercepted_https,
    "idle": idle_tunnels,
    # `exec --attach -- true` beside it (bench/attach.py)
    "exec": lambda ctx: [
        *exec_true(ctx),
        *exec_attach(ctx.work, ctx.proxy_cpu, ctx.sizes.repeats, ctx.sizes.exec_runs),
    ],
    "decision": decision,
    "job": real_job,
    "sandbox-throughput": sandbox_throughput,
    "sandbox-setup": sandbox_setup,
    "sandbox-latency": sandbox_latency,
    "sandbox-true": sandbox_true,
}
