"""The Python floor of tunnel set-up: a bare uvloop CONNECT relay next to tinyproxy and egressd.

    .venv/bin/python -m bench.floor [--seconds 5] [--repeats 3]

The bare relay (`python -m bench.floor relay PORT`) reads a CONNECT head, connects, answers 200 and
relays with two asyncio protocols — no policy, no authentication, no audit: the least a Python proxy
on uvloop can do per tunnel. Run in one invocation against the same upstream (a uvloop server
answering `GET /small`), with the same load generator and pinning as `bench/run.py`'s workload 2, it
shows how much of egressd's set-up cost is the runtime rather than egressd. Prints one JSON line per
figure and a table of ratios.

    .venv/bin/python -m bench.floor --syscalls [--seconds 5]

counts instead each target's system calls per tunnel by name (`strace -c -f` attached to the proxy
over the tunnels of one load run at concurrency 10, after a warm-up): unlike CPU time, the counts do
not move with the machine's load. strace slows the proxy, not what it calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import loadgen, peers, system
from bench.upstream import SmallOrigin


class _Side(asyncio.Protocol):
    def __init__(self) -> None:
        self.peer: _Side | None = None
        self.transport: Any = None
        self.pending = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.write(data)
        else:
            self.pending += data

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


class _Client(_Side):
    """The bare relay's client side: CONNECT head, connect, 200, relay."""

    def data_received(self, data: bytes) -> None:
        if self.peer is not None or b"\r\n\r\n" not in self.pending + data:
            if self.peer is None:
                self.pending += data
                return
            super().data_received(data)
            return
        head, _, rest = (self.pending + data).partition(b"\r\n\r\n")
        self.pending = rest
        host, _, port = head.split(b" ", 2)[1].decode().rpartition(":")
        self.transport.pause_reading()
        asyncio.get_running_loop().create_task(self._open(host, int(port)))

    async def _open(self, host: str, port: int) -> None:
        upstream = _Side()
        try:
            await asyncio.get_running_loop().create_connection(lambda: upstream, host, port)
        except OSError:
            self.transport.close()
            return
        upstream.peer, self.peer = self, upstream
        self.transport.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        if self.pending:
            upstream.transport.write(self.pending)
            self.pending = b""
        self.transport.resume_reading()


