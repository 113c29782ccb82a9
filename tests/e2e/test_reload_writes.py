"""Files rewritten in place while egressd runs: applied whole or not at all.

Why: editors, shell scripts and config management often rewrite a file in place (truncate, then
write a line or a block at a time). egressd reads its policy and the gateway's token file while they
run, so it can catch such a file half written. Every case here goes through the real `egressd run`
with 50 concurrent clients while a writer rewrites the file in place; both versions deny
`deny.common.test` (a `deny:` rule at the end of the file, where a half-written file has none yet),
and that host must never be admitted. The last version written must be in force shortly after the
last write.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from egressd.admission.tokens import TokenEntry, TokenTable, make_entry, new_token
from tests.support import netns
from tests.support.attempts import wait_until
from tests.support.corpus import ProxyClient
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun, GatewayRun
from tests.support.upstreams import EchoHTTPServer, free_port

CLIENTS = 50
WRITING = 6.0  # seconds of rewrites: about a dozen of the watcher's polls
DENIED = "deny.common.test"
ALLOWED = "ok.common.test"


def policy_text(only: str, padding: int = 400) -> str:
    """A policy of about 12 KiB (several 4 KiB writes): `common.test` allowed, `only` allowed in
    this version alone, and the deny rule of `deny.common.test` on the file's last line."""
    lines = ["version: 1", "mode: enforce", "allow:", "  - common.test", "  - 198.51.100.0/24", f"  - {only}"]
    lines += [f"  - pad{i:04}.common.test" for i in range(padding)]
    lines += ["deny:", f"  - {DENIED}"]
    return "\n".join(lines) + "\n"


def write_lines(path: Path, text: str) -> None:
    """In place, one write() per line, as a shell script's echo lines write."""
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        for line in text.splitlines(keepends=True):
            os.write(fd, line.encode())
            time.sleep(0.0003)
    finally:
        os.close(fd)


def write_chunks(path: Path, text: str) -> None:
    """In place, in 4 KiB writes a few milliseconds apart."""
    data = text.encode()
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        for start in range(0, len(data), 4096):
            os.write(fd, data[start : start + 4096])
            time.sleep(0.005)
    finally:
        os.close(fd)


WRITERS: dict[str, Callable[[Path, str], None]] = {"lines": write_lines, "chunks": write_chunks}


def rewrite_for(
    path: Path, versions: Sequence[str], write: Callable[[Path, str], None], seconds: float
) -> None:
    """Rewrite `path` in place, the versions in turn, a few tens of milliseconds apart, for
    `seconds`; the last write is the last version."""
    deadline = time.monotonic() + seconds
    turn = 0
    while time.monotonic() < deadline:
        write(path, versions[turn % len(versions)])
        turn += 1
        time.sleep(random.uniform(0.02, 0.1))
    write(path, versions[-1])


class Clients:
    """`count` concurrent clients on their own event loop (a thread), each asking its `ask` in
    turn, again and again, until stop(); `results` counts (label, answer) pairs (None: the
    connection ended without an HTTP answer)."""

    def __init__(
        self, asks: Sequence[tuple[str, Callable[[], bytes]]], address: tuple[str, int], count: int
    ) -> None:
        self.asks = asks
        self.address = address
        self.count = count
        self.results: collections.Counter[tuple[str, int | None]] = collections.Counter()
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self) -> Clients:
        self._thread.start()
        return self

    def stop(self) -> collections.Counter[tuple[str, int | None]]:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "the clients did not stop"
        return self.take()

    def take(self) -> collections.Counter[tuple[str, int | None]]:
        """The answers so far, and start counting afresh."""
        with self.lock:
            taken, self.results = self.results, collections.Counter()
        return taken

    async def _main(self) -> None:
        await asyncio.gather(*(self._client(i) for i in range(self.count)))

    async def _client(self, index: int) -> None:
        turn = index
        while not self._stop.is_set():
            label, request = self.asks[turn % len(self.asks)]
            turn += 1
            status = await self._ask(request())
            with self.lock:
                self.results[(label, status)] += 1

    async def _ask(self, raw: bytes) -> int | None:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(*self.address), 20)
        except (OSError, TimeoutError):
            return None
        try:
            writer.write(raw)
            line = await asyncio.wait_for(reader.readline(), 30)
            return int(line.split()[1]) if line.startswith(b"HTTP/1.1 ") else None
        except (OSError, TimeoutError, ValueError, IndexError):
            return None
        finally:
            writer.close()


