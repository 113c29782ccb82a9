"""Every port egressd listens on is its own: a child asking the proxy for it is refused `self`, in
every spelling of the address, on every front — the proxy and SOCKS ports, the metrics endpoint,
the dashboard (of `run --dashboard`, and of an `egressd dashboard` attached later), the
credential-free port of an `exec` child. The embedded mitmproxy listens nowhere.

The listeners are found in /proc (tests/support/listening.py), not listed by the test: one added
later that is not registered as egressd's own fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from tests.support.attempts import wait_until
from tests.support.audit_log import audit_records
from tests.support.corpus import FRONTS, ProxyClient, attempt, socks_address
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD, EgressdRun, write_policy
from tests.support.listening import listening
from tests.support.upstreams import EchoHTTPSServer

SOCKS_NOT_ALLOWED = 2
POLICY = """\
version: 1
allow: [tls.test]
inspect: [tls.test]   # an inspected request starts the embedded mitmproxy (which listens nowhere)
private: {allow: true}
"""
# spellings of 127.0.0.1 (the listeners' address) a child may write; {P} is the port
SPELLINGS = [
    "127.0.0.1",
    "localhost",
    "LOCALHOST.",
    "sub.localhost",
    "127.1",
    "0x7f.1",
    "0x7f000001",
    "2130706433",
    "017700000001",
    "127.0.0.2",  # another loopback address: this machine's loopback is refused on egressd's ports
    "[::1]",
    "[::ffff:127.0.0.1]",
    "[0:0:0:0:0:ffff:7f00:1]",
]


@dataclass
class Served:
    run: EgressdRun
    client: ProxyClient
    ports: dict[str, int]  # kind -> port
    home: str  # its EGRESSD_HOME (each test gets a fresh one): where its control socket is

    @property
    def pid(self) -> int:
        assert self.run.proc is not None
        return self.run.proc.pid


def _port(pattern: str, text: str) -> int:
    found = re.search(pattern, text)
    assert found, text
    return int(found.group(1))


@pytest.fixture(scope="module")
def served(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("self")
    policy = write_policy(tmp, POLICY)
    ca_file = tmp / "upstream-ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    home = str(tmp / "home")  # its own EGRESSD_HOME: a module's egressd outlives each test's
    with (
        pytest.MonkeyPatch.context() as env,
        DnsServer() as dns,
        EchoHTTPSServer("127.0.0.1", ca=ca, hostnames=["tls.test"]) as tls,
    ):
        env.setenv("EGRESSD_HOME", home)
        dns.add("tls.test", "127.0.0.1")
        options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--no-prompt", "--dashboard"]
        options += ["--metrics", "127.0.0.1:0", "--upstream-ca", str(ca_file)]
        with EgressdRun(options) as run:
            assert run.wait_for_stderr("dashboard: http://", timeout=15), run.stderr
            client = ProxyClient.from_env(run.env)
            fetched = subprocess.run(
                ["curl", "-sS", "--max-time", "20", f"https://tls.test:{tls.port}/inspected"],
                env=run.child_env(),
                capture_output=True,
                timeout=60,
            )
            assert b"/inspected" in fetched.stdout, fetched
            assert client.socks_port is not None
            ports = {
                "proxy": client.port,
                "socks": client.socks_port,
                "metrics": _port(r"metrics on http://127\.0\.0\.1:(\d+)/", run.stderr),
                "dashboard": _port(r"dashboard: http://127\.0\.0\.1:(\d+)/", run.stderr),
            }
            assert run.proc is not None
            others = {port for _, port in listening(run.proc.pid)} - set(ports.values())
            assert not others, others  # the embedded mitmproxy gets its tunnels from the front
            yield Served(run, client, ports, home)


def refused_as_self(client: ProxyClient, front: str, written: str, port: int) -> str | None:
    """None when the proxy refuses `written:port` as egressd's own address, else what it did."""
    got = attempt(client, front, written, port)
    expected = (SOCKS_NOT_ALLOWED, None) if front.startswith("socks") else (403, "self")
    return None if got == expected else f"answered {got}"


CASES = [
    pytest.param(kind, front, written, id=f"{kind}-{front}-{written}")
    for kind in ("proxy", "socks", "metrics", "dashboard")
    for front in FRONTS
    for written in SPELLINGS
    if front != "socks-address" or socks_address(written) is not None
]


@pytest.mark.parametrize(("kind", "front", "written"), CASES)
def test_each_listener_is_self_in_every_spelling_on_every_front(
    served: Served, kind: str, front: str, written: str
) -> None:
    assert refused_as_self(served.client, front, written, served.ports[kind]) is None


