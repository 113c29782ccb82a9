"""Capture in the sandbox: clients that ignore the proxy variables go through the proxy anyway.

What is proved here, through the real `egressd sandbox` with the real clients (node 20's fetch and
https.get, urllib3's PoolManager, aiohttp's default session, Java 17's HttpClient, Go with a
transport that ignores the environment) and no proxy configuration in the child: the bridge's DNS
answers with synthetic addresses, each TCP connection is redirected to the bridge and decided by
the proxy as a CONNECT to the name asked, so an allowed host answers 200 and another is refused
with its reason in the audit; UDP other than DNS gets nothing; a ClientHello naming another host
than the DNS name is closed (sni_mismatch); an IP literal is decided as that literal; plain HTTP
to a host with path rules is decided request by request; with inspection on, the JVM trusts
egressd's CA through JAVA_TOOL_OPTIONS; the child cannot undo the capture; without nft egressd
warns and the child stays confined; --no-capture means nothing gets out.
"""

from __future__ import annotations

import json
import socket
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from egressd.sandbox import capture
from tests.support import direct_clients
from tests.support.audit_log import audit_records
from tests.support.capture_clients import JAVA, TIMEOUT, build_go_client, java_trusting
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import write_policy
from tests.support.netns import UPSTREAM_V4
from tests.support.sandboxes import PY, egressd_sandbox, python_inside, sandbox_env
from tests.support.upstreams import EchoHTTPServer, EchoHTTPSServer, TcpEchoServer

# No proxy configuration at all in the child: every variable egressd sets for it is removed.
NO_PROXY_CONFIG = [
    "env",
    *[
        arg
        for name in (
            "HTTP_PROXY",
            "HTTPS_PROXY",
            "ALL_PROXY",
            "NO_PROXY",
            "http_proxy",
            "https_proxy",
            "all_proxy",
            "no_proxy",
            "EGRESSD_SOCKS_PROXY",
            "NODE_USE_ENV_PROXY",
        )
        for arg in ("-u", name)
    ],
]
@pytest.fixture
def audit(tmp_path: Path) -> Path:
    return tmp_path / "audit.jsonl"


def records(audit: Path) -> list[dict[str, Any]]:
    return audit_records(audit)


def refused_in_audit(audit: Path, host: str, reason: str) -> bool:
    return any(
        r.get("event") == "decision"
        and r.get("host") == host
        and r.get("decision") == "deny"
        and r.get("reason") == reason
        for r in records(audit)
    )


def run_captured(
    tmp_path: Path, dns: DnsServer, audit: Path, command: list[str], work: Path, *extra: str
) -> subprocess.CompletedProcess[bytes]:
    policy = write_policy(tmp_path)
    options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(audit), *extra]
    return egressd_sandbox(options, [*NO_PROXY_CONFIG, *command], cwd=work, timeout=TIMEOUT)


def output(result: subprocess.CompletedProcess[bytes]) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    return json.loads(result.stdout.decode().strip().splitlines()[-1])


@dataclass
class Clients:
    """Everything a client test needs: allowed plain and HTTPS URLs, a refused one, the audit."""

    tmp_path: Path
    dns: DnsServer
    upstream: EchoHTTPServer
    ca_file: Path
    audit: Path
    work: Path
    urls: tuple[str, str, str]

    def run(self, command: list[str], *extra: str) -> dict[str, Any]:
        """Run the client in the sandbox (the CA file shown) with the URLs as its last arguments."""
        options = ["--ro", str(self.ca_file.parent), *extra]
        return output(
            run_captured(self.tmp_path, self.dns, self.audit, [*command, *self.urls], self.work, *options)
        )

    def run_client(self, name: str) -> dict[str, Any]:
        """One of the clients of tests/support/direct_clients.py, in the sandbox."""
        return self.run(direct_clients.command(name, self.ca_file, []))

    def check(self, seen: dict[str, Any], prefix: str = "") -> None:
        """Allowed: 200 with the path; refused: an error in the child, the reason in the audit."""
        plain, tls, refused = self.urls
        assert seen[prefix + plain] == [200, "/plain"], seen
        assert seen[prefix + tls] == [200, "/tls"], seen
        assert seen[prefix + refused][0] == "error", seen
        assert refused_in_audit(self.audit, "elsewhere.test", "not_allowlisted")
        assert "/refused" not in [r["path"] for r in self.upstream.requests]


