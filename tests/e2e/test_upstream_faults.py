"""An upstream that accepts and then fails the exchange: the child is told why, and it is recorded.

Why: an upstream that accepts a request and never answers left a plain-HTTP client waiting for its
own timeout with no reason; a half response was reported as a failed connect. Through the real
`egressd exec` with curl, to real servers on this machine: `timeouts.response` ends the wait with
`504 upstream_timeout`, a broken answer is `502 upstream_protocol_error`, on plain HTTP and inside
an inspected tunnel (mitmproxy) alike; stderr tells both as failures, never as refusals.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.support.answers import assert_refusal
from tests.support.audit_log import audit_records
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import TEST_POLICY, egressd_exec, write_policy
from tests.support.upstreams import EchoHTTPServer, EchoHTTPSServer

CLIENT_WAIT = 40  # the client's own limit: far beyond what egressd may take


def _through_egressd(
    tmp_path: Path, dns: DnsServer, server: EchoHTTPServer, path: str, extra_policy: str, ca_file: Path
) -> tuple[subprocess.CompletedProcess[bytes], str, list[dict], float]:
    """curl -i SCHEME://up.test:PORT/PATH under `egressd exec`: (its result, egressd's stderr,
    the audit records, seconds taken)."""
    dns.add("up.test", server.host)
    policy = write_policy(tmp_path, TEST_POLICY + extra_policy)
    audit = tmp_path / "audit.jsonl"
    options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(audit)]
    if server.scheme == "https":
        options += ["--upstream-ca", str(ca_file)]
    started = time.monotonic()
    result = egressd_exec(
        options,
        ["curl", "-sS", "-i", "--max-time", str(CLIENT_WAIT), server.url_for("up.test", path)],
        timeout=CLIENT_WAIT + 30,
    )
    took = time.monotonic() - started
    assert result.stdout, (result.stderr.decode(errors="replace")[-1500:], took)
    return result, result.stderr.decode(errors="replace"), audit_records(audit), took


def _inspected(scheme: str) -> str:
    return "inspect: [up.test]\n" if scheme == "https" else ""


@pytest.fixture(params=["http", "https"], ids=["plain-http", "inspected"])
def server(
    request: pytest.FixtureRequest, upstream: EchoHTTPServer, upstream_tls: EchoHTTPSServer
) -> EchoHTTPServer:
    """The upstream: plain HTTP (egressd's own front serves it) or HTTPS that egressd inspects
    (the embedded mitmproxy serves it)."""
    return upstream if request.param == "http" else upstream_tls


def test_an_upstream_that_never_answers_gets_504_upstream_timeout(
    tmp_path: Path, dns: DnsServer, server: EchoHTTPServer, ca_file: Path
) -> None:
    extra = _inspected(server.scheme) + "timeouts: {response: 1}\n"
    result, stderr, records, took = _through_egressd(tmp_path, dns, server, "/silent", extra, ca_file)
    headers = assert_refusal(result, 504, "upstream_timeout", "http_response_timeout")
    assert "timeouts.response" in headers["proxy-status"]
    assert took < CLIENT_WAIT / 2, took  # egressd answered, not the client's own timeout
    assert [r["path"] for r in server.requests] == ["/silent"]  # the request did reach it
    failed = [r for r in records if r.get("reason") == "upstream_timeout"]
    assert len(failed) == 1 and failed[0]["decision"] == "deny" and failed[0]["host"] == "up.test", records
    assert f"egressd: failed to reach up.test:{server.port} (upstream_timeout)" in stderr, stderr
    assert "egressd: refused" not in stderr, stderr


def test_an_upstream_that_answers_in_time_is_not_cut(
    tmp_path: Path, dns: DnsServer, server: EchoHTTPServer, ca_file: Path
) -> None:
    """The wait ends with the response head: a slow start within the limit, then a body that takes
    longer than the limit (an SSE stream), both go through."""
    extra = _inspected(server.scheme) + "timeouts: {response: 3}\n"
    result, stderr, records, _ = _through_egressd(tmp_path, dns, server, "/slow?s=0.5", extra, ca_file)
    assert result.stdout.startswith(b"HTTP/1.1 200"), (result.stdout[:300], stderr[-800:])
    result, stderr, records, _ = _through_egressd(tmp_path, dns, server, "/sse?n=20", extra, ca_file)
    out = result.stdout
    assert out.startswith(b"HTTP/1.1 200") and out.count(b"data: ") == 20, (out[-300:], stderr[-800:])
    assert not [r for r in records if r.get("reason") == "upstream_timeout"]


def test_a_half_response_is_upstream_protocol_error(
    tmp_path: Path, dns: DnsServer, server: EchoHTTPServer, ca_file: Path
) -> None:
    result, stderr, records, _ = _through_egressd(
        tmp_path, dns, server, "/half", _inspected(server.scheme), ca_file
    )
    assert_refusal(result, 502, "upstream_protocol_error", "http_protocol_error")
    failed = [r for r in records if r.get("reason") == "upstream_protocol_error"]
    assert len(failed) == 1 and failed[0]["decision"] == "deny", records
    assert not [r for r in records if r.get("reason") == "connect_error"], records
    assert f"egressd: failed to reach up.test:{server.port} (upstream_protocol_error)" in stderr, stderr
