"""`egressd run --gateway`: clients named by their own tokens, through the real command line.

Why: a gateway serves other machines, so who a client is comes only from the token it presents
(and the network it comes from). Every case goes through `egressd run --gateway --listen
127.0.0.1:PORT` and `egressd gateway token ...` as a user runs them, with real clients (curl, raw
sockets) to real upstreams on the test namespace's loopback.
"""

from __future__ import annotations

import base64
import json
import re
import socket
import ssl
import stat
import subprocess
import threading
import urllib.request
from pathlib import Path

import pytest

from tests.support import netns
from tests.support.answers import parse_http
from tests.support.attempts import wait_until
from tests.support.audit_log import audit_records
from tests.support.corpus import Response, tunnel_get
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD, GatewayRun, write_policy
from tests.support.gateway_clients import add_token, client, token_cli
from tests.support.upstreams import EchoHTTPServer, EchoHTTPSServer, free_port

GATEWAY_POLICY = """\
version: 1
mode: enforce
allow:
  - up.test
  - other.test
  - 198.51.100.0/24  # the test upstreams' addresses (private ranges need an address rule)
deny:
  - denied.test
profiles:
  narrow:
    allow: [up.test]
"""


def curl(proxy: str, url: str, *extra: str) -> tuple[int, dict[str, str], bytes]:
    done = subprocess.run(
        ["curl", "-sS", "-i", "--max-time", "20", "--proxy", proxy, *extra, url],
        capture_output=True,
        timeout=60,
    )
    return parse_http(done.stdout)


@pytest.fixture
def gateway_env(tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer) -> dict[str, Path]:
    dns.add("up.test", upstream.host)
    dns.add("other.test", upstream.host)
    return {
        "policy": write_policy(tmp_path, GATEWAY_POLICY),
        "tokens": tmp_path / "gw" / "tokens.json",
        "audit": tmp_path / "audit.jsonl",
    }


def test_token_cli_prints_the_token_once_and_stores_only_its_hash(tmp_path: Path) -> None:
    tokens = tmp_path / "gw" / "tokens.json"
    policy = str(write_policy(tmp_path, GATEWAY_POLICY))
    done = token_cli(
        "add", "agent1", "--profile", "narrow", "--policy", policy, "--from", "10.0.0.0/8", tokens=tokens
    )
    assert done.returncode == 0, done.stderr
    token = done.stdout.strip()
    assert done.stdout == token + "\n" and len(token) >= 40  # the token and nothing else on stdout
    assert stat.S_IMODE(tokens.stat().st_mode) == 0o600
    text = tokens.read_text()
    assert token not in text
    entry = json.loads(text)["clients"]["agent1"]
    assert entry["profile"] == "narrow" and entry["from"] == ["10.0.0.0/8"]
    assert entry["hash"].startswith("sha256:")
    second = add_token(tokens, "agent2")
    assert second != token
    listed = token_cli("list", tokens=tokens)
    assert listed.returncode == 0, listed.stderr
    assert [line.split("\t")[0] for line in listed.stdout.splitlines()] == ["agent1", "agent2"]
    assert token not in listed.stdout and second not in listed.stdout
    assert "profile=narrow" in listed.stdout and "from=10.0.0.0/8" in listed.stdout
    assert token_cli("remove", "agent1", tokens=tokens).returncode == 0
    assert "agent1" not in json.loads(tokens.read_text())["clients"]
    missing = token_cli("remove", "agent1", tokens=tokens)
    assert missing.returncode == 1 and "no client" in missing.stderr
    for bad in ("a:b", "", "-x", "other", "x" * 65, "name with space"):
        refused = token_cli("add", bad, tokens=tokens)
        assert refused.returncode == 2 and refused.stdout == "", bad
    bad_net = token_cli("add", "agent3", "--from", "10.0.0.0/33", tokens=tokens)
    assert bad_net.returncode == 2 and "CIDR" in bad_net.stderr