@pytest.fixture
def clients(
    tmp_path: Path,
    dns: DnsServer,
    upstream: EchoHTTPServer,
    upstream_tls: EchoHTTPSServer,
    ca_file: Path,
    audit: Path,
    work: Path,
) -> Clients:
    """up.test (plain HTTP) and other.test (HTTPS) are allowed; elsewhere.test is not."""
    urls = (
        *direct_clients.allowed_urls(dns, upstream, upstream_tls),
        f"http://elsewhere.test:{upstream.port}/refused",
    )
    return Clients(tmp_path, dns, upstream, ca_file, audit, work, urls)


def test_urllib3_pool_manager(clients: Clients) -> None:
    clients.check(clients.run_client("urllib3"))


def test_aiohttp_default_session(clients: Clients) -> None:
    clients.check(clients.run_client("aiohttp"))


def test_node_fetch_and_https_get(clients: Clients) -> None:
    seen = clients.run_client("node")
    clients.check(seen, prefix="fetch ")
    clients.check(seen, prefix="get ")


def test_java_http_client(clients: Clients) -> None:
    # without egressd's JAVA_TOOL_OPTIONS (its proxy settings): the JVM then ignores any proxy
    java = java_trusting(clients.work, clients.ca_file)
    clients.check(clients.run(["env", "-u", "JAVA_TOOL_OPTIONS", *java]))


def test_java_through_java_tool_options_needs_no_credentials(clients: Clients) -> None:
    """egressd's JAVA_TOOL_OPTIONS point the JVM at the sandbox's credential-free proxy port (the
    JVM sends no Basic credentials on a CONNECT): with capture off, the proxy decides each host."""
    seen = clients.run(java_trusting(clients.work, clients.ca_file), "--no-capture")
    plain, tls, refused = clients.urls
    assert seen[plain] == [200, "/plain"] and seen[tls] == [200, "/tls"], seen
    assert seen[refused] == [403, "?"], seen  # the proxy's refusal, with its reason in the audit
    assert refused_in_audit(clients.audit, "elsewhere.test", "not_allowlisted")
    assert "/refused" not in [r["path"] for r in clients.upstream.requests]


OPEN_PORT = """
    import json, os, socket, sys
    from urllib.parse import urlsplit
    def ask(port, target, auth=None):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            host = urlsplit(target).netloc
            head = f"GET {target} HTTP/1.1\\r\\nHost: {host}\\r\\nConnection: close\\r\\n"
            if auth:
                head += f"Proxy-Authorization: Basic {auth}\\r\\n"
            s.sendall((head + "\\r\\n").encode())
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        return int(data.split(b" ", 2)[1])
    plain = sys.argv[1]
    print(json.dumps({
        "open": ask(3130, plain), "open_wrong": ask(3130, plain, "Zm9vOmJhcg=="),
        "proxy_without": ask(3128, plain), "env": os.environ.get("JAVA_TOOL_OPTIONS"),
    }))
"""


def test_the_credential_free_port_is_the_childs_and_refuses_wrong_credentials(clients: Clients) -> None:
    plain = clients.urls[0]
    seen = output(
        run_captured(
            clients.tmp_path, clients.dns, clients.audit, [*python_inside(OPEN_PORT), plain], clients.work
        )
    )
    assert seen["open"] == 200  # no credentials needed: only the child reaches it
    assert seen["open_wrong"] == 407  # but wrong ones are still refused
    assert seen["proxy_without"] == 407  # the main port still needs the child's token
    assert "-Dhttps.proxyPort=3130" in seen["env"] and "-Dhttp.nonProxyHosts=" in seen["env"]


