"""Out of file descriptors: every client gets a working tunnel or a status with a reason, never a
bare close, a 500 or a DNS reason, and egressd serves everyone again once the burst is over.

Why: under `prlimit --nofile=256` a burst of 1,000 CONNECTs left 760 clients with a closed socket
and no answer, a cold start answered `500 internal_error` (a module failed to import with EMFILE)
and others were told `dns_timeout`. The real `egressd run` runs under `prlimit --nofile=N:N` (soft
and hard alike, so raising the soft limit cannot help), with a real DNS server and a real echo
server on this machine; the clients are real sockets, all connecting at once.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import resource
import shutil
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.support.audit_log import audit_records
from tests.support.corpus import ProxyClient, tunnel_get
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun, write_policy
from tests.support.upstreams import EchoHTTPServer, RefusingPort, TcpEchoServer

LIMIT = 256  # egressd's descriptors, soft and hard
CLIENTS = 1000
RECOVERY = 60.0  # s: the burst's connections closed and egressd serving all again, at the latest
POLICY = "version: 1\nallow: [up.test]\nprivate: {allow: true}\n"


class _Burst:
    """CLIENTS clients at once; each working tunnel stays open until every client has its answer."""

    def __init__(self, proxy: tuple[str, int], auth: str, target: str, count: int) -> None:
        self.proxy, self.auth, self.target, self.count = proxy, auth, target, count
        self.answered = 0
        self.everyone: asyncio.Event | None = None

    async def run(self) -> Counter[str]:
        self.everyone = asyncio.Event()
        return Counter(await asyncio.gather(*(self._one() for _ in range(self.count))))

    def _answer(self, what: str) -> str:
        self.answered += 1
        if self.answered == self.count:
            assert self.everyone is not None
            self.everyone.set()
        return what

    async def _one(self) -> str:
        """CONNECT, then "ping" through the tunnel: "tunnel", "STATUS reason", "closed" (no answer
        at all) or "broken" (a 200 whose tunnel did not carry the ping)."""
        try:
            reader, writer = await asyncio.open_connection(*self.proxy)
        except OSError as exc:
            return self._answer(f"no-connect {exc.errno}")
        try:
            return await self._exchange(reader, writer)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
        auth = f"Proxy-Authorization: Basic {self.auth}\r\n"
        writer.write(f"CONNECT {self.target} HTTP/1.1\r\nHost: {self.target}\r\n{auth}\r\n".encode())
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
        except (asyncio.IncompleteReadError, ConnectionError):
            return self._answer("closed")
        lines = head.decode("latin-1").split("\r\n")
        if lines[0].split(" ")[1] != "200":
            reasons = [
                line.split(":", 1)[1].strip()
                for line in lines
                if line.lower().startswith("x-egressd-reason:")
            ]
            return self._answer(f"{lines[0].split(' ')[1]} {reasons[0] if reasons else '-'}")
        writer.write(b"ping")
        try:
            if await asyncio.wait_for(reader.readexactly(4), 30) != b"ping":
                return self._answer("broken")
        except (asyncio.IncompleteReadError, ConnectionError):
            return self._answer("broken")
        self._answer("tunnel")
        assert self.everyone is not None
        await asyncio.wait_for(self.everyone.wait(), 120)
        return "tunnel"


@pytest.fixture
def many_files() -> None:
    """This test process holds CLIENTS sockets at once."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < CLIENTS + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, CLIENTS * 4), hard))


