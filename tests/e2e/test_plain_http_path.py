"""Plain HTTP in egressd's front (egressd.front.plain_http) with real clients and a real scripted server.

The server below speaks raw HTTP/1.1 so each test can choose the framing (Content-Length, chunked,
close-delimited, broken chunked, 1xx) and count the TCP connections egressd opened to it: keep-alive
reuse and "nothing reached the server" are proven by those counters, not assumed.
"""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.egressd_cli import EgressdRun, write_policy
from tests.support.plain_http import POLICY, RawClient, ScriptedServer, _auth, _url


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    s = ScriptedServer()
    yield s
    s.close()


def _proxy(tmp_path: Path, policy: str = POLICY) -> EgressdRun:
    return EgressdRun(["--policy", str(write_policy(tmp_path, policy))]).start()


@pytest.fixture
def run(tmp_path: Path) -> Iterator[EgressdRun]:
    proxy = _proxy(tmp_path)
    yield proxy
    proxy.stop()


# -- forwarding ---------------------------------------------------------------------------------
def test_keep_alive_reuses_one_upstream_connection(run: EgressdRun, server: ScriptedServer) -> None:
    client = RawClient(run)
    first = client.get(_url(server, "/one?q=1"))
    second = client.get(_url(server, "/two"))
    assert b"200 OK" in first and b'"/one?q=1"' in first and b'"/two"' in second
    assert server.connections == 1
    head = server.heads()[0]
    assert head.startswith("GET /one?q=1 HTTP/1.1\r\n")  # origin-form upstream
    assert f"Host: 127.0.0.1:{server.port}" in head
    assert "proxy-authorization" not in head.lower()


def test_new_upstream_connection_when_the_host_changes(run: EgressdRun, server: ScriptedServer) -> None:
    client = RawClient(run)
    assert b"200 OK" in client.get(_url(server, "/a"))
    assert b"200 OK" in client.get(_url(server, "/b", host="localhost"))
    assert server.connections == 2


def test_pipelined_requests_are_answered_in_order(run: EgressdRun, server: ScriptedServer) -> None:
    client = RawClient(run)
    client.sock.sendall(b"".join(client.request_bytes(_url(server, f"/p{i}")) for i in range(3)))
    answers = [client.response() for _ in range(3)]
    for i, answer in enumerate(answers):
        assert f'"/p{i}"'.encode() in answer
    assert server.connections == 1


def test_post_body_and_hop_by_hop_headers(run: EgressdRun, server: ScriptedServer) -> None:
    client = RawClient(run)
    answer = client.get(
        _url(server, "/post"),
        "Connection: keep-alive, X-Secret",
        "X-Secret: 1",
        "Keep-Alive: timeout=5",
        "Proxy-Connection: keep-alive",
        method="POST",
        body=b"payload",
    )
    assert b'"body": "payload"' in answer
    head = server.heads()[0].lower()
    assert "x-secret: 1" not in head and "keep-alive: timeout" not in head and "proxy-connection" not in head


def test_head_204_304_responses_have_no_body(run: EgressdRun, server: ScriptedServer) -> None:
    client = RawClient(run)
    assert b"200 OK" in client.get(_url(server, "/h"), method="HEAD")
    assert b"204 No Content" in client.get(_url(server, "/204"))
    assert b"304 Not Modified" in client.get(_url(server, "/304"))
    assert b'"/after"' in client.get(_url(server, "/after"))  # framing kept: the next answer is right
    assert server.connections == 1


def test_interim_response_is_relayed_before_the_final_one(run: EgressdRun, server: ScriptedServer) -> None:
    interim = RawClient(run).get(_url(server, "/interim"))
    assert interim.startswith(b"HTTP/1.1 103 Early Hints") and interim.endswith(b"ok")


def test_chunked_and_close_delimited_responses_with_curl(run: EgressdRun, server: ScriptedServer) -> None:
    env = run.child_env()
    for path, expected in (("/chunked", b"hello world"), ("/eof", b"x" * 3000)):
        got = subprocess.run(["curl", "-sS", _url(server, path)], env=env, capture_output=True, timeout=20)
        assert got.stdout == expected, got.stderr