def test_java_with_inspection_trusts_egressd_through_java_tool_options(
    tmp_path: Path,
    dns: DnsServer,
    upstream_tls: EchoHTTPSServer,
    ca_file: Path,
    audit: Path,
    work: Path,
) -> None:
    """Inspection on: the JVM reads no CA-bundle variable, so egressd's JAVA_TOOL_OPTIONS names a
    trust store with its CA; path rules then hold for Java's captured HTTPS."""
    dns.add("up.test", upstream_tls.host)
    policy = write_policy(
        tmp_path, "version: 1\nallow: [198.51.100.0/24]\nbuiltin:\n  - {host: up.test, paths: [/v1/]}\n"
    )
    source = work / "Client.java"
    source.write_text(JAVA)
    urls = [upstream_tls.url_for("up.test", "/v1/item"), upstream_tls.url_for("up.test", "/v2/item")]
    options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(audit)]
    result = egressd_sandbox(
        [*options, "--upstream-ca", str(ca_file)],
        [*NO_PROXY_CONFIG, "java", str(source), *urls],
        cwd=work,
        timeout=TIMEOUT,
    )
    assert b"Picked up JAVA_TOOL_OPTIONS" in result.stderr
    seen = output(result)
    assert seen == {urls[0]: [200, "/v1/item"], urls[1]: [403, "?"]}, result.stderr
    assert refused_in_audit(audit, "up.test", "builtin_path")
    assert [r["path"] for r in upstream_tls.requests] == ["/v1/item"]


@pytest.fixture(scope="module")
def go_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_go_client(tmp_path_factory)


def test_go_transport_without_proxy(clients: Clients, go_client: Path) -> None:
    clients.check(clients.run([str(go_client), str(clients.ca_file)], "--ro", str(go_client.parent)))


# -- what the capture does and does not let through ------------------------------------------------
PROBE = """
    import json, socket, ssl, sys
    import dns.message, dns.query, dns.rdatatype
    tls_port, udp_host, udp_port, outside_dns, outside_dns_port, ca = sys.argv[1:7]
    out = {}
    def addresses(name):
        return sorted({info[4][0] for info in socket.getaddrinfo(name, 80, type=socket.SOCK_STREAM)})
    out["up"] = addresses("up.test")
    out["up_again"] = addresses("UP.test.")
    out["other"] = addresses("other.test")
    try:
        socket.getaddrinfo("up.test", 80, socket.AF_INET6)
        out["aaaa"] = "answered"
    except socket.gaierror as exc:
        out["aaaa"] = "no address"
    # any nameserver address on port 53 (here: the outside DNS server's) reaches the bridge's
    # responder instead, over UDP and TCP
    query = dns.message.make_query("up.test", "A")
    for name, ask in (("dns_udp_53", dns.query.udp), ("dns_tcp_53", dns.query.tcp)):
        answer = ask(query, outside_dns, port=53, timeout=10)
        out[name] = [r.address for rrset in answer.answer for r in rrset]
    # UDP anywhere else gets nothing: a datagram to an upstream, a DNS server on another port
    for name, host, port in (("udp", udp_host, udp_port), ("dns_other_port", outside_dns, outside_dns_port)):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(3)
            try:
                s.sendto(dns.message.make_query("up.test", "A").to_wire(), (host, int(port)))
                s.recvfrom(512)
                out[name] = "ANSWERED"
            except OSError as exc:
                out[name] = type(exc).__name__
    # up.test and other.test share an address: a ClientHello naming a name nobody looked up for
    # it is closed; one naming either of the two is that name's
    context = ssl.create_default_context(cafile=ca)
    try:
        with socket.create_connection(("up.test", int(tls_port)), timeout=30) as raw:
            with context.wrap_socket(raw, server_hostname="never-asked.test") as tls:
                tls.sendall(b"GET / HTTP/1.1\\r\\nHost: never-asked.test\\r\\n\\r\\n")
                out["sni_mismatch"] = "ANSWERED " + repr(tls.recv(100))
    except (OSError, ssl.SSLError) as exc:
        out["sni_mismatch"] = type(exc).__name__
    try:
        with socket.create_connection(("up.test", int(tls_port)), timeout=30) as raw:
            with context.wrap_socket(raw, server_hostname="other.test") as tls:
                head = "GET /sni-other HTTP/1.1\\r\\nHost: other.test\\r\\nConnection: close\\r\\n\\r\\n"
                tls.sendall(head.encode())
                out["sni_other"] = tls.recv(100).split(b"\\r\\n")[0].decode()
    except (OSError, ssl.SSLError) as exc:
        out["sni_other"] = type(exc).__name__
    # the same name in the ClientHello works
    try:
        with socket.create_connection(("up.test", int(tls_port)), timeout=30) as raw:
            with context.wrap_socket(raw, server_hostname="up.test") as tls:
                tls.sendall(b"GET /sni-ok HTTP/1.1\\r\\nHost: up.test\\r\\nConnection: close\\r\\n\\r\\n")
                out["sni_same"] = tls.recv(100).split(b"\\r\\n")[0].decode()
    except (OSError, ssl.SSLError) as exc:
        out["sni_same"] = type(exc).__name__
    print(json.dumps(out))
"""