def basic(name: str, token: str) -> bytes:
    return b"Proxy-Authorization: Basic " + base64.b64encode(f"{name}:{token}".encode()) + b"\r\n"


def connect_request(target: str, auth: bytes) -> Callable[[], bytes]:
    return lambda: f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n".encode() + auth + b"\r\n"


def get_request(url: str, auth: bytes) -> Callable[[], bytes]:
    return lambda: f"GET {url} HTTP/1.1\r\nConnection: close\r\n".encode() + auth + b"\r\n"


@pytest.fixture
def servers(dns: DnsServer) -> Iterator[tuple[EchoHTTPServer, EchoHTTPServer]]:
    """The upstream of the allowed names, and a separate one that only the denied name resolves
    to: its connection count proves the denied host was never reached."""
    with (
        EchoHTTPServer(netns.UPSTREAM_V4[5], name="allowed") as allowed,
        EchoHTTPServer(netns.UPSTREAM_V4[6], name="denied") as denied,
    ):
        for name in (ALLOWED, "only-a.test", "only-b.test"):
            dns.add(name, allowed.host)
        dns.add(DENIED, denied.host)
        yield allowed, denied


def status(client: ProxyClient, target: str) -> int | None:
    with client.connect(target) as (answer, _sock):
        return answer.status if answer is not None else None


@pytest.mark.parametrize(
    ("writer", "same", "merged"),
    [("lines", False, False), ("chunks", False, False), ("chunks", True, False), ("chunks", False, True)],
    ids=["line-by-line", "4KiB-chunks", "same-content", "merged-file"],
)
def test_policy_rewritten_in_place_is_applied_whole(
    tmp_path: Path,
    dns: DnsServer,
    servers: tuple[EchoHTTPServer, EchoHTTPServer],
    writer: str,
    same: bool,
    merged: bool,
) -> None:
    """`merged`: the file rewritten is the second of `--policy A --policy B`."""
    allowed, denied = servers
    first, second = policy_text("only-a.test"), policy_text("only-b.test")
    versions = [second] if same else [first, second]
    policy = tmp_path / "policy.yaml"
    policy.write_text(versions[0])
    options = ["--policy", str(policy), "--nameserver", dns.nameserver]
    if merged:
        base = tmp_path / "base.yaml"
        base.write_text("version: 1\nmode: enforce\nallow: [198.51.100.0/24]\n")
        options[:2] = ["--policy", str(base), "--policy", str(policy)]
    with EgressdRun(options) as run:
        proxy = ProxyClient.from_env(run.env)
        auth = proxy.auth_header
        asks = [
            ("denied", connect_request(f"{DENIED}:{denied.port}", auth)),
            ("allowed", connect_request(f"{ALLOWED}:{allowed.port}", auth)),
        ]
        clients = Clients(asks, (proxy.host, proxy.port), CLIENTS).start()
        try:
            rewrite_for(policy, versions, WRITERS[writer], WRITING)
            last_write = time.monotonic()
            wait_until(
                lambda: (
                    status(proxy, f"only-b.test:{allowed.port}") == 200
                    and status(proxy, f"only-a.test:{allowed.port}") == 403
                ),
                "the last version in force",
            )
            print(f"last version in force {time.monotonic() - last_write:.2f} s after the last write")
        finally:
            results = clients.stop()
        print(dict(results))
        assert results[("denied", 200)] == 0, results
        assert denied.connections == 0
        assert results[("denied", 403)] > 100 and results[("allowed", 200)] > 100, results
        # a file being written is neither applied nor reported broken
        assert "reload failed" not in run.stderr, run.stderr


def token_file(entries: Sequence[TokenEntry], padding: int = 60) -> str:
    """The token file of these clients and `padding` more: about 10 KiB."""
    table = TokenTable.empty()
    for entry in [*entries, *(make_entry(f"pad{i:02}", new_token()) for i in range(padding))]:
        table = table.with_entry(entry)
    return json.dumps(table.to_data(), indent=1, sort_keys=True) + "\n"


