"""Plain HTTP served entirely by egressd's front (egressd.front.plain_http on h11): any method,
chunked bodies, Expect: 100-continue, WebSocket upgrades, HTTP/1.0, pooled upstream connections,
and flow control of a large upload through a slow upstream.
Real clients (raw sockets, curl) against real servers on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.egressd_cli import EgressdRun, write_policy
from tests.support.plain_http import POLICY, RawClient, ScriptedServer, _auth, _url


class HandlerServer:
    """127.0.0.1: each connection is given to `handle` (a function of the socket)."""

    def __init__(self, handle: Callable[[socket.socket], None]) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.handle = handle
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            self.handle(conn)

    def close(self) -> None:
        self.sock.close()


def _read_head(conn: socket.socket) -> tuple[bytes, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = conn.recv(65536)
        if not data:
            raise OSError("closed")
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head, rest


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    s = ScriptedServer()
    yield s
    s.close()


def _run(tmp_path: Path, policy: str = POLICY) -> EgressdRun:
    return EgressdRun(["--policy", str(write_policy(tmp_path, policy))]).start()


@pytest.fixture
def run(tmp_path: Path) -> Iterator[EgressdRun]:
    proxy = _run(tmp_path)
    yield proxy
    proxy.stop()


def test_any_method_and_a_chunked_body_are_served_in_the_front(
    run: EgressdRun, server: ScriptedServer
) -> None:
    client = RawClient(run)
    answer = client.get(_url(server, "/dav"), "Depth: 1", method="PROPFIND")
    assert b'"method": "PROPFIND"' in answer
    request = client.request_bytes(_url(server, "/chunked-up"), "Transfer-Encoding: chunked", method="POST")
    client.sock.sendall(request + b"4;ext=1\r\ndata\r\n3\r\nmor\r\n0\r\nX-Trailer: 1\r\n\r\n")
    assert b'"/chunked-up"' in client.response()
    assert server.connections == 1  # one kept-alive upstream connection for both
    head, body = server.requests[-1]
    assert b"transfer-encoding: chunked" in head.lower()
    assert body == b"4\r\ndata\r\n3\r\nmor\r\n0\r\n\r\n"  # re-framed by h11, trailers not forwarded


def test_upstream_connections_are_pooled_per_target(run: EgressdRun, server: ScriptedServer) -> None:
    client = RawClient(run)
    for host in ("127.0.0.1", "localhost", "127.0.0.1", "localhost"):
        assert b"200 OK" in client.get(_url(server, "/p", host=host))
    assert server.connections == 2


def test_http10_client_gets_its_answer_and_the_close(run: EgressdRun, server: ScriptedServer) -> None:
    host, port, auth = _auth(run)
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(f"GET {_url(server, '/old')} HTTP/1.0\r\nProxy-Authorization: {auth}\r\n\r\n".encode())
        answer = b""
        while data := sock.recv(65536):
            answer += data
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'"body": ""}')
    assert f"Host: 127.0.0.1:{server.port}" in server.heads()[0]


def _continue_then_echo(conn: socket.socket) -> None:
    head, rest = _read_head(conn)
    assert b"expect: 100-continue" in head.lower()
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    while len(rest) < length:
        rest += conn.recv(65536)
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(rest), rest))


def test_expect_100_continue_with_curl(run: EgressdRun) -> None:
    upstream = HandlerServer(_continue_then_echo)
    try:
        got = subprocess.run(
            [
                "curl",
                "-sS",
                "-H",
                "Expect: 100-continue",
                "--data-binary",
                "x" * 5000,
                f"http://127.0.0.1:{upstream.port}/",
            ],
            env=run.child_env(),
            capture_output=True,
            timeout=20,
        )
        assert got.stdout == b"x" * 5000, got.stderr
    finally:
        upstream.close()


def _websocket_echo(conn: socket.socket) -> None:
    head, rest = _read_head(conn)
    assert b"upgrade: websocket" in head.lower() and b"connection: upgrade" in head.lower()
    conn.sendall(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\nhello"
    )
    if rest:
        conn.sendall(rest)
    while data := conn.recv(65536):
        conn.sendall(data)


def _upgrade(run: EgressdRun, port: int) -> RawClient:
    client = RawClient(run)
    client.sock.sendall(
        client.request_bytes(
            f"http://127.0.0.1:{port}/ws",
            "Connection: Upgrade",
            "Upgrade: websocket",
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
            "Sec-WebSocket-Version: 13",
        )
        + b"early"
    )
    return client


def test_websocket_upgrade_becomes_a_relay(run: EgressdRun) -> None:
    upstream = HandlerServer(_websocket_echo)
    try:
        client = _upgrade(run, upstream.port)
        while b"helloearly" not in client.buf:
            client._recv()
        assert client.buf.startswith(b"HTTP/1.1 101 ") and b"upgrade: websocket" in client.buf.lower()
        client.sock.sendall(b"\x81\x05frame")
        while not client.buf.endswith(b"\x81\x05frame"):
            client._recv()
    finally:
        upstream.close()


def test_websocket_refused_when_the_policy_says_so(tmp_path: Path) -> None:
    upstream = HandlerServer(_websocket_echo)
    run = _run(tmp_path, POLICY + "websocket: false\n")
    try:
        answer = _upgrade(run, upstream.port).rest()
        assert answer.startswith(b"HTTP/1.1 403 ") and b"X-Egressd-Reason: websocket" in answer
        assert upstream.connections == 0
    finally:
        run.stop()
        upstream.close()


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class _Memory:
    """egressd's RSS when this is made, and the most it reached at the samples since."""

    def __init__(self, run: EgressdRun) -> None:
        assert run.proc is not None
        self.pid = run.proc.pid
        self.before = self.peak = _rss(self.pid)

    def sample(self) -> None:
        self.peak = max(self.peak, _rss(self.pid))

    def grew_less_than(self, limit: int) -> bool:
        return self.peak - self.before < limit


