"""TLS inspection where a rule needs it, built-in allowances, credential stripping, response limits."""

from __future__ import annotations

import json
import os
import socket
import ssl
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import trustme

from tests.support.answers import assert_refusal, parse_http
from tests.support.audit_log import audit_records
from tests.support.corpus import read_head
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD, EgressdRun, egressd_exec, write_policy
from tests.support.upstreams import EchoHTTPServer, EchoHTTPSServer

CA_VARS = (
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "GIT_SSL_CAINFO",
    "PIP_CERT",
    "AWS_CA_BUNDLE",
    "CARGO_HTTP_CAINFO",
    "DENO_CERT",
    "NIX_SSL_CERT_FILE",
)

BUILTIN_POLICY = """\
version: 1
allow: [198.51.100.0/24]
builtin:
  - {host: up.test, paths: [/pkg/], methods: [GET]}
"""


@pytest.fixture
def home(egressd_home: Path) -> Path:
    """egressd's config dir (the CA) for this test only (conftest sets EGRESSD_HOME)."""
    return egressd_home


def run_exec(
    policy: Path, dns: DnsServer, home: Path, ca_file: Path | None, command: list[str], *extra: str
) -> subprocess.CompletedProcess[bytes]:
    options = ["--policy", str(policy), "--nameserver", dns.nameserver, *extra]
    if ca_file is not None:
        options += ["--upstream-ca", str(ca_file)]
    env = dict(os.environ, EGRESSD_HOME=str(home))
    return egressd_exec(options, command, env=env)


def assert_no_ca_variables_from_egressd(child: dict[str, str]) -> None:
    """Without inspection egressd sets none: whatever the child has, it inherited."""
    for var in CA_VARS:
        assert child.get(var) == os.environ.get(var), var


def curl(*args: str) -> list[str]:
    return ["curl", "-sS", "-i", "--max-time", "20", "--path-as-is", *args]


# -- built-in allowances and path rules --------------------------------------------------------
def test_builtin_paths_on_intercepted_https(
    tmp_path: Path, dns: DnsServer, upstream_tls: EchoHTTPSServer, ca_file: Path, home: Path
) -> None:
    policy = write_policy(tmp_path, BUILTIN_POLICY)
    dns.add("up.test", upstream_tls.host)
    base = f"https://up.test:{upstream_tls.port}"
    ok = run_exec(policy, dns, home, ca_file, curl(f"{base}/pkg/a?v=1"))
    status, _, body = parse_http(ok.stdout)
    assert status == 200, ok.stdout + ok.stderr
    assert json.loads(body)["path"] == "/pkg/a?v=1"
    for path in (
        "/admin",
        "/pkg/../admin",
        "/pkg/%2e%2e/admin",
        "/pkg/%2E%2E/admin",
        "//pkg/a",
        "/pkg%2fa",
        "/pk",
    ):
        refused = run_exec(policy, dns, home, ca_file, curl(f"{base}{path}"))
        assert_refusal(refused, 403, "builtin_path", "http_request_denied")
    post = run_exec(policy, dns, home, ca_file, curl("-X", "POST", "-d", "x", f"{base}/pkg/a"))
    assert_refusal(post, 403, "builtin_path", "http_request_denied")
    assert [r["path"] for r in upstream_tls.requests] == ["/pkg/a?v=1"]


def test_builtin_paths_on_plain_http(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer, home: Path
) -> None:
    policy = write_policy(tmp_path, BUILTIN_POLICY)
    dns.add("up.test", upstream.host)
    base = f"http://up.test:{upstream.port}"
    assert parse_http(run_exec(policy, dns, home, None, curl(f"{base}/pkg/x")).stdout)[0] == 200
    refused = run_exec(policy, dns, home, None, curl(f"{base}/pkg/../etc"))
    assert_refusal(refused, 403, "builtin_path", "http_request_denied")
    assert [r["path"] for r in upstream.requests] == ["/pkg/x"]