def test_dns_udp_and_sni_inside_the_capture(
    tmp_path: Path, dns: DnsServer, upstream_tls: EchoHTTPSServer, ca_file: Path, audit: Path, work: Path
) -> None:
    dns.add("up.test", upstream_tls.host)
    dns.add("other.test", upstream_tls.host)
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp,
        DnsServer(UPSTREAM_V4[8]) as outside_dns,
    ):
        outside_dns.add("up.test", upstream_tls.host)
        udp.bind((UPSTREAM_V4[2], 0))
        udp.settimeout(0.5)
        udp_host, udp_port = udp.getsockname()
        command = [
            PY, "-c", textwrap.dedent(PROBE), str(upstream_tls.port), udp_host, str(udp_port),
            outside_dns.host, str(outside_dns.port), str(ca_file),
        ]  # fmt: skip
        result = run_captured(tmp_path, dns, audit, command, work, "--ro", str(ca_file.parent))
        seen = output(result)
        with pytest.raises(TimeoutError):
            udp.recvfrom(512)
        assert outside_dns.queries == []
    # the real addresses egressd resolved, whatever the spelling asked
    assert seen["up"] == seen["up_again"] == seen["other"] == [upstream_tls.host], seen
    up = upstream_tls.host
    assert seen["aaaa"] == "no address"  # the name has IPv4: capture is IPv4
    assert seen["dns_udp_53"] == seen["dns_tcp_53"] == [up]
    # dropped on the way out of the sender: sendto() itself fails (EPERM)
    assert seen["udp"] == seen["dns_other_port"] == "PermissionError"
    assert not seen["sni_mismatch"].startswith("ANSWERED"), seen
    assert seen["sni_other"].endswith(" 200 OK") and seen["sni_same"].endswith(" 200 OK"), seen
    assert refused_in_audit(audit, "other.test", "sni_mismatch")  # the newest name for the address
    assert dns.queries, "the proxy resolved the names it decided"
    assert sorted(r["path"] for r in upstream_tls.requests) == ["/sni-ok", "/sni-other"]


LITERAL = """
    import json, socket, sys
    host, port = sys.argv[1], int(sys.argv[2])
    with socket.create_connection((host, port), timeout=30) as s:
        head = "GET /literal HTTP/1.1\\r\\nHost: " + host + "\\r\\nConnection: close\\r\\n\\r\\n"
        s.sendall(head.encode())
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    print(json.dumps({"status": data.split(b"\\r\\n")[0].decode()}))
"""


def test_an_ip_literal_is_decided_as_a_literal(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer, audit: Path, work: Path
) -> None:
    """198.51.100.0/24 is allowed by an explicit CIDR rule: the literal destination is what the
    proxy decides (no name is invented for it)."""
    command = [PY, "-c", textwrap.dedent(LITERAL), upstream.host, str(upstream.port)]
    seen = output(run_captured(tmp_path, dns, audit, command, work))
    assert seen["status"].endswith("200 OK")
    assert upstream.requests[-1]["path"] == "/literal"
    assert any(r.get("host") == upstream.host and r.get("decision") == "allow" for r in records(audit))


BULK = """
    import hashlib, json, socket, sys, threading
    host, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    data = bytes(range(256)) * (size // 256)
    with socket.create_connection((host, port), timeout=60) as s:
        def send():
            s.sendall(data)
        sender = threading.Thread(target=send)
        sender.start()
        got = hashlib.sha256()
        count = 0
        while count < size and (chunk := s.recv(65536)):
            got.update(chunk)
            count += len(chunk)
        sender.join()
    print(json.dumps({"count": count, "same": got.hexdigest() == hashlib.sha256(data).hexdigest()}))
"""


