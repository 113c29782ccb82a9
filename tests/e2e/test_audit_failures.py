"""The audit log when it cannot be written: a full disk, a FIFO whose reader stops reading.

A decision acted upon always has its record, or egressd refuses (`audit.on_failure: refuse`, the
default): every request a client got an answer for from upstream has its records in the file.
Under `continue` every record that could not be written is counted, exactly. Recording resumes
when the sink works again, with no torn line and nothing out of order. All through the real
`egressd run --audit`, real clients and a real upstream.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.attempts import wait_until
from tests.support.audit_log import audit_records
from tests.support.audit_reading import get, whole_lines
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import TEST_POLICY, EgressdRun, write_policy
from tests.support.filesystems import fill_up, small_tmpfs
from tests.support.upstreams import EchoHTTPServer, EchoHTTPSServer, TcpEchoServer

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="mounting a tmpfs (a real full filesystem) needs root"
)

# the records one plain-HTTP request on its own client connection makes: its decision, its
# upstream connection, and the client connection's end
RECORDS_PER_REQUEST = 3


def tunnel(proxy: str, target: str, timeout: float = 15) -> int:
    """The status egressd answers a CONNECT with; through an open tunnel, one GET is answered."""
    url = urllib.parse.urlsplit(proxy)
    auth = base64.b64encode(f"{url.username}:{url.password}".encode()).decode()
    assert url.hostname is not None and url.port is not None
    with socket.create_connection((url.hostname, url.port), timeout=timeout) as sock:
        head = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: Basic {auth}\r\n\r\n"
        sock.sendall(head.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(4096)
            assert chunk, f"egressd closed the CONNECT without an answer: {head!r}"
            head += chunk
        status = int(head.split(b" ", 2)[1])
        if status == 200:
            sock.sendall(f"GET /tunnel HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n".encode())
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
            assert answer.startswith(b"HTTP/1.0 200") or answer.startswith(b"HTTP/1.1 200"), answer[:80]
        return status


def audit_policy(directory: Path, audit: str = "") -> Path:
    """The test policy, with an `audit:` section when given (`{on_failure: continue}`)."""
    return write_policy(directory, TEST_POLICY + (f"audit: {audit}\n" if audit else ""))


def served_records(records: list[dict[str, Any]], path: str) -> list[dict[str, Any]]:
    """The allowed request records of `path` and the allowed connection records of their conns."""
    asked = [r for r in records if r.get("stage") == "request" and r.get("path") == path]
    conns = {r["conn"] for r in asked if r["decision"] == "allow"}
    opened = [r for r in records if r.get("stage") == "connection" and r.get("conn") in conns]
    return [r for r in asked if r["decision"] == "allow"] + [r for r in opened if r["decision"] == "allow"]


def dropped_counts(records: list[dict[str, Any]]) -> int:
    """The records the audit_dropped records say were lost."""
    return sum(int(r["count"]) for r in records if r.get("event") == "audit_dropped")


def accounted(records: list[dict[str, Any]]) -> int:
    """Records of requests written plus records counted as lost (the start's record of the policy
    in force is written before any request, while the log still takes records)."""
    written = [r for r in records if r.get("event") not in ("audit_dropped", "policy")]
    return len(written) + dropped_counts(records)


def metric(stderr: str, name: str) -> float:
    """A sample of `egressd run --metrics`'s endpoint (its URL is on stderr)."""
    found = re.search(r"metrics on (http://\S+)", stderr)
    assert found is not None, stderr
    text = urllib.request.urlopen(found.group(1), timeout=10).read().decode()
    value = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert value is not None, text
    return float(value.group(1))


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "fs", 256 * 1024) as fs:
        yield fs


