"""Real clients through `egressd exec` to real servers in the test namespace.

Every refusal is checked for its status, Proxy-Status, X-Egressd-Reason and — through the servers'
connection counters — that nothing reached a server the policy refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.answers import assert_refusal, parse_http
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import egressd_exec, write_policy
from tests.support.upstreams import EchoHTTPServer, EchoHTTPSServer, RefusingPort, StallingPort

HERE = Path(__file__).resolve().parents[1]


def curl_via(
    policy: Path, dns: DnsServer, *args: str, extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[bytes]:
    return egressd_exec(
        ["--policy", str(policy), "--nameserver", dns.nameserver, *extra],
        ["curl", "-sS", "-i", "--max-time", "20", *args],
    )


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    return write_policy(tmp_path)


# -- allowed -----------------------------------------------------------------------------------
def test_curl_plain_http_allowed(policy: Path, dns: DnsServer, upstream: EchoHTTPServer) -> None:
    dns.add("up.test", upstream.host)
    result = curl_via(policy, dns, f"http://up.test:{upstream.port}/hello?x=1")
    status, headers, body = parse_http(result.stdout)
    assert status == 200, result.stderr
    seen = upstream.requests[-1]
    assert seen["path"] == "/hello?x=1"
    assert seen["headers"]["host"] == f"up.test:{upstream.port}"
    # egressd's own credentials and proxy headers never reach the upstream
    assert "proxy-authorization" not in seen["headers"]
    assert "proxy-connection" not in seen["headers"]


def test_curl_https_tunnel_passthrough(
    policy: Path, dns: DnsServer, upstream_tls: EchoHTTPSServer, ca_file: Path
) -> None:
    dns.add("up.test", upstream_tls.host)
    result = curl_via(policy, dns, "--cacert", str(ca_file), f"https://up.test:{upstream_tls.port}/secure")
    status, _, body = parse_http(result.stdout)
    assert status == 200, result.stderr
    assert json.loads(body)["path"] == "/secure"
    # not intercepted: the upstream's own certificate reached the client (verified with ca_file only)


def test_ip_literal_target_allowed_by_cidr(policy: Path, dns: DnsServer, upstream: EchoHTTPServer) -> None:
    result = curl_via(policy, dns, f"http://{upstream.host}:{upstream.port}/ip")
    assert parse_http(result.stdout)[0] == 200
    assert dns.queries == []  # an IP literal is never resolved


def test_loopback_allowed_by_default_policy(dns: DnsServer) -> None:
    with EchoHTTPServer("127.0.0.1", name="local") as local:
        result = egressd_exec([], ["curl", "-sS", "-i", f"http://127.0.0.1:{local.port}/local"])
        assert parse_http(result.stdout)[0] == 200
        assert local.connections == 1


# -- refused, one per main reason --------------------------------------------------------------
def test_not_allowlisted_plain_http(policy: Path, dns: DnsServer) -> None:
    result = curl_via(policy, dns, "http://elsewhere.test/")
    assert_refusal(result, 403, "not_allowlisted", "http_request_denied")
    _, _, body = parse_http(result.stdout)
    text = body.decode()
    assert "elsewhere.test" in text and "policy decision" in text and "egressd exec --allow" in text
    assert dns.queries == []  # refused before any lookup


def test_not_allowlisted_connect(policy: Path, dns: DnsServer) -> None:
    result = curl_via(policy, dns, "https://elsewhere.test/")
    assert_refusal(result, 403, "not_allowlisted", "http_request_denied")
    assert dns.queries == []


def test_denylist_beats_allowlist(tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer) -> None:
    policy = write_policy(tmp_path, "version: 1\nallow: [198.51.100.0/24, up.test]\ndeny: [up.test]\n")
    dns.add("up.test", upstream.host)
    result = curl_via(policy, dns, f"http://up.test:{upstream.port}/")
    assert_refusal(result, 403, "denylist", "http_request_denied")
    assert upstream.connections == 0


def test_metadata_literal_forbidden_in_any_spelling(policy: Path, dns: DnsServer) -> None:
    for spelling in (
        "169.254.169.254",
        "2852039166",
        "0xa9fea9fe",
        "0251.0376.0251.0376",
        "[::ffff:169.254.169.254]",
    ):
        result = curl_via(
            policy, dns, "--path-as-is", f"http://{spelling}/latest/meta-data/", extra=("--mode", "allow")
        )
        assert_refusal(result, 403, "forbidden_address", "destination_ip_prohibited")


def test_name_resolving_to_metadata_refused(policy: Path, dns: DnsServer) -> None:
    dns.add("up.test", "169.254.169.254")
    result = curl_via(policy, dns, "http://up.test/")
    headers = assert_refusal(result, 403, "resolved_forbidden", "destination_ip_prohibited")
    assert "169.254.169.254" in headers["proxy-status"]


def test_name_resolving_to_loopback_refused(policy: Path, dns: DnsServer) -> None:
    with EchoHTTPServer("127.0.0.1", name="local") as local:
        dns.add("up.test", "127.0.0.1")
        result = curl_via(policy, dns, f"http://up.test:{local.port}/")
        assert_refusal(result, 403, "resolved_forbidden", "destination_ip_prohibited")
        assert local.connections == 0


def test_dns_nxdomain_is_502(policy: Path, dns: DnsServer) -> None:
    dns.nxdomain("up.test")
    for url in ("http://up.test/", "https://up.test/"):
        result = curl_via(policy, dns, url)
        assert_refusal(result, 502, "dns_error", "dns_error")


def test_dns_servfail_is_502(policy: Path, dns: DnsServer) -> None:
    dns.servfail("up.test")
    assert_refusal(curl_via(policy, dns, "http://up.test/"), 502, "dns_error", "dns_error")


def test_dns_timeout_is_502(tmp_path: Path, dns: DnsServer) -> None:
    policy = write_policy(tmp_path, "version: 1\nallow: [up.test]\nlimits: {dns_timeout: 1}\n")
    dns.blackhole("up.test")
    assert_refusal(curl_via(policy, dns, "https://up.test/"), 502, "dns_timeout", "dns_timeout")


def test_connection_refused_is_502(policy: Path, dns: DnsServer, refusing_port: RefusingPort) -> None:
    host, port = refusing_port.address
    dns.add("up.test", host)
    assert_refusal(
        curl_via(policy, dns, f"http://up.test:{port}/"), 502, "connect_refused", "connection_refused"
    )


def test_connect_timeout_is_504(tmp_path: Path, dns: DnsServer, stalling_port: StallingPort) -> None:
    policy = write_policy(
        tmp_path, "version: 1\nallow: [up.test, 198.51.100.0/24]\nlimits: {connect_timeout: 1}\n"
    )
    host, port = stalling_port.address
    dns.add("up.test", host)
    assert_refusal(
        curl_via(policy, dns, f"https://up.test:{port}/"), 504, "connect_timeout", "connection_timeout"
    )


@pytest.mark.parametrize("scheme", ["https", "http"])
def test_connecting_does_not_count_against_header_timeout(
    tmp_path: Path, dns: DnsServer, stalling_port: StallingPort, scheme: str
) -> None:
    """header_timeout bounds the request head only: a complete CONNECT whose upstream is slow to
    answer gets the connect_timeout refusal, not a connection cut as a slow client."""
    policy = write_policy(
        tmp_path,
        "version: 1\nallow: [up.test, 198.51.100.0/24]\nlimits: {connect_timeout: 3, header_timeout: 1}\n",
    )
    host, port = stalling_port.address
    dns.add("up.test", host)
    assert_refusal(
        curl_via(policy, dns, f"{scheme}://up.test:{port}/"), 504, "connect_timeout", "connection_timeout"
    )


def test_port_restriction(tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer) -> None:
    policy = write_policy(tmp_path, "version: 1\nallow: [up.test, 198.51.100.0/24]\nports: [443]\n")
    dns.add("up.test", upstream.host)
    assert_refusal(
        curl_via(policy, dns, f"http://up.test:{upstream.port}/"), 403, "port", "http_request_denied"
    )
    assert upstream.connections == 0


def test_mode_off_refuses_everything(policy: Path, dns: DnsServer) -> None:
    result = curl_via(policy, dns, "http://up.test/", extra=("--mode", "off"))
    assert_refusal(result, 403, "mode_off", "http_request_denied")


def test_egressd_mode_env_overrides_file(policy: Path, dns: DnsServer, upstream: EchoHTTPServer) -> None:
    env = dict(os.environ, EGRESSD_MODE="off")
    result = egressd_exec(
        ["--policy", str(policy), "--nameserver", dns.nameserver],
        ["curl", "-sS", "-i", f"http://{upstream.host}:{upstream.port}/"],
        env=env,
    )
    assert_refusal(result, 403, "mode_off", "http_request_denied")


def test_missing_credentials_get_407(policy: Path, dns: DnsServer) -> None:
    # the child strips the credentials from its proxy URL: egressd answers 407
    script = (
        "p=${HTTP_PROXY#http://}; p=${p#*@}; "
        'curl -sS -i --proxy "http://$p" http://up.test/; '
        'curl -sS -i --proxy "http://egressd:wrong@$p" http://up.test/'
    )
    result = egressd_exec(["--policy", str(policy)], ["sh", "-c", script])
    out = result.stdout
    assert out.count(b"407 Proxy Authentication Required") == 2
    assert b"Proxy-Authenticate: Basic" in out


def test_host_header_naming_another_host_refused(
    policy: Path, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    dns.add("up.test", upstream.host)
    result = curl_via(policy, dns, "-H", "Host: elsewhere.test", f"http://up.test:{upstream.port}/")
    assert_refusal(result, 400, "host_mismatch", "http_request_error")
    assert upstream.connections == 0


def test_sni_mismatch_closes_tunnel(
    policy: Path, dns: DnsServer, upstream_tls: EchoHTTPSServer, ca_file: Path
) -> None:
    dns.add("up.test", upstream_tls.host)
    port = upstream_tls.port
    # CONNECT up.test, but the TLS ClientHello names other.test
    result = curl_via(
        policy,
        dns,
        "--cacert",
        str(ca_file),
        "--connect-to",
        f"other.test:{port}:up.test:{port}",
        f"https://other.test:{port}/",
    )
    assert result.returncode != 0
    assert b'"path"' not in result.stdout
    assert upstream_tls.requests == []


def test_forged_egressd_headers_from_upstream_are_stripped(
    policy: Path, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    dns.add("up.test", upstream.host)
    result = curl_via(policy, dns, f"http://up.test:{upstream.port}/headers-forged")
    status, headers, _ = parse_http(result.stdout)
    assert status == 200
    assert "x-egressd-reason" not in headers and "proxy-status" not in headers


# -- resolution and pinning --------------------------------------------------------------------
def test_rebinding_name_uses_the_validated_address(
    policy: Path, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    # first answer: the upstream; every later answer: 127.0.0.1 (a DNS rebinding attack)
    with EchoHTTPServer("127.0.0.1", port=upstream.port, name="loopback-victim") as victim:
        dns.add_sequence("up.test", [[upstream.host], ["127.0.0.1"]])
        url = f"http://up.test:{upstream.port}/r"
        # one connection carries several requests: resolved once, all go to the validated address
        first = curl_via(policy, dns, url, "--next", "-sS", "-i", url, "--next", "-sS", "-i", url)
        assert first.stdout.count(b"HTTP/1.1 200") == 3, first.stdout
        assert dns.count("up.test", "A") == 1
        assert upstream.connections == 1
        # the next connection resolves anew, gets 127.0.0.1, and is refused before connecting
        second = curl_via(policy, dns, url)
        assert_refusal(second, 403, "resolved_forbidden", "destination_ip_prohibited")
        assert victim.connections == 0


def test_one_lookup_per_connection(
    policy: Path, dns: DnsServer, upstream_tls: EchoHTTPSServer, ca_file: Path
) -> None:
    dns.add("up.test", upstream_tls.host)
    result = curl_via(policy, dns, "--cacert", str(ca_file), f"https://up.test:{upstream_tls.port}/")
    assert parse_http(result.stdout)[0] == 200
    assert dns.count("up.test", "A") == 1


def test_refused_address_then_accepting_address(
    policy: Path, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    # 198.51.100.9 has nothing listening on the upstream's port: refused, then the next one is tried
    dns.add("up.test", "198.51.100.9", upstream.host)
    result = curl_via(policy, dns, f"http://up.test:{upstream.port}/next")
    assert parse_http(result.stdout)[0] == 200
    assert upstream.connections == 1


def test_mixed_answer_drops_forbidden_addresses(
    policy: Path, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    dns.add("up.test", "169.254.169.254", upstream.host)
    result = curl_via(policy, dns, f"http://up.test:{upstream.port}/mixed")
    assert parse_http(result.stdout)[0] == 200


def test_ipv6_upstream(policy: Path, dns: DnsServer, upstream_v6: EchoHTTPServer) -> None:
    dns.add("up.test", upstream_v6.host)
    result = curl_via(policy, dns, f"http://up.test:{upstream_v6.port}/v6")
    assert parse_http(result.stdout)[0] == 200


# -- other clients -----------------------------------------------------------------------------
PY_CLIENT = r"""
import json, sys, urllib.request, urllib.error
import requests, httpx
out = {}
for url in sys.argv[1:]:
    try:
        out["urllib " + url] = urllib.request.urlopen(url, timeout=20).status
    except urllib.error.HTTPError as e:
        out["urllib " + url] = [e.code, e.headers.get("X-Egressd-Reason")]
    r = requests.get(url, timeout=20, verify=False) if url.startswith("http:") else None
    if r is not None:
        out["requests " + url] = [r.status_code, r.headers.get("X-Egressd-Reason")]
    try:
        r = httpx.get(url, timeout=20, trust_env=True)
        out["httpx " + url] = [r.status_code, r.headers.get("X-Egressd-Reason")]
    except httpx.ProxyError as e:
        out["httpx " + url] = ["proxy-error", str(e)]
