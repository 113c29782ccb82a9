"""Concurrent lookups of one name share one DNS query per record type (as the README says).

Why: a burst of connections to one host (a package manager opening many tunnels at once) must not
become a burst of DNS queries. The tests' own DNS server, on 127.0.0.1, answers slowly so that the
lookups overlap in time, and counts every query it receives.
"""

from __future__ import annotations

import contextlib
import socket
import time
from pathlib import Path

from tests.support.corpus import ProxyClient, read_response
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun, write_policy
from tests.support.upstreams import TcpEchoServer

# dns_timeout 30: dnspython resends an unanswered UDP query after dns_timeout/4, which must not
# happen while the answer is held back (DELAY)
POLICY = """\
version: 1
allow: [burst.test]
private: {allow: true}
limits: {dns_timeout: 30}
"""
CONNECTIONS = 6
DELAY = 1.5  # s the DNS server holds each answer: all CONNECTs are decided meanwhile


def _send_connect(client: ProxyClient, stack: contextlib.ExitStack, authority: str) -> socket.socket:
    sock = stack.enter_context(client.open(timeout=30))
    sock.sendall(
        f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n".encode() + client.auth_header + b"\r\n"
    )
    return sock


def test_concurrent_connects_to_one_name_share_one_query_per_type(tmp_path: Path, dns: DnsServer) -> None:
    """N CONNECTs to one name while its lookup is in flight: every tunnel opens (each waiter gets
    the one answer), and the DNS server saw one A and one AAAA query."""
    with TcpEchoServer("127.0.0.1") as echo:
        dns.add("burst.test", "127.0.0.1", delay=DELAY)
        policy = write_policy(tmp_path, POLICY)
        with (
            EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]) as run,
            contextlib.ExitStack() as stack,
        ):
            client = ProxyClient.from_env(run.env)
            authority = f"burst.test:{echo.address[1]}"
            socks = [_send_connect(client, stack, authority)]
            deadline = time.monotonic() + 10
            while dns.count("burst.test") == 0:  # the first lookup is in flight now
                assert time.monotonic() < deadline, "no DNS query for the first CONNECT"
                time.sleep(0.02)
            socks += [_send_connect(client, stack, authority) for _ in range(CONNECTIONS - 1)]
            statuses = []
            for sock in socks:
                response = read_response(sock, timeout=30, head_only=True)
                statuses.append(response.status if response is not None else None)
                sock.sendall(b"ping")
                assert sock.recv(4) == b"ping"
    assert statuses == [200] * CONNECTIONS
    counts = {rdtype: dns.count("burst.test", rdtype) for rdtype in ("A", "AAAA")}
    assert counts == {"A": 1, "AAAA": 1}, dns.query_log