def test_a_burst_beyond_the_descriptor_limit_is_answered_and_recovers(
    tmp_path: Path, dns: DnsServer, many_files: None
) -> None:
    with TcpEchoServer("127.0.0.1") as echo:
        dns.add("up.test", "127.0.0.1")
        policy = write_policy(tmp_path, POLICY)
        audit = tmp_path / "audit.jsonl"
        options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(audit)]
        prlimit = shutil.which("prlimit")
        assert prlimit is not None, "prlimit (util-linux) is needed"
        with EgressdRun(options, wrapper=[prlimit, f"--nofile={LIMIT}:{LIMIT}", "--"]) as run:
            url = urlsplit(run.proxy_url)
            assert url.hostname is not None and url.port is not None
            proxy = (url.hostname, url.port)
            auth = base64.b64encode(f"{url.username}:{url.password}".encode()).decode()
            target = f"up.test:{echo.address[1]}"
            got = asyncio.run(_Burst(proxy, auth, target, CLIENTS).run())
            # every client: a working tunnel, or 503 overloaded (egressd at capacity)
            assert set(got) <= {"tunnel", "503 overloaded"}, got
            assert got["tunnel"] >= 50, got  # egressd did serve while at its limit
            # the burst is over: everyone is served again, a few at once, once egressd has closed
            # the burst's connections (a loaded machine runs egressd late: polled, with a deadline)
            deadline = time.monotonic() + RECOVERY
            while (again := asyncio.run(_Burst(proxy, auth, target, 20).run())) != Counter({"tunnel": 20}):
                assert set(again) <= {"tunnel", "503 overloaded"}, again
                assert time.monotonic() < deadline, again
                time.sleep(0.5)
            stderr = run.stderr
        assert "Traceback" not in stderr and "internal error" not in stderr, stderr[-3000:]
    reasons = Counter(r.get("reason") for r in audit_records(audit) if r.get("decision") == "deny")
    assert set(reasons) <= {"overloaded"}, reasons


def test_max_connections_counts_before_a_descriptor_is_taken(
    tmp_path: Path, dns: DnsServer, many_files: None
) -> None:
    """limits.max_connections 5 and 40 CONNECTs at once, each decided while the others' lookups are
    in flight: 5 tunnels, the rest 429, and the upstream never sees a sixth connection."""
    with TcpEchoServer("127.0.0.1") as echo:
        dns.add("up.test", "127.0.0.1", delay=0.3)  # every lookup overlaps the others
        policy = write_policy(tmp_path, POLICY + "limits: {max_connections: 5}\n")
        with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]) as run:
            url = urlsplit(run.proxy_url)
            assert url.hostname is not None and url.port is not None
            auth = base64.b64encode(f"{url.username}:{url.password}".encode()).decode()
            target = f"up.test:{echo.address[1]}"
            got = asyncio.run(_Burst((url.hostname, url.port), auth, target, 40).run())
        assert got == Counter({"tunnel": 5, "429 connection_limit": 35}), got
        assert echo.connections == 5


def _imports(stderr: str) -> list[str]:
    """The modules `python -X importtime` listed, in order."""
    return [
        line.rsplit("|", 1)[1].strip()
        for line in stderr.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    ]


def test_the_paths_of_a_request_import_nothing_after_start(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once egressd has started (and settled), a CONNECT, a plain-HTTP request, a SOCKS5 connect,
    a name that does not resolve and a refused port import no module: an import at first use can
    meet a process out of descriptors (EMFILE), and then the request failed with a traceback."""
    dns.add("up.test", upstream.host)
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")  # -X importtime for egressd's interpreter
    policy = write_policy(tmp_path, "version: 1\nallow: [up.test, missing.test, 198.51.100.0/24]\n")
    with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]) as run:
        settled = len(_imports(run.stderr))
        deadline = time.monotonic() + 20
        while True:  # the start-up's own loading (in a thread while a child would start) is over
            time.sleep(1.0)
            now = len(_imports(run.stderr))
            if now == settled or time.monotonic() > deadline:
                break
            settled = now
        client = ProxyClient.from_env(run.env)
        with client.connect(f"up.test:{upstream.port}") as (answer, sock):
            assert answer is not None and answer.status == 200
            assert tunnel_get(sock, f"up.test:{upstream.port}") is not None
        response = client.get(f"http://up.test:{upstream.port}/plain")
        assert response is not None and response.status == 200
        with client.socks5("up.test", upstream.port) as (code, _):
            assert code == 0
        response = client.get("http://missing.test/")
        assert response is not None and response.reason == "dns_error"
        with RefusingPort(upstream.host) as closed:
            response = client.get(f"http://up.test:{closed.port}/")
        assert response is not None and response.reason == "connect_refused"
        late = _imports(run.stderr)[settled:]
    assert late == [], late