def test_every_listening_socket_of_egressd_is_refused_as_self(served: Served) -> None:
    """Whatever egressd listens on now (found in /proc), the child is refused it."""
    found = listening(served.pid)
    assert {port for _, port in found} == set(served.ports.values())
    for address, port in found:
        written = f"[{address}]" if ":" in address else address
        for front in ("http", "connect"):
            assert refused_as_self(served.client, front, written, port) is None, (address, port, front)
            assert refused_as_self(served.client, front, "localhost", port) is None, (port, front)


def test_an_attached_dashboard_is_self_for_the_instances_children(served: Served) -> None:
    """`egressd dashboard` runs in a process of its own: its port is registered with the egressd
    it attaches to (the control API), whose child is then refused it."""
    dashboard = subprocess.Popen(
        [*EGRESSD, "dashboard", "--pid", str(served.pid)],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "EGRESSD_HOME": served.home},
    )
    try:
        assert dashboard.stderr is not None
        line = ""
        deadline = time.monotonic() + 30
        while "dashboard: http://" not in line:
            assert time.monotonic() < deadline and dashboard.poll() is None, line
            line = dashboard.stderr.readline()
        port = _port(r"dashboard: http://127\.0\.0\.1:(\d+)/", line)
        for front in FRONTS:
            for written in ("127.0.0.1", "localhost", "[::ffff:127.0.0.1]"):
                if front != "socks-address" or socks_address(written) is not None:
                    assert refused_as_self(served.client, front, written, port) is None, (front, written)
    finally:
        dashboard.terminate()
        dashboard.wait(10)


def test_every_listener_of_exec_is_self_for_its_child(tmp_path: Path) -> None:
    """`egressd exec --no-capture` (the child on this machine's network): its listeners (with the
    child's credential-free one) found in /proc while the child runs, each refused through the
    child's own proxy settings."""
    command = [*EGRESSD, "exec", "--no-capture", "--metrics", "127.0.0.1:0", "--"]
    script = 'echo "$HTTP_PROXY"; echo "$EGRESSD_CHILD_PROXY"; exec sleep 30'
    proc = subprocess.Popen([*command, "sh", "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        proxy, child_proxy = proc.stdout.readline().strip(), proc.stdout.readline().strip()
        client = ProxyClient.from_env({"HTTP_PROXY": proxy})
        child_only = int(child_proxy.rsplit(":", 1)[1])
        found = wait_until(
            lambda: {p for _, p in listening(proc.pid)} >= {client.port, child_only}, "listeners"
        )
        assert found
        ports = {port for _, port in listening(proc.pid)}
        assert len(ports) >= 3  # the proxy, the child's own, the metrics
        for port in ports:
            for front in ("http", "connect"):
                for written in ("127.0.0.1", "localhost", "2130706433"):
                    assert refused_as_self(client, front, written, port) is None, (port, front, written)
    finally:
        proc.terminate()  # egressd exec ends its child too
        proc.wait(20)


CAPTURED_CHILD = """
until [ -s "$1" ]; do sleep 0.1; done
for port in $(cat "$1"); do
  for how in direct proxy; do
    # NO_PROXY names loopback in the child's namespace: --noproxy "" makes curl use the proxy
    if [ "$how" = proxy ]; then skip=""; else skip="*"; fi
    reason=$(curl -s -o /dev/null -D - --max-time 20 --noproxy "$skip" "http://127.0.0.1:$port/" |
      tr -d '\\r' | sed -n 's/^[Xx]-[Ee]gressd-[Rr]eason: //p')
    echo "$port $how ${reason:-none}"
  done
done
"""


def test_every_listener_of_exec_is_self_for_a_captured_child(tmp_path: Path) -> None:
    """`egressd exec` (the child in a network namespace of its own): egressd's listeners on this
    machine's loopback, found in /proc, are refused `self` to the child both through its proxy and
    directly (that connection is captured and decided)."""
    ports_file = tmp_path / "ports"
    audit = tmp_path / "audit.jsonl"
    command = [*EGRESSD, "exec", "--audit", str(audit), "--metrics", "127.0.0.1:0", "--"]
    command += ["sh", "-c", CAPTURED_CHILD]
    proc = subprocess.Popen([*command, "sh", str(ports_file)], stdout=subprocess.PIPE, text=True)
    try:
        found = wait_until(lambda: len({p for _, p in listening(proc.pid)}) >= 2, "listeners")
        assert found
        ports = sorted({port for _, port in listening(proc.pid)})
        ports_file.write_text(" ".join(map(str, ports)) + "\n")
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait(20)
    lines = out.split("\n")[:-1]
    assert len(lines) == 2 * len(ports) >= 4, out  # the proxy and the metrics, at least
    assert all(line.endswith(" self") for line in lines), out
    records = [r for r in audit_records(audit) if r.get("event") == "decision"]
    assert {(r["port"], bool(r.get("captured"))) for r in records} == {
        (port, captured) for port in ports for captured in (True, False)
    }, records
