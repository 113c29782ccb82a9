"""The load generators, all run from the load core, all talking to 127.0.0.1 only.

- `throughput`: one tunnel, a blocking socket, 4 MiB sendall()s (raw or TLS inside the tunnel).
- `connect_load`: asyncio protocols (uvloop when installed) doing CONNECT + one small GET + close,
  closed-loop (setup rate) or paced with Poisson arrivals (latency); latency is socket() to "tunnel
  usable" (the proxy's 2xx to CONNECT read; for direct, the TCP handshake done).
- `run_wrk`: wrk with a Lua script sending absolute-form requests (and Proxy-Authorization) to the
  proxy's address: plain-HTTP GETs with and without keep-alive.
- `https_requests`: keep-alive HTTPS clients (CONNECT, TLS, sequential GETs) for interception.
- `big_response`: one large HTTPS response read through the proxy.
- `idle_tunnels`: N tunnels opened, held idle, then each checked with an echo.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import ssl
import struct
import subprocess
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import system
from bench.peers import Proxy

_CHUNK = 4 * 1024 * 1024


def run_async[R](main: Coroutine[Any, Any, R]) -> R:
    """asyncio.run, on uvloop when it is installed (the generator must not be the bottleneck)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def event_loop_name() -> str:
    try:
        import uvloop

        return f"uvloop {uvloop.__version__}"
    except ImportError:
        return "asyncio (default loop)"


class ProxyError(RuntimeError):
    """The proxy did not answer a CONNECT with 2xx."""


# -- 1. one tunnel, many bytes ---------------------------------------------------------------------
def _read_head(sock: socket.socket) -> bytes:
    """Read up to the end of an HTTP head (byte by byte is fine: once per tunnel)."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        b = sock.recv(1)
        if not b:
            raise ProxyError(f"connection closed during the proxy's answer: {head!r}")
        head += b
        if len(head) > 65536:
            raise ProxyError("proxy answer too long")
    return head


def open_tunnel(proxy: Proxy, host: str, port: int, timeout: float = 30.0) -> socket.socket:
    """A connected socket to host:port, through the proxy's CONNECT unless direct."""
    if proxy.direct:
        sock = socket.create_connection((host, port), timeout=timeout)
    else:
        assert proxy.port is not None
        sock = socket.create_connection((proxy.host, proxy.port), timeout=timeout)
        sock.sendall(proxy.connect_request(host, port))
        head = _read_head(sock)
        if head.split(b" ", 2)[1:2] != [b"200"] and not head.split(b" ", 2)[1].startswith(b"2"):
            sock.close()
            raise ProxyError(f"CONNECT refused: {head.splitlines()[0]!r}")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


@dataclass
class Transfer:
    seconds: float
    nbytes: int
    proxy_cpu: float

    @property
    def mib_per_s(self) -> float:
        return self.nbytes / (1024 * 1024) / self.seconds


def throughput(proxy: Proxy, host: str, port: int, nbytes: int, tls: ssl.SSLContext | None) -> Transfer:
    """Send nbytes through one tunnel to the sink; timed until the sink says it read them all."""
    sock = open_tunnel(proxy, host, port, timeout=600)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _CHUNK)
    stream: socket.socket = tls.wrap_socket(sock, server_hostname=host) if tls is not None else sock
    buf = memoryview(random.randbytes(_CHUNK))
    cpu = system.CpuWindow(proxy.pid).start()
    try:
        stream.sendall(struct.pack("!Q", nbytes))
        t0 = time.perf_counter()
        remaining = nbytes
        while remaining > 0:
            n = min(_CHUNK, remaining)
            stream.sendall(buf[:n])
            remaining -= n
        ack = stream.recv(1)
        elapsed = time.perf_counter() - t0
    finally:
        with contextlib.suppress(OSError):
            stream.close()
    if ack != b"\x01":
        raise ProxyError("the sink did not confirm the bytes (tunnel broken)")
    return Transfer(elapsed, nbytes, cpu.stop())


def native_tls_load_binary() -> Path | None:
    """bench/tls_load.c (workload 1's TLS client and sink) built against OpenSSL, else None."""
    return system.build_c(Path(__file__).with_name("tls_load.c"), ["-lssl", "-lcrypto", "-lpthread"])


def tls_throughput_native(
    binary: Path, proxy: Proxy, host: str, port: int, nbytes: int, ca: Path
) -> Transfer:
    """Workload 1 (TLS) with the C client (bench/tls_load.c) against its C sink: the same exchange
    as throughput() with an ssl context, a fraction of the load core's CPU per byte."""
    connect = b"" if proxy.direct else proxy.connect_request(host, port)
    address = (host, port) if proxy.direct else (proxy.host, proxy.port)
    argv = [str(binary), "send", address[0], str(address[1]), connect.decode(), host, str(nbytes), str(ca)]
    data, proxy_cpu = _run_windowed(argv, proxy)
    return Transfer(float(data["seconds"]), int(data["bytes"]), proxy_cpu)