def test_allow_rule_with_paths_and_methods(
    tmp_path: Path, dns: DnsServer, upstream_tls: EchoHTTPSServer, ca_file: Path, home: Path
) -> None:
    policy = write_policy(
        tmp_path,
        "version: 1\nallow:\n  - 198.51.100.0/24\n  - {host: up.test, paths: [/v1/read], methods: [GET]}\n",
    )
    dns.add("up.test", upstream_tls.host)
    base = f"https://up.test:{upstream_tls.port}"
    assert parse_http(run_exec(policy, dns, home, ca_file, curl(f"{base}/v1/read/item")).stdout)[0] == 200
    for args in (("-X", "DELETE", f"{base}/v1/read/item"), (f"{base}/v1/write",), (f"{base}/v1/readme",)):
        result = run_exec(policy, dns, home, ca_file, curl(*args))
        assert parse_http(result.stdout)[0] == 403, result.stdout
    assert len(upstream_tls.requests) == 1


def test_no_inspect_refuses_hosts_that_need_it(
    tmp_path: Path, dns: DnsServer, upstream_tls: EchoHTTPSServer, home: Path
) -> None:
    policy = write_policy(tmp_path, BUILTIN_POLICY)
    dns.add("up.test", upstream_tls.host)
    result = run_exec(
        policy, dns, home, None, curl(f"https://up.test:{upstream_tls.port}/pkg/a"), "--no-inspect"
    )
    assert_refusal(result, 403, "needs_inspection", "http_request_denied")
    assert upstream_tls.connections == 0
    env = run_exec(
        policy,
        dns,
        home,
        None,
        [sys.executable, "-c", "import os, json; print(json.dumps(dict(os.environ)))"],
        "--no-inspect",
    )
    child = json.loads(env.stdout)
    assert_no_ca_variables_from_egressd(child)
    assert not (home / "ca").exists()  # no CA is created when nothing is intercepted


# -- the CA and the child's trust --------------------------------------------------------------
def test_ca_bundle_variables_only_when_inspection_is_on(tmp_path: Path, dns: DnsServer, home: Path) -> None:
    dump = [sys.executable, "-c", "import os, json; print(json.dumps(dict(os.environ)))"]
    plain = write_policy(tmp_path, "version: 1\nallow: [up.test]\n", name="plain.yaml")
    child = json.loads(run_exec(plain, dns, home, None, dump).stdout)
    assert_no_ca_variables_from_egressd(child)
    inspecting = write_policy(tmp_path, BUILTIN_POLICY)
    child = json.loads(run_exec(inspecting, dns, home, None, dump).stdout)
    bundle = Path(child["SSL_CERT_FILE"])
    assert all(child[var] == str(bundle) for var in CA_VARS)
    ca_cert = (home / "public" / "egressd-ca-cert.pem").read_text().strip()
    text = bundle.read_text()
    assert ca_cert in text and text.count("BEGIN CERTIFICATE") > 10  # system roots plus egressd's CA
    assert not any(b"PRIVATE KEY" in p.read_bytes() for p in bundle.parent.iterdir())  # .jks too
    key_dir = home / "ca"
    assert stat.S_IMODE(key_dir.stat().st_mode) == 0o700
    key = key_dir / "mitmproxy-ca.pem"
    assert "PRIVATE KEY" in key.read_text() and stat.S_IMODE(key.stat().st_mode) == 0o600


def test_ca_path_and_rotate(home: Path) -> None:
    env = dict(os.environ, EGRESSD_HOME=str(home))
    first = subprocess.run([*EGRESSD, "ca", "path"], env=env, capture_output=True, text=True, check=True)
    path = Path(first.stdout.strip())
    before = path.read_text()
    assert "BEGIN CERTIFICATE" in before and "PRIVATE" not in before
    again = subprocess.run([*EGRESSD, "ca", "path"], env=env, capture_output=True, text=True, check=True)
    assert again.stdout == first.stdout and path.read_text() == before
    subprocess.run([*EGRESSD, "ca", "rotate"], env=env, capture_output=True, check=True)
    assert path.read_text() != before


