"""A/B of one `egressd run` option: egressd's CPU per operation, A and B interleaved.

    .venv/bin/python -m bench.ab --b-args "--metrics 127.0.0.1:0" --count 3000 --concurrency 10 --rounds 12
    .venv/bin/python -m bench.ab --a-egressd ~/.cache/egressd-bench/egressd-<commit>/venv/bin/egressd
    .venv/bin/python -m bench.ab --workload keepalive --a-env PYTHONPATH=/other/checkout

The second compares this tree's egressd with another build (an earlier commit's, as bench/before.py
prepares it), both with their defaults. An operation (`--workload`) is a tunnel (`connect`: CONNECT
+ GET + close, the default), an absolute-form GET on a kept-alive connection (`keepalive`) or one
with `Connection: close` (`close`), against a fast keep-alive origin (bench.upstream.SmallOrigin).

Why: on a shared machine the full bench's figures move ±30% between runs, far more than an
observer costs. This runs the two settings in turns (A B B A A B ...), counts the proxy's own CPU
time (/proc/PID/stat, every thread) per operation after a warm-up, and prints the medians and their
ratio, so drift in the machine's load falls on both sides alike. The client and the upstream are
one asyncio process here; run it as root in a namespace or on an idle machine for tighter figures.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import shlex
import statistics
import subprocess
import time
import urllib.parse
from pathlib import Path

from bench.upstream import SmallOrigin

EGRESSD = str(Path(__file__).resolve().parent.parent / ".venv" / "bin" / "egressd")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of the process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def upstream() -> asyncio.Server:
    """The fast keep-alive origin (bench.upstream.SmallOrigin) on 127.0.0.1."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(SmallOrigin, "127.0.0.1", 0, backlog=4096)


# what one operation is: CONNECT + GET + close, or an absolute-form GET kept alive or closed
WORKLOADS = ("connect", "keepalive", "close")


async def _response(reader: asyncio.StreamReader) -> None:
    """One whole response (a Content-Length body), or an error naming what came instead."""
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"refused: {head[:80]!r}")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await reader.readexactly(length)


