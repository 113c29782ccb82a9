"""The gateway under many clients: N concurrent clients, each with its own token, held open through
`egressd run --gateway`, then a SHA-256-checked transfer on every one; the gateway's memory per
idle client.

    .venv/bin/python -m bench.gateway [--clients 1000] [--payload 16384]

Everything runs on loopback: an echo upstream and the clients in this process (asyncio), the
gateway as the real command. The tokens are written in one go (`add_clients`), as `egressd gateway
token add` writes them one by one. Memory per idle client = (the gateway's RSS with every client's
tunnel open and idle − its RSS after a warm-up) ÷ clients; each idle client holds two sockets in
the gateway (its own and the upstream's). Prints one JSON line. tests/e2e/test_gateway_load.py runs
the same measurement with its assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import json
import os
import re
import resource
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

EGRESSD = (sys.executable, "-m", "egressd")
LISTENING = re.compile(rb"gateway listening on http://([0-9.]+):(\d+)")
OPENING = 200  # tunnels being opened at once (all of them stay open together afterwards)


@dataclass
class GatewayLoad:
    clients: int
    payload_bytes: int
    open_seconds: float  # every client's CONNECT answered 200
    transfer_seconds: float  # every client's payload echoed back and checked
    rss_warm_kib: int
    rss_idle_kib: int
    rss_per_idle_client_kib: float
    checked: int  # transfers whose SHA-256 matched
    gateway_exit: int | None


class _Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)


def raise_fd_limit(needed: int) -> None:
    """Clients and the upstream's sockets live in this process: two descriptors per client."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        target = hard if hard == resource.RLIM_INFINITY else min(max(needed, soft), hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        raise RuntimeError(f"RLIMIT_NOFILE is {soft}; {needed} descriptors are needed")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def _open_tunnel(
    gateway: tuple[str, int], name: str, token: str, target: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    auth = base64.b64encode(f"{name}:{token}".encode()).decode()
    reader, writer = await asyncio.open_connection(*gateway)
    writer.write(
        f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: Basic {auth}\r\n\r\n".encode()
    )
    head = await reader.readuntil(b"\r\n\r\n")
    if b" 200 " not in head.split(b"\r\n")[0]:
        writer.close()
        raise RuntimeError(f"{name}: {head.split(b'\r\n')[0]!r}")
    return reader, writer


async def _transfer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes) -> bool:
    writer.write(payload)
    await writer.drain()
    received = await reader.readexactly(len(payload))
    return hashlib.sha256(received).digest() == hashlib.sha256(payload).digest()


async def _gateway_address(
    proc: asyncio.subprocess.Process, log: bytearray, timeout: float
) -> tuple[str, int]:
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    while (found := LISTENING.search(log)) is None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"the gateway did not start: {log.decode(errors='replace')}")
        line = await asyncio.wait_for(proc.stderr.readline(), left)
        if not line:
            raise RuntimeError(f"the gateway exited: {log.decode(errors='replace')}")
        log += line
    return found.group(1).decode(), int(found.group(2))


async def _drain_stderr(proc: asyncio.subprocess.Process, log: bytearray) -> None:
    assert proc.stderr is not None
    while line := await proc.stderr.readline():
        log += line


async def measure(
    workdir: Path,
    clients: int = 1000,
    payload_bytes: int = 16384,
    *,
    egressd: Sequence[str] = EGRESSD,
    timeout: float = 90,
) -> GatewayLoad:
    """The whole run; raises when a phase misses its deadline or a client is refused."""
    from egressd.session.token_file import add_clients

    raise_fd_limit(2 * clients + 256)
    loop = asyncio.get_running_loop()
    upstream = await loop.create_server(_Echo, "127.0.0.1", 0, backlog=4096)
    up_port = upstream.sockets[0].getsockname()[1]
    target = f"127.0.0.1:{up_port}"
    workdir.mkdir(parents=True, exist_ok=True)
    policy = workdir / "policy.yaml"
    policy.write_text(f"version: 1\nmode: enforce\nloopback:\n  ports: [{up_port}]\n")
    tokens_file = workdir / "tokens.json"
    names = [f"client{i:04d}" for i in range(clients)]
    tokens = add_clients(tokens_file, names)
    env = {**os.environ, "EGRESSD_HOME": str(workdir / "home")}
    proc = await asyncio.create_subprocess_exec(
        *egressd,
        "run",
        "--gateway",
        "--listen",
        "127.0.0.1:0",
        "--tokens",
        str(tokens_file),
        "--policy",
        str(policy),
        "--quiet",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    log = bytearray()
    opened: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    drain: asyncio.Task[None] | None = None
    try:
        gateway = await _gateway_address(proc, log, 60)
        drain = asyncio.ensure_future(_drain_stderr(proc, log))
        for _ in range(20):  # warm up: imports, first allocations
            reader, writer = await _open_tunnel(gateway, names[0], tokens[names[0]], target)
            await _transfer(reader, writer, b"warm" * 256)
            writer.close()
        await asyncio.sleep(0.5)
        rss_warm = rss_kib(proc.pid)

        gate = asyncio.Semaphore(OPENING)

        async def open_one(name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            async with gate:
                return await _open_tunnel(gateway, name, tokens[name], target)

        started = time.monotonic()
        opening = [asyncio.ensure_future(open_one(name)) for name in names]
        try:
            opened = list(await asyncio.wait_for(asyncio.gather(*opening), timeout))
        finally:
            for task in opening:
                if task.done() and not task.cancelled() and task.exception() is None:
                    if task.result() not in opened:
                        opened.append(task.result())
                else:
                    task.cancel()
        open_seconds = time.monotonic() - started
        await asyncio.sleep(1.0)  # idle: nothing moves
        rss_idle = rss_kib(proc.pid)

        payloads = [os.urandom(payload_bytes) for _ in names]
        started = time.monotonic()
        results = await asyncio.wait_for(
            asyncio.gather(*(_transfer(r, w, p) for (r, w), p in zip(opened, payloads, strict=True))),
            timeout,
        )
        transfer_seconds = time.monotonic() - started
    finally:
        for _, writer in opened:
            writer.close()
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 30)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if drain is not None:
            drain.cancel()
        upstream.close()
    return GatewayLoad(
        clients=clients,
        payload_bytes=payload_bytes,
        open_seconds=round(open_seconds, 2),
        transfer_seconds=round(transfer_seconds, 2),
        rss_warm_kib=rss_warm,
        rss_idle_kib=rss_idle,
        rss_per_idle_client_kib=round((rss_idle - rss_warm) / clients, 1),
        checked=sum(results),
        gateway_exit=proc.returncode,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--payload", type=int, default=16384, help="bytes each client sends and gets back")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="egressd-gateway-bench-") as temp:
        workdir = args.workdir or Path(temp)
        result = asyncio.run(measure(workdir, args.clients, args.payload))
    print(json.dumps(asdict(result)))


if __name__ == "__main__":
    main()