def test_a_captured_connection_carries_megabytes_both_ways(
    tmp_path: Path, dns: DnsServer, tcp_echo: TcpEchoServer, audit: Path, work: Path
) -> None:
    """Once admitted, a captured connection is a byte relay: 16 MiB sent while the echo comes
    back arrive whole and in order (the relay holds back a side whose peer cannot take more)."""
    size = 16 << 20
    command = [PY, "-c", textwrap.dedent(BULK), tcp_echo.host, str(tcp_echo.port), str(size)]
    seen = output(run_captured(tmp_path, dns, audit, command, work))
    assert seen == {"count": size, "same": True}
    assert tcp_echo.received == size


def test_no_capture_gets_nothing(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer, audit: Path, work: Path
) -> None:
    command = [PY, "-c", textwrap.dedent(LITERAL), upstream.host, str(upstream.port)]
    result = run_captured(tmp_path, dns, audit, command, work, "--no-capture")
    assert result.returncode != 0
    assert b"Network is unreachable" in result.stderr
    assert upstream.connections == 0


@pytest.mark.parametrize("nft", ["/nonexistent/nft", "/bin/false"], ids=["missing", "refused"])
def test_without_nft_the_child_runs_confined_and_egressd_says_so(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer, audit: Path, work: Path, nft: str
) -> None:
    """No nft (or nft failing, as when the kernel refuses): a warning on stderr, the child still
    runs, the proxy still works, and a connection that ignores it gets nothing."""
    dns.add("up.test", upstream.host)
    env = sandbox_env(work)
    env["EGRESSD_NFT"] = nft
    script = f"""
        import json, subprocess, sys
        proxied = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-w", "%{{http_code}}",
                                  "http://up.test:{upstream.port}/proxied"], capture_output=True, text=True)
        direct = subprocess.run([sys.executable, "-c", sys.argv[1], "{upstream.host}", "{upstream.port}"],
                                capture_output=True, text=True)
        print(json.dumps({{"proxied": proxied.stdout, "direct": direct.returncode}}))
    """
    policy = write_policy(tmp_path)
    result = egressd_sandbox(
        ["--policy", str(policy), "--nameserver", dns.nameserver],
        [PY, "-c", textwrap.dedent(script), textwrap.dedent(LITERAL)],
        cwd=work,
        env=env,
        timeout=TIMEOUT,
    )
    seen = output(result)
    assert b"cannot capture connections that ignore the proxy variables" in result.stderr
    assert seen == {"proxied": "200", "direct": 1}
    assert [r["path"] for r in upstream.requests] == ["/proxied"]


UNDO = """
    import json, socket, subprocess, sys
    out = {}
    nft, ip = sys.argv[2:4]  # where they are (an ordinary user's PATH has no sbin)
    route = [ip, "route", "del", "local", "0.0.0.0/0", "dev", "lo", "table", "local"]
    for name, argv in (("nft_flush", [nft, "flush", "ruleset"]), ("route_del", route)):
        out[name] = subprocess.run(argv, capture_output=True).returncode
    # the transparent listener itself, asked directly: closed without a word
    try:
        with socket.create_connection(("127.0.0.1", 3129), timeout=30) as s:
            s.sendall(b"CONNECT up.test:80 HTTP/1.1\\r\\n\\r\\n")
            out["direct_listener"] = s.recv(100).decode()
    except OSError as exc:  # closed with our bytes unread: a reset
        out["direct_listener"] = type(exc).__name__
    for name in ("up.test", "elsewhere.test"):
        try:
            with socket.create_connection((name, int(sys.argv[1])), timeout=30) as s:
                s.sendall(b"GET /after HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n")
                out[name] = s.recv(100).split(b"\\r\\n")[0].decode()
        except OSError as exc:
            out[name] = type(exc).__name__
    print(json.dumps(out))
"""


