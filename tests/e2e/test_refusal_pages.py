"""`refusal_pages: tls`: a refused HTTPS CONNECT answered inside TLS, so clients print the reason.

Why: curl, requests and node show a refused CONNECT as an error with "403" at best. With inspection
on (the child trusts egressd's CA through the bundle egressd sets), egressd answers 200, speaks TLS
as the refused host, and answers the request with the same 403, headers and body: clients print it
like any server's answer. The tunnel stays refused: nothing is resolved, pinned or connected (an
HTTPS server listens on the refused host's address and port 443 here and must see no connection).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from egressd.child.env import CA_BUNDLE_VARS
from tests.support import netns
from tests.support.audit_log import audit_records
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import egressd_exec, write_policy
from tests.support.upstreams import EchoHTTPSServer

NODE_CLIENT = Path(__file__).parents[1] / "support" / "node_inspect_client.js"
POLICY = "version: 1\nrefusal_pages: tls\nallow: [up.test]\n"
PHRASE = "Forbidden by egressd: not_allowlisted"

PY_CLIENT = """
import sys, requests
answer = requests.get(sys.argv[1], timeout=20)
print(answer.status_code, answer.reason, answer.headers.get("x-egressd-reason"))
print(answer.text)
"""


@pytest.fixture
def refused_server(ca: trustme.CA, dns: DnsServer) -> Iterator[EchoHTTPSServer]:
    """An HTTPS server where refused.test resolves, on 443: what the child would reach if let."""
    with EchoHTTPSServer(
        netns.UPSTREAM_V4[1], 443, name="refused", ca=ca, hostnames=["refused.test"]
    ) as server:
        dns.add("refused.test", server.host)
        yield server


def child_env() -> dict[str, str]:
    """No inherited CA variables: the child trusts egressd's CA only through what egressd sets."""
    return {k: v for k, v in os.environ.items() if k not in CA_BUNDLE_VARS and k != "SSL_CERT_DIR"}


def run(tmp_path: Path, dns: DnsServer, command: list[str], *extra: str) -> tuple[str, str, list[dict]]:
    policy = write_policy(tmp_path, POLICY)
    audit = tmp_path / "audit.jsonl"
    options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(audit), *extra]
    result = egressd_exec(options, command, env=child_env())
    records = audit_records(audit)
    return result.stdout.decode(), result.stderr.decode(), records


def assert_never_connected(server: EchoHTTPSServer, dns: DnsServer, records: list[dict]) -> None:
    assert server.connections == 0  # nothing reached the refused host
    assert dns.count("refused.test") == 0  # not even resolved: there is no pin
    decisions = [r for r in records if r.get("event") == "decision" and r.get("host") == "refused.test"]
    assert decisions and all(r["decision"] == "deny" for r in decisions), records
    assert all(not r.get("connected") and not r.get("resolved") for r in decisions)


def test_curl_prints_the_refusal_inside_tls(
    tmp_path: Path, dns: DnsServer, refused_server: EchoHTTPSServer
) -> None:
    out, err, records = run(
        tmp_path, dns, ["curl", "-sS", "-v", "--max-time", "20", "https://refused.test/x"]
    )
    assert f"< HTTP/1.1 403 {PHRASE}" in err, err
    assert "issuer: CN=egressd inspection CA" in err  # egressd's certificate for the refused host
    assert "egressd refused the connection to refused.test:443." in out
    assert "To allow it, a person can run: egressd exec --allow refused.test" in out
    assert_never_connected(refused_server, dns, records)


def test_requests_prints_the_refusal_inside_tls(
    tmp_path: Path, dns: DnsServer, refused_server: EchoHTTPSServer
) -> None:
    script = tmp_path / "client.py"
    script.write_text(PY_CLIENT)
    out, err, records = run(tmp_path, dns, [sys.executable, str(script), "https://refused.test/"])
    assert out.startswith(f"403 {PHRASE} not_allowlisted\n"), err
    assert "reason: not_allowlisted" in out
    assert_never_connected(refused_server, dns, records)


def test_node_prints_the_refusal_inside_tls(
    tmp_path: Path, dns: DnsServer, refused_server: EchoHTTPSServer
) -> None:
    """node trusts egressd's CA only through NODE_EXTRA_CA_CERTS, as egressd sets it."""
    out, err, records = run(tmp_path, dns, ["node", str(NODE_CLIENT), "https://refused.test/"])
    [result] = json.loads(out)
    assert result["connect"] == 200 and result["status"] == 403, (result, err)
    assert result["reason"] == "not_allowlisted"
    assert "egressd refused the connection to refused.test:443." in result["body"]
    assert_never_connected(refused_server, dns, records)


def test_without_inspection_the_connect_itself_is_refused(
    tmp_path: Path, dns: DnsServer, refused_server: EchoHTTPSServer
) -> None:
    """--no-inspect: the child trusts no egressd CA, so the CONNECT is answered 403 as always."""
    out, err, records = run(
        tmp_path, dns, ["curl", "-sS", "-v", "--max-time", "20", "https://refused.test/"], "--no-inspect"
    )
    assert f"< HTTP/1.1 403 {PHRASE}" in err and "CONNECT tunnel failed, response 403" in err, err
    assert "issuer: CN=egressd" not in err
    assert_never_connected(refused_server, dns, records)


def test_other_ports_keep_the_plain_refusal(tmp_path: Path, dns: DnsServer) -> None:
    """Only port 443: on another port the server may speak first, and a 200 would leave it waiting."""
    out, err, _ = run(tmp_path, dns, ["curl", "-sS", "-v", "--max-time", "20", "https://refused.test:8443/"])
    assert "CONNECT tunnel failed, response 403" in err, err


def test_a_client_that_does_not_trust_the_ca_is_closed(
    tmp_path: Path, dns: DnsServer, refused_server: EchoHTTPSServer
) -> None:
    """A client without egressd's CA fails its handshake: closed, never connected upstream."""
    out, err, records = run(
        tmp_path,
        dns,
        [
            "curl",
            "-sS",
            "--max-time",
            "20",
            "--cacert",
            "/dev/null",
            "--capath",
            "/nonexistent",
            "https://refused.test/",
        ],
    )
    assert "HTTP/1.1 403" not in out
    assert_never_connected(refused_server, dns, records)
