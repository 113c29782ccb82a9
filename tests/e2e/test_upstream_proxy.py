"""`upstream_proxy:` through a real Squid on loopback that requires credentials.

Why: a parent proxy is only worth something if what egressd admits really goes through it and
what egressd refuses never reaches it. Squid's access log is the witness: an allowed CONNECT (or the
CONNECT that carries a plain-HTTP request) shows up there, a refused target never does. A parent
that refuses egressd's credentials, or is down, gives the child a 502 whose reason says which;
the credentials themselves appear in no audit line, trace or error.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from tests.support.answers import parse_http
from tests.support.attempts import wait_until
from tests.support.audit_log import audit_records
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun, egressd_exec, write_policy
from tests.support.squid import base_conf, running_squid
from tests.support.upstreams import EchoHTTPServer, EchoHTTPSServer, free_port

USER, PASSWORD = "egressd-parent", "s3cret-parent-pass"
CREDS_ENV = "EGRESSD_TEST_PARENT_CREDENTIALS"


@dataclass
class Parent:
    port: int
    directory: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        path = self.directory / "access.log"
        return path.read_text() if path.exists() else ""

    def wait_for(self, text: str, timeout: float = 15) -> str:
        wait_until(lambda: text in self.log(), f"{text!r} in squid's access log", timeout)
        return self.log()


@pytest.fixture(scope="module")
def parent() -> Iterator[Parent]:
    """Squid on 127.0.0.1 requiring basic credentials (an htpasswd file checked by basic_ncsa_auth).
    Its directory is outside pytest's 0700 tree: squid writes its access log as its own user."""
    directory = Path(tempfile.mkdtemp(prefix="egressd-parent-", dir="/var/tmp"))
    try:
        yield from _squid(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _squid(directory: Path) -> Iterator[Parent]:
    hashed = subprocess.run(
        ["openssl", "passwd", "-1", PASSWORD], capture_output=True, text=True, check=True
    ).stdout.strip()
    htpasswd = directory / "htpasswd"
    htpasswd.write_text(f"{USER}:{hashed}\n")
    htpasswd.chmod(0o644)
    (directory / "hosts").write_text("198.51.100.2 up.test\n")  # connect_by: name resolves here
    port = free_port("127.0.0.1")
    conf = [
        *base_conf(directory, port, access_log=True),
        "dns_nameservers 127.0.0.1",
        f"auth_param basic program /usr/lib/squid/basic_ncsa_auth {htpasswd}",
        "auth_param basic realm parent",
        "acl authed proxy_auth REQUIRED",
        "acl forbidden dst 198.51.100.9",  # the parent's own rule: a 403 egressd did not decide
        "http_access deny !authed",
        "http_access deny forbidden",
        "http_access allow authed",
        "http_access deny all",
    ]
    with running_squid(directory, port, conf):
        yield Parent(port, directory)


def _policy(tmp_path: Path, parent_url: str, extra: str = "", parent_extra: str = "") -> Path:
    text = f"""\
version: 1
allow: [up.test, other.test, 198.51.100.0/24]
deny: [denied.test]
{extra}
upstream_proxy:
  url: {parent_url}
  credentials_env: {CREDS_ENV}
  direct: [other.test]
{parent_extra}"""
    return write_policy(tmp_path, text)


def _exec(
    policy: Path,
    dns: DnsServer,
    command: list[str],
    *,
    creds: str = f"{USER}:{PASSWORD}",
    extra: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, CREDS_ENV: creds}
    return egressd_exec(["--policy", str(policy), "--nameserver", dns.nameserver, *extra], command, env=env)


def _curl(*args: str) -> list[str]:
    return ["curl", "-sS", "-i", "--max-time", "20", *args]


def _audit(path: Path) -> list[dict[str, object]]:
    return audit_records(path)


# -- allowed traffic goes through the parent ------------------------------------------------------
def test_tunnel_goes_through_the_parent_by_pinned_address(
    tmp_path: Path, parent: Parent, dns: DnsServer, upstream_tls: EchoHTTPSServer, ca_file: Path
) -> None:
    dns.add("up.test", upstream_tls.host)
    audit = tmp_path / "audit.jsonl"
    policy = _policy(tmp_path, parent.url)
    result = _exec(
        policy,
        dns,
        _curl("--cacert", str(ca_file), f"https://up.test:{upstream_tls.port}/through"),
        extra=("--audit", str(audit), "--trace"),
    )
    status, _, body = parse_http(result.stdout)
    assert status == 200, result.stderr
    assert json.loads(body)["path"] == "/through"
    # the parent was asked for the pinned address, not the name: the pin holds through it
    parent.wait_for(f"CONNECT {upstream_tls.host}:{upstream_tls.port}")
    assert f"{USER}" in parent.log()  # squid logs the authenticated user
    records = [r for r in _audit(audit) if r.get("stage") == "connection"]
    assert records and records[-1]["via"] == f"127.0.0.1:{parent.port}"
    assert records[-1]["connected"] == f"{upstream_tls.host}:{upstream_tls.port}"
    everything = audit.read_text() + result.stderr.decode()
    assert PASSWORD not in everything and USER not in everything


def test_plain_http_goes_through_the_parent(
    tmp_path: Path, parent: Parent, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    dns.add("up.test", upstream.host)
    policy = _policy(tmp_path, parent.url)
    result = _exec(policy, dns, _curl(f"http://up.test:{upstream.port}/plain?q=1"))
    status, _, _ = parse_http(result.stdout)
    assert status == 200, result.stderr
    seen = upstream.requests[-1]
    assert seen["path"] == "/plain?q=1"
    assert seen["headers"]["host"] == f"up.test:{upstream.port}"
    # neither egressd's credentials nor the parent's reach the origin
    assert "proxy-authorization" not in seen["headers"]
    parent.wait_for(f"CONNECT {upstream.host}:{upstream.port}")


def test_socks5_goes_through_the_parent(
    tmp_path: Path, parent: Parent, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    dns.add("up.test", upstream.host)
    policy = _policy(tmp_path, parent.url)
    script = f'curl -sS -i --max-time 20 -x "$EGRESSD_SOCKS_PROXY" http://up.test:{upstream.port}/socks'
    result = _exec(policy, dns, ["sh", "-c", script])
    assert parse_http(result.stdout)[0] == 200, result.stderr
    assert upstream.requests[-1]["path"] == "/socks"
    parent.wait_for(f"CONNECT {upstream.host}:{upstream.port}")


def test_inspected_tunnel_goes_through_the_parent(
    tmp_path: Path, parent: Parent, dns: DnsServer, ca: trustme.CA, ca_file: Path
) -> None:
    """mitmproxy's upstream connection is the pin's too: through the parent."""
    with EchoHTTPSServer("198.51.100.6", ca=ca, hostnames=["up.test"], name="inspected") as server:
        dns.add("up.test", server.host)
        policy = _policy(tmp_path, parent.url, extra="inspect: [up.test]")
        result = _exec(
            policy,
            dns,
            _curl(f"https://up.test:{server.port}/inspected"),
            extra=("--upstream-ca", str(ca_file)),
        )
        status, _, body = parse_http(result.stdout)
        assert status == 200, result.stderr
        assert json.loads(body)["path"] == "/inspected"
        parent.wait_for(f"CONNECT {server.host}:{server.port}")


def test_connect_by_name_sends_the_name(
    tmp_path: Path, parent: Parent, dns: DnsServer, upstream_tls: EchoHTTPSServer, ca_file: Path
) -> None:
    dns.add("up.test", upstream_tls.host)  # egressd still resolves it and checks the addresses
    policy = _policy(tmp_path, parent.url, parent_extra="  connect_by: name\n")
    result = _exec(policy, dns, _curl("--cacert", str(ca_file), f"https://up.test:{upstream_tls.port}/n"))
    assert parse_http(result.stdout)[0] == 200, result.stderr
    parent.wait_for(f"CONNECT up.test:{upstream_tls.port}")
    assert dns.queries, "egressd resolved the name before sending it to the parent"


# -- refused traffic never reaches the parent ----------------------------------------------------
def test_refused_targets_never_reach_the_parent(
    tmp_path: Path, parent: Parent, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    dns.add("up.test", upstream.host)
    dns.add("rebound.test", "169.254.169.254")
    policy = _policy(tmp_path, parent.url, extra="private:\n  allow: true")
    policy.write_text(policy.read_text().replace("allow: [up.test,", "allow: [rebound.test, up.test,"))
    for url, reason in (
        ("https://denied.test/", "denylist"),
        ("http://elsewhere.test/", "not_allowlisted"),
        ("https://rebound.test/", "resolved_forbidden"),
        ("http://169.254.169.254/latest/", "forbidden_address"),
    ):
        result = _exec(policy, dns, _curl(url))
        status, headers, _ = parse_http(result.stdout)
        assert status == 403 and headers["x-egressd-reason"] == reason, (url, result.stdout[:300])
    # a request after them, allowed: once squid logged it, it would have logged the refused ones
    result = _exec(policy, dns, _curl(f"http://up.test:{upstream.port}/after"))
    assert parse_http(result.stdout)[0] == 200
    log = parent.wait_for(f"CONNECT {upstream.host}:{upstream.port}")
    for needle in ("denied.test", "elsewhere.test", "rebound.test", "169.254.169.254"):
        assert needle not in log


def test_direct_host_bypasses_the_parent(
    tmp_path: Path, parent: Parent, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    with EchoHTTPServer("198.51.100.7", name="direct") as direct:
        dns.add("other.test", direct.host)
        dns.add("up.test", upstream.host)
        policy = _policy(tmp_path, parent.url)
        result = _exec(policy, dns, _curl(f"http://other.test:{direct.port}/direct"))
        assert parse_http(result.stdout)[0] == 200, result.stderr
        assert direct.requests[-1]["path"] == "/direct"
        result = _exec(policy, dns, _curl(f"http://up.test:{upstream.port}/sentinel"))
        assert parse_http(result.stdout)[0] == 200
        log = parent.wait_for(f"CONNECT {upstream.host}:{upstream.port}")
        assert direct.host not in log


# -- a parent that refuses, or is down ------------------------------------------------------------
def test_wrong_parent_credentials_give_502_refused(
    tmp_path: Path, parent: Parent, dns: DnsServer, upstream_tls: EchoHTTPSServer, ca_file: Path
) -> None:
    dns.add("up.test", upstream_tls.host)
    audit = tmp_path / "audit.jsonl"
    policy = _policy(tmp_path, parent.url)
    wrong = f"{USER}:not-the-password"
    for url in (f"https://up.test:{upstream_tls.port}/", f"http://up.test:{upstream_tls.port}/"):
        result = _exec(
            policy, dns, _curl("--cacert", str(ca_file), url), creds=wrong, extra=("--audit", str(audit))
        )
        status, headers, _ = parse_http(result.stdout)
        assert status == 502, (url, result.stdout[:400])
        assert headers["x-egressd-reason"] == "upstream_proxy_refused"
        assert "407" in headers["proxy-status"]  # the detail: what the parent answered
        assert b"upstream_proxy_refused" in result.stdout.split(b"\r\n", 1)[0]  # the reason phrase
    records = [r for r in _audit(audit) if r.get("stage") == "connection"]
    assert records and all(r["reason"] == "upstream_proxy_refused" for r in records)
    assert "not-the-password" not in audit.read_text()


def test_parent_rule_refusal_gives_502_refused(tmp_path: Path, parent: Parent, dns: DnsServer) -> None:
    with EchoHTTPServer("198.51.100.9", name="parent-forbids") as server:
        dns.add("up.test", server.host)
        result = _exec(_policy(tmp_path, parent.url), dns, _curl(f"http://up.test:{server.port}/"))
        status, headers, body = parse_http(result.stdout)
        assert status == 502 and headers["x-egressd-reason"] == "upstream_proxy_refused"
        assert b"403" in body and "403" in headers["proxy-status"]
        assert server.connections == 0


def test_parent_down_gives_502_unreachable(tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer) -> None:
    dns.add("up.test", upstream.host)
    policy = _policy(tmp_path, f"http://127.0.0.1:{free_port('127.0.0.1')}")
    result = _exec(policy, dns, _curl(f"http://up.test:{upstream.port}/"))
    status, headers, body = parse_http(result.stdout)
    assert status == 502, result.stdout[:400]
    assert headers["x-egressd-reason"] == "upstream_proxy_unreachable"
    assert b"upstream_proxy_unreachable" in result.stdout.split(b"\r\n", 1)[0]
    assert upstream.connections == 0


def test_missing_credentials_variable_stops_egressd(tmp_path: Path, dns: DnsServer) -> None:
    policy = _policy(tmp_path, "http://127.0.0.1:3128")
    env = {k: v for k, v in os.environ.items() if k != CREDS_ENV}
    result = egressd_exec(["--policy", str(policy)], ["true"], env=env)
    assert result.returncode == 2
    assert CREDS_ENV.encode() in result.stderr and b"not set" in result.stderr


def test_child_never_sees_the_parent_credentials(tmp_path: Path, parent: Parent, dns: DnsServer) -> None:
    policy = _policy(tmp_path, parent.url)
    result = _exec(policy, dns, ["env"])
    assert result.returncode == 0
    assert PASSWORD.encode() not in result.stdout and CREDS_ENV.encode() not in result.stdout


def test_command_line_parent_proxy(
    tmp_path: Path, parent: Parent, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    """--upstream-proxy URL with EGRESSD_UPSTREAM_PROXY_CREDENTIALS; credentials in the URL are refused."""
    dns.add("up.test", upstream.host)
    env = {**os.environ, "EGRESSD_UPSTREAM_PROXY_CREDENTIALS": f"{USER}:{PASSWORD}"}
    base = ["--allow", "up.test", "--allow", "198.51.100.0/24", "--nameserver", dns.nameserver]
    result = egressd_exec(
        [*base, "--upstream-proxy", parent.url], _curl(f"http://up.test:{upstream.port}/cli"), env=env
    )
    assert parse_http(result.stdout)[0] == 200, result.stderr
    parent.wait_for(f"CONNECT {upstream.host}:{upstream.port}")
    with_creds = f"http://{USER}:{PASSWORD}@127.0.0.1:{parent.port}"
    result = egressd_exec([*base, "--upstream-proxy", with_creds], ["true"], env=env)
    assert result.returncode == 2 and b"credentials do not belong in the URL" in result.stderr
    assert PASSWORD.encode() not in result.stderr


def test_a_server_that_speaks_first_loses_no_byte_through_the_parent(
    tmp_path: Path, parent: Parent, dns: DnsServer
) -> None:
    """SSH servers speak first: their banner may arrive with the parent's 200. egressd reads the
    parent's answer head and nothing more, so the banner reaches the child whole. (The client's
    stdin stays open: Squid closes a whole tunnel when the client half-closes it.)"""
    banner = b"SSH-2.0-egressd-test-banner\r\n" + b"x" * 3000 + b"\r\n"
    listener = socket.create_server(("198.51.100.8", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(banner)

    threading.Thread(target=serve, daemon=True).start()
    dns.add("up.test", "198.51.100.8")
    policy = _policy(tmp_path, parent.url)
    command = f"sleep 3 | {sys.executable} -m egressd.child.connect up.test {port}"
    result = _exec(policy, dns, ["sh", "-c", command])
    assert result.stdout == banner, result.stderr
    parent.wait_for(f"CONNECT 198.51.100.8:{port}")


def test_credentials_are_read_again_on_reload(
    tmp_path: Path, parent: Parent, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    dns.add("up.test", upstream.host)
    secret = tmp_path / "parent-auth"
    secret.write_text(f"{USER}:wrong\n")
    policy = _policy(tmp_path, parent.url)
    text = policy.read_text().replace(f"credentials_env: {CREDS_ENV}", f"credentials_file: {secret}")
    policy.write_text(text)
    url = f"http://up.test:{upstream.port}/reloaded"
    with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]) as run:
        env = run.child_env()
        first = subprocess.run(_curl(url), env=env, capture_output=True)
        assert parse_http(first.stdout)[0] == 502
        secret.write_text(f"{USER}:{PASSWORD}\n")
        policy.write_text(text + "# edited\n")
        assert run.wait_for_stderr("policy reloaded", timeout=20), run.stderr
        second = subprocess.run(_curl(url), env=env, capture_output=True)
        assert parse_http(second.stdout)[0] == 200, second.stdout[:300]
        # a reload whose credentials cannot be read keeps the last good policy (and its credentials)
        secret.unlink()
        policy.write_text(text + "# edited again\n")
        assert run.wait_for_stderr("reload failed", timeout=20), run.stderr
        third = subprocess.run(_curl(url), env=env, capture_output=True)
        assert parse_http(third.stdout)[0] == 200
        assert PASSWORD not in run.stderr