def test_token_file_rewritten_in_place_is_applied_whole(
    tmp_path: Path, dns: DnsServer, servers: tuple[EchoHTTPServer, EchoHTTPServer]
) -> None:
    """Clients `gone` (first version only) and `new` (second only) while the file is rewritten in
    place: `keep` (in both) is always served, every request gets an HTTP answer (a request in flight
    when its token goes is answered 407, never cut without one), and once the last version is in
    force `gone` is refused and `new` served."""
    allowed, _ = servers
    tokens = {name: new_token() for name in ("keep", "gone", "new")}
    entry = {name: make_entry(name, token) for name, token in tokens.items()}
    first = token_file([entry["keep"], entry["gone"]])
    second = token_file([entry["keep"], entry["new"]])
    path = tmp_path / "gw" / "tokens.json"
    path.parent.mkdir(mode=0o700)
    path.write_text(first)
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text("only-a.test", padding=0))
    options = ["--gateway", "--listen", f"127.0.0.1:{free_port()}", "--tokens", str(path)]
    options += ["--policy", str(policy), "--nameserver", dns.nameserver]
    url = f"http://{ALLOWED}:{allowed.port}/slow?s=0.05"  # answers take a while: some are in flight
    with GatewayRun(options) as run:
        asks = [(name, get_request(url, basic(name, token))) for name, token in tokens.items()]
        clients = Clients(asks, run.address, CLIENTS).start()
        try:
            rewrite_for(path, [first, second], write_chunks, WRITING)
            last_write = time.monotonic()

            def answer(name: str) -> int | None:
                host, port = run.address
                response = ProxyClient(host, port, name, tokens[name]).get(url)
                return response.status if response is not None else None

            wait_until(lambda: answer("gone") == 407 and answer("new") == 200, "the last version in force")
            print(f"last version in force {time.monotonic() - last_write:.2f} s after the last write")
            during = clients.take()
            time.sleep(1.0)  # the last version stays in force: `gone` is never served again
        finally:
            after = clients.stop()
        print(dict(during), dict(after))
        for results in (during, after):
            assert not [k for k in results if k[1] is None], results  # every request answered
            assert {k for k in results if k[0] == "keep"} == {("keep", 200)}, results
        assert set(after) == {("keep", 200), ("new", 200), ("gone", 407)}, after
        assert "reload failed" not in run.stderr, run.stderr


def test_secret_file_rewritten_in_place_is_applied_whole(
    tmp_path: Path, dns: DnsServer, servers: tuple[EchoHTTPServer, EchoHTTPServer]
) -> None:
    """A secret's `file:` is read with the policy and watched with it: rewritten in place, the
    upstream gets one whole value or the other, never part of one, and the last one once it is
    in force."""
    allowed, _ = servers
    values = ["a" * 10000, "b" * 10000]  # 10 KB: three 4 KiB writes
    secret = tmp_path / "key"
    secret.write_text(values[0] + "\n")
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        policy_text("only-a.test", padding=0)
        + f"secrets:\n  - name: key\n    from: {{file: {secret}}}\n    hosts: [{ALLOWED}]\n"
        + '    header: "x-key: {}"\n    env: KEY\n'
    )
    url = f"http://{ALLOWED}:{allowed.port}/"
    with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]) as run:
        proxy = ProxyClient.from_env(run.env)
        ask = get_request(url, proxy.auth_header + f"x-key: {run.env['KEY']}\r\n".encode())
        clients = Clients([("key", ask)], (proxy.host, proxy.port), CLIENTS).start()
        try:
            rewrite_for(secret, [f"{value}\n" for value in values], write_chunks, WRITING)

            def sent_since(mark: int) -> set[str]:  # the upstream's view: the child's is masked
                return {r["headers"].get("x-key") for r in allowed.requests[mark:]}

            mark = len(allowed.requests)
            wait_until(lambda: values[1] in sent_since(mark), "the last value in force")
            time.sleep(0.5)  # requests admitted with the value before reach the upstream
            mark = len(allowed.requests)
            time.sleep(0.5)
            assert sent_since(mark) == {values[1]}
        finally:
            results = clients.stop()
        print(dict(results))
        assert set(results) == {("key", 200)}, results
        received = collections.Counter(r["headers"].get("x-key") for r in allowed.requests)
        assert set(received) <= set(values), {value[:8]: n for value, n in received.items()}
        assert "reload failed" not in run.stderr, run.stderr
