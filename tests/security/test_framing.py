"""Framing, authentication and audit attacks, through the real proxy.

Each test sends raw bytes from a real client socket to a real `egressd run` and watches a real
upstream on 127.0.0.1: what the upstream received (never the smuggled request), what the client was
answered (status and egressd's refusal headers) and what the audit file holds.
"""

from __future__ import annotations

import base64
import json
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from tests.support.audit_log import audit_records
from tests.support.corpus import read_head
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun, write_policy
from tests.support.plain_http import RawClient, ScriptedServer, _auth, _url
from tests.support.upstreams import EchoHTTPSServer

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
        found = [r for r in audit_records(audit) if predicate(r)]
        if found or time.monotonic() > end:
            return found
        time.sleep(0.05)


def _assert_refused(answer: bytes, status: int, reason: str) -> None:
    assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:300]
    assert b"Proxy-Status: egressd; error=" in answer, answer[:600]
    assert f"X-Egressd-Reason: {reason}".encode() in answer, answer[:600]


# -- 1. Connection naming Content-Length, Transfer-Encoding or Host -------------------------------
def _smuggling_head(auth: str, target: str, host: str, named: str) -> bytes:
    """A GET under the allow rule whose body is a second request, and whose Connection header
    names the header that frames (or addresses) it: stripped as hop-by-hop, the body would reach
    the upstream as a request of its own."""
    if named == "Transfer-Encoding":
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(SMUGGLED), SMUGGLED)
        framing = "Transfer-Encoding: chunked"
    else:
        body = SMUGGLED
        framing = f"Content-Length: {len(body)}"
    lines = [
        f"GET {target} HTTP/1.1",
        f"Host: {host}",
        *([f"Proxy-Authorization: {auth}"] if auth else []),
        f"Connection: keep-alive, {named}",
        framing,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@pytest.mark.parametrize("named", ["Content-Length", "Transfer-Encoding", "Host"])
def test_connection_naming_a_framing_header_is_refused_on_plain_http(
    audited: tuple[EgressdRun, Path], server: ScriptedServer, named: str
) -> None:
    run, audit = audited
    client = RawClient(run)
    host = f"up.test:{server.port}"
    client.sock.sendall(_smuggling_head(client.auth, f"http://{host}/v1/read", host, named))
    answer = client.rest()
    _assert_refused(answer, 400, "bad_request")
    assert named.lower().encode() in answer.lower()  # the body says which header
    time.sleep(0.3)  # a smuggled request would have arrived by now
    assert server.requests == [] and server.connections == 0
    records = _records(audit, lambda r: r.get("reason") == "bad_request" and r.get("stage") == "request")
    assert records and records[0]["decision"] == "deny" and records[0]["path"] == "/v1/read"
    # the same request without the Connection trick is allowed: the refusal is about the framing
    fine = RawClient(run).get(f"http://{host}/v1/read")
    assert fine.startswith(b"HTTP/1.1 200 ") and [h.split(" ")[:2] for h in server.heads()] == [
        ["GET", "/v1/read"]
    ]


@pytest.fixture
def inspected(
    tmp_path: Path, dns: DnsServer, ca: trustme.CA, ca_file: Path
) -> Iterator[tuple[EgressdRun, EchoHTTPSServer, Path]]:
    """egressd intercepting up.test (PATH_POLICY admits only some paths) in front of an HTTPS echo
    server on 127.0.0.1."""
    dns.add("up.test", "127.0.0.1")
    audit = tmp_path / "audit.jsonl"
    policy = write_policy(tmp_path, PATH_POLICY)
    options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(audit)]
    with (
        EchoHTTPSServer("127.0.0.1", ca=ca, hostnames=["up.test"]) as upstream,
        EgressdRun([*options, "--upstream-ca", str(ca_file)]) as run,
    ):
        yield run, upstream, audit


def _tunnel(run: EgressdRun, port: int) -> ssl.SSLSocket:
    """An authenticated CONNECT to up.test, then TLS trusting egressd's CA bundle."""
    host, proxy_port, auth = _auth(run)
    sock = socket.create_connection((host, proxy_port), timeout=10)
    sock.sendall(f"CONNECT up.test:{port} HTTP/1.1\r\nProxy-Authorization: {auth}\r\n\r\n".encode())
    head = read_head(sock)
    assert head.startswith(b"HTTP/1.1 200 "), head
    context = ssl.create_default_context(cafile=run.env["SSL_CERT_FILE"])
    return context.wrap_socket(sock, server_hostname="up.test")