@needs_root
def test_full_disk_refuse_serves_nothing_without_its_record(
    tmp_path: Path, full_disk: Path, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    """Needs root: it mounts a small tmpfs, the only way to get a real full filesystem here.

    With the disk full every request and CONNECT is refused with `audit_unavailable` (503, the
    reason in X-Egressd-Reason and Proxy-Status); each one served (200) has its request and
    connection records. Once space returns egressd records and serves again, says how many
    records it lost, and the file holds no torn line."""
    audit = full_disk / "audit.jsonl"
    dns.add("up.test", upstream.host)
    base = f"http://up.test:{upstream.port}"
    options = ["--policy", str(audit_policy(tmp_path)), "--nameserver", dns.nameserver, "--audit", str(audit)]
    outcomes: dict[str, tuple[int, str | None]] = {}
    with EgressdRun(options) as run:
        for i in range(5):
            outcomes[f"/before/{i}"] = get(run.proxy_url, f"{base}/before/{i}")
        filler = fill_up(full_disk)
        for i in range(60):  # the audit file's last page still takes a few records, then none
            outcomes[f"/full/{i}"] = get(run.proxy_url, f"{base}/full/{i}")
        refused = [p for p, (status, reason) in outcomes.items() if reason == "audit_unavailable"]
        assert refused and all(outcomes[p][0] == 503 for p in refused), outcomes
        assert outcomes["/full/59"] == (503, "audit_unavailable"), outcomes
        assert tunnel(run.proxy_url, f"up.test:{upstream.port}") == 503  # tunnels alike
        filler.unlink()
        wait_until(lambda: get(run.proxy_url, f"{base}/again")[0] == 200, "served again once space returned")
        for i in range(5):
            outcomes[f"/after/{i}"] = get(run.proxy_url, f"{base}/after/{i}")
        assert tunnel(run.proxy_url, f"up.test:{upstream.port}") == 200
        assert run.stop() == 0
    assert all(outcomes[f"/before/{i}"][0] == 200 and outcomes[f"/after/{i}"][0] == 200 for i in range(5))
    assert set(status for status, _ in outcomes.values()) <= {200, 503}, outcomes
    text = audit.read_text()
    whole_lines(text)
    records = audit_records(audit)
    for path, (status, _) in outcomes.items():
        if status == 200:  # served: its decision and its upstream connection are both on record
            assert len(served_records(records, path)) == 2, (path, served_records(records, path))
    served = [p for p, (status, _) in outcomes.items() if status == 200]
    allowed = [r for r in records if r.get("stage") == "request" and r["decision"] == "allow"]
    assert len(allowed) >= len(served)
    assert dropped_counts(records) >= len(refused)  # each refused request's records were lost, counted
    # the one tunnel served (after space returned) has its connection record
    requested = {r["conn"] for r in records if r.get("stage") == "request"}
    opened = [r for r in records if r.get("stage") == "connection" and r["decision"] == "allow"]
    assert len([r for r in opened if r["conn"] not in requested]) == 1


def open_tunnel(proxy: str, target: str) -> socket.socket:
    """A CONNECT tunnel through the proxy, answered 200, left open."""
    url = urllib.parse.urlsplit(proxy)
    assert url.hostname is not None and url.port is not None
    auth = base64.b64encode(f"{url.username}:{url.password}".encode()).decode()
    sock = socket.create_connection((url.hostname, url.port), timeout=15)
    sock.sendall(
        f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: Basic {auth}\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def inspected(run: EgressdRun, host: str, port: int) -> http.client.HTTPSConnection:
    """A kept-alive HTTPS connection through egressd's inspection (trusting its CA)."""
    url = urllib.parse.urlsplit(run.proxy_url)
    assert url.hostname is not None and url.port is not None
    auth = base64.b64encode(f"{url.username}:{url.password}".encode()).decode()
    context = ssl.create_default_context(cafile=run.env["SSL_CERT_FILE"])
    conn = http.client.HTTPSConnection(url.hostname, url.port, context=context, timeout=15)
    conn.set_tunnel(host, port, headers={"Proxy-Authorization": f"Basic {auth}"})
    return conn


def inner_get(conn: http.client.HTTPSConnection, path: str) -> tuple[int, str | None]:
    conn.request("GET", path)
    response = conn.getresponse()
    response.read()
    return response.status, response.getheader("X-Egressd-Reason")


@needs_root
def test_full_disk_refuse_keeps_open_tunnels_and_refuses_what_they_cannot_record(
    tmp_path: Path,
    full_disk: Path,
    dns: DnsServer,
    upstream: EchoHTTPServer,
    upstream_tls: EchoHTTPSServer,
    tcp_echo: TcpEchoServer,
    ca_file: Path,
) -> None:
    """Needs root: it mounts a small tmpfs, the only way to get a real full filesystem here.

    A tunnel open before the disk filled goes on relaying (nothing of it is recorded while it
    relays); a request inside an inspected tunnel has a record of its own, and is refused with
    audit_unavailable while that record cannot be written."""
    audit = full_disk / "audit.jsonl"
    dns.add("up.test", upstream_tls.host)
    dns.add("other.test", upstream.host)
    plain = f"http://other.test:{upstream.port}"
    policy = write_policy(tmp_path, TEST_POLICY + "inspect: [up.test]\n")
    options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(audit)]
    with EgressdRun([*options, "--upstream-ca", str(ca_file)]) as run:
        relay = open_tunnel(run.proxy_url, f"{tcp_echo.host}:{tcp_echo.port}")
        relay.sendall(b"before")
        assert relay.recv(100) == b"before"
        conn = inspected(run, "up.test", upstream_tls.port)
        assert inner_get(conn, "/inner/before") == (200, None)
        filler = fill_up(full_disk)
        for i in range(40):  # the audit file's last page still takes a few records, then none
            if get(run.proxy_url, f"{plain}/fill/{i}")[1] == "audit_unavailable":
                break
        relay.sendall(b"while full")  # the open tunnel was not closed
        assert relay.recv(100) == b"while full"
        assert inner_get(conn, "/inner/full") == (503, "audit_unavailable")
        conn.close()
        filler.unlink()
        wait_until(
            lambda: get(run.proxy_url, f"{plain}/again")[0] == 200,
            "served again once space returned",
        )
        conn = inspected(run, "up.test", upstream_tls.port)
        assert inner_get(conn, "/inner/after") == (200, None)
        conn.close()
        relay.close()
    records = audit_records(audit)
    inner = {
        r["path"]: r["decision"] for r in records if r.get("stage") == "request" and "/inner/" in r["path"]
    }
    assert inner.get("/inner/before") == inner.get("/inner/after") == "allow"
    assert inner.get("/inner/full") != "allow"
    assert [r["path"] for r in upstream_tls.requests if r["path"].startswith("/inner/")] == [
        "/inner/before",
        "/inner/after",
    ]


@needs_root
def test_full_disk_continue_counts_every_dropped_record(
    tmp_path: Path, full_disk: Path, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    """Needs root: it mounts a small tmpfs, the only way to get a real full filesystem here.

    Under `continue` every request is served; what the full disk did not take is counted
    exactly: written + counted in audit_dropped records = every record, and the metric and the
    stderr line say the same number. Once space returns recording resumes without a torn line."""
    audit = full_disk / "audit.jsonl"
    dns.add("up.test", upstream.host)
    base = f"http://up.test:{upstream.port}"
    policy = audit_policy(tmp_path, "{on_failure: continue}")
    options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(audit)]
    options += ["--metrics", "127.0.0.1:0"]
    requests = 0
    with EgressdRun(options) as run:
        for i in range(5):
            assert get(run.proxy_url, f"{base}/before/{i}")[0] == 200
        requests += 5
        filler = fill_up(full_disk)
        for i in range(40):
            assert get(run.proxy_url, f"{base}/full/{i}") == (200, None)
        requests += 40
        assert run.wait_for_stderr("records not written since the last report"), run.stderr
        lost_so_far = metric(run.stderr, "egressd_audit_records_dropped_total")
        assert lost_so_far > 0
        filler.unlink()
        wait_until(lambda: metric(run.stderr, "egressd_audit_writable") == 1, "writable once space returned")
        for i in range(5):
            assert get(run.proxy_url, f"{base}/after/{i}")[0] == 200
        requests += 5
        # the closed records of the last connections are written as they end
        wait_until(
            lambda: accounted(audit_records(audit)) >= RECORDS_PER_REQUEST * requests,
            "every record written or counted",
        )
        lost = metric(run.stderr, "egressd_audit_records_dropped_total")
        failing_lines = [line for line in run.stderr.splitlines() if line.startswith("egressd: audit:")]
        assert len(failing_lines) == 1, failing_lines  # at most one line a minute
        assert run.stop() == 0
    whole_lines(audit.read_text())
    records = audit_records(audit)
    counted = dropped_counts(records)
    assert accounted(records) == RECORDS_PER_REQUEST * requests, (counted, requests)
    assert counted == lost > 0
    assert re.search(rf"\b{int(lost)} in all\b", run.stderr), run.stderr  # the last stderr line
    for i in range(5):
        assert len(served_records(records, f"/after/{i}")) == 2


class FifoReader:
    """The reader of a FIFO (a log shipper): reads lines until told to stop, then holds the FIFO
    open without reading, until told to go on."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path, 0o600)
        self.path = path
        self.lines: list[str] = []
        self.reading = threading.Event()
        self.reading.set()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        rest = b""
        with open(self.path, "rb", buffering=0) as fifo:
            while True:
                self.reading.wait()
                chunk = fifo.read(4096)
                if not chunk:
                    break
                rest += chunk
                *lines, rest = rest.split(b"\n")
                self.lines.extend(line.decode() for line in lines)
        if rest:
            self.lines.append(rest.decode() + "<torn>")

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.lines]

    def join(self, timeout: float = 30) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "egressd never closed the FIFO"


def test_fifo_reader_stops_refuse(tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer) -> None:
    """A FIFO whose reader stops reading: egressd keeps answering (no client waits forever); once
    the pipe and the queue are full it refuses with audit_unavailable, and everything it served is
    recorded, whole and in order, when the reader reads again."""
    fifo = FifoReader(tmp_path / "audit.fifo")
    dns.add("up.test", upstream.host)
    base = f"http://up.test:{upstream.port}"
    policy = audit_policy(tmp_path, "{max_queue_bytes: 16384}")
    options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(fifo.path)]
    served: list[str] = []
    with EgressdRun(options) as run:
        for i in range(3):
            assert get(run.proxy_url, f"{base}/before/{i}")[0] == 200
            served.append(f"/before/{i}")
        wait_until(lambda: len(fifo.lines) >= 6, "the first records read")
        fifo.reading.clear()
        time.sleep(0.2)  # the reader is parked (it may take one more read)
        refused = 0
        for i in range(400):  # 64 KiB of pipe and 16 KiB of queue: about 80 requests' records
            status, reason = get(run.proxy_url, f"{base}/stalled/{i}")
            if status == 200:
                served.append(f"/stalled/{i}")
            else:
                assert (status, reason) == (503, "audit_unavailable")
                refused += 1
                if refused == 5:
                    break
        assert refused == 5, "the queue never reached its bound"
        fifo.reading.set()
        wait_until(
            lambda: get(run.proxy_url, f"{base}/after")[0] == 200, "served again once the reader reads"
        )
        served.append("/after")
        assert run.stop() == 0
    fifo.join()
    assert not any(line.endswith("<torn>") for line in fifo.lines)
    records = fifo.records()
    for path in served:
        assert len(served_records(records, path)) == 2, path
    order = [r["path"] for r in records if r.get("stage") == "request" and r["decision"] == "allow"]
    assert [p for p in order if p in served] == served  # in the order they were served


def test_fifo_reader_stops_continue_counts_exactly(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    """Under `continue` a reader that stops reading costs records, never service: every request
    is served at once, and records written + records counted as dropped = every record."""
    fifo = FifoReader(tmp_path / "audit.fifo")
    dns.add("up.test", upstream.host)
    base = f"http://up.test:{upstream.port}"
    policy = audit_policy(tmp_path, "{on_failure: continue, max_queue_bytes: 16384}")
    options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(fifo.path)]
    requests = 0
    with EgressdRun(options) as run:
        assert get(run.proxy_url, f"{base}/before")[0] == 200
        requests += 1
        wait_until(lambda: len(fifo.lines) >= 2, "the first records read")
        fifo.reading.clear()
        time.sleep(0.2)
        for i in range(200):  # more than the pipe and the queue hold
            assert get(run.proxy_url, f"{base}/stalled/{i}") == (200, None)
        requests += 200
        assert run.wait_for_stderr("is not being read"), run.stderr
        fifo.reading.set()
        wait_until(lambda: dropped_counts(fifo.records()) > 0, "the audit_dropped record")
        assert get(run.proxy_url, f"{base}/after")[0] == 200
        requests += 1
        assert run.stop() == 0
    fifo.join()
    assert not any(line.endswith("<torn>") for line in fifo.lines)
    records = fifo.records()
    assert dropped_counts(records) > 0
    assert accounted(records) == RECORDS_PER_REQUEST * requests
    assert len(served_records(records, "/after")) == 2
