"""The upstreams every proxy is measured against, all on 127.0.0.1 and all on the load core.

- nginx (one worker): plain HTTP and HTTPS origin (`/small`, 128 bytes; `/big`, the large response)
  and the local npm registry (HTTPS, static packuments and tarballs).
- This module's own server process (`python -m bench.upstream`): a raw-TCP sink for the 1 GiB tunnel
  (the client sends an 8-byte length, then the bytes; the sink answers one byte once it has read them
  all) and an echo server for the idle tunnels.
- The TLS sink for the 1 GiB tunnel: bench/tls_load.c's (C, OpenSSL; it counts the records after the
  first without decrypting them) when it builds, else a thread of the Python server process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import ssl
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from bench import system
from bench.certs import Certs

SMALL_BODY = b"x" * 127 + b"\n"
_BUF = 4 * 1024 * 1024


@dataclass
class Upstreams:
    http_port: int
    https_port: int
    registry_port: int
    sink_port: int
    tls_sink_port: int
    echo_port: int
    certs: Certs
    nginx: subprocess.Popen[bytes]
    servers: subprocess.Popen[bytes]
    nginx_conf: str
    tls_sink: subprocess.Popen[bytes] | None = None  # the C TLS sink; None: the Python one
    tls_load: Path | None = None  # bench/tls_load.c built, when the C sink runs

    @property
    def processes(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in (self.tls_sink, self.servers, self.nginx) if p is not None]

    @property
    def host(self) -> str:
        return "127.0.0.1"

    def stop(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGQUIT if proc is self.nginx else signal.SIGTERM)
        for proc in self.processes:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def nginx_config(
    work: Path, www: Path, registry: Path, certs: Certs, http: int, https: int, reg: int, fds: int
) -> str:
    user = "user root root;\n" if os.geteuid() == 0 else ""
    return f"""{user}worker_processes 1;