def test_token_add_refuses_a_profile_the_policy_does_not_define(tmp_path: Path) -> None:
    """A typo in --profile is refused at once, naming the profiles there are; nothing is added (the
    gateway would otherwise refuse that client everything, later and without saying why)."""
    tokens = tmp_path / "gw" / "tokens.json"
    policy = str(write_policy(tmp_path, GATEWAY_POLICY))
    for extra in (("--policy", policy), ()):  # the gateway's policy, or the built-in one
        typo = token_cli("add", "ci", "--profile", "narow", *extra, tokens=tokens)
        assert typo.returncode == 2 and typo.stdout == "", typo.stderr
        assert "profile 'narow' is not defined" in typo.stderr
        assert not tokens.exists() or "ci" not in json.loads(tokens.read_text())["clients"]
    typo = token_cli("add", "ci", "--profile", "narow", "--policy", policy, tokens=tokens)
    assert "(profiles: narrow)" in typo.stderr and policy in typo.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("version: 1\nallow: [\n")
    refused = token_cli("add", "ci", "--profile", "narrow", "--policy", str(broken), tokens=tokens)
    assert refused.returncode == 2 and str(broken) in refused.stderr
    assert add_token(tokens, "ci", "--profile", "narrow", "--policy", policy)


def test_default_tokens_file_is_under_egressd_home(egressd_home: Path) -> None:
    done = subprocess.run([*EGRESSD, "gateway", "token", "add", "agent1"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    path = egressd_home / "gateway" / "tokens.json"
    assert "agent1" in json.loads(path.read_text())["clients"]
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_non_loopback_listen_needs_gateway(tmp_path: Path) -> None:
    # only the command-line check runs: nothing listens, nothing is sent
    done = subprocess.run(
        [*EGRESSD, "run", "--listen", "0.0.0.0:3128"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and done.stdout == ""
    assert "--gateway" in done.stderr and "loopback" in done.stderr
    stray = subprocess.run(
        [*EGRESSD, "run", "--tokens", str(tmp_path / "t.json")], capture_output=True, text=True, timeout=60
    )
    assert stray.returncode == 2 and "only with --gateway" in stray.stderr
    profile = subprocess.run(
        [*EGRESSD, "run", "--gateway", "--profile", "narrow"], capture_output=True, text=True, timeout=60
    )
    assert profile.returncode == 2 and "token add NAME --profile" in profile.stderr


def test_gateway_names_each_client_and_refuses_the_rest(
    gateway_env: dict[str, Path], upstream: EchoHTTPServer, dns: DnsServer
) -> None:
    tokens, policy, audit = gateway_env["tokens"], gateway_env["policy"], gateway_env["audit"]
    token = add_token(tokens, "agent1")
    narrow = add_token(tokens, "ci", "--profile", "narrow", "--policy", str(policy))
    socks_port = free_port()
    options = [
        "--gateway",
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--tokens",
        str(tokens),
        "--policy",
        str(policy),
        "--nameserver",
        dns.nameserver,
        "--audit",
        str(audit),
        "--socks-listen",
        f"127.0.0.1:{socks_port}",
        "--metrics",
        "127.0.0.1:0",
    ]
    url = f"http://up.test:{upstream.port}/hello"
    with GatewayRun(options) as run:
        assert token not in run.stderr and narrow not in run.stderr  # nothing secret printed
        host, port = run.address
        proxy = run.url_for("agent1", token)
        # allowed with the token: plain HTTP and a CONNECT tunnel
        first = curl(proxy, url)
        assert first[0] == 200, first
        with client(run, "agent1", token).connect(f"up.test:{upstream.port}") as (answer, sock):
            assert answer is not None and answer.status == 200
            inner = tunnel_get(sock, "up.test")
            assert inner is not None and inner.status == 200
        # refused host: 403 with the reason
        status, headers, _ = curl(proxy, f"http://denied.test:{upstream.port}/")
        assert status == 403 and headers.get("x-egressd-reason") == "denylist"
        # no token, a wrong token, a wrong name: 407
        assert curl(f"http://{host}:{port}", url)[0] == 407
        assert curl(run.url_for("agent1", token[:-2] + "xx"), url)[0] == 407
        assert curl(run.url_for("nobody", token), url)[0] == 407
        with client(run, "agent1", "wrong").connect(f"up.test:{upstream.port}") as (answer, _sock):
            assert answer is not None and answer.status == 407
        # SOCKS5 with name and token; a wrong token fails its authentication
        with client(run, "agent1", token, socks_port).socks5("up.test", upstream.port) as (code, sock):
            assert code == 0
            inner = tunnel_get(sock, "up.test")
            assert inner is not None and inner.status == 200
        with socket.create_connection((host, socks_port), timeout=10) as raw:
            raw.sendall(b"\x05\x01\x02")
            assert raw.recv(2) == b"\x05\x02"
            raw.sendall(b"\x01\x06agent1\x05wrong")
            assert raw.recv(2)[1:2] != b"\x00"
        # health check, no credentials
        with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=10) as health:
            assert health.status == 200 and health.read().strip() == b"ok"
        # the token's profile narrows: other.test is in the policy but not in profile narrow
        ci = run.url_for("ci", narrow)
        assert curl(ci, url)[0] == 200
        status, headers, _ = curl(ci, f"http://other.test:{upstream.port}/")
        assert status == 403 and headers.get("x-egressd-reason") in ("profile", "not_allowlisted")
        assert curl(proxy, f"http://other.test:{upstream.port}/")[0] == 200
        # each decision carries its client's name
        records = wait_until(
            lambda: [
                r
                for r in audit_records(audit)
                if r.get("event") == "decision" and r.get("client") == "ci" and r.get("decision") == "deny"
            ],
            "the ci client's refusal in the audit",
        )
        assert records[0]["host"] == "other.test" and records[0]["profile"] == "narrow", records
        assert any(r.get("client") == "agent1" and r.get("decision") == "allow" for r in audit_records(audit))
        assert token not in audit.read_text() and narrow not in audit.read_text()
        # the client's credentials never reach the upstream
        assert upstream.requests and all("proxy-authorization" not in r["headers"] for r in upstream.requests)
        # metrics: decisions per client name (the token file's names only)
        metrics_url = re.search(r"metrics on (\S+)", run.stderr)
        assert metrics_url is not None, run.stderr
        body = urllib.request.urlopen(metrics_url.group(1), timeout=10).read().decode()
        assert re.search(
            r'egressd_gateway_client_decisions_total\{client="agent1",decision="allow"\} [1-9]', body
        )
        assert re.search(r'egressd_gateway_client_decisions_total\{client="ci",decision="deny"\} [1-9]', body)
        assert "up.test" not in body
        # a token added while it runs works, a removed one stops, without a restart
        late = add_token(tokens, "late")
        wait_until(lambda: curl(run.url_for("late", late), url)[0] == 200, "the new token admitted")
        with client(run, "agent1", token).connect(f"up.test:{upstream.port}") as (answer, held):
            assert answer is not None and answer.status == 200
            assert token_cli("remove", "agent1", tokens=tokens).returncode == 0
            wait_until(lambda: curl(proxy, url)[0] == 407, "the removed token refused")
            # and the tunnel it had open is closed, not left until idle_timeout
            held.settimeout(20)
            assert held.recv(1) == b""
        # a policy edit applies without a restart
        policy.write_text(GATEWAY_POLICY.replace("  - up.test\n", "", 1))
        wait_until(lambda: curl(run.url_for("late", late), url)[0] == 403, "the policy edit applied")
        assert "reload" in run.stderr
    # the gateway refused nothing from the control API's side: it never listened elsewhere
    assert run.proc is not None and run.proc.returncode == 0, run.stderr


def test_a_removed_token_is_refused_on_the_next_identical_connect(
    gateway_env: dict[str, Path], upstream: EchoHTTPServer, dns: DnsServer
) -> None:
    """A client sends the same CONNECT head again and again (its credentials found valid once are
    remembered with it): once the token file without it is in force, the very next CONNECT with
    that same head is refused 407, and another client's still works."""
    tokens, policy = gateway_env["tokens"], gateway_env["policy"]
    token = add_token(tokens, "agent1")
    options = ["--gateway", "--listen", f"127.0.0.1:{free_port()}", "--tokens", str(tokens)]
    options += ["--policy", str(policy), "--nameserver", dns.nameserver]
    authority = f"up.test:{upstream.port}"
    with GatewayRun(options) as run:
        for _ in range(3):
            with client(run, "agent1", token).connect(authority) as (answer, sock):
                assert answer is not None and answer.status == 200, answer
                assert tunnel_get(sock, "up.test") is not None
        assert token_cli("remove", "agent1", tokens=tokens).returncode == 0
        probe = add_token(tokens, "probe")  # written after the removal: in force means both are
        probing = run.url_for("probe", probe)
        wait_until(lambda: curl(probing, f"http://{authority}/")[0] == 200, "the new token file in force")
        with client(run, "agent1", token).connect(authority) as (answer, _):
            assert answer is not None and answer.status == 407, answer
            assert answer.reason == "proxy_auth_required"
        with client(run, "probe", probe).connect(authority) as (answer, _):
            assert answer is not None and answer.status == 200, answer


def test_a_removed_clients_waiting_requests_are_answered(
    tmp_path: Path, upstream: EchoHTTPServer, dns: DnsServer
) -> None:
    """A plain-HTTP request waiting for its response and a CONNECT still being admitted (its name
    resolving) when the client's token is removed are answered 407 with the reason: never a
    connection closed without an answer. Another client's request in flight is served."""
    dns.add("up.test", upstream.host)
    dns.add("slow.test", upstream.host, delay=8)
    tokens = tmp_path / "tokens.json"
    token, kept = add_token(tokens, "agent1"), add_token(tokens, "agent2")
    policy = write_policy(
        tmp_path, "version: 1\nallow: [up.test, slow.test, 198.51.100.0/24]\nlimits: {dns_timeout: 30}\n"
    )
    options = ["--gateway", "--listen", f"127.0.0.1:{free_port()}", "--tokens", str(tokens)]
    options += ["--policy", str(policy), "--nameserver", dns.nameserver]
    slow = f"http://up.test:{upstream.port}/slow?s=10"
    answers: dict[str, Response | None] = {}

    def plain(key: str, name: str, secret: str) -> None:
        answers[key] = client(run, name, secret).get(slow, timeout=40)

    def tunnel() -> None:
        with client(run, "agent1", token).connect(f"slow.test:{upstream.port}", timeout=40) as (answer, _):
            answers["tunnel"] = answer

    with GatewayRun(options) as run:
        waiting = [
            threading.Thread(target=plain, args=("removed", "agent1", token)),
            threading.Thread(target=plain, args=("kept", "agent2", kept)),
            threading.Thread(target=tunnel),
        ]
        for thread in waiting:
            thread.start()
        wait_until(lambda: len(upstream.requests) == 2, "both plain requests at the upstream")
        assert token_cli("remove", "agent1", tokens=tokens).returncode == 0
        for thread in waiting:
            thread.join(60)
    removed, tunnelled, served = answers["removed"], answers["tunnel"], answers["kept"]
    assert removed is not None and removed.status == 407, removed
    assert removed.reason == "proxy_auth_required" and b"removed" in removed.body, removed
    assert tunnelled is not None and tunnelled.status == 407, tunnelled
    assert served is not None and served.status == 200, served


def test_gateway_source_networks(
    gateway_env: dict[str, Path], upstream: EchoHTTPServer, dns: DnsServer
) -> None:
    tokens, policy = gateway_env["tokens"], gateway_env["policy"]
    anywhere = add_token(tokens, "anywhere")
    pinned = add_token(tokens, "pinned", "--from", "127.0.0.1/32")
    url = f"http://up.test:{upstream.port}/"
    base = ["--gateway", "--listen", f"127.0.0.1:{free_port()}", "--tokens", str(tokens)]
    base += ["--policy", str(policy), "--nameserver", dns.nameserver]
    from_second = ("--interface", "127.0.0.2")
    with GatewayRun(base) as run:
        assert curl(run.url_for("pinned", pinned), url)[0] == 200
        assert curl(run.url_for("pinned", pinned), url, *from_second)[0] == 407  # --from
        assert curl(run.url_for("anywhere", anywhere), url, *from_second)[0] == 200
    with GatewayRun([*base, "--allow-from", "127.0.0.2/32"]) as run:
        assert curl(run.url_for("anywhere", anywhere), url, *from_second)[0] == 200
        assert curl(run.url_for("anywhere", anywhere), url)[0] == 407  # --allow-from
        # both apply: the token's own network and the gateway's
        assert curl(run.url_for("pinned", pinned), url, *from_second)[0] == 407
        assert curl(run.url_for("pinned", pinned), url)[0] == 407


def test_gateway_refusal_hint_names_the_policy_file(gateway_env: dict[str, Path], dns: DnsServer) -> None:
    """A gateway's client cannot run `egressd exec`: the refusal names the gateway's policy file and
    the rule its operator adds, over plain HTTP and inside a refused CONNECT's answer alike."""
    tokens, policy = gateway_env["tokens"], gateway_env["policy"]
    token = add_token(tokens, "agent1")
    options = ["--gateway", "--listen", f"127.0.0.1:{free_port()}", "--tokens", str(tokens)]
    with GatewayRun([*options, "--policy", str(policy), "--nameserver", dns.nameserver]) as run:
        proxy = run.url_for("agent1", token)
        for url, rule in (("http://nope.test/", "nope.test"), ("http://nope.test:8080/", "nope.test:8080")):
            status, _headers, body = curl(proxy, url)
            text = body.decode()
            assert status == 403 and "egressd exec" not in text, text
            assert f"adds '{rule}' to the allow list in {policy}" in text, text
        credentials = base64.b64encode(f"agent1:{token}".encode()).decode()
        with socket.create_connection(run.address, timeout=10) as raw:
            raw.sendall(
                b"CONNECT nope.test:443 HTTP/1.1\r\nHost: nope.test:443\r\n"
                + f"Proxy-Authorization: Basic {credentials}\r\n\r\n".encode()
            )
            answer = b"".join(iter(lambda: raw.recv(4096), b""))
        assert (
            answer.startswith(b"HTTP/1.1 403")
            and f"adds 'nope.test' to the allow list in {policy}".encode() in answer
        )
    with GatewayRun(options) as run:  # no policy file: the operator needs one
        status, _headers, body = curl(run.url_for("agent1", token), "http://nope.test/")
        assert status == 403 and "restarts it with --policy FILE, 'nope.test'" in body.decode()


def test_gateway_tls_listener(
    gateway_env: dict[str, Path], upstream: EchoHTTPServer, dns: DnsServer, egressd_home: Path, tmp_path: Path
) -> None:
    """--tls-name: the proxy port speaks TLS with a certificate from egressd's CA, so a client's
    token never crosses the network in clear: real curl with `--proxy https://`, plain HTTP and a
    CONNECT tunnel inside it; a client speaking clear text gets no HTTP answer at all; a client that
    does not trust egressd's CA stops at the handshake, before its token is sent."""
    tokens, policy = gateway_env["tokens"], gateway_env["policy"]
    token = add_token(tokens, "agent1")
    port = free_port()
    options = ["--gateway", "--listen", f"127.0.0.1:{port}", "--tokens", str(tokens), "--policy", str(policy)]
    options += ["--nameserver", dns.nameserver, "--tls-name", "127.0.0.1", "--tls-name", "gateway.test"]
    url = f"http://up.test:{upstream.port}/hello"
    with GatewayRun(options) as run:
        assert run.scheme == "https", run.stderr
        ca = ("--proxy-cacert", str(egressd_home / "public" / "egressd-ca-cert.pem"))
        proxy = run.url_for("agent1", token)
        assert proxy.startswith("https://")
        assert curl(proxy, url, *ca)[0] == 200  # absolute-form HTTP inside TLS
        assert curl(proxy, url, *ca, "--proxytunnel")[0] == 200  # CONNECT inside TLS
        status, headers, _ = curl(proxy, f"http://denied.test:{upstream.port}/", *ca)
        assert status == 403 and headers.get("x-egressd-reason") == "denylist"
        assert curl(run.url_for("agent1", "wrong"), url, *ca)[0] == 407
        # the certificate names what clients dial: the name too, verified against egressd's CA
        context = ssl.create_default_context(cafile=ca[1])
        with (
            socket.create_connection(run.address, timeout=10) as raw,
            context.wrap_socket(raw, server_hostname="gateway.test") as tls,
        ):
            assert tls.version() in ("TLSv1.2", "TLSv1.3")
        # a client in clear text: no HTTP answer (TLS alert or close), so nothing it sent was read
        credentials = base64.b64encode(f"agent1:{token}".encode()).decode()
        with socket.create_connection(run.address, timeout=10) as raw:
            raw.sendall(f"GET {url} HTTP/1.1\r\nProxy-Authorization: Basic {credentials}\r\n\r\n".encode())
            answer = b"".join(iter(lambda: raw.recv(4096), b""))
        assert not answer.startswith(b"HTTP/"), answer[:80]
        # a client that does not trust egressd's CA refuses the handshake: curl exits 35/60, no answer
        done = subprocess.run(
            ["curl", "-sS", "--max-time", "20", "--proxy", proxy, url], capture_output=True, timeout=60
        )
        assert done.returncode in (35, 60) and done.stdout == b"", done
    assert run.proc is not None and run.proc.returncode == 0, run.stderr


def test_gateway_tls_listener_hands_an_inspected_tunnel_over(
    tmp_path: Path, dns: DnsServer, upstream_tls: EchoHTTPSServer, ca_file: Path, egressd_home: Path
) -> None:
    """TLS on the proxy port meets inspection: a CONNECT inside the client's TLS to egressd, to a
    host admitted for some paths only, is served by the embedded mitmproxy on that TLS connection
    (curl: HTTPS inside the HTTPS proxy), each request decided with its path."""
    dns.add("up.test", upstream_tls.host)
    tokens = tmp_path / "tokens.json"
    token = add_token(tokens, "agent1")
    rule = "{host: up.test, paths: [/pkg/], methods: [GET]}"
    policy = write_policy(tmp_path, f"version: 1\nallow:\n  - 198.51.100.0/24\n  - {rule}\n")
    port = free_port()
    options = ["--gateway", "--listen", f"127.0.0.1:{port}", "--tokens", str(tokens), "--policy", str(policy)]
    options += ["--nameserver", dns.nameserver, "--upstream-ca", str(ca_file), "--tls-name", "127.0.0.1"]
    with GatewayRun(options) as run:
        egressd_ca = str(egressd_home / "public" / "egressd-ca-cert.pem")
        trust = ("--proxy-cacert", egressd_ca, "--cacert", egressd_ca)
        proxy, base = run.url_for("agent1", token), f"https://up.test:{upstream_tls.port}"
        assert proxy.startswith("https://")
        assert curl(proxy, f"{base}/pkg/a", *trust)[0] == 200
        status, headers, _ = curl(proxy, f"{base}/admin", *trust)
        assert status == 403 and headers.get("x-egressd-reason") == "not_allowlisted", headers
    assert [r["path"] for r in upstream_tls.requests] == ["/pkg/a"]


def test_gateway_tls_options(tmp_path: Path) -> None:
    """--tls-cert needs --tls-key, does not mix with --tls-name, and every --tls-* needs --gateway."""
    for args, error in (
        (["--gateway", "--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
        (["--gateway", "--tls-cert", "c", "--tls-key", "k", "--tls-name", "x"], "not with --tls-cert"),
        (["--tls-name", "x"], "--tls-name only with --gateway"),
    ):
        done = subprocess.run([*EGRESSD, "run", *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and error in done.stderr, (args, done.stderr)


def test_gateway_refusals_tell_its_operator_what_to_edit(
    gateway_env: dict[str, Path], dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    """A gateway's client is another machine: its refusals name what the gateway's operator edits
    in the gateway's policy file (the allow list; for a client whose token has a profile, the
    line of that profile), never `egressd exec`, and nothing says so to the client as if it could."""
    tokens, policy = gateway_env["tokens"], gateway_env["policy"]
    agent = add_token(tokens, "agent1")
    ci = add_token(tokens, "ci", "--profile", "narrow", "--policy", str(policy))
    options = ["--gateway", "--listen", f"127.0.0.1:{free_port()}", "--tokens", str(tokens)]
    with GatewayRun([*options, "--policy", str(policy), "--nameserver", dns.nameserver]) as run:
        status, _, body = curl(run.url_for("agent1", agent), "http://nope.test/")
        said = body.decode()
        assert (
            status == 403 and f"the gateway's operator adds 'nope.test' to the allow list in {policy}" in said
        )
        status, headers, body = curl(run.url_for("ci", ci), f"http://other.test:{upstream.port}/")
        said = body.decode()
        assert status == 403 and headers["x-egressd-reason"] == "profile", said
        line = f"the line '- other.test:{upstream.port}' under profiles.narrow.allow in {policy}"
        assert f"To allow it, the gateway's operator adds {line} (a saved edit applies at once)" in said, said
        for text in (said, run.stderr):
            assert "egressd exec" not in text and "a person can run" not in text
    assert upstream.requests == []


@pytest.mark.parametrize("own_address", ["127.0.0.1", netns.INTERFACE_V4[0]], ids=["loopback", "interface"])
def test_gateway_refuses_its_own_host_unless_named(tmp_path: Path, own_address: str) -> None:
    """The gateway host's loopback and interface addresses are not its clients': only the ports
    `loopback.ports` names."""
    loopback_server = EchoHTTPServer(own_address)
    with loopback_server:
        tokens = tmp_path / "tokens.json"
        token = add_token(tokens, "agent1")
        policy = write_policy(tmp_path, f"version: 1\nmode: enforce\nallow: [{own_address}]\n")
        base = ["--gateway", "--listen", f"127.0.0.1:{free_port()}", "--tokens", str(tokens)]
        with GatewayRun([*base, "--policy", str(policy)]) as run:
            status, headers, _ = curl(run.url_for("agent1", token), loopback_server.url)
            assert status == 403 and headers.get("x-egressd-reason") == "loopback_port"
            named = f"loopback:\n  ports: [{loopback_server.port}]\n"
            policy.write_text(f"version: 1\nmode: enforce\nallow: [{own_address}]\n{named}")
            wait_until(
                lambda: curl(run.url_for("agent1", token), loopback_server.url)[0] == 200,
                "the named loopback port admitted",
            )


def test_gateway_keeps_the_last_good_token_file(
    tmp_path: Path, upstream: EchoHTTPServer, dns: DnsServer
) -> None:
    dns.add("up.test", upstream.host)
    tokens = tmp_path / "tokens.json"
    token = add_token(tokens, "agent1")
    policy = write_policy(tmp_path, GATEWAY_POLICY)
    options = ["--gateway", "--listen", f"127.0.0.1:{free_port()}", "--tokens", str(tokens)]
    options += ["--policy", str(policy), "--nameserver", dns.nameserver]
    url = f"http://up.test:{upstream.port}/"
    with GatewayRun(options) as run:
        assert curl(run.url_for("agent1", token), url)[0] == 200
        tokens.write_text("{not json")
        assert run.wait_for_stderr("token file reload failed", timeout=20), run.stderr
        assert curl(run.url_for("agent1", token), url)[0] == 200


def test_basic_credentials_spellings_are_checked_exactly(
    gateway_env: dict[str, Path], upstream: EchoHTTPServer, dns: DnsServer
) -> None:
    """The nasty spellings of Proxy-Authorization: none of them is anyone's."""
    tokens, policy = gateway_env["tokens"], gateway_env["policy"]
    token = add_token(tokens, "agent1")
    options = ["--gateway", "--listen", f"127.0.0.1:{free_port()}", "--tokens", str(tokens)]
    options += ["--policy", str(policy), "--nameserver", dns.nameserver]

    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    with GatewayRun(options) as run:
        host, port = run.address
        target = f"up.test:{upstream.port}"

        def status(value: str | None) -> int | None:
            auth = f"Proxy-Authorization: {value}\r\n" if value is not None else ""
            with socket.create_connection((host, port), timeout=10) as sock:
                sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n".encode())
                head = sock.recv(200).split(b" ", 2)
                return int(head[1]) if len(head) > 1 else None

        assert status(f"Basic {b64('agent1:' + token)}") == 200
        for value in (
            None,
            f"Bearer {token}",
            f"Basic {b64('agent1:' + token + ' ')}",
            f"Basic {b64('AGENT1:' + token)}",
            f"Basic {b64('agent1' + token)}",
            f"Basic {b64(':' + token)}",
            f"Basic {b64('agent1:')}",
            f"Basic {b64('agent1:' + token.upper())}",
            f"Basic {b64('agent1:' + token)}!!",
            "Basic",
        ):
            assert status(value) == 407, value


def _listening(pid: int) -> set[str]:
    """The TCP addresses process `pid` listens on (ss, in the test's network namespace)."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[3] for line in out.splitlines() if f"pid={pid}," in line}


def test_gateway_on_an_interface_inspects_and_keeps_its_internals_on_loopback(
    tmp_path: Path, dns: DnsServer, upstream_tls: EchoHTTPSServer, ca_file: Path, egressd_home: Path
) -> None:
    """A gateway on a non-loopback address (one of the test namespace's own): a host admitted for
    some paths only is inspected for its client, the client's name is on the inner decisions, and
    the embedded mitmproxy it starts for that listens nowhere, least of all on the gateway's
    address (the front hands it the tunnels)."""
    dns.add("up.test", upstream_tls.host)
    tokens = tmp_path / "tokens.json"
    token = add_token(tokens, "agent1")
    policy = write_policy(
        tmp_path,
        "version: 1\nallow:\n  - 198.51.100.0/24\n  - {host: up.test, paths: [/pkg/], methods: [GET]}\n",
    )
    audit = tmp_path / "audit.jsonl"
    address = netns.UPSTREAM_V4[8]
    options = ["--gateway", "--listen", f"{address}:{free_port(address)}", "--tokens", str(tokens)]
    options += ["--policy", str(policy), "--nameserver", dns.nameserver, "--upstream-ca", str(ca_file)]
    options += ["--audit", str(audit)]
    with GatewayRun(options) as run:
        assert run.address[0] == address
        assert run.proc is not None
        proxy = run.url_for("agent1", token)
        cacert = ("--cacert", str(egressd_home / "public" / "egressd-ca-cert.pem"))
        base = f"https://up.test:{upstream_tls.port}"
        assert curl(proxy, f"{base}/pkg/a", *cacert)[0] == 200
        status, headers, _ = curl(proxy, f"{base}/admin", *cacert)
        assert status == 403 and headers.get("x-egressd-reason") in ("builtin_path", "not_allowlisted"), (
            headers
        )
        # the requests inside the inspected tunnel: the decisions that name a path
        inner = [r for r in audit_records(audit) if r.get("event") == "decision" and r.get("path")]
        assert {r.get("path") for r in inner} == {"/pkg/a", "/admin"}, inner
        assert all(r.get("client") == "agent1" for r in inner), inner
        listening = _listening(run.proc.pid)
        assert f"{address}:{run.address[1]}" in listening, listening
        others = listening - {f"{address}:{run.address[1]}"}
        assert not others, listening


def test_gateway_on_every_address_refuses_itself(
    gateway_env: dict[str, Path], upstream: EchoHTTPServer, dns: DnsServer
) -> None:
    """`--listen 0.0.0.0:PORT` (what a container runs): clients reach it on any of the host's
    addresses, and no client reaches the gateway itself through it, on any of them."""
    tokens, policy = gateway_env["tokens"], gateway_env["policy"]
    token = add_token(tokens, "agent1")
    port = free_port()
    options = ["--gateway", "--listen", f"0.0.0.0:{port}", "--tokens", str(tokens)]
    options += ["--policy", str(policy), "--nameserver", dns.nameserver]
    with GatewayRun(options) as run:
        own = netns.INTERFACE_V4[0]  # an interface address of the namespace: the gateway's own
        for host in ("127.0.0.1", own):
            with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=10) as health:
                assert health.status == 200
            proxy = f"http://agent1:{token}@{host}:{port}"
            assert curl(proxy, f"http://up.test:{upstream.port}/")[0] == 200
            for target in (f"127.0.0.1:{port}", f"{own}:{port}", f"0.0.0.0:{port}"):
                with client(run, "agent1", token).connect(target) as (answer, _sock):
                    assert answer is not None and answer.status == 403, (host, target)
                    assert answer.reason in ("self", "loopback_port", "forbidden_address"), answer.reason