def _peer_issuer(host: str, port: int, cafile: str, sni: str, proxy_url: str) -> str:
    """CONNECT through the proxy, then a TLS handshake trusting only cafile: the issuer's O=."""
    import base64
    from urllib.parse import urlsplit

    proxy = urlsplit(proxy_url)
    auth = base64.b64encode(f"{proxy.username}:{proxy.password}".encode()).decode()
    sock = socket.create_connection((proxy.hostname, proxy.port), timeout=10)
    sock.sendall(
        f"CONNECT {sni}:{port} HTTP/1.1\r\nHost: {sni}:{port}\r\n"
        f"Proxy-Authorization: Basic {auth}\r\n\r\n".encode()
    )
    head = read_head(sock)
    assert b" 200 " in head.split(b"\r\n")[0], head
    context = ssl.create_default_context(cafile=cafile)
    with context.wrap_socket(sock, server_hostname=sni) as tls:
        issuer = dict(x[0] for x in tls.getpeercert()["issuer"])
    return str(issuer.get("organizationName"))


def test_pinned_client_works_for_hosts_not_inspected(
    tmp_path: Path, dns: DnsServer, upstream_tls: EchoHTTPSServer, ca: trustme.CA, ca_file: Path, home: Path
) -> None:
    policy = write_policy(
        tmp_path,
        "version: 1\nallow: [other.test, 198.51.100.0/24]\ninspect: [up.test]\n"
        "builtin:\n  - {host: up.test, paths: [/], methods: [GET]}\n",
    )
    dns.add("up.test", upstream_tls.host)
    dns.add("other.test", upstream_tls.host)
    with EgressdRun(
        ["--policy", str(policy), "--nameserver", dns.nameserver, "--upstream-ca", str(ca_file)]
    ) as run:
        # a client that trusts only the upstream's own CA (pinned): fine where egressd does not intercept
        assert (
            _peer_issuer(upstream_tls.host, upstream_tls.port, str(ca_file), "other.test", run.proxy_url)
            == "egressd tests"
        )
        # and it notices interception where the policy asks for it
        with pytest.raises(ssl.SSLCertVerificationError):
            _peer_issuer(upstream_tls.host, upstream_tls.port, str(ca_file), "up.test", run.proxy_url)
        bundle = run.env["SSL_CERT_FILE"]
        assert (
            _peer_issuer(upstream_tls.host, upstream_tls.port, bundle, "up.test", run.proxy_url) == "egressd"
        )


def test_upstream_certificate_is_verified(
    tmp_path: Path, dns: DnsServer, upstream_tls: EchoHTTPSServer, home: Path
) -> None:
    policy = write_policy(tmp_path, BUILTIN_POLICY)
    dns.add("up.test", upstream_tls.host)
    result = run_exec(policy, dns, home, None, curl(f"https://up.test:{upstream_tls.port}/pkg/a"))
    headers = assert_refusal(result, 502, "upstream_tls_error", "tls_certificate_error")
    assert "certificate" in headers["proxy-status"].lower()
    assert upstream_tls.requests == []


# -- credentials on host change ----------------------------------------------------------------
REQUESTS_FOLLOW = r"""
import json, sys, requests
r = requests.get(sys.argv[1], headers={"Authorization": "Bearer secret-token", "X-Api-Key": "k-123",
                 "Cookie": "session=s1", "X-Other": "kept"}, timeout=20)
print(json.dumps({"status": r.status_code, "history": [h.status_code for h in r.history],
                  "reason": r.headers.get("X-Egressd-Reason")}))
"""