def test_the_child_cannot_undo_or_skip_the_capture(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer, audit: Path, work: Path
) -> None:
    """The rules and route are out of the child's reach (it has no capabilities); the listener
    asked directly answers nothing; after the attempts, decisions are still the proxy's."""
    dns.add("up.test", upstream.host)
    tools = [str(capture.find_tool(name)) for name in ("nft", "ip")]
    command = [PY, "-c", textwrap.dedent(UNDO), str(upstream.port), *tools]
    seen = output(run_captured(tmp_path, dns, audit, command, work))
    assert seen["nft_flush"] != 0 and seen["route_del"] != 0
    assert seen["direct_listener"] in ("", "ConnectionResetError", "BrokenPipeError")
    assert seen["up.test"].endswith("200 OK")
    assert seen["elsewhere.test"] == "gaierror"  # a name the policy refuses has no address inside
    assert refused_in_audit(audit, "elsewhere.test", "not_allowlisted")
    assert [r["path"] for r in upstream.requests] == ["/after"]


PLAIN_REQUESTS = """
    import json, socket, sys
    out = {}
    for path, host in (("/v1/ok", "up.test"), ("/v2/no", "up.test"), ("/v1/fronted", "other.test")):
        with socket.create_connection(("up.test", int(sys.argv[1])), timeout=30) as s:
            head = f"GET {path} HTTP/1.1\\r\\nHost: {host}\\r\\nConnection: close\\r\\n\\r\\n"
            s.sendall(head.encode())
            data = b""
            while chunk := s.recv(4096):
                data += chunk
        out[path] = int(data.split(b" ")[1]) if data else None
    print(json.dumps(out))
"""


def test_plain_http_to_a_host_with_path_rules_is_decided_per_request(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer, audit: Path, work: Path
) -> None:
    """A captured plain-HTTP connection to a host with path rules is inspected like any CONNECT
    to it: each request's path is decided, and a Host header naming another host is refused."""
    dns.add("up.test", upstream.host)
    dns.add("other.test", upstream.host)
    policy = write_policy(
        tmp_path, "version: 1\nallow: [198.51.100.0/24]\nbuiltin:\n  - {host: up.test, paths: [/v1/]}\n"
    )
    options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(audit)]
    command = [*NO_PROXY_CONFIG, PY, "-c", textwrap.dedent(PLAIN_REQUESTS), str(upstream.port)]
    seen = output(egressd_sandbox(options, command, cwd=work, timeout=TIMEOUT))
    assert seen["/v1/ok"] == 200
    assert seen["/v2/no"] == 403 and refused_in_audit(audit, "up.test", "builtin_path")
    assert seen["/v1/fronted"] in (400, 403) and refused_in_audit(audit, "up.test", "host_mismatch")
    assert [r["path"] for r in upstream.requests] == ["/v1/ok"]


def test_node_and_go_reach_the_host_loopback_port_the_policy_names(
    tmp_path: Path, dns: DnsServer, ca_file: Path, audit: Path, work: Path, go_client: Path
) -> None:
    """node's fetch and Go never use a proxy for 127.0.0.1: their connection to the port the
    policy names for the host's loopback is captured and goes through the proxy to the host's
    service; another port stays the sandbox's own loopback (nothing there)."""
    with (
        EchoHTTPServer("127.0.0.1", name="host-service") as named,
        EchoHTTPServer("127.0.0.1", name="host-other") as other,
    ):
        urls = [f"http://127.0.0.1:{named.port}/named", f"http://127.0.0.1:{other.port}/other"]
        options = [
            "--allow-loopback-port",
            str(named.port),
            "--ro",
            str(go_client.parent),
            "--ro",
            str(ca_file.parent),
        ]
        node = output(
            run_captured(tmp_path, dns, audit, direct_clients.command("node", ca_file, urls), work, *options)
        )
        go = output(run_captured(tmp_path, dns, audit, [str(go_client), str(ca_file), *urls], work, *options))
        assert other.connections == 0
    for seen, prefixes in ((node, ("fetch ", "get ")), (go, ("",))):
        for prefix in prefixes:
            assert seen[prefix + urls[0]] == [200, "/named"], seen
            assert seen[prefix + urls[1]][0] == "error", seen
    assert [r["path"] for r in named.requests] == ["/named"] * 3
    assert any(r.get("host") == "127.0.0.1" and r.get("decision") == "allow" for r in records(audit))