def _run_windowed(argv: list[str], proxy: Proxy) -> tuple[dict[str, Any], float]:
    """Run a C load generator: the proxy's CPU between its WINDOW_START and WINDOW_END lines, and
    the JSON line it prints last."""
    cpu = system.CpuWindow(proxy.pid)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proxy_cpu = 0.0
    data: dict[str, Any] = {}
    for line in proc.stdout:
        if line.startswith("WINDOW_START"):
            cpu.start()
        elif line.startswith("WINDOW_END"):
            proxy_cpu = cpu.stop()
        elif line.startswith("{"):
            data = json.loads(line)
    err = proc.stderr.read()
    proc.wait(timeout=60)
    if not data:
        name = Path(argv[0]).name
        raise ProxyError(f"{name}: {err.strip() or f'exit {proc.returncode}'}"[:300])
    return data, proxy_cpu


# -- 2/3. CONNECT + small request + close -----------------------------------------------------------
def small_get(host: str, port: int, path: str = "/small", *, close: bool = True) -> bytes:
    conn = "Connection: close\r\n" if close else ""
    return f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: egressd-bench\r\n{conn}\r\n".encode()


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return -1


class _TunnelOnce(asyncio.Protocol):
    """One CONNECT (or direct connect), one request, the whole response, close."""

    __slots__ = ("buf", "connect", "done", "request", "state", "t_ready", "transport", "want")

    def __init__(self, connect: bytes | None, request: bytes, done: asyncio.Future[float]) -> None:
        self.connect = connect
        self.request = request
        self.done = done
        self.buf = b""
        self.state = 0  # 0: waiting for the proxy's answer, 1: waiting for the response
        self.t_ready = 0.0
        self.want = -1
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.connect is not None:
            transport.write(self.connect)  # type: ignore[attr-defined]
        else:
            self.t_ready = time.perf_counter()
            self.state = 1
            transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.state == 0:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            if self.buf[9:10] != b"2":
                self._fail(ProxyError(f"CONNECT refused: {self.buf[:60]!r}"))
                return
            self.t_ready = time.perf_counter()
            self.buf = self.buf[end + 4 :]
            self.state = 1
            assert self.transport is not None
            self.transport.write(self.request)
        if self.state == 1:
            if self.want < 0:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                self.want = end + 4 + _content_length(self.buf[:end])
            if len(self.buf) >= self.want:
                self.state = 2
                if not self.done.done():
                    self.done.set_result(self.t_ready)
                assert self.transport is not None
                self.transport.close()

    def _fail(self, exc: BaseException) -> None:
        self.state = 3
        if not self.done.done():
            self.done.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(exc or ProxyError("connection closed early"))


@dataclass
class ConnectResult:
    ops: int  # completed in the window
    seconds: float  # the window
    errors: int
    latencies: list[float] = field(default_factory=list)  # seconds, socket() to tunnel usable
    proxy_cpu: float = 0.0
    generator_cpu: float = 0.0
    first_error: str = ""

    @property
    def rate(self) -> float:
        return self.ops / self.seconds