STRIP_POLICY = """\
version: 1
allow: [up.test, other.test, 198.51.100.0/24]
credentials:
  strip_on_host_change: [authorization, cookie, proxy-authorization, x-api-key]
"""


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_credentials_stripped_on_cross_origin_redirect(
    tmp_path: Path, dns: DnsServer, ca: trustme.CA, ca_file: Path, home: Path, scheme: str
) -> None:
    names = ["up.test", "other.test"]
    server = EchoHTTPSServer if scheme == "https" else EchoHTTPServer
    kwargs = {"ca": ca, "hostnames": names} if scheme == "https" else {}
    inspect = "inspect: [up.test, other.test]\n" if scheme == "https" else ""
    policy = write_policy(tmp_path, STRIP_POLICY + inspect)
    audit = tmp_path / "audit.jsonl"
    with (
        server("198.51.100.11", name="origin", **kwargs) as origin,
        server("198.51.100.12", name="target", **kwargs) as target,
    ):
        dns.add("up.test", origin.host)
        dns.add("other.test", target.host)
        landing = f"{scheme}://other.test:{target.port}/landing"
        cross = f"{scheme}://up.test:{origin.port}/redirect?to={landing}"
        same = f"{scheme}://up.test:{origin.port}/redirect?to=/same"
        for url in (cross, same):
            result = run_exec(
                policy,
                dns,
                home,
                ca_file,
                [sys.executable, "-c", REQUESTS_FOLLOW, url],
                "--audit",
                str(audit),
            )
            assert json.loads(result.stdout) == {"status": 200, "history": [302], "reason": None}, (
                result.stderr
            )
        followed = target.requests[-1]["headers"]
        for name in ("authorization", "x-api-key", "cookie"):
            assert name not in followed
        assert followed["x-other"] == "kept"
        same_origin = origin.requests[-1]
        assert same_origin["path"] == "/same"
        assert same_origin["headers"]["authorization"] == "Bearer secret-token"
        assert same_origin["headers"]["x-api-key"] == "k-123"
    events = audit_records(audit)
    stripped = [e for e in events if e["event"] == "credentials_stripped"]
    assert len(stripped) == 1
    # requests drops Authorization (and the Cookie header) itself; the custom X-Api-Key it forwards
    assert stripped[0]["host"] == "other.test" and "x-api-key" in stripped[0]["stripped"]


def test_redirect_into_refused_host_is_refused(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer, home: Path
) -> None:
    policy = write_policy(tmp_path, STRIP_POLICY)
    dns.add("up.test", upstream.host)
    url = f"http://up.test:{upstream.port}/redirect?to=http://elsewhere.test/x"
    result = run_exec(policy, dns, home, None, [sys.executable, "-c", REQUESTS_FOLLOW, url])
    assert json.loads(result.stdout) == {"status": 403, "history": [302], "reason": "not_allowlisted"}


# -- limits and protocol options ---------------------------------------------------------------
def test_max_response_bytes(
    tmp_path: Path,
    dns: DnsServer,
    upstream: EchoHTTPServer,
    upstream_tls: EchoHTTPSServer,
    ca_file: Path,
    home: Path,
) -> None:
    policy = write_policy(
        tmp_path,
        "version: 1\nallow: [up.test, other.test, 198.51.100.0/24]\ninspect: [other.test]\n"
        "limits: {max_response_bytes: 100000}\n",
    )
    audit = tmp_path / "audit.jsonl"
    dns.add("up.test", upstream.host)
    dns.add("other.test", upstream_tls.host)
    small = run_exec(policy, dns, home, ca_file, curl(f"http://up.test:{upstream.port}/big?n=1000"))
    assert parse_http(small.stdout)[0] == 200
    for url in (
        f"http://up.test:{upstream.port}/big?n=200000",
        f"https://other.test:{upstream_tls.port}/big?n=200000",
    ):
        big = run_exec(policy, dns, home, ca_file, curl(url), "--audit", str(audit))
        headers = assert_refusal(big, 502, "response_too_large", "http_response_body_size")
        assert "100000" in headers["proxy-status"]
    # a response of unknown length is cut once it passes the limit: the client sees a broken transfer
    policy_small = write_policy(
        tmp_path,
        "version: 1\nallow: [up.test, 198.51.100.0/24]\nlimits: {max_response_bytes: 200}\n",
        name="small.yaml",
    )
    stream = run_exec(
        policy_small,
        dns,
        home,
        None,
        ["curl", "-sS", "--max-time", "20", f"http://up.test:{upstream.port}/sse"],
        "--audit",
        str(audit),
    )
    assert stream.returncode != 0
    assert stream.stdout.count(b"data:") < 10
    events = audit_records(audit)
    assert len([e for e in events if e["event"] == "response_cut"]) == 3


