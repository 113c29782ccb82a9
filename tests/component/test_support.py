"""Self-tests of the test support: the isolated namespace, the DNS server, the upstreams, MCP echo.

Why: every integration test trusts these fixtures; if one of them lied (a DNS answer not really sent,
a connection count that never moves, a namespace that is not isolated) the egressd tests above them
would prove nothing.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import dns.flags as dns_flags
import dns.message as dns_message
import dns.query as dns_query
import dns.resolver as dns_resolver
import pytest
import requests

from tests.support import netns
from tests.support.dns_server import DnsServer
from tests.support.upstreams import EchoHTTPServer, EchoHTTPSServer, RefusingPort, StallingPort, TcpEchoServer

REPO = Path(__file__).resolve().parents[2]
MCP_SERVER = REPO / "tests" / "support" / "mcp_echo_server.py"


def resolver_for(server: DnsServer, lifetime: float = 2.0) -> dns_resolver.Resolver:
    r = dns_resolver.Resolver(configure=False)
    r.nameservers = [server.host]
    r.port = server.port
    r.lifetime = lifetime
    r.timeout = lifetime
    return r


def answers(r: dns_resolver.Resolver, name: str, rdtype: str = "A", tcp: bool = False) -> list[str]:
    return sorted(rr.to_text() for rr in r.resolve(name, rdtype, tcp=tcp, search=False))


def curl(*args: str, timeout: float = 10) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["curl", "-sS", "--noproxy", "*", "--max-time", str(timeout), *args],
        capture_output=True,
        text=True,
        timeout=timeout + 5,
        check=False,
    )


# ------------------------------------------------------------------------------------------------
# Namespace
# ------------------------------------------------------------------------------------------------
def test_session_is_isolated() -> None:
    assert os.environ.get("EGRESSD_TEST_NETNS") == "1"
    assert netns.in_test_netns()
    assert netns.links() == ["lo"]
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert [line.split(":")[1].strip() for line in out.splitlines()] == ["lo"]
    # No route anywhere but the local table: nothing can leave.
    assert (
        subprocess.run(
            ["ip", "-4", "route", "show"], capture_output=True, text=True, check=True
        ).stdout.strip()
        == ""
    )
    if os.access("/proc/1/ns/net", os.R_OK):  # unprivileged: cannot look at pid 1's namespace
        assert os.stat("/proc/self/ns/net").st_ino != os.stat("/proc/1/ns/net").st_ino


@pytest.mark.parametrize(
    "addr",
    [
        "127.0.0.1",
        "::1",
        *netns.UPSTREAM_V4,
        *netns.ALT_V4,
        *netns.EXTRA_V4,
        *netns.UPSTREAM_V6,
        "198.51.100.200",
        "203.0.113.250",
    ],
)
def test_upstream_addresses_are_local(addr: str) -> None:
    fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(fam) as srv:
        srv.bind((addr, 0))
        srv.listen(1)
        with socket.create_connection(srv.getsockname()[:2], timeout=2):
            conn, _ = srv.accept()
            conn.close()


# ------------------------------------------------------------------------------------------------
# DNS
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tcp", [False, True], ids=["udp", "tcp"])
def test_dns_a_aaaa_nxdomain_servfail(dns: DnsServer, tcp: bool) -> None:
    dns.add("Up.Test.", "198.51.100.1", "2001:db8::1", "198.51.100.7")
    dns.nxdomain("gone.test")
    dns.servfail("broken.test")
    r = resolver_for(dns)
    assert answers(r, "up.test", "A", tcp) == ["198.51.100.1", "198.51.100.7"]
    assert answers(r, "UP.TEST.", "AAAA", tcp) == ["2001:db8::1"]
    with pytest.raises(dns_resolver.NXDOMAIN):
        r.resolve("gone.test", "A", tcp=tcp)
    with pytest.raises(dns_resolver.NXDOMAIN):
        r.resolve("unknown.test", "A", tcp=tcp)
    with pytest.raises(dns_resolver.NoNameservers):  # SERVFAIL from the only server
        r.resolve("broken.test", "A", tcp=tcp)
    with pytest.raises(dns_resolver.NoAnswer):  # known name, no data of that type
        r.resolve("up.test", "MX", tcp=tcp)
    assert dns.count("up.test") == 3
    assert dns.count("up.test", "A") == 1
    assert {t for _n, _r, t in dns.query_log} == {"tcp" if tcp else "udp"}
    assert dns.nameserver == f"127.0.0.1:{dns.port}"
    assert dns.address == ("127.0.0.1", dns.port)


def test_dns_sequence_for_rebinding(dns: DnsServer) -> None:
    dns.add_sequence("rebind.test", [["198.51.100.9"], ["127.0.0.1"]])
    r = resolver_for(dns)
    assert answers(r, "rebind.test") == ["198.51.100.9"]
    assert answers(r, "rebind.test", tcp=True) == ["127.0.0.1"]
    assert answers(r, "rebind.test") == ["127.0.0.1"]  # the last answer repeats
    with pytest.raises(dns_resolver.NoAnswer):
        r.resolve("rebind.test", "AAAA")
    assert dns.count("rebind.test", "A") == 3


def test_dns_cname_chain(dns: DnsServer) -> None:
    dns.add_cname("alias.test", "mid.test")
    dns.add_cname("mid.test", "up.test")
    dns.add("up.test", "198.51.100.1")
    dns.add_cname("dangling.test", "nowhere.test")
    r = resolver_for(dns)
    ans = r.resolve("alias.test", "A")
    assert [rr.to_text() for rr in ans] == ["198.51.100.1"]
    assert ans.canonical_name.to_text() == "up.test."
    with pytest.raises(dns_resolver.NXDOMAIN):
        r.resolve("dangling.test", "A")


def test_dns_blackhole_times_out(dns: DnsServer) -> None:
    dns.blackhole("silent.test")
    r = resolver_for(dns, lifetime=0.5)
    start = time.monotonic()
    with pytest.raises(dns_resolver.LifetimeTimeout):
        r.resolve("silent.test", "A")
    with pytest.raises(dns_resolver.LifetimeTimeout):
        r.resolve("silent.test", "A", tcp=True)
    assert time.monotonic() - start < 3
    assert dns.count("silent.test") >= 2


def test_dns_huge_answer_truncated_over_udp_then_tcp(dns: DnsServer) -> None:
    addrs = dns.huge("many.test")
    assert len(addrs) == 500 and addrs[0] == "198.51.100.1"
    q = dns_message.make_query("many.test", "A")
    udp = dns_query.udp(q, dns.host, port=dns.port, timeout=2)
    assert udp.flags & dns_flags.TC and not udp.answer
    full = resolver_for(dns).resolve("many.test", "A")  # the resolver retries over TCP by itself
    assert len(full) == 500
    assert ("many.test", "A", "tcp") in dns.query_log


# ------------------------------------------------------------------------------------------------
# Upstreams
# ------------------------------------------------------------------------------------------------
def test_http_upstream_with_curl_and_requests(upstream: EchoHTTPServer) -> None:
    assert upstream.url == f"http://198.51.100.1:{upstream.port}"
    res = curl(upstream.url + "/hello?x=1", "-H", "X-Test: yes")
    assert res.returncode == 0, res.stderr
    body = json.loads(res.stdout)
    assert (
        body["server"] == "upstream" and body["path"] == "/hello?x=1" and body["headers"]["x-test"] == "yes"
    )
    r = requests.post(upstream.url + "/post", data=b"payload", timeout=5)
    assert r.status_code == 200 and r.json()["method"] == "POST"
    assert upstream.connections == 2
    assert upstream.requests[-1]["body"] == b"payload"
    assert upstream.requests[-1]["peer"][0] == netns.INTERFACE_V4[0]  # source address of the lo route


def test_http_upstream_ipv6(upstream_v6: EchoHTTPServer) -> None:
    assert upstream_v6.url == f"http://[2001:db8::1]:{upstream_v6.port}"
    res = curl("-g", upstream_v6.url + "/v6")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["server"] == "upstream-v6"
    assert requests.get(upstream_v6.url + "/v6", timeout=5).status_code == 200
    assert upstream_v6.connections == 2


def test_https_upstream_with_ca(upstream_tls: EchoHTTPSServer, ca_file: Path) -> None:
    assert ca_file.read_text().startswith("-----BEGIN CERTIFICATE-----")
    assert "PRIVATE KEY" not in ca_file.read_text()
    res = curl(
        "--cacert",
        str(ca_file),
        "--resolve",
        f"up.test:{upstream_tls.port}:198.51.100.2",
        upstream_tls.url_for("up.test", "/tls"),
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["server"] == "upstream-tls"
    r = requests.get(upstream_tls.url + "/by-ip", verify=str(ca_file), timeout=5)
    assert r.status_code == 200
    # A client that does not trust the CA fails the handshake but was still accepted at TCP level.
    bad = curl(upstream_tls.url_for("up.test"), "--resolve", f"up.test:{upstream_tls.port}:198.51.100.2")
    assert bad.returncode != 0
    assert upstream_tls.connections == 3
    assert upstream_tls.tls_handshakes == 2
    assert upstream_tls.sni[:1] == ["up.test"]


def test_https_upstream_with_node(upstream_tls: EchoHTTPSServer, ca_file: Path) -> None:
    script = (
        "const https = require('https');"
        "const ip = '198.51.100.2';"
        "https.get(process.argv[1], {lookup: (h, o, cb) => o.all ? cb(null, [{address: ip, family: 4}])"
        " : cb(null, ip, 4)}, r => { let b = ''; r.on('data', d => b += d);"
        " r.on('end', () => { console.log(r.statusCode, JSON.parse(b).server); }); })"
        ".on('error', e => { console.error(e.message); process.exit(1); });"
    )
    env = {**os.environ, "NODE_EXTRA_CA_CERTS": str(ca_file)}
    res = subprocess.run(
        ["node", "-e", script, upstream_tls.url_for("other.test", "/node")],
        env=env,
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["200", "upstream-tls"]
    assert upstream_tls.sni == ["other.test"]


def test_special_paths(upstream: EchoHTTPServer) -> None:
    s = requests.Session()
    r = s.get(upstream.url + "/redirect?to=http://example.invalid/x", allow_redirects=False, timeout=5)
    assert r.status_code == 302 and r.headers["Location"] == "http://example.invalid/x"
    r = s.get(upstream.url + "/big?n=3000000", timeout=10)
    assert len(r.content) == 3000000
    start = time.monotonic()
    assert s.get(upstream.url + "/slow?s=0.3", timeout=5).status_code == 200
    assert time.monotonic() - start >= 0.3
    r = s.get(upstream.url + "/headers-forged", timeout=5)
    assert r.headers["X-Egressd-Reason"] == "forged" and r.headers["Proxy-Status"] == "forged"
    assert s.get(upstream.url + "/status/418", timeout=5).status_code == 418
    with s.get(upstream.url + "/sse", stream=True, timeout=5) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        lines = r.iter_lines(chunk_size=1)
        events = [line for line in (next(lines) for _ in range(6)) if line.startswith(b"data:")]
        assert events == [b'data: {"n": 0}', b'data: {"n": 1}']
    assert upstream.connections == 1  # one keep-alive connection for all of it (SSE closes it)


def test_tcp_echo(tcp_echo: TcpEchoServer) -> None:
    with socket.create_connection(tcp_echo.address, timeout=2) as c:
        c.sendall(b"ping")
        assert c.recv(10) == b"ping"
    assert tcp_echo.connections == 1 and tcp_echo.received == 4


def test_refusing_and_stalling_ports(refusing_port: RefusingPort, stalling_port: StallingPort) -> None:
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(refusing_port.address, timeout=2)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        socket.create_connection(stalling_port.address, timeout=0.3)
    assert 0.25 < time.monotonic() - start < 2


def test_stop_closes_open_sse_stream() -> None:
    server = EchoHTTPServer("198.51.100.6").start()
    with requests.get(server.url + "/sse", stream=True, timeout=5) as r:
        next(r.iter_lines(chunk_size=1))
        start = time.monotonic()
        server.stop()
        assert time.monotonic() - start < 3


# ------------------------------------------------------------------------------------------------
# MCP echo server
# ------------------------------------------------------------------------------------------------
def _rpc(proc: subprocess.Popen[str], msg: dict[str, Any]) -> dict[str, Any] | None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(msg) + "\n")
    proc.stdin.flush()
    if "id" not in msg:
        return None
    return json.loads(proc.stdout.readline())


def test_mcp_echo_server(upstream: EchoHTTPServer, refusing_port: RefusingPort) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(MCP_SERVER)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        init = _rpc(
            proc,
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "initialize",
                "params": {
                    "protocolVersion": "2025-06-18",
                    "capabilities": {},
                    "clientInfo": {"name": "t", "version": "0"},
                },
            },
        )
        assert init is not None and init["result"]["protocolVersion"] == "2025-06-18"
        assert _rpc(proc, {"jsonrpc": "2.0", "method": "notifications/initialized"}) is None
        tools = _rpc(proc, {"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
        assert tools is not None and [t["name"] for t in tools["result"]["tools"]] == ["fetch"]
        ok = _rpc(
            proc,
            {
                "jsonrpc": "2.0",
                "id": 3,
                "method": "tools/call",
                "params": {"name": "fetch", "arguments": {"url": upstream.url + "/mcp"}},
            },
        )
        assert ok is not None and ok["id"] == 3 and ok["result"]["isError"] is False
        assert ok["result"]["content"][0]["text"].startswith("status: 200\n")
        denied = _rpc(
            proc,
            {
                "jsonrpc": "2.0",
                "id": 4,
                "method": "tools/call",
                "params": {"name": "fetch", "arguments": {"url": upstream.url + "/status/403"}},
            },
        )
        assert denied is not None and denied["result"]["isError"] is True
        assert denied["result"]["content"][0]["text"].startswith("status: 403\n")
        down = _rpc(
            proc,
            {
                "jsonrpc": "2.0",
                "id": 5,
                "method": "tools/call",
                "params": {"name": "fetch", "arguments": {"url": refusing_port.url}},
            },
        )
        assert down is not None and down["result"]["isError"] is True
        unknown = _rpc(proc, {"jsonrpc": "2.0", "id": 6, "method": "nope"})
        assert unknown is not None and unknown["error"]["code"] == -32601
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=5)
        assert proc.stdout is not None and proc.stderr is not None
        rest = proc.stdout.read()
        proc.stdout.close()
        proc.stderr.close()
    assert rest == ""  # nothing but JSON-RPC replies on stdout
    assert proc.returncode == 0
    assert upstream.connections == 2