async def connect_load(
    proxy: Proxy,
    host: str,
    port: int,
    *,
    concurrency: int,
    seconds: float | None = None,
    warmup: float = 0.0,
    samples: int | None = None,
    rate: float | None = None,
    timeout: float = 10.0,
) -> ConnectResult:
    """Workers each doing CONNECT + GET /small + close in a loop.

    Closed loop (each worker starts its next tunnel at once) unless `rate` is given: then every worker
    starts tunnels at Poisson times, together `rate` per second (open loop, up to `concurrency` in
    flight). Stops after `seconds` (measuring after `warmup`) or after `samples` completions.
    """
    loop = asyncio.get_running_loop()
    connect = None if proxy.direct else proxy.connect_request(host, port)
    address = (host, port) if proxy.direct else (proxy.host, proxy.port)
    request = small_get(host, port)
    t_begin = time.perf_counter()
    t_measure = t_begin + warmup
    t_end = t_measure + seconds if seconds is not None else float("inf")
    result = ConnectResult(0, 0.0, 0)
    stop = asyncio.Event()
    per_worker = rate / concurrency if rate else None

    async def worker() -> None:
        next_start = time.perf_counter() + (random.expovariate(per_worker) if per_worker else 0.0)
        while not stop.is_set():
            if per_worker:
                now = time.perf_counter()
                if next_start >= t_end:  # no more arrivals for this worker in the window
                    await asyncio.sleep(max(0.0, t_end - now))
                    break
                if next_start > now:
                    await asyncio.sleep(next_start - now)
                next_start += random.expovariate(per_worker)
            t0 = time.perf_counter()
            if t0 >= t_end:
                break
            done: asyncio.Future[float] = loop.create_future()
            transport: asyncio.BaseTransport | None = None
            try:
                async with asyncio.timeout(timeout):
                    transport, _ = await loop.create_connection(
                        lambda d=done: _TunnelOnce(connect, request, d), *address
                    )
                    t_ready = await done
            except (OSError, ProxyError, TimeoutError) as e:
                if transport is not None:
                    transport.abort()  # type: ignore[attr-defined]
                if t_measure <= time.perf_counter() <= t_end:
                    result.errors += 1
                    result.first_error = result.first_error or f"{type(e).__name__}: {e}"
                await asyncio.sleep(0.01)
                continue
            t1 = time.perf_counter()
            if t_measure <= t1 <= t_end:  # completed in the window (whenever it started)
                result.ops += 1
                result.latencies.append(t_ready - t0)
                if samples is not None and result.ops >= samples:
                    stop.set()

    cpu = system.CpuWindow(proxy.pid)
    gen_cpu0 = 0.0

    async def window() -> None:
        nonlocal gen_cpu0
        await asyncio.sleep(max(0.0, t_measure - time.perf_counter()))
        cpu.start()
        gen_cpu0 = system.self_cpu_seconds()

    await asyncio.gather(window(), *(worker() for _ in range(concurrency)))
    result.proxy_cpu = cpu.stop()
    result.generator_cpu = system.self_cpu_seconds() - gen_cpu0
    result.seconds = min(t_end, time.perf_counter()) - t_measure
    return result


def native_connect_load_binary() -> Path | None:
    """bench/connect_load.c built with the system C compiler, else None."""
    return system.build_c(Path(__file__).with_name("connect_load.c"))


def connect_load_native(
    binary: Path, proxy: Proxy, host: str, port: int, *, concurrency: int, seconds: float, warmup: float
) -> ConnectResult:
    """Workload 2 with the C generator (bench/connect_load.c) on this process's core: same
    exchange as connect_load's closed loop, a fraction of the CPU per tunnel."""
    connect = b"" if proxy.direct else proxy.connect_request(host, port)
    address = (host, port) if proxy.direct else (proxy.host, proxy.port)
    argv = [str(binary), address[0], str(address[1]), str(concurrency), str(warmup), str(seconds)]
    argv += [connect.decode(), small_get(host, port).decode()]
    data, proxy_cpu = _run_windowed(argv, proxy)
    return ConnectResult(
        ops=int(data["ops"]),
        seconds=float(data["seconds"]),
        errors=int(data["errors"]),
        latencies=[us / 1e6 for us in data["latencies_us"]],
        proxy_cpu=proxy_cpu,
        first_error=str(data["first_error"]),
    )


# -- 4. wrk ---------------------------------------------------------------------------------------
_WRK_DONE = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '\\nWRKJSON {"requests": %d, "duration_us": %d, "connect": %d, "read": %d, "write": %d, ' ..
    '"status": %d, "timeout": %d, "p50_us": %d, "p99_us": %d}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


@dataclass
class WrkResult:
    requests: int
    seconds: float
    errors: dict[str, int]
    p50_ms: float
    p99_ms: float
    proxy_cpu: float

    @property
    def rate(self) -> float:
        return self.requests / self.seconds


def wrk_script(path: Path, proxy: Proxy, host: str, port: int, keepalive: bool) -> None:
    lines = []
    if not proxy.direct:  # absolute-form request line, sent to the proxy's address
        lines.append(f'wrk.path = "http://{host}:{port}/small"')
    else:
        lines.append('wrk.path = "/small"')
    lines.append(f'wrk.headers["Host"] = "{host}:{port}"')
    if proxy.auth:
        lines.append(f'wrk.headers["Proxy-Authorization"] = "{proxy.auth}"')
    if not keepalive:
        lines.append('wrk.headers["Connection"] = "close"')
    path.write_text("\n".join(lines) + "\n" + _WRK_DONE)