def _read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length body (or up to the close)."""
    head, sep, body = read_head(sock).partition(b"\r\n\r\n")
    if not sep:
        return head  # closed before the head ended
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(body) < length:
        piece = sock.recv(65536)
        if not piece:
            break
        body += piece
    return head + b"\r\n\r\n" + body


@pytest.mark.parametrize("named", ["Content-Length", "Transfer-Encoding", "Host"])
def test_connection_naming_a_framing_header_is_refused_inside_tls(
    inspected: tuple[EgressdRun, EchoHTTPSServer, Path], named: str
) -> None:
    run, upstream, audit = inspected
    host = f"up.test:{upstream.port}"
    with _tunnel(run, upstream.port) as tls:
        # inside the tunnel no request carries Proxy-Authorization: the CONNECT authenticated them
        tls.sendall(f"GET /v1/read HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        assert _read_response(tls).startswith(b"HTTP/1.1 200 ")
        tls.sendall(_smuggling_head("", "/v1/read", host, named))
        answer = _read_response(tls)
    _assert_refused(answer, 400, "bad_request")
    time.sleep(0.3)  # a smuggled request would have arrived by now
    assert [(r["method"], r["path"]) for r in upstream.requests] == [("GET", "/v1/read")]
    assert _records(audit, lambda r: r.get("reason") == "bad_request" and r.get("scheme") == "https")


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
            answers.append(read_head(sock))
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


# -- 4. credentials on a kept-alive connection ---------------------------------------------------
def test_every_request_on_a_kept_alive_connection_needs_credentials(
    tmp_path: Path, server: ScriptedServer
) -> None:
    run = EgressdRun(["--policy", str(write_policy(tmp_path, "version: 1\nmode: enforce\n"))]).start()
    try:
        url = _url(server, "/second")
        for unusual in ("", "Transfer-Encoding: chunked"):  # a Content-Length body, and a chunked one
            client = RawClient(run)
            assert client.get(_url(server, "/first")).startswith(b"HTTP/1.1 200 ")
            lines = [f"POST {url} HTTP/1.1", f"Host: 127.0.0.1:{server.port}"]
            lines += [unusual] if unusual else ["Content-Length: 1"]
            body = b"1\r\nx\r\n0\r\n\r\n" if unusual else b"x"
            client.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
            answer = client.response()
            assert answer.startswith(b"HTTP/1.1 407 ") and b"Proxy-Authenticate: Basic" in answer, answer
        assert [h.split(" ")[1] for h in server.heads()] == ["/first", "/first"]
    finally:
        run.stop()


# -- 5. empty lines before a request line ----------------------------------------------------------
def test_empty_lines_before_a_request_line_are_ignored(tmp_path: Path, server: ScriptedServer) -> None:
    policy = "version: 1\nmode: enforce\nlimits: {header_timeout: 60}\n"
    run = EgressdRun(["--policy", str(write_policy(tmp_path, policy))]).start()
    try:
        for empty in (b"\r\n", b"\r\n\r\n"):
            client = RawClient(run)
            client.sock.sendall(empty + client.request_bytes(_url(server, "/first")))
            assert b'"/first"' in client.response()
            client.sock.sendall(empty + client.request_bytes(_url(server, "/kept")))  # between requests
            assert b'"/kept"' in client.response()
            tunnel = RawClient(run)
            tunnel.sock.sendall(
                empty
                + f"CONNECT 127.0.0.1:{server.port} HTTP/1.1\r\n"
                f"Proxy-Authorization: {tunnel.auth}\r\n\r\n".encode()
            )
            assert tunnel.response().startswith(b"HTTP/1.1 200 ")
            tunnel.sock.sendall(f"GET /tunnelled HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n\r\n".encode())
            assert b'"/tunnelled"' in tunnel.response()
            client.sock.close()
            tunnel.sock.close()  # else egressd's drain waits for the tunnel when it stops
    finally:
        run.stop()
