"""A tunnel admitted for inspection is handed to the embedded mitmproxy on the client's own
connection: the upstream is connected first, through the pipeline's pin step, then the client is
answered in its protocol, CONNECT and SOCKS5 alike.

Why: mitmproxy gets each tunnel already admitted and pinned, and nothing is spelled out again for
it — no second CONNECT, no registry of peers, no failure written into text and read back. So the
answers and records must be the pipeline's own: a connect that fails is the client's typed answer
(502 `connect_refused`, 504 `connect_timeout`, SOCKS5 0x05, 0x06) with its connection record; the
pinned addresses are tried in order; every upstream connection mitmproxy opens (a new one inside
the tunnel too) goes to the tunnel's target under its canonical name, is recorded, and one that
fails is answered with its reason. Real `egressd run`, raw clients, servers on this machine.
"""

from __future__ import annotations

import http.client
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from tests.support import netns
from tests.support.attempts import wait_until
from tests.support.audit_log import audit_records
from tests.support.corpus import ProxyClient, attempt, read_response
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import TEST_POLICY, EgressdRun, write_policy
from tests.support.upstreams import EchoHTTPSServer, OneAnswerHTTPSServer, RefusingPort, StallingPort

SOCKS_REFUSED, SOCKS_TTL_EXPIRED = 0x05, 0x06
NAMES = ["up.test", "two.test", "once.test", "gone.test"]


@dataclass
class Lab:
    client: ProxyClient
    dns: DnsServer
    run: EgressdRun
    audit: Path
    tls: EchoHTTPSServer
    refusing: RefusingPort
    stalling: StallingPort

    def connections(self, host: str) -> list[dict[str, object]]:
        """The connection records of upstream connections to `host` so far."""
        return [
            r for r in audit_records(self.audit) if r.get("stage") == "connection" and r.get("host") == host
        ]

    def context(self) -> ssl.SSLContext:
        """A client's TLS context trusting egressd's CA (the bundle it gives its children)."""
        return ssl.create_default_context(cafile=self.run.env["SSL_CERT_FILE"])


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA, ca_file: Path) -> Iterator[Lab]:
    tmp = tmp_path_factory.mktemp("handover")
    inspect = ", ".join(NAMES)
    policy = write_policy(
        tmp,
        TEST_POLICY.replace("  - other.test\n", "".join(f"  - {n}\n" for n in NAMES[1:]))
        + f"inspect: [{inspect}]\nlimits: {{connect_timeout: 1}}\n",
    )
    audit = tmp / "audit.jsonl"
    with (
        DnsServer() as dns,
        EchoHTTPSServer(netns.UPSTREAM_V4[6], ca=ca, hostnames=NAMES) as tls,
        RefusingPort(netns.UPSTREAM_V4[3]) as refusing,
        StallingPort(netns.UPSTREAM_V4[4]) as stalling,
    ):
        options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(audit)]
        with EgressdRun([*options, "--upstream-ca", str(ca_file)]) as run:
            yield Lab(ProxyClient.from_env(run.env), dns, run, audit, tls, refusing, stalling)


@pytest.mark.parametrize("front", ["connect", "socks"])
@pytest.mark.parametrize(
    ("fault", "http", "socks"),
    [
        ("refused", (502, "connect_refused"), SOCKS_REFUSED),
        ("stalled", (504, "connect_timeout"), SOCKS_TTL_EXPIRED),
    ],
)
def test_an_inspected_tunnel_that_cannot_connect_is_answered_in_its_protocol(
    lab: Lab, front: str, fault: str, http: tuple[int, str], socks: int
) -> None:
    host, port = lab.refusing.address if fault == "refused" else lab.stalling.address
    lab.dns.add("up.test", host)
    got = attempt(lab.client, front, "up.test", port)
    assert got == (http if front == "connect" else (socks, None))
    reason = http[1]
    recorded = wait_until(
        lambda: [r for r in lab.connections("up.test") if r.get("port") == port], "a record"
    )
    assert recorded[-1]["reason"] == reason and recorded[-1]["decision"] != "allow", recorded[-1]
    assert f"{host}:{port}" in str(recorded[-1]["attempts"])