def run_wrk(
    proxy: Proxy, host: str, port: int, *, keepalive: bool, connections: int, seconds: float, script: Path
) -> WrkResult:
    wrk_script(script, proxy, host, port, keepalive)
    target = f"http://{host}:{port}" if proxy.direct else f"http://{proxy.host}:{proxy.port}"
    argv = [
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{max(1, round(seconds))}s",
        "--timeout",
        "5s",
        "-s",
        str(script),
        target,
    ]
    cpu = system.CpuWindow(proxy.pid).start()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60, check=False)
    proxy_cpu = cpu.stop()
    for line in out.stdout.splitlines():
        if line.startswith("WRKJSON "):
            data = json.loads(line[len("WRKJSON ") :])
            errors = {k: int(data[k]) for k in ("connect", "read", "write", "status", "timeout")}
            return WrkResult(
                data["requests"],
                data["duration_us"] / 1e6,
                errors,
                data["p50_us"] / 1e3,
                data["p99_us"] / 1e3,
                proxy_cpu,
            )
    raise RuntimeError(
        f"wrk printed no summary (exit {out.returncode}): {out.stderr.strip() or out.stdout[-500:]}"
    )


# -- 5. intercepted HTTPS --------------------------------------------------------------------------
async def _open_https(
    proxy: Proxy, host: str, port: int, ctx: ssl.SSLContext
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    if proxy.direct:
        return await asyncio.open_connection(host, port, ssl=ctx, server_hostname=host)
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    writer.write(proxy.connect_request(host, port))
    head = await reader.readuntil(b"\r\n\r\n")
    if head[9:10] != b"2":
        writer.close()
        raise ProxyError(f"CONNECT refused: {head[:60]!r}")
    await writer.start_tls(ctx, server_hostname=host)
    return reader, writer


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    if head[9:12] != b"200":
        raise ProxyError(f"status {head[:40]!r}")
    body = await reader.readexactly(_content_length(head))
    return len(body)


async def https_requests(
    proxy: Proxy,
    host: str,
    port: int,
    ctx: ssl.SSLContext,
    *,
    connections: int,
    seconds: float,
    warmup: float,
) -> ConnectResult:
    """Keep-alive HTTPS GET /small on `connections` tunnels; rate counted after the warm-up. The
    tunnels are opened (CONNECT and the TLS handshake) before the warm-up starts: on a busy machine
    their handshakes would otherwise fall into the window and be counted as the GETs' cost."""
    request = small_get(host, port, close=False)
    result = ConnectResult(0, seconds, 0)
    Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]

    async def open_one(until: float) -> Streams | None:
        while time.perf_counter() < until:
            try:
                return await _open_https(proxy, host, port, ctx)
            except (OSError, ProxyError, ssl.SSLError, asyncio.IncompleteReadError) as e:
                result.errors += 1
                result.first_error = result.first_error or f"{type(e).__name__}: {e}"
                await asyncio.sleep(0.05)
        return None

    opened = await asyncio.gather(*(open_one(time.perf_counter() + 30) for _ in range(connections)))
    t_measure = time.perf_counter() + warmup
    t_end = t_measure + seconds

    async def client(streams: Streams | None) -> None:
        while time.perf_counter() < t_end:
            if streams is None and (streams := await open_one(t_end)) is None:
                return
            reader, writer = streams
            try:
                while (now := time.perf_counter()) < t_end:
                    writer.write(request)
                    await _read_response(reader)
                    if now >= t_measure:
                        result.ops += 1
            except (OSError, ProxyError, ssl.SSLError, asyncio.IncompleteReadError) as e:
                result.errors += 1
                result.first_error = result.first_error or f"{type(e).__name__}: {e}"
            finally:
                writer.close()
                streams = None

    cpu = system.CpuWindow(proxy.pid)

    async def window() -> None:
        await asyncio.sleep(max(0.0, t_measure - time.perf_counter()))
        cpu.start()

    await asyncio.gather(window(), *(client(streams) for streams in opened))
    result.proxy_cpu = cpu.stop()
    return result


@dataclass
class BigResult:
    seconds: float
    nbytes: int
    peak_rss: int | None
    proxy_cpu: float

    @property
    def mib_per_s(self) -> float:
        return self.nbytes / (1024 * 1024) / self.seconds