def test_large_upload_through_a_slow_upstream_is_not_buffered(run: EgressdRun) -> None:
    """64 MiB up through an upstream reading ~16 MiB/s: egressd's memory stays flat (flow control
    pauses the child, it does not queue the body)."""
    size = 64 << 20
    received = []

    def slow_sink(conn: socket.socket) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        _, rest = _read_head(conn)
        total = len(rest)
        while total < size:
            data = conn.recv(65536)
            if not data:
                break
            total += len(data)
            time.sleep(0.004)
        received.append(total)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    upstream = HandlerServer(slow_sink)
    memory = _Memory(run)
    try:
        client = RawClient(run)
        head = client.request_bytes(
            f"http://127.0.0.1:{upstream.port}/up", f"Content-Length: {size}", method="PUT"
        )
        client.sock.sendall(head)
        chunk = b"u" * (1 << 20)
        for _ in range(size >> 20):
            client.sock.sendall(chunk)
            memory.sample()
        assert client.response().endswith(b"ok") and received == [size]
    finally:
        upstream.close()
    assert memory.grew_less_than(24 << 20), (memory.before, memory.peak)


def test_large_download_to_a_slow_child_is_not_buffered(run: EgressdRun) -> None:
    """64 MiB down from a fast upstream to a child reading ~16 MiB/s: egressd's memory stays flat
    (a child that reads slowly stops the upstream's reads; egressd does not queue the response),
    and every byte arrives, in order."""
    size = 64 << 20
    block = bytes(range(256)) * 4096  # 1 MiB, each position's byte known

    def fast_source(conn: socket.socket) -> None:
        _read_head(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for _ in range(size >> 20):
            conn.sendall(block)

    upstream = HandlerServer(fast_source)
    memory = _Memory(run)
    try:
        client = RawClient(run)
        client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        client.sock.sendall(client.request_bytes(f"http://127.0.0.1:{upstream.port}/down"))
        while b"\r\n\r\n" not in client.buf:
            client._recv()
        head, _, body = client.buf.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: %d" % size in head, head
        received = len(body)
        intact = body == block[: len(body)]
        while received < size:
            data = client.sock.recv(1 << 16)
            assert data, f"closed after {received} bytes"
            start = received % len(block)
            intact = intact and data == (block + block)[start : start + len(data)]
            received += len(data)
            if received % (1 << 20) < len(data):
                memory.sample()
                time.sleep(0.06)
        assert received == size and intact
    finally:
        upstream.close()
    assert memory.grew_less_than(24 << 20), (memory.before, memory.peak)


def test_a_reloaded_idle_timeout_closes_a_connection_already_idle(
    tmp_path: Path, server: ScriptedServer
) -> None:
    """limits.idle_timeout between requests is the one in force now: a reload that lowers it closes
    a kept-alive connection that was already idle under the old one (the front's sweep reads the
    limits in force each time)."""
    long = "limits: {idle_timeout: 3600, header_timeout: 3600}\n"
    policy = write_policy(tmp_path, POLICY + long)
    with EgressdRun(["--policy", str(policy)]) as proxy:
        client = RawClient(proxy)
        assert b"200 OK" in client.get(_url(server, "/a"))
        policy.write_text(POLICY + "limits: {idle_timeout: 1, header_timeout: 3600}\n")
        client.sock.settimeout(30)
        assert client.sock.recv(1) == b""  # closed by egressd, not by the 30 s deadline
