"""Framing, authentication and audit defects from outside testers, through the real proxy.

Each test sends raw bytes from a real client socket to a real `egressd run` and watches a real
upstream on 127.0.0.1: what the upstream received (never the smuggled request), what the client was
answered (status and egressd's refusal headers) and what the audit file holds. scripts/test.sh runs
this file on both paths (default, and EGRESSD_FASTPATH=0: everything through mitmproxy).
"""

from __future__ import annotations

import base64
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun, write_policy
from tests.test_plain_http_path import RawClient, ScriptedServer, _auth, _url

# up.test resolves to 127.0.0.1 (the tests' DNS server): a name, so path and method rules apply
PATH_POLICY = """\
version: 1
mode: enforce
allow:
  - {host: up.test, paths: [/v1/read], methods: [GET]}
private: {allow: true}
"""
SMUGGLED = b"DELETE /admin/users HTTP/1.1\r\nHost: evil.test\r\nContent-Length: 0\r\n\r\n"


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    s = ScriptedServer()
    yield s
    s.close()


@pytest.fixture
def audited(tmp_path: Path, dns: DnsServer) -> Iterator[tuple[EgressdRun, Path]]:
    """egressd with PATH_POLICY, the tests' DNS server and an audit file."""
    dns.add("up.test", "127.0.0.1")
    audit = tmp_path / "audit.jsonl"
    policy = write_policy(tmp_path, PATH_POLICY)
    run = EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(audit)]).start()
    yield run, audit
    run.stop()


def _records(audit: Path, predicate: Any, deadline: float = 10.0) -> list[dict[str, Any]]:
    """The audit records matching predicate, polled until there is one or the deadline passes."""
    end = time.monotonic() + deadline
    while True:
        found = [r for r in map(json.loads, audit.read_text().splitlines()) if predicate(r)]
        if found or time.monotonic() > end:
            return found
        time.sleep(0.05)


def _assert_refused(answer: bytes, status: int, reason: str) -> None:
    assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:300]
    assert b"Proxy-Status: egressd; error=" in answer, answer[:600]
    assert f"X-Egressd-Reason: {reason}".encode() in answer, answer[:600]


# -- 2. malformed Proxy-Authorization ------------------------------------------------------------
def _b64(raw: bytes) -> bytes:
    return base64.b64encode(raw)


NASTY_CREDENTIALS = [
    b"Basic \xff\xfe\xfd",  # raw non-ASCII bytes
    "Basic égressd:tøken".encode(),  # UTF-8 where base64 belongs
    b"Basic " + _b64("egressd:tök".encode("latin-1")),  # latin-1 inside the base64
    b"Basic " + _b64(b"\xff\xfe:\x80\x81"),  # neither UTF-8 nor ASCII once decoded
    b"Basic " + _b64(b"\x00:\x00"),
    b"Basic " + _b64(b"no-colon-at-all"),
    b"Basic " + _b64(b"egressd:x")[:-1],  # broken padding
    b"Basic !!!not*base64!!!",
    b"Basic ",
    b"Basic",
    b"Bearer abc",
    b"\xc3\xa9 " + _b64(b"egressd:x"),  # a non-ASCII scheme
]


def _proxy_auth_answers(run: EgressdRun, server: ScriptedServer, value: bytes) -> list[bytes]:
    """The answers to a plain-HTTP request and to a CONNECT carrying `value` as credentials."""
    host, port, _ = _auth(run)
    url = _url(server, "/")
    answers = []
    for head in (
        f"GET {url} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n".encode(),
        f"CONNECT 127.0.0.1:{server.port} HTTP/1.1\r\n".encode(),
    ):
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(head + b"Proxy-Authorization: " + value + b"\r\n\r\n")
            answer = b""
            while b"\r\n\r\n" not in answer and (piece := sock.recv(65536)):
                answer += piece
            answers.append(answer)
    return answers


def test_malformed_proxy_authorization_is_407(tmp_path: Path, server: ScriptedServer) -> None:
    run = EgressdRun(["--policy", str(write_policy(tmp_path, "version: 1\nmode: enforce\n"))]).start()
    try:
        for value in NASTY_CREDENTIALS:
            for answer in _proxy_auth_answers(run, server, value):
                assert answer.startswith(b"HTTP/1.1 407 "), (value, answer[:300])
                assert b"Proxy-Authenticate: Basic" in answer and b"proxy_auth_required" in answer, value
    finally:
        run.stop()
    assert server.connections == 0


# -- 3. a non-UTF-8 byte in the request line -----------------------------------------------------
def test_non_utf8_request_line_is_audited(audited: tuple[EgressdRun, Path], server: ScriptedServer) -> None:
    run, audit = audited
    client = RawClient(run)
    request = client.request_bytes(f"http://up.test:{server.port}/v1/read/caf\xe9")
    client.sock.sendall(request.replace("caf\xe9".encode(), b"caf\xe9"))  # one raw 0xE9 byte
    assert client.rest().startswith(b"HTTP/1.1 4")
    assert server.requests == []
    # the refusal is recorded, the byte escaped; and records after it still arrive
    records = _records(audit, lambda r: "/v1/read/caf" in json.dumps(r))
    assert records and records[0]["decision"] == "deny" and records[0]["reason"] == "bad_request", records
    assert any("caf\\xe9" in str(value) for value in records[0].values()), records
    tunnel = RawClient(run)
    tunnel.sock.sendall(
        b"CONNECT caf\xe9.test:443 HTTP/1.1\r\nProxy-Authorization: " + tunnel.auth.encode() + b"\r\n\r\n"
    )
    assert tunnel.rest().startswith(b"HTTP/1.1 400 ")
    assert _records(audit, lambda r: r.get("reason") == "bad_request" and "CONNECT" in str(r.get("detail")))
    assert RawClient(run).get("http://nope.test/after").startswith(b"HTTP/1.1 403 ")
    assert _records(audit, lambda r: r.get("host") == "nope.test" and r.get("decision") == "deny")