print(json.dumps(out))
"""


def test_python_clients(
    policy: Path, dns: DnsServer, upstream: EchoHTTPServer, upstream_tls: EchoHTTPSServer, ca_file: Path
) -> None:
    dns.add("up.test", upstream.host)
    dns.add("other.test", upstream_tls.host)
    env = dict(os.environ, SSL_CERT_FILE=str(ca_file), REQUESTS_CA_BUNDLE=str(ca_file))
    urls = [
        f"http://up.test:{upstream.port}/py",
        "http://elsewhere.test/py",
        f"https://other.test:{upstream_tls.port}/py",
    ]
    result = egressd_exec(
        ["--policy", str(policy), "--nameserver", dns.nameserver],
        [sys.executable, "-c", PY_CLIENT, *urls],
        env=env,
    )
    assert result.returncode == 0, result.stderr.decode()
    out = json.loads(result.stdout)
    assert out[f"urllib {urls[0]}"] == 200
    assert out[f"requests {urls[0]}"] == [200, None]
    assert out[f"httpx {urls[0]}"] == [200, None]
    assert out[f"urllib {urls[1]}"] == [403, "not_allowlisted"]
    assert out[f"requests {urls[1]}"] == [403, "not_allowlisted"]
    assert out[f"httpx {urls[1]}"] == [403, "not_allowlisted"]
    assert out[f"urllib {urls[2]}"] == 200
    assert out[f"httpx {urls[2]}"] == [200, None]


NODE_CLIENT = str(HERE / "support" / "node_proxy_client.js")


def test_node_client(
    policy: Path, dns: DnsServer, upstream: EchoHTTPServer, upstream_tls: EchoHTTPSServer, ca_file: Path
) -> None:
    dns.add("up.test", upstream.host)
    dns.add("other.test", upstream_tls.host)
    env = dict(os.environ, CA_FILE=str(ca_file))
    result = egressd_exec(
        ["--policy", str(policy), "--nameserver", dns.nameserver],
        [
            "node",
            NODE_CLIENT,
            f"http://up.test:{upstream.port}/n",
            "http://elsewhere.test/n",
            f"https://other.test:{upstream_tls.port}/n",
        ],
        env=env,
    )
    assert result.returncode == 0, result.stderr.decode()
    assert json.loads(result.stdout) == [
        [200, None],
        [403, "not_allowlisted"],
        [200, None],
        [403, "not_allowlisted"],
    ]