def big_response(proxy: Proxy, host: str, port: int, ctx: ssl.SSLContext, path: str = "/big") -> BigResult:
    """GET one large response over HTTPS through the proxy; the proxy's peak RSS while it streams."""
    if proxy.pid:
        system.reset_peak_rss(proxy.pid)
    sock = open_tunnel(proxy, host, port, timeout=600)
    stream = ctx.wrap_socket(sock, server_hostname=host)
    cpu = system.CpuWindow(proxy.pid).start()
    try:
        t0 = time.perf_counter()
        stream.sendall(small_get(host, port, path))
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = stream.recv(65536)
            if not chunk:
                raise ProxyError("closed before the response head")
            head += chunk
        end = head.index(b"\r\n\r\n")
        if head[9:12] != b"200":
            raise ProxyError(f"status {head[:40]!r}")
        want = _content_length(head[:end])
        got = len(head) - end - 4
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while got < want:
            n = stream.recv_into(view)
            if n == 0:
                raise ProxyError(f"closed after {got} of {want} bytes")
            got += n
        elapsed = time.perf_counter() - t0
    finally:
        with contextlib.suppress(OSError):
            stream.close()
    peak = system.peak_rss_bytes(proxy.pid) if proxy.pid else None
    return BigResult(elapsed, want, peak, cpu.stop())


# -- 6. idle tunnels -------------------------------------------------------------------------------
class _Idle(asyncio.Protocol):
    __slots__ = ("buf", "connect", "ready", "state", "transport")

    def __init__(self, connect: bytes | None, ready: asyncio.Future[None]) -> None:
        self.connect = connect
        self.ready = ready
        self.buf = b""
        self.state = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.connect is None:
            self.state = 1
            self.ready.set_result(None)
        else:
            transport.write(self.connect)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.state == 0:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            if self.buf[9:10] != b"2":
                self.state = 3
                if not self.ready.done():
                    self.ready.set_exception(ProxyError(f"CONNECT refused: {self.buf[:60]!r}"))
                return
            self.buf = self.buf[end + 4 :]
            self.state = 1
            if not self.ready.done():
                self.ready.set_result(None)
        elif self.state == 2 and self.buf.endswith(b"\n"):
            self.state = 1
            if not self.ready.done():
                self.ready.set_result(None)

    def ping(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        self.ready = loop.create_future()
        self.buf = b""
        self.state = 2
        assert self.transport is not None
        self.transport.write(b"ping\n")
        return self.ready

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = 3
        if not self.ready.done():
            self.ready.set_exception(exc or ProxyError("closed"))


@dataclass
class IdleResult:
    requested: int
    opened: int
    open_seconds: float
    rss_before: int | None
    rss_open: int | None
    rss_after_close: int | None
    working: int
    first_error: str = ""

    @property
    def rss_per_tunnel(self) -> float | None:
        if self.rss_before is None or self.rss_open is None or not self.opened:
            return None
        return (self.rss_open - self.rss_before) / self.opened


async def _bounded[R](n: int, limit: int, make: Callable[[int], Awaitable[R]]) -> list[R | BaseException]:
    sem = asyncio.Semaphore(limit)

    async def one(i: int) -> R | BaseException:
        async with sem:
            try:
                return await make(i)
            except (OSError, ProxyError, TimeoutError) as e:
                return e

    return await asyncio.gather(*(one(i) for i in range(n)))


async def idle_tunnels(
    proxy: Proxy, host: str, port: int, *, count: int, hold: float, open_concurrency: int
) -> IdleResult:
    loop = asyncio.get_running_loop()
    connect = None if proxy.direct else proxy.connect_request(host, port)
    address = (host, port) if proxy.direct else (proxy.host, proxy.port)
    await asyncio.sleep(0.5)
    rss_before = system.rss_bytes(proxy.pid) if proxy.pid else None

    async def open_one(_: int) -> _Idle:
        ready: asyncio.Future[None] = loop.create_future()
        _, proto = await asyncio.wait_for(
            loop.create_connection(lambda: _Idle(connect, ready), *address), timeout=30
        )
        await asyncio.wait_for(ready, timeout=30)
        return proto

    t0 = time.perf_counter()
    opened = await _bounded(count, open_concurrency, open_one)
    open_seconds = time.perf_counter() - t0
    tunnels = [t for t in opened if isinstance(t, _Idle)]
    errors = [e for e in opened if not isinstance(e, _Idle)]
    await asyncio.sleep(hold)
    rss_open = system.rss_bytes(proxy.pid) if proxy.pid else None

    async def check(i: int) -> bool:
        await asyncio.wait_for(tunnels[i].ping(loop), timeout=30)
        return True

    checked = await _bounded(len(tunnels), open_concurrency, check)
    working = sum(1 for c in checked if c is True)
    for t in tunnels:
        if t.transport is not None:
            t.transport.close()
    await asyncio.sleep(2.0)
    rss_after = system.rss_bytes(proxy.pid) if proxy.pid else None
    first_error = f"{type(errors[0]).__name__}: {errors[0]}" if errors else ""
    return IdleResult(
        count, len(tunnels), open_seconds, rss_before, rss_open, rss_after, working, first_error
    )