async def _serve(factory: Any, port: int) -> None:
    loop = asyncio.get_running_loop()
    loop.set_task_factory(asyncio.eager_task_factory)
    server = await loop.create_server(factory, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def _uvloop_run(coro: Any) -> None:
    import uvloop

    uvloop.run(coro)


class BareRelayPeer(peers.Peer):
    name = "bare uvloop relay"
    description = "a CONNECT relay on uvloop with no policy at all (bench/floor.py)"

    def start(self) -> peers.Proxy:
        port = system.free_port()
        proc = self._spawn([sys.executable, "-m", "bench.floor", "relay", str(port)], port)
        return peers.Proxy(self.name, port, proc)


def _measure(proxy: peers.Proxy, up_port: int, concurrency: int, seconds: float) -> dict[str, float]:
    """Tunnels/s and the proxy's CPU µs per tunnel: in all, in user space and in the kernel."""

    def load(seconds: float) -> loadgen.ConnectResult:
        return loadgen.run_async(
            loadgen.connect_load(
                proxy, "127.0.0.1", up_port, concurrency=concurrency, seconds=seconds, warmup=0
            )
        )

    load(1.0)  # warm-up
    assert proxy.pid is not None
    user0, sys0 = system.cpu_split(proxy.pid)
    result = load(seconds)
    user1, sys1 = system.cpu_split(proxy.pid)
    per = 1e6 / result.ops if result.ops else float("nan")
    return {
        "rate": result.rate,
        "cpu_us": (user1 - user0 + sys1 - sys0) * per,
        "user_us": (user1 - user0) * per,
        "sys_us": (sys1 - sys0) * per,
    }


def _syscalls(proxy: peers.Proxy, up_port: int, seconds: float) -> dict[str, float]:
    """The proxy's system calls per tunnel by name (and "total"), over one load run at concurrency
    10 after a warm-up; "errors" of a name counted apart (`connect` is EINPROGRESS, non-blocking)."""

    def load(seconds: float) -> loadgen.ConnectResult:
        return loadgen.run_async(
            loadgen.connect_load(proxy, "127.0.0.1", up_port, concurrency=10, seconds=seconds, warmup=0)
        )

    load(1.0)  # warm-up
    assert proxy.pid is not None
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as out:
        tracer = subprocess.Popen(
            ["strace", "-c", "-f", "-p", str(proxy.pid), "-o", out.name], stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 10
        while not _traced(proxy.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        result = load(seconds)
        tracer.send_signal(signal.SIGINT)
        tracer.wait(30)
        counts: dict[str, float] = {}
        for line in out.read().splitlines():  # % time, seconds, usecs/call, calls, [errors,] name
            fields = line.split()
            if len(fields) in (5, 6) and fields[0][0].isdigit() and fields[-1] != "total":
                counts[fields[-1]] = int(fields[3]) / result.ops
                if len(fields) == 6:
                    counts[f"{fields[-1]} errors"] = int(fields[4]) / result.ops
    counts["total"] = sum(v for k, v in counts.items() if not k.endswith(" errors"))
    return counts


def _traced(pid: int) -> bool:
    """Every thread of `pid` has a tracer (strace attached to all of them)."""
    threads = list(Path(f"/proc/{pid}/task").iterdir())
    return all("TracerPid:\t0\n" not in (t / "status").read_text() for t in threads)


def compare(seconds: float, repeats: int, syscalls: bool = False) -> dict[str, Any]:
    work = Path("/tmp/egressd-bench-floor")
    work.mkdir(parents=True, exist_ok=True)
    system.enter_netns()
    system.raise_fd_limit()
    pin = system.can_pin()
    cpu = system.PROXY_CPU if pin else None
    if pin:
        system.pin_self(system.LOAD_CPU)
    up_port = system.free_port()
    upstream = subprocess.Popen(
        system.pinned([sys.executable, "-m", "bench.floor", "upstream", str(up_port)], None)
    )
    system.wait_port("127.0.0.1", up_port, proc=upstream)
    targets: dict[str, peers.Peer] = {
        "tinyproxy": peers.TinyproxyPeer(work, cpu),
        "egressd": peers.EgressdPeer(work, cpu),
        "bare uvloop relay": BareRelayPeer(work, cpu),
    }
    figures: dict[str, dict[str, list[float]]] = {}
    try:
        for name, peer in targets.items():
            proxy = peer.start()
            try:
                if syscalls:
                    figures[name] = {k: [v] for k, v in _syscalls(proxy, up_port, seconds).items()}
                    continue
                for conc in (10, 100):
                    for _ in range(repeats):
                        for metric, value in _measure(proxy, up_port, conc, seconds).items():
                            figures.setdefault(f"{name} c={conc}", {}).setdefault(metric, []).append(value)
            finally:
                proxy.stop()
    finally:
        upstream.kill()
    return {k: {m: statistics.median(v) for m, v in f.items()} for k, f in figures.items()}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] in ("relay", "upstream"):
        factory = _Client if sys.argv[1] == "relay" else SmallOrigin
        _uvloop_run(_serve(factory, int(sys.argv[2])))
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--syscalls", action="store_true", help="system calls per tunnel (strace)")
    args = parser.parse_args()
    medians = compare(args.seconds, args.repeats, args.syscalls)
    print(json.dumps(medians, indent=1))
    if args.syscalls:
        _print_syscalls(medians)
        return
    print("\nTunnels/s (proxy CPU µs per tunnel: user + system)\n")
    print("| concurrency | tinyproxy | egressd | bare uvloop relay | egressd ÷ tinyproxy ", end="")
    print("| bare ÷ tinyproxy | egressd ÷ bare |")
    print("|---|---|---|---|---|---|---|")

    def cell(m: dict[str, float]) -> str:
        return f"{m['rate']:,.0f}/s ({m['user_us']:.0f} + {m['sys_us']:.0f} µs)"

    for conc in (10, 100):
        t, e, b = (medians[f"{n} c={conc}"] for n in ("tinyproxy", "egressd", "bare uvloop relay"))
        print(
            f"| {conc} | {cell(t)} | {cell(e)} | {cell(b)} | {e['rate'] / t['rate']:.2f}× | "
            f"{b['rate'] / t['rate']:.2f}× | {e['rate'] / b['rate']:.2f}× |"
        )


def _print_syscalls(counts: dict[str, dict[str, float]]) -> None:
    names = ("tinyproxy", "egressd", "bare uvloop relay")
    calls = sorted(
        {c for n in names for c in counts[n]}, key=lambda c: (c == "total", -counts["egressd"].get(c, 0))
    )
    print("\nSystem calls per tunnel (CONNECT + GET + close, concurrency 10)\n")
    print("| system call | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for call in calls:
        if max(counts[n].get(call, 0) for n in names) >= 0.05:
            print(f"| {call} | " + " | ".join(f"{counts[n].get(call, 0):.2f}" for n in names) + " |")


if __name__ == "__main__":
    main()