# -- the child's DNS holds the real addresses; a connection is decided by the name behind it ----------
BY_NAME = """
    import json, socket, ssl, sys
    tls_port, plain_port, echo_host, echo_port, ca = sys.argv[1:6]
    context = ssl.create_default_context(cafile=ca)
    out = {}
    def get(host, path):
        return f"GET /{path} HTTP/1.1\\r\\nHost: {host}\\r\\nConnection: close\\r\\n\\r\\n".encode()
    def lookup(name):
        try:
            return sorted({i[4][0] for i in socket.getaddrinfo(name, 80, type=socket.SOCK_STREAM)})
        except socket.gaierror as exc:
            return str(exc)
    def tls(address, sni):
        try:
            with socket.create_connection((address, int(tls_port)), timeout=30) as raw:
                with context.wrap_socket(raw, server_hostname=sni) as conn:
                    conn.sendall(get(sni, sni))
                    return conn.recv(100).split(b"\\r\\n")[0].decode()
        except (OSError, ssl.SSLError) as exc:
            return type(exc).__name__
    def plain(address, port, host):
        try:
            with socket.create_connection((address, int(port)), timeout=30) as conn:
                conn.sendall(get(host, host))
                return conn.recv(100).split(b"\\r\\n")[0].decode() or "closed"
        except OSError as exc:
            return type(exc).__name__
    for name in ("up.test", "denied.test", "rotate.test"):
        out[name] = lookup(name)
    (up,) = out["up.test"]
    out["up by its name"] = tls(up, "up.test")
    # the same address, a ClientHello for a name that resolves there too but was refused
    out["denied on up's address"] = tls(up, "denied.test")
    # an address the child never had an answer for, though a server listens there
    out["never resolved"] = plain(echo_host, echo_port, echo_host)
    # rotate.test answers another address on every later query: the connection goes where the
    # child was told, with no second lookup
    (rotated,) = out["rotate.test"]
    out["rotate by its name"] = plain(rotated, plain_port, "rotate.test")
    print(json.dumps(out))
"""


def test_connections_are_decided_by_the_name_that_resolved_to_their_address(
    tmp_path: Path,
    dns: DnsServer,
    upstream: EchoHTTPServer,
    upstream_tls: EchoHTTPSServer,
    tcp_echo: TcpEchoServer,
    ca_file: Path,
    audit: Path,
    work: Path,
) -> None:
    dns.add("up.test", upstream_tls.host)
    dns.add("denied.test", upstream_tls.host)  # a refused name pointed at an allowed one's address
    dns.add_sequence("rotate.test", [[upstream.host], [UPSTREAM_V4[9]]])
    policy = write_policy(
        tmp_path,
        "version: 1\nprivate: {allow: true}\nallow: [up.test, rotate.test]\ndeny: [denied.test]\n",
    )
    options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(audit)]
    ports = [str(upstream_tls.port), str(upstream.port), *map(str, tcp_echo.address)]
    command = [PY, "-c", textwrap.dedent(BY_NAME), *ports, str(ca_file)]
    result = egressd_sandbox(
        [*options, "--ro", str(ca_file.parent)], [*NO_PROXY_CONFIG, *command], cwd=work, timeout=TIMEOUT
    )
    seen = output(result)
    assert seen["up.test"] == [upstream_tls.host]  # real, what an SSRF guard can judge
    assert seen["rotate.test"] == [upstream.host]
    assert "not known" in seen["denied.test"], seen  # a refused name is never looked up: no address
    assert dns.count("denied.test") == 0
    assert any(
        r.get("stage") == "dns" and r.get("host") == "denied.test" and r.get("reason") == "denylist"
        for r in records(audit)
    )
    assert seen["up by its name"].endswith(" 200 OK"), seen
    assert not seen["denied on up's address"].endswith(" 200 OK"), seen
    assert refused_in_audit(audit, "up.test", "sni_mismatch")
    # egressd's refusal, in the client's own protocol (HTTP here)
    assert seen["never resolved"] == "HTTP/1.1 403 Forbidden by egressd: not_allowlisted", seen
    assert refused_in_audit(audit, tcp_echo.address[0], "not_allowlisted") and tcp_echo.connections == 0
    assert seen["rotate by its name"].endswith(" 200 OK"), seen
    assert dns.count("rotate.test", "A") == 1  # the connection took the answer the child had
    assert [r["path"] for r in upstream_tls.requests] == ["/up.test"]
    assert [r["path"] for r in upstream.requests] == ["/rotate.test"]