def test_a_response_cut_at_the_limit_never_reaches_the_client_complete(
    tmp_path: Path,
    dns: DnsServer,
    upstream: EchoHTTPServer,
    upstream_tls: EchoHTTPSServer,
    ca_file: Path,
    home: Path,
) -> None:
    """A response of unknown length that arrives whole at once (one chunk and the body's end in
    one write), inspected or plain: once past limits.max_response_bytes it is cut, and its end is
    not sent after the cut, so the client sees a broken transfer, not a shortened complete one."""
    policy = write_policy(
        tmp_path,
        "version: 1\nallow: [up.test, other.test, 198.51.100.0/24]\ninspect: [other.test]\n"
        "limits: {max_response_bytes: 100000}\n",
    )
    audit = tmp_path / "audit.jsonl"
    dns.add("up.test", upstream.host)
    dns.add("other.test", upstream_tls.host)
    urls = [
        f"https://other.test:{upstream_tls.port}/chunked?n=",
        f"http://up.test:{upstream.port}/chunked?n=",
    ]
    for url in urls:
        whole = run_exec(policy, dns, home, ca_file, ["curl", "-sS", "--max-time", "20", url + "50000"])
        assert whole.returncode == 0 and whole.stdout == b"x" * 50000, whole.stderr
        for _ in range(3):
            command = ["curl", "-sS", "--max-time", "20", url + "150000"]
            cut = run_exec(policy, dns, home, ca_file, command, "--audit", str(audit))
            # curl: 18, a partial transfer; 56, a receive error. 0 would be a shortened body taken whole.
            assert cut.returncode in (18, 56), (url, cut.returncode, cut.stderr.decode()[-3000:])
            assert len(cut.stdout) <= 100000
    assert len([e for e in audit_records(audit) if e["event"] == "response_cut"]) == 6


def test_websocket_upgrade_refused_when_off(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer, home: Path
) -> None:
    upgrade = (
        "-H",
        "Connection: Upgrade",
        "-H",
        "Upgrade: websocket",
        "-H",
        "Sec-WebSocket-Version: 13",
        "-H",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
    )
    off = write_policy(
        tmp_path, "version: 1\nallow: [up.test, 198.51.100.0/24]\nwebsocket: false\n", name="off.yaml"
    )
    dns.add("up.test", upstream.host)
    refused = run_exec(off, dns, home, None, curl(*upgrade, f"http://up.test:{upstream.port}/ws"))
    assert_refusal(refused, 403, "websocket", "http_request_denied")
    assert upstream.requests == []
    on = write_policy(tmp_path, "version: 1\nallow: [up.test, 198.51.100.0/24]\n", name="on.yaml")
    relayed = run_exec(on, dns, home, None, curl(*upgrade, f"http://up.test:{upstream.port}/ws"))
    assert parse_http(relayed.stdout)[0] == 200
    assert upstream.requests[-1]["headers"]["upgrade"] == "websocket"


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


@pytest.mark.slow
def test_intercepted_256mib_response_streams_with_bounded_memory(
    tmp_path: Path, dns: DnsServer, upstream_tls: EchoHTTPSServer, ca_file: Path
) -> None:
    policy = write_policy(tmp_path, "version: 1\nallow: [up.test, 198.51.100.0/24]\ninspect: [up.test]\n")
    dns.add("up.test", upstream_tls.host)
    size = 256 * 1024 * 1024
    with EgressdRun(
        ["--policy", str(policy), "--nameserver", dns.nameserver, "--upstream-ca", str(ca_file)]
    ) as run:
        assert run.proc is not None
        before = _peak_rss_kib(run.proc.pid)
        result = subprocess.run(
            [
                "curl",
                "-sS",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code} %{size_download}",
                f"https://up.test:{upstream_tls.port}/big?n={size}",
            ],
            env=run.child_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.stdout == f"200 {size}", result.stderr
        growth_mib = (_peak_rss_kib(run.proc.pid) - before) / 1024
        assert growth_mib < 128, f"peak RSS grew by {growth_mib:.0f} MiB for a 256 MiB body"