pid {work}/nginx.pid;
error_log {work}/nginx-error.log warn;
worker_rlimit_nofile {fds};
events {{ worker_connections {max(1024, fds - 100)}; multi_accept on; }}
http {{
    access_log off;
    sendfile on; tcp_nopush on; tcp_nodelay on;
    keepalive_timeout 600s; keepalive_requests 100000000;
    types {{ application/json json; application/octet-stream tgz; }}
    default_type application/octet-stream;
    server {{
        listen 127.0.0.1:{http} backlog=65535;
        root {www};
    }}
    server {{
        listen 127.0.0.1:{https} ssl backlog=65535;
        ssl_certificate {certs.cert};
        ssl_certificate_key {certs.key};
        root {www};
    }}
    server {{
        listen 127.0.0.1:{reg} ssl backlog=65535;
        ssl_certificate {certs.cert};
        ssl_certificate_key {certs.key};
        root {registry};
        location / {{ try_files $uri $uri/index.json =404; }}
    }}
}}
"""


def start(
    work: Path, certs: Certs, registry: Path, big_bytes: int, cpu: int | None, tls_load: Path | None
) -> Upstreams:
    """tls_load: bench/tls_load.c built (its sink serves TLS), or None (the Python sink does)."""
    www = work / "www"
    www.mkdir(parents=True, exist_ok=True)
    (www / "small").write_bytes(SMALL_BODY)
    with open(www / "big", "wb") as f:  # sparse: the page cache serves zeros, the disk is not read
        f.truncate(big_bytes)
    registry.mkdir(parents=True, exist_ok=True)
    ports = [system.free_port() for _ in range(6)]
    http, https, reg, sink, tls_sink, echo = ports
    conf_text = nginx_config(work, www, registry, certs, http, https, reg, system.fd_limit())
    conf = work / "nginx.conf"
    conf.write_text(conf_text)
    nginx_bin = system.which("nginx") or "nginx"
    argv = [
        nginx_bin,
        "-e",
        str(work / "nginx-error.log"),
        "-p",
        str(work),
        "-c",
        str(conf),
        "-g",
        "daemon off;",
    ]
    nginx = subprocess.Popen(system.pinned(argv, cpu), stdin=subprocess.DEVNULL)
    python_argv = [sys.executable, "-m", "bench.upstream", "--sink", str(sink), "--echo", str(echo)]
    python_argv += ["--cert", str(certs.cert), "--key", str(certs.key)]
    native_sink = None
    if tls_load is not None:
        sink_argv = [str(tls_load), "sink", str(tls_sink), str(certs.cert), str(certs.key)]
        native_sink = subprocess.Popen(system.pinned(sink_argv, cpu), stdin=subprocess.DEVNULL)
    else:
        python_argv += ["--tls-sink", str(tls_sink)]
    servers = subprocess.Popen(
        system.pinned(python_argv, cpu),
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    up = Upstreams(
        http, https, reg, sink, tls_sink, echo, certs, nginx, servers, conf_text, native_sink, tls_load
    )
    try:
        for port, proc in ((http, nginx), (https, nginx), (reg, nginx), (sink, servers), (echo, servers)):
            system.wait_port("127.0.0.1", port, proc=proc)
        system.wait_port("127.0.0.1", tls_sink, proc=native_sink or servers)
    except Exception:
        up.stop()
        raise
    return up


# -- the Python server process ---------------------------------------------------------------------
def _sink_connection(conn: socket.socket, tls: ssl.SSLContext | None) -> None:
    sock: socket.socket = conn
    try:
        if tls is not None:
            sock = tls.wrap_socket(conn, server_side=True)
        header = b""
        while len(header) < 8:
            chunk = sock.recv(8 - len(header))
            if not chunk:
                return
            header += chunk
        (remaining,) = struct.unpack("!Q", header)
        buf = bytearray(_BUF)
        view = memoryview(buf)
        while remaining > 0:
            n = sock.recv_into(view, min(_BUF, remaining))
            if n == 0:
                return
            remaining -= n
        sock.sendall(b"\x01")
        with contextlib.suppress(OSError):
            sock.recv(1)  # wait for the client to close first (no TIME_WAIT here)
    except (OSError, ssl.SSLError):
        pass
    finally:
        with contextlib.suppress(OSError):
            sock.close()


def _sink_server(port: int, tls: ssl.SSLContext | None) -> None:
    listener = socket.create_server(("127.0.0.1", port), backlog=1024)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_sink_connection, args=(conn, tls), daemon=True).start()


SMALL_HEAD = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nContent-Type: text/plain\r\n\r\n" % len(SMALL_BODY)
SMALL_RESPONSE = SMALL_HEAD + SMALL_BODY


class SmallOrigin(asyncio.Protocol):
    """A fast keep-alive origin: `/small`'s 128 bytes for every request head, the connection kept
    unless the request ends it (`Connection: close`, or HTTP/1.0 without keep-alive) — what nginx
    does, at a fraction of the load core's CPU, so the proxy sets the rate."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head, self.buffer = self.buffer[:end].lower(), self.buffer[end + 4 :]
            self.transport.write(SMALL_RESPONSE)  # type: ignore[attr-defined]
            old = head.split(b"\r\n", 1)[0].endswith(b"http/1.0")
            if b"connection: close" in head or (old and b"keep-alive" not in head):
                self.transport.close()
                return


class _Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[attr-defined]


async def _echo_main(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Echo, "127.0.0.1", port, backlog=65535)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    async with server:
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description="the bench's sink and echo upstreams")
    parser.add_argument("--sink", type=int, required=True)
    parser.add_argument("--tls-sink", type=int, help="serve the TLS sink here too (no C one)")
    parser.add_argument("--echo", type=int, required=True)
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    args = parser.parse_args()
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(args.cert, args.key)
    for port, ctx in ((args.sink, None), (args.tls_sink, tls)):
        if port is not None:
            threading.Thread(target=_sink_server, args=(port, ctx), daemon=True).start()
    asyncio.run(_echo_main(args.echo))


def describe(up: Upstreams) -> dict[str, object]:
    return {
        "nginx": {"http": up.http_port, "https": up.https_port, "registry": up.registry_port},
        "python": {"sink": up.sink_port, "echo": up.echo_port},
        "tls_sink": {"port": up.tls_sink_port, "by": "bench/tls_load.c" if up.tls_sink else "python"},
        "nginx.conf": up.nginx_conf,
    }


if __name__ == "__main__":
    main()