@pytest.mark.parametrize("front", ["connect", "socks"])
def test_an_inspected_tunnel_tries_the_next_pinned_address(lab: Lab, front: str, ca: trustme.CA) -> None:
    """The first address refuses (nothing listens there on that port): the second is connected,
    and the tunnel's record says both. (A answers come before AAAA answers: the order is known.)"""
    with EchoHTTPSServer(netns.UPSTREAM_V6[6], ca=ca, hostnames=["two.test"]) as second:
        refusing, port = lab.refusing.host, second.port
        lab.dns.add("two.test", refusing, second.host)
        before = len(lab.connections("two.test"))
        status, body = _inspected_get(lab, front, "two.test", port, "/next")
        assert status == 200 and b"/next" in body
        record = wait_until(lambda: lab.connections("two.test")[before:], "a connection record")[-1]
    assert record["connected"] == f"{second.host}:{port}", record
    assert record["resolved"] == [refusing, second.host]
    (tried,) = record["attempts"]  # type: ignore[misc]
    assert tried.startswith(f"{refusing}:{port}") and "refused" in tried, tried


def test_each_upstream_connection_in_a_tunnel_is_admitted_recorded_and_named_canonically(
    lab: Lab, ca: trustme.CA
) -> None:
    """A server that closes each connection after its answer: the next request in the same tunnel
    opens a new upstream connection, to the tunnel's target, with the canonical name as SNI (the
    client wrote it with a trailing dot), recorded like the first; once the server stops listening,
    the next request is answered 502 `connect_refused` inside the tunnel."""
    with OneAnswerHTTPSServer(netns.UPSTREAM_V4[7], ca=ca, hostnames=["once.test"]) as server:
        lab.dns.add("once.test", server.host)
        conn = _https(lab, "once.test", server.port, server_hostname="once.test.")
        try:
            assert _get(conn, "/1") == (200, None, b"1")
            assert _get(conn, "/2") == (200, None, b"2")
            assert server.connections == 2
            assert server.sni == ["once.test", "once.test"]
            records = wait_until(lambda: lab.connections("once.test")[1:], "both connection records")
            assert all(r["decision"] == "allow" for r in records)
            server.stop_listening()
            status, reason, _ = _get(conn, "/3")
            assert (status, reason) == (502, "connect_refused")
        finally:
            conn.close()
    assert server.connections == 2


def _https(lab: Lab, host: str, port: int, server_hostname: str) -> http.client.HTTPConnection:
    """A kept-alive HTTPS connection through egressd's CONNECT to host:port, trusting its CA, with
    `server_hostname` as the client spells the name in its TLS handshake."""
    sock = lab.client.open(15)
    sock.sendall(
        f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n".encode()
        + lab.client.auth_header
        + b"\r\n"
    )
    answer = read_response(sock, 15, head_only=True)
    assert answer is not None and answer.status == 200, answer
    conn = http.client.HTTPConnection(host, port, timeout=15)
    conn.sock = lab.context().wrap_socket(sock, server_hostname=server_hostname)
    return conn


def _get(conn: http.client.HTTPConnection, path: str) -> tuple[int, str | None, bytes]:
    conn.request("GET", path)
    response = conn.getresponse()
    return response.status, response.getheader("X-Egressd-Reason"), response.read()


def _inspected_get(lab: Lab, front: str, host: str, port: int, path: str) -> tuple[int, bytes]:
    """GET path over TLS through an inspected tunnel opened with `front`: (status, whole answer)."""
    request = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode()
    if front == "socks":
        with lab.client.socks5(host, port) as (code, sock):
            assert code == 0, code
            return _over_tls(lab, sock, host, request)
    with lab.client.connect(f"{host}:{port}") as (answer, sock):
        assert answer is not None and answer.status == 200, answer
        return _over_tls(lab, sock, host, request)


def _over_tls(lab: Lab, sock: socket.socket, host: str, request: bytes) -> tuple[int, bytes]:
    with lab.context().wrap_socket(sock, server_hostname=host) as tls:
        tls.sendall(request)
        answer = b""
        while chunk := tls.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1]), answer