def test_malformed_chunked_response_closes_the_connection(run: EgressdRun, server: ScriptedServer) -> None:
    client = RawClient(run)
    client.sock.sendall(client.request_bytes(_url(server, "/bad-chunked")))
    got = client.rest()  # returns once egressd closed the connection
    # cut short with no last chunk, or a 502 when the error came in the same read as the head
    assert got.startswith((b"HTTP/1.1 200 OK", b"HTTP/1.1 502 ")) and b"world" not in got
    assert not got.endswith(b"0\r\n\r\n")


def test_python_http_client_keep_alive(run: EgressdRun, server: ScriptedServer) -> None:
    host, port, auth = _auth(run)
    conn = http.client.HTTPConnection(host, port, timeout=10)
    for path in ("/x", "/y"):
        conn.request("GET", _url(server, path), headers={"Proxy-Authorization": auth})
        response = conn.getresponse()
        assert response.status == 200 and path.encode() in response.read()
    assert server.connections == 1


def test_large_request_body_streams_through(run: EgressdRun, server: ScriptedServer) -> None:
    host, port, auth = _auth(run)
    conn = http.client.HTTPConnection(host, port, timeout=30)
    body = b"z" * (3 << 20)  # above the write-buffer high-water mark: flow control both ways
    conn.request("PUT", _url(server, "/put"), body=body, headers={"Proxy-Authorization": auth})
    answer = json.loads(conn.getresponse().read())
    assert answer["method"] == "PUT" and len(answer["body"]) == len(body)
    assert server.requests[-1][1] == body


def test_forged_egressd_headers_are_removed(run: EgressdRun, server: ScriptedServer) -> None:
    answer = RawClient(run).get(_url(server, "/forged")).lower()
    assert b"x-egressd-reason" not in answer and b"proxy-status" not in answer


# -- refusals -----------------------------------------------------------------------------------
def test_refused_host_has_proxy_status(run: EgressdRun, server: ScriptedServer) -> None:
    answer = RawClient(run).get("http://nope.test/")
    assert answer.startswith(b"HTTP/1.1 403 ")
    assert b"Proxy-Status: egressd; error=" in answer and b"X-Egressd-Reason: not_allowlisted" in answer


def test_missing_credentials_get_407(run: EgressdRun, server: ScriptedServer) -> None:
    host, port, _ = _auth(run)
    with socket.create_connection((host, port), timeout=10) as sock:
        url = _url(server, "/")
        sock.sendall(f"GET {url} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n\r\n".encode())
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 407 ") and b"Proxy-Authenticate: Basic" in answer
    assert server.connections == 0


def test_host_header_mismatch_is_400(run: EgressdRun, server: ScriptedServer) -> None:
    client = RawClient(run)
    request = client.request_bytes(_url(server, "/")).replace(b"Host: 127.0.0.1", b"Host: elsewhere.test")
    client.sock.sendall(request)
    answer = client.rest()
    assert answer.startswith(b"HTTP/1.1 400 ") and b"host_mismatch" in answer
    assert server.connections == 0


@pytest.mark.parametrize(
    "spelling",
    [b"\xb2", b"\xc2\xb2", b"\xd9\xa8\xd9\xa0", b"+80", b"8_0", b"0" * 5000 + b"80"],
    ids=["latin-1 superscript two", "utf-8 superscript two", "arabic-indic 80", "plus", "underscore", "long"],
)
def test_a_host_header_port_that_is_not_ascii_digits_of_the_port_is_refused(
    run: EgressdRun, server: ScriptedServer, spelling: bytes
) -> None:
    client = RawClient(run)
    request = client.request_bytes(_url(server, "/"))
    written = f"Host: 127.0.0.1:{server.port}".encode()
    client.sock.sendall(request.replace(written, b"Host: 127.0.0.1:" + spelling))
    answer = client.rest()
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert b"internal_error" not in answer
    assert server.connections == 0