async def operations(
    workload: str, proxy_port: int, auth: str, up: int, count: int, concurrency: int
) -> None:
    """`count` operations of `workload` through the proxy, `concurrency` clients at a time."""
    target = f"127.0.0.1:{up}"
    credentials = f"Proxy-Authorization: Basic {auth}\r\n"
    if workload == "connect":
        first = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{credentials}\r\n".encode()
        then = f"GET /small HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n".encode()
    else:
        close = "Connection: close\r\n" if workload == "close" else ""
        first = f"GET http://{target}/small HTTP/1.1\r\nHost: {target}\r\n{credentials}{close}\r\n".encode()
    per_client = [count // concurrency + (i < count % concurrency) for i in range(concurrency)]

    async def client(n: int) -> None:
        reader = writer = None
        for _ in range(n):
            if writer is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", proxy_port)
            assert reader is not None
            writer.write(first)
            if workload == "connect":
                answer = await reader.readuntil(b"\r\n\r\n")
                if not answer.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(f"tunnel refused: {answer[:80]!r}")
                writer.write(then)
            await _response(reader)
            if workload != "keepalive":
                writer.close()
                reader = writer = None
        if writer is not None:
            writer.close()

    await asyncio.gather(*(client(n) for n in per_client))


async def settled(pid: int, quiet: float = 0.01, window: float = 0.5, limit: float = 15.0) -> None:
    """Wait until the proxy is idle (under `quiet` CPU seconds in `window`): work a build does in
    the background once at start (the control API's thread imports aiohttp, ~0.25 s of CPU) must
    not be counted as the cost of the operations measured next."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        before = cpu_seconds(pid)
        await asyncio.sleep(window)
        if cpu_seconds(pid) - before < quiet:
            return


def proxy_of(proc: subprocess.Popen[str]) -> tuple[int, str]:
    """The proxy port and Basic credentials an `egressd run` prints as exports on its stdout."""
    exports: dict[str, str] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export":
            key, _, value = words[1].partition("=")
            exports[key] = value
    url = urllib.parse.urlsplit(exports["HTTP_PROXY"])
    assert url.port is not None
    return url.port, base64.b64encode(f"{url.username}:{url.password}".encode()).decode()


async def measure(
    egressd: str,
    extra: list[str],
    up: int,
    count: int,
    concurrency: int,
    env: dict[str, str] | None = None,
    workload: str = "connect",
) -> tuple[float, float]:
    """(CPU µs per operation, operations/s) of one fresh `egressd run` with `extra` options and
    `env` added to the environment."""
    proc = subprocess.Popen(
        [egressd, "run", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **(env or {})},
    )
    try:
        port, auth = proxy_of(proc)
        await operations(workload, port, auth, up, min(300, count), concurrency)  # warm-up
        await settled(proc.pid)
        cpu, started = cpu_seconds(proc.pid), time.monotonic()
        await operations(workload, port, auth, up, count, concurrency)
        cpu, elapsed = cpu_seconds(proc.pid) - cpu, time.monotonic() - started
    finally:
        proc.terminate()
        proc.wait(20)
    return cpu / count * 1e6, count / elapsed


async def main(args: argparse.Namespace) -> None:
    server = await upstream()
    up = server.sockets[0].getsockname()[1]
    settings = {"A": shlex.split(args.a_args), "B": shlex.split(args.b_args)}
    binaries = {"A": args.a_egressd, "B": args.b_egressd}
    envs = {"A": dict(v.split("=", 1) for v in args.a_env), "B": dict(v.split("=", 1) for v in args.b_env)}
    results: dict[str, list[tuple[float, float]]] = {"A": [], "B": []}
    for round_ in range(args.rounds):
        order = ("A", "B") if round_ % 2 == 0 else ("B", "A")
        for name in order:
            measured = await measure(
                binaries[name], settings[name], up, args.count, args.concurrency, envs[name], args.workload
            )
            results[name].append(measured)
            cpu, rate = results[name][-1]
            env = [f"{key}={value}" for key, value in envs[name].items()]
            options = shlex.join([*env, binaries[name], *settings[name]])
            print(f"{name} {options}: {cpu:.0f} CPU µs/op, {rate:.0f} ops/s ({args.workload})")
    medians = {
        name: (statistics.median(c for c, _ in runs), statistics.median(r for _, r in runs))
        for name, runs in results.items()
    }
    for name, (cpu, rate) in medians.items():
        print(f"median {name}: {cpu:.1f} CPU µs/op, {rate:.0f} ops/s ({len(results[name])} runs)")
    (cpu_a, rate_a), (cpu_b, rate_b) = medians["A"], medians["B"]
    ratios = f"CPU per operation {cpu_b / cpu_a:.3f}, operations/s {rate_b / rate_a:.3f}"
    print(f"B / A ({args.workload}): {ratios}")
    server.close()


def add_sides(p: argparse.ArgumentParser) -> None:
    """The options that make A and B differ by environment or build, and what one operation is
    (shared with bench.instructions)."""
    p.add_argument("--workload", choices=WORKLOADS, default="connect", help="what one operation is")
    p.add_argument("--a-env", action="append", default=[], metavar="KEY=VALUE", help="A's extra environment")
    p.add_argument("--b-env", action="append", default=[], metavar="KEY=VALUE", help="B's extra environment")
    p.add_argument("--a-egressd", default=EGRESSD, help="the egressd of A (default: this tree's)")
    p.add_argument("--b-egressd", default=EGRESSD, help="the egressd of B (default: this tree's)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--a-args", default="", help="options of egressd run for A (default: none)")
    p.add_argument("--b-args", default="", help='egressd run options for B: "--metrics 127.0.0.1:0"')
    add_sides(p)
    p.add_argument("--count", type=int, default=3000, help="operations measured (after 300 of warm-up)")
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--rounds", type=int, default=12, help="measurements of each of A and B")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
