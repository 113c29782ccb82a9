"""The client of the sandbox workloads, run as the child of each wrapper (egressd exec, egressd sandbox,
srt): it finds its proxy in HTTP_PROXY (credentials included), measures, and prints one line
`SANDBOX_RESULT {json}` on stdout.

    python -m bench.sandbox_client download HOST PORT PATH
    python -m bench.sandbox_client setup HOST PORT CONCURRENCY WARMUP SECONDS [CONNECT_LOAD_BINARY]
    python -m bench.sandbox_client latency HOST PORT SAMPLES WARMUP

- download: one CONNECT tunnel, `GET PATH` over plain HTTP inside it, the whole body read; MiB/s from
  the request sent to the last byte.
- setup: CONNECT + `GET /small` + close in a closed loop per connection (bench/connect_load.c when
  given, else the Python generator), tunnels/s in the window, time to tunnel p50/p99.
- latency: SAMPLES CONNECTs back to back (concurrency 1), socket() to the proxy's 2xx, p50/p99.

NO_PROXY is ignored on purpose (srt sets it to loopback): every connection goes through the proxy.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from bench import loadgen
from bench.peers import Proxy

RESULT = "SANDBOX_RESULT "


def proxy_from_env() -> Proxy:
    url = os.environ.get("HTTP_PROXY") or os.environ.get("http_proxy") or ""
    parts = urlsplit(url)
    if not parts.hostname or not parts.port:
        raise SystemExit(f"sandbox_client: no usable HTTP_PROXY ({url!r})")
    auth = None
    if parts.username is not None:
        user, password = unquote(parts.username), unquote(parts.password or "")
        auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    # an address literal: the C generator takes one (srt names the proxy `localhost`)
    host = socket.gethostbyname(parts.hostname)
    return Proxy("inside", parts.port, auth=auth, url=url, host=host)


def _pct(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))]


def download(proxy: Proxy, host: str, port: int, path: str) -> dict[str, Any]:
    sock = loadgen.open_tunnel(proxy, host, port, timeout=600)
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    try:
        t0 = time.perf_counter()
        sock.sendall(loadgen.small_get(host, port, path))
        head = b""
        while b"\r\n\r\n" not in head:
            n = sock.recv_into(view)
            if not n:
                raise loadgen.ProxyError(f"closed before the response head: {head[:80]!r}")
            head += bytes(view[:n])
        end = head.index(b"\r\n\r\n") + 4
        if head[9:12] != b"200":
            raise loadgen.ProxyError(f"GET {path}: {head.splitlines()[0]!r}")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head[:end].split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        got = len(head) - end
        while got < length:
            n = sock.recv_into(view)
            if not n:
                raise loadgen.ProxyError(f"closed after {got} of {length} bytes")
            got += n
        seconds = time.perf_counter() - t0
    finally:
        sock.close()
    return {"bytes": got, "seconds": seconds}


def setup(
    proxy: Proxy, host: str, port: int, concurrency: int, warmup: float, seconds: float, binary: str
) -> dict[str, Any]:
    size = {"concurrency": concurrency, "seconds": seconds, "warmup": warmup}
    if binary:
        r = loadgen.connect_load_native(Path(binary), proxy, host, port, **size)
    else:
        r = loadgen.run_async(loadgen.connect_load(proxy, host, port, **size))
    out: dict[str, Any] = {"ops": r.ops, "seconds": r.seconds, "errors": r.errors, "error": r.first_error}
    if r.latencies:
        out["p50"], out["p99"] = _pct(r.latencies, 50), _pct(r.latencies, 99)
    return out


def latency(proxy: Proxy, host: str, port: int, samples: int, warmup: float) -> dict[str, Any]:
    r = loadgen.run_async(
        loadgen.connect_load(proxy, host, port, concurrency=1, samples=samples, warmup=warmup)
    )
    if not r.latencies:
        raise loadgen.ProxyError(f"no CONNECT completed ({r.errors} errors: {r.first_error})")
    return {
        "samples": len(r.latencies),
        "errors": r.errors,
        "error": r.first_error,
        "p50": _pct(r.latencies, 50),
        "p99": _pct(r.latencies, 99),
    }


def main(argv: list[str]) -> int:
    mode, host, port, *rest = argv
    proxy = proxy_from_env()
    if mode == "download":
        result = download(proxy, host, int(port), rest[0])
    elif mode == "setup":
        conc, warmup, seconds = int(rest[0]), float(rest[1]), float(rest[2])
        result = setup(proxy, host, int(port), conc, warmup, seconds, rest[3] if len(rest) > 3 else "")
    elif mode == "latency":
        result = latency(proxy, host, int(port), int(rest[0]), float(rest[1]))
    else:
        raise SystemExit(f"sandbox_client: unknown mode {mode!r}")
    print(RESULT + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