def test_a_host_header_port_with_leading_zeros_is_the_same_port(
    run: EgressdRun, server: ScriptedServer
) -> None:
    client = RawClient(run)
    request = client.request_bytes(_url(server, "/zeros"))
    client.sock.sendall(request.replace(b"Host: 127.0.0.1:", b"Host: 127.0.0.1:000"))
    assert b'"/zeros"' in client.response()


def test_content_length_with_transfer_encoding_is_never_forwarded_twice(
    run: EgressdRun, server: ScriptedServer
) -> None:
    client = RawClient(run)
    smuggled = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    body = b"0\r\n\r\n" + smuggled
    request = client.request_bytes(_url(server, "/cl-te"), "Transfer-Encoding: chunked", method="POST")
    client.sock.sendall(request[:-2] + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    client.rest()
    assert not any("/smuggled" in head for head in server.heads())


def test_chunked_request_body_is_streamed_each_request_decided(
    run: EgressdRun, server: ScriptedServer
) -> None:
    client = RawClient(run)
    assert b"200 OK" in client.get(_url(server, "/first"))
    request = client.request_bytes(_url(server, "/chunked-body"), "Transfer-Encoding: chunked", method="POST")
    client.sock.sendall(request + b"4\r\ndata\r\n0\r\n\r\n")
    answer = client.response()
    assert b'"/chunked-body"' in answer and b"data" in answer
    denied = client.request_bytes("http://nope.test/", "Transfer-Encoding: chunked", method="POST")
    client.sock.sendall(denied + b"0\r\n\r\n")
    assert client.response().startswith(b"HTTP/1.1 403 ")


# -- limits and redirects -----------------------------------------------------------------------
def test_max_response_bytes_both_ways(tmp_path: Path, server: ScriptedServer) -> None:
    run = _proxy(tmp_path, POLICY + "limits: {max_response_bytes: 1000}\n")
    try:
        big = RawClient(run).get(_url(server, "/big"))
        assert big.startswith(b"HTTP/1.1 502 ") and b"response_too_large" in big and b"yyyy" not in big
        client = RawClient(run)
        client.sock.sendall(client.request_bytes(_url(server, "/eof")))
        cut = client.rest()
        assert b"transfer-encoding: chunked" in cut.lower() and not cut.endswith(b"0\r\n\r\n")
        assert cut.count(b"x") <= 1000
    finally:
        run.stop()


def test_credentials_stripped_after_cross_host_redirect(run: EgressdRun, server: ScriptedServer) -> None:
    client = RawClient(run)
    target = _url(server, "/landed", host="localhost")
    answer = client.get(_url(server, f"/redirect?to={target}"), "Authorization: Bearer secret", "Cookie: a=b")
    assert b"302 Found" in answer
    client.get(target, "Authorization: Bearer secret", "Cookie: a=b")
    landed = server.heads()[-1].lower()
    assert "/landed" in landed and "authorization" not in landed and "cookie" not in landed
    # the same origin again (no redirect): the credentials go through
    client.get(target, "Authorization: Bearer secret")
    assert "authorization: bearer secret" in server.heads()[-1].lower()


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk not installed (scripts/setup.sh installs it)")
def test_wrk_keep_alive_load(run: EgressdRun, server: ScriptedServer, tmp_path: Path) -> None:
    host, port, auth = _auth(run)
    script = tmp_path / "s.lua"
    script.write_text(
        f'wrk.path = "{_url(server, "/w")}"\nwrk.headers["Host"] = "127.0.0.1:{server.port}"\n'
        f'wrk.headers["Proxy-Authorization"] = "{auth}"\n'
    )
    out = subprocess.run(
        ["wrk", "-t1", "-c4", "-d1s", "-s", str(script), f"http://{host}:{port}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "Requests/sec" in out.stdout and "Non-2xx" not in out.stdout, out.stdout
    assert server.connections <= 4
