"""Load: 1,000 concurrent tunnels with the payload checked end to end, 10,000 in sequence, no leaks."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import resource
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.support.egressd_cli import TEST_POLICY, EgressdRun, write_policy
from tests.support.upstreams import TcpEchoServer


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def tunnel_round_trip(proxy: str, target: str, payload: bytes) -> bytes:
    """CONNECT, send the payload, read it back, close: the SHA-256 of what came back."""
    url = urlsplit(proxy)
    auth = base64.b64encode(f"{url.username}:{url.password}".encode()).decode()
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    try:
        writer.write(
            f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
            f"Proxy-Authorization: Basic {auth}\r\n\r\n".encode()
        )
        head = await reader.readuntil(b"\r\n\r\n")
        assert b" 200 " in head.split(b"\r\n")[0], head
        writer.write(payload)
        await writer.drain()
        received = await reader.readexactly(len(payload))
        return hashlib.sha256(received).digest()
    finally:
        writer.close()


def _proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def _settle(pid: int, baseline: int, slack: int, timeout: float = 20) -> int:
    deadline = time.monotonic() + timeout
    fds = _proc_fds(pid)
    while fds > baseline + slack and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        fds = _proc_fds(pid)
    return fds


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_concurrent_and_sequential_tunnels_without_leaks(
    tmp_path: Path, tcp_echo: TcpEchoServer
) -> None:
    _raise_fd_limit()
    # an IP literal (allowed by the policy's CIDR): this measures the proxy, not the test's DNS server
    policy = write_policy(tmp_path, TEST_POLICY)
    target = f"{tcp_echo.address[0]}:{tcp_echo.address[1]}"
    with EgressdRun(["--policy", str(policy)]) as run:
        assert run.proc is not None
        pid = run.proc.pid
        proxy = run.proxy_url

        for _ in range(50):  # warm up
            await tunnel_round_trip(proxy, target, b"warm")
        fds_before = await _settle(pid, _proc_fds(pid), 0, timeout=2)
        rss_before = _rss_kib(pid)

        t0 = time.monotonic()
        payloads = [os.urandom(4096 + i) for i in range(1000)]
        digests = await asyncio.gather(*(tunnel_round_trip(proxy, target, p) for p in payloads))
        assert digests == [hashlib.sha256(p).digest() for p in payloads]
        print(f"1,000 concurrent tunnels: {time.monotonic() - t0:.1f} s")

        t0 = time.monotonic()
        payload = os.urandom(512)
        digest = hashlib.sha256(payload).digest()
        for _ in range(10_000):
            assert await tunnel_round_trip(proxy, target, payload) == digest
        print(f"10,000 sequential tunnels: {time.monotonic() - t0:.1f} s")

        fds_after = await _settle(pid, fds_before, 4)
        assert fds_after <= fds_before + 4, f"file descriptors: {fds_before} before, {fds_after} after"
        growth_mib = (_rss_kib(pid) - rss_before) / 1024
        assert growth_mib < 64, f"RSS grew by {growth_mib:.0f} MiB over 11,000 tunnels"
