"""The native tunnel front (egressd/engine/_tunnels.c): a CONNECT head Python admitted is served
again without Python, only while nothing a decision depends on has changed, with the same answers
and records as the Python path.

Every test opens a tunnel once (Python decides: a miss), then again with the very same head bytes
(a hit, served in C) and checks what the hit does. CI builds the module; a machine without it fails
here unless EGRESSD_NATIVE=0 says it is off on purpose.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import socketserver
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from egressd.audit import AuditLog
from egressd.engine import native_front
from egressd.engine.credentials import ProxyCredentials
from egressd.engine.proxy import EgressProxy
from egressd.policy import parse_policy
from tests.support import netns
from tests.support.attempts import gave_up_after, timed_out_after
from tests.support.corpus import Reader, read_response
from tests.support.dns_server import DnsServer
from tests.support.upstreams import EchoHTTPSServer, StallableEchoServer, TcpEchoServer

pytestmark = pytest.mark.skipif(
    os.environ.get("EGRESSD_NATIVE") == "0", reason="EGRESSD_NATIVE=0: the native front is off on purpose"
)


def test_the_native_front_is_built() -> None:
    """setup.py builds it on Linux; CI must not fall back to the Python path silently."""
    assert native_front.available(), "egressd/engine/_tunnels.c was not built (see setup.py)"


def _policy(allow: list[str], limits: dict[str, object] | None = None) -> object:
    doc: dict[str, object] = {"version": 1, "mode": "enforce", "allow": allow}
    if limits:
        doc["limits"] = limits
    return parse_policy(doc, "test")


@pytest.fixture
def audit_path(tmp_path: Path) -> Path:
    return tmp_path / "audit.jsonl"


def _engine(policy: object, audit_path: Path | None = None, **kwargs: object) -> EgressProxy:
    audit = AuditLog(str(audit_path)) if audit_path is not None else None
    engine = EgressProxy(policy, fastpath=True, audit=audit, **kwargs)  # type: ignore[arg-type]
    engine.start()
    return engine


@pytest.fixture
def engine_for(tcp_echo: TcpEchoServer, audit_path: Path) -> Iterator[EgressProxy]:
    host, port = tcp_echo.address
    engine = _engine(_policy([f"{host}:{port}"]), audit_path)
    try:
        yield engine
    finally:
        engine.stop()


def _stats(engine: EgressProxy) -> dict[str, int]:
    front = engine._front
    assert front is not None and front.native is not None, "the native front is not serving"
    return front.native.stats()


def _auth(creds: ProxyCredentials) -> str:
    return base64.b64encode(f"{creds.username}:{creds.token}".encode()).decode()


def _head(target: str, creds: ProxyCredentials) -> bytes:
    auth = f"Proxy-Authorization: Basic {_auth(creds)}\r\n"
    return f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n".encode()


def _open(engine: EgressProxy, head: bytes) -> tuple[socket.socket, bytes]:
    """Send a head; the socket and the proxy's answer head (b"" when it closed without one)."""
    sock = socket.create_connection(engine.http_address, timeout=10)
    sock.sendall(head)
    response = read_response(sock, head_only=True)
    return sock, response.raw_head if response is not None else b""


def _answer_to(engine: EgressProxy, head: bytes) -> bytes:
    sock, answer = _open(engine, head)
    sock.close()
    return answer


def _served_head(engine: EgressProxy, target: str, creds: ProxyCredentials | None = None) -> bytes:
    """A head Python has decided, admitted and remembered: the next one is served natively."""
    head = _head(target, creds or engine.issue_credentials())
    _echo_once(engine, head)
    return head


def _echo_once(engine: EgressProxy, head: bytes, message: bytes = b"ping") -> None:
    sock, answer = _open(engine, head)
    with sock:
        assert answer == b"HTTP/1.1 200 Connection established", answer
        sock.sendall(message)
        got = b""
        while len(got) < len(message):
            chunk = sock.recv(4096)
            assert chunk, "tunnel closed"
            got += chunk
        assert got == message


def _records(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _connection_records(records: list[dict[str, object]]) -> list[dict[str, object]]:
    """The decision records of connections (not of requests)."""
    return [r for r in records if r["event"] == "decision" and r.get("stage") == "connection"]


def _assert_alike(records: list[dict[str, object]], keys: tuple[str, ...]) -> None:
    """Records of served connections say what the first one (decided by Python) said."""
    for record in records[1:]:
        for key in keys:
            assert record.get(key) == records[0].get(key), (key, record, records[0])


def _wait_for(predicate: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")


def test_a_repeated_head_is_served_natively_with_the_same_records(
    engine_for: EgressProxy, tcp_echo: TcpEchoServer, audit_path: Path
) -> None:
    host, port = tcp_echo.address
    creds = engine_for.issue_credentials()
    head = _head(f"{host}:{port}", creds)
    for i in range(20):
        _echo_once(engine_for, head, b"ping %d" % i)
    stats = _stats(engine_for)
    assert stats["misses"] == 1 and stats["hits"] == 19, stats
    _wait_for(lambda: len([r for r in _records(audit_path) if r["event"] == "closed"]) == 20)
    records = _records(audit_path)
    connections = _connection_records(records)
    closed = [r for r in records if r["event"] == "closed"]
    assert len(connections) == 20 and len(closed) == 20
    _assert_alike(
        connections,
        ("decision", "reason", "rule", "host", "port", "client", "profile", "resolved", "connected"),
    )
    for record in connections[1:]:  # a served tunnel's record says what Python's said
        assert not record.get("attempts")
    assert len({r["conn"] for r in connections}) == 20
    assert {r["conn"] for r in closed} == {r["conn"] for r in connections}
    by_conn = {r["conn"]: r for r in closed}
    for i, record in enumerate(connections):
        done = by_conn[record["conn"]]
        assert done["bytes_up"] == done["bytes_down"] == len(b"ping %d" % i)
        assert done["host"] == host and done["port"] == port


def test_a_head_differing_in_one_byte_is_decided_by_python(
    engine_for: EgressProxy, tcp_echo: TcpEchoServer
) -> None:
    host, port = tcp_echo.address
    creds = engine_for.issue_credentials()
    _served_head(engine_for, f"{host}:{port}", creds)
    other_port = port + 1 if port < 65535 else port - 1
    answer = _answer_to(engine_for, _head(f"{host}:{other_port}", creds))
    assert answer.startswith(b"HTTP/1.1 403") and b"X-Egressd-Reason: not_allowlisted" in answer, answer
    assert _stats(engine_for)["hits"] == 0


def test_revoked_credentials_are_not_served(engine_for: EgressProxy, tcp_echo: TcpEchoServer) -> None:
    host, port = tcp_echo.address
    creds = engine_for.issue_credentials()
    head = _served_head(engine_for, f"{host}:{port}", creds)
    _echo_once(engine_for, head)
    assert _stats(engine_for)["hits"] == 1
    engine_for.revoke(creds)
    answer = _answer_to(engine_for, head)
    assert answer.startswith(b"HTTP/1.1 407"), answer
    assert _stats(engine_for)["hits"] == 1


def test_a_policy_reload_forgets_every_head(engine_for: EgressProxy, tcp_echo: TcpEchoServer) -> None:
    host, port = tcp_echo.address
    head = _served_head(engine_for, f"{host}:{port}")
    _echo_once(engine_for, head)
    engine_for.set_policy(_policy(["other.test"]))  # type: ignore[arg-type]
    answer = _answer_to(engine_for, head)
    assert answer.startswith(b"HTTP/1.1 403") and b"X-Egressd-Reason: not_allowlisted" in answer, answer
    assert _stats(engine_for)["hits"] == 1


def test_any_change_a_decision_depends_on_forgets_every_head(
    engine_for: EgressProxy, tcp_echo: TcpEchoServer
) -> None:
    """Redirect memory (the next tunnel may need inspection), credentials issued, own addresses."""
    host, port = tcp_echo.address
    creds = engine_for.issue_credentials()
    head = _head(f"{host}:{port}", creds)
    rt = engine_for.runtime
    changes = [
        lambda: rt.redirects.remember(creds.token, "http://a.test/x", f"https://{host}:{port}/y"),
        lambda: engine_for.issue_credentials(),
        lambda: rt.gate.add_self_address("127.0.0.1", 1),
    ]
    for change in changes:
        _echo_once(engine_for, head)  # Python decides and remembers it
        before = _stats(engine_for)
        assert before["entries"] == 1
        change()
        after = _stats(engine_for)
        assert after["entries"] == 0 and after["generation"] > before["generation"]


def test_a_head_decided_before_a_change_is_not_remembered_after_it(
    engine_for: EgressProxy, tcp_echo: TcpEchoServer
) -> None:
    """remember() takes the generation seen when the head arrived: a change meanwhile wins."""
    host, port = tcp_echo.address
    creds = engine_for.issue_credentials()
    native = engine_for._front.native  # type: ignore[union-attr]
    assert native is not None
    stale = native.generation
    engine_for.issue_credentials()  # a change
    _echo_once(engine_for, _head(f"{host}:{port}", creds))
    assert (
        native.tunnels.remember(b"CONNECT x:1 HTTP/1.1\r\n\r\n", stale, host, port, 5.0, 60.0, None) is False
    )
    assert native.tunnels.remember(
        b"CONNECT x:1 HTTP/1.1\r\n\r\n", native.generation, host, port, 5.0, 60.0, None
    )
    with pytest.raises(ValueError):
        native.tunnels.remember(b"CONNECT x:1 HTTP/1.1\r\n", native.generation, host, port, 5.0, 60.0, None)
    with pytest.raises(ValueError):
        native.tunnels.remember(
            b"CONNECT x:1 HTTP/1.1\r\n\r\n", native.generation, "x.test", 1, 5.0, 60.0, None
        )


@pytest.mark.parametrize(
    "limits", [{"max_connections": 100}, {"requests_per_second": 1000}], ids=["max_connections", "rate"]
)
def test_limits_that_count_requests_keep_every_head_in_python(
    tcp_echo: TcpEchoServer, limits: dict[str, object]
) -> None:
    host, port = tcp_echo.address
    engine = _engine(_policy([f"{host}:{port}"], limits))
    try:
        head = _head(f"{host}:{port}", engine.issue_credentials())
        for _ in range(5):
            _echo_once(engine, head)
        stats = _stats(engine)
        assert stats["hits"] == 0 and stats["misses"] == 5 and stats["entries"] == 0
    finally:
        engine.stop()


def test_served_tunnels_count_against_max_connections_after_a_reload(tcp_echo: TcpEchoServer) -> None:
    host, port = tcp_echo.address
    engine = _engine(_policy([f"{host}:{port}"]))
    try:
        head = _served_head(engine, f"{host}:{port}")
        held = []
        for _ in range(2):
            sock, answer = _open(engine, head)  # served natively, kept open
            assert answer.startswith(b"HTTP/1.1 200")
            held.append(sock)
        assert _stats(engine)["hits"] == 2
        engine.set_policy(_policy([f"{host}:{port}"], {"max_connections": 2}))  # type: ignore[arg-type]
        answer = _answer_to(engine, head)
        assert answer.startswith(b"HTTP/1.1 429") and b"X-Egressd-Reason: connection_limit" in answer, answer
        for s in held:
            s.close()
    finally:
        engine.stop()


def test_a_name_is_resolved_again_after_its_ttl(dns: DnsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A served head of a name goes back to Python (and DNS) after NAME_TTL."""
    monkeypatch.setattr(native_front, "NAME_TTL", 0.3)
    with TcpEchoServer(netns.UPSTREAM_V4[5], name="echo-far") as far:
        host, port = far.address
        dns.add("echo.test", host)
        engine = _engine(_policy([f"echo.test:{port}", "198.51.100.0/24"]), nameservers=[dns.address])
        try:
            head = _served_head(engine, f"echo.test:{port}")
            _echo_once(engine, head)
            assert _stats(engine)["hits"] == 1
            time.sleep(0.5)
            _echo_once(engine, head)
            stats = _stats(engine)
            assert stats["hits"] == 1 and stats["misses"] == 2, stats
        finally:
            engine.stop()


def test_a_failed_connect_goes_back_to_python_and_its_refusal(audit_path: Path) -> None:
    """The remembered upstream went away: the client gets Python's 502 and its record."""
    with TcpEchoServer() as gone:
        host, port = gone.address
        engine = _engine(_policy([f"{host}:{port}"]), audit_path)
        head = _served_head(engine, f"{host}:{port}")
    try:
        answer = _answer_to(engine, head)
        assert answer.startswith(b"HTTP/1.1 502"), answer
        stats = _stats(engine)
        assert stats["hits"] == 1 and stats["misses"] == 2 and stats["entries"] == 0, stats
        denied = [r for r in _records(audit_path) if r["event"] == "decision" and r["decision"] == "deny"]
        assert denied and denied[-1]["stage"] == "connection"
    finally:
        engine.stop()


def test_a_remembered_address_that_times_out_costs_no_more_than_twice_connect_timeout(
    audit_path: Path,
) -> None:
    """The remembered address stops answering: the native connect times out after connect_timeout,
    Python tries it again only for what is left of 2x connect_timeout (not a whole new budget),
    and the client gets the 504 with both attempts in its record."""
    with StallableEchoServer(netns.UPSTREAM_V4[6]) as server:
        host, port = server.address
        engine = _engine(_policy([f"{host}:{port}"], {"connect_timeout": 1}), audit_path)
        try:
            head = _served_head(engine, f"{host}:{port}")
            server.stall()
            start = time.monotonic()
            answer = _answer_to(engine, head)
            elapsed = time.monotonic() - start
            assert answer.startswith(b"HTTP/1.1 504"), answer
            assert b"X-Egressd-Reason: connect_timeout" in answer, answer
            stats = _stats(engine)
            assert stats["hits"] == 1 and stats["entries"] == 0, stats
        finally:
            engine.stop()
        assert server.connections == 1
    # within 2x connect_timeout (one address: Python's retry gets what is left of the budget), and
    # the record lists the native attempt too (before, only Python's own)
    assert elapsed < 2 * 1 + 0.7, elapsed
    attempts = _connection_records(_records(audit_path))[-1]["attempts"]
    assert isinstance(attempts, list) and len(attempts) == 2, attempts
    assert gave_up_after(attempts[0], f"{host}:{port}", 1), attempts
    assert timed_out_after(attempts[1], f"{host}:{port}") <= 1, attempts  # what was left of 2x


def test_after_a_remembered_address_times_out_the_other_addresses_go_first(
    audit_path: Path, dns: DnsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name with two addresses; the first, remembered, stops answering. After the native connect
    times out, Python tries the second address first (the silent one last): the tunnel opens
    within about one connect_timeout, not after the silent address is waited for again."""
    monkeypatch.setattr(native_front, "NAME_TTL", 30.0)
    with StallableEchoServer(netns.UPSTREAM_V4[6]) as first:
        host, port = first.address
        with TcpEchoServer(netns.UPSTREAM_V6[7], port, name="second") as second:
            # A answers come before AAAA answers: the IPv4 address is tried (and remembered) first
            dns.add("two.test", host, second.host)
            policy = _policy([f"two.test:{port}", "198.51.100.0/24", "2001:db8::/32"], {"connect_timeout": 1})
            engine = _engine(policy, audit_path, nameservers=[dns.address])
            try:
                head = _served_head(engine, f"two.test:{port}")
                assert first.connections == 1 and second.connections == 0
                first.stall()
                start = time.monotonic()
                _echo_once(engine, head)
                elapsed = time.monotonic() - start
                assert _stats(engine)["hits"] == 1
            finally:
                engine.stop()
            assert second.connections == 1
    assert elapsed < 1 + 0.7, elapsed  # before: 1 s natively, 1 s more in Python, then the second
    record = _connection_records(_records(audit_path))[-1]
    assert record["connected"] == f"{second.host}:{port}", record
    (attempt,) = record["attempts"]
    assert gave_up_after(attempt, f"{host}:{port}", 1), record


def _hello(server_name: str | None) -> bytes:
    """A real TLS ClientHello (Python's ssl), not sent anywhere."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


@pytest.fixture
def tls_engine(
    upstream_tls: EchoHTTPSServer, dns: DnsServer, audit_path: Path
) -> Iterator[tuple[EgressProxy, str]]:
    dns.add("up.test", upstream_tls.host)
    target = f"up.test:{upstream_tls.port}"
    engine = _engine(_policy([target, "198.51.100.0/24"]), audit_path, nameservers=[dns.address])
    try:
        yield engine, target
    finally:
        engine.stop()


def _tls_get(engine: EgressProxy, head: bytes, ca: trustme.CA, server_name: str) -> bytes:
    sock, answer = _open(engine, head)
    assert answer.startswith(b"HTTP/1.1 200"), answer
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    with ctx.wrap_socket(sock, server_hostname=server_name) as tls:
        tls.sendall(b"GET /native HTTP/1.1\r\nHost: up.test\r\nConnection: close\r\n\r\n")
        body = b""
        while chunk := tls.recv(65536):
            body += chunk
    return body


def test_the_sni_rule_holds_on_served_tunnels(
    tls_engine: tuple[EgressProxy, str], ca: trustme.CA, audit_path: Path
) -> None:
    engine, target = tls_engine
    head = _head(target, engine.issue_credentials())
    assert b" 200 " in _tls_get(engine, head, ca, "up.test")[:20]
    assert b" 200 " in _tls_get(engine, head, ca, "up.test")[:20]  # served, its hello checked by Python
    assert _stats(engine)["hits"] == 1
    # the same head, a ClientHello naming another host, split in two writes: closed, recorded
    sock, answer = _open(engine, head)
    assert answer.startswith(b"HTTP/1.1 200")
    hello = _hello("other.test")
    sock.sendall(hello[:40])
    time.sleep(0.1)
    sock.sendall(hello[40:])
    sock.settimeout(5)
    assert sock.recv(100) == b""
    sock.close()
    assert _stats(engine)["hits"] == 2
    _wait_for(lambda: any(r.get("reason") == "sni_mismatch" for r in _records(audit_path)))
    refusal = next(r for r in _records(audit_path) if r.get("reason") == "sni_mismatch")
    assert refusal["decision"] == "deny" and "other.test" in str(refusal["detail"])
    assert refusal["conn"], refusal


def test_curl_is_served_natively_on_its_second_run(
    tls_engine: tuple[EgressProxy, str], ca_file: Path
) -> None:
    """curl sends the same CONNECT head each run: the second run's tunnel is served in C."""
    engine, target = tls_engine
    creds = engine.issue_credentials()
    proxy = creds.proxy_url(*engine.http_address)
    for _ in range(2):
        result = subprocess.run(
            ["curl", "-sS", "--fail", "--proxy", proxy, "--cacert", str(ca_file), f"https://{target}/curl"],
            capture_output=True,
            timeout=30,
        )
        assert result.returncode == 0, result.stderr
    assert _stats(engine)["hits"] == 1


@pytest.mark.parametrize("sent", [b"", b"CONN"], ids=["nothing", "a-prefix"])
def test_a_silent_client_is_cut_natively_and_recorded(
    tmp_path: Path, tcp_echo: TcpEchoServer, sent: bytes
) -> None:
    """Nothing, or less than "CONNECT ": the native front waits, cuts at header_timeout, records it."""
    audit_path = tmp_path / "audit.jsonl"
    host, port = tcp_echo.address
    engine = _engine(_policy([f"{host}:{port}"], {"header_timeout": 0.5}), audit_path)
    try:
        with socket.create_connection(engine.http_address, timeout=10) as sock:
            start = time.monotonic()
            sock.sendall(sent)
            assert sock.recv(100) == b""
            elapsed = time.monotonic() - start
        assert 0.4 < elapsed < 3, elapsed
        _wait_for(lambda: any(r["event"] == "header_timeout" for r in _records(audit_path)))
        record = next(r for r in _records(audit_path) if r["event"] == "header_timeout")
        assert str(record["peer"]).startswith("127.0.0.1:") and record["conn"]
        assert _stats(engine)["misses"] == 0
    finally:
        engine.stop()


@pytest.mark.parametrize(
    "partial",
    [b"CONNECT ", b"CONNECT a.test:1 HTTP/1.1\r\nX-Slow: ", b"CONNECT a.test:1 HTTP/1.1\n\n"],
    ids=["line", "header", "bare-lf"],
)
def test_a_head_in_pieces_goes_to_python_and_keeps_its_time(tcp_echo: TcpEchoServer, partial: bytes) -> None:
    """A head that does not arrive whole is Python's at once (a malformed one refused at once, as
    Python would), and header_timeout still counts from the accept, not from the hand-off."""
    host, port = tcp_echo.address
    engine = _engine(_policy([f"{host}:{port}"], {"header_timeout": 1.0}))
    try:
        with socket.create_connection(engine.http_address, timeout=10) as sock:
            start = time.monotonic()
            time.sleep(0.6)  # waited in the native front
            sock.sendall(partial)
            answer = sock.recv(4096)
            elapsed = time.monotonic() - start
        if partial.endswith(b"\n\n"):
            assert answer.startswith(b"HTTP/1.1 400"), answer
            assert elapsed < 0.9, elapsed
        else:
            assert answer == b"", answer
            assert 0.9 < elapsed < 1.6, elapsed
        assert _stats(engine)["misses"] == 1
    finally:
        engine.stop()


def test_idle_served_tunnels_are_closed(tcp_echo: TcpEchoServer) -> None:
    host, port = tcp_echo.address
    engine = _engine(_policy([f"{host}:{port}"], {"idle_timeout": 1}))
    try:
        head = _served_head(engine, f"{host}:{port}")
        sock, answer = _open(engine, head)
        with sock:
            assert answer.startswith(b"HTTP/1.1 200")
            assert _stats(engine)["hits"] == 1
            start = time.monotonic()
            sock.settimeout(10)
            assert sock.recv(100) == b""
            assert 0.9 < time.monotonic() - start < 4
    finally:
        engine.stop()


def test_a_half_closed_served_tunnel_delivers_then_closes(
    engine_for: EgressProxy, tcp_echo: TcpEchoServer
) -> None:
    host, port = tcp_echo.address
    sock, answer = _open(engine_for, _served_head(engine_for, f"{host}:{port}"))
    with sock:
        assert answer.startswith(b"HTTP/1.1 200")
        payload = os.urandom(300_000)
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        got = b""
        sock.settimeout(10)
        while chunk := sock.recv(65536):
            got += chunk
        # the Python relay closes a half-closed tunnel once what it read is out; so does C: what
        # came back is a prefix of the echo, and the tunnel ends
        assert payload.startswith(got)
    _wait_for(lambda: _stats(engine_for)["active"] == 0)


def test_draining_waits_for_served_tunnels(engine_for: EgressProxy, tcp_echo: TcpEchoServer) -> None:
    host, port = tcp_echo.address
    sock, answer = _open(engine_for, _served_head(engine_for, f"{host}:{port}"))
    with sock:
        assert answer.startswith(b"HTTP/1.1 200")
        assert engine_for.runtime.active() >= 1
    _wait_for(lambda: engine_for.runtime.active() == 0)


def test_plain_http_and_socks_are_handed_to_python(engine_for: EgressProxy, upstream: object) -> None:
    """Anything but a remembered CONNECT goes to Python at once (here a plain GET, refused there)."""
    creds = engine_for.issue_credentials()
    auth = b"Proxy-Authorization: Basic " + _auth(creds).encode() + b"\r\n"
    answer = _answer_to(
        engine_for, b"GET http://nothere.test/ HTTP/1.1\r\nHost: nothere.test\r\n" + auth + b"\r\n"
    )
    assert answer.startswith(b"HTTP/1.1 403"), answer
    assert _stats(engine_for)["misses"] == 1


def test_rebinding_within_the_ttl_keeps_the_validated_address(
    dns: DnsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """First answer an allowed address, every later one loopback: a served head connects to the
    address Python validated (never resolves again); after the ttl Python resolves and refuses."""
    monkeypatch.setattr(native_front, "NAME_TTL", 1.0)
    with TcpEchoServer(netns.UPSTREAM_V4[5], name="good") as good:
        host, port = good.address
        with TcpEchoServer("127.0.0.1", port, name="loopback") as loopback:
            dns.add_sequence("rebind.test", [[host], ["127.0.0.1"]])
            engine = _engine(_policy([f"rebind.test:{port}", "198.51.100.0/24"]), nameservers=[dns.address])
            try:
                head = _head(f"rebind.test:{port}", engine.issue_credentials())
                for _ in range(3):
                    _echo_once(engine, head)
                assert _stats(engine)["hits"] == 2
                assert dns.count("rebind.test", "A") == 1
                time.sleep(1.2)
                answer = _answer_to(engine, head)
                assert b"X-Egressd-Reason: resolved_forbidden" in answer, answer
            finally:
                engine.stop()
            assert good.connections == 3 and loopback.connections == 0


# -- the native front answers what Python answers ---------------------------------------------------
def _outcome(engine: EgressProxy, data: bytes) -> tuple[str, bytes]:
    """(status line and egressd reason, or "closed"; the echo of "ping" through a 200 tunnel)."""
    with socket.create_connection(engine.http_address, timeout=5) as sock:
        sock.sendall(data)
        reader = Reader(sock)
        try:
            response = reader.response(timeout=3, head_only=True)
        except (TimeoutError, ConnectionResetError):
            response = None
        if response is None:
            return "closed", b""
        line = response.raw_head.split(b"\r\n")[0].decode("latin-1")
        verdict = f"{line} {response.reason}"
        echo = bytes(reader.buf)  # tunnel bytes that came with the answer
        if response.status == 200:
            sock.sendall(b"ping")
            sock.settimeout(3)
            with contextlib.suppress(TimeoutError, ConnectionResetError):
                while len(echo) < len(data) + 4 and (chunk := sock.recv(4096)):
                    echo += chunk
                    if echo.endswith(b"ping"):
                        break
        return verdict, echo


CANNED = {
    "/cl": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
    "/chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    + b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
    "/eof": b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nthe body ends when the server closes",
    "/interim": b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
    + b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "/no-content": b"HTTP/1.1 204 No Content\r\n\r\n",
    "/redirect": b"HTTP/1.1 302 Found\r\nLocation: http://other.test/next\r\nContent-Length: 0\r\n\r\n",
    "/both-lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\nhello",
    "/bad-length": b"HTTP/1.1 200 OK\r\nContent-Length: 5x\r\n\r\nhello",
    "/bytes-after-body": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA BYTES",
    "/closed-early": b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort",
    "/no-response": b"",
    "/not-http": b"SSH-2.0-OpenSSH\r\n\r\n",
    "/own-headers": b"HTTP/1.1 200 OK\r\nX-Egressd-Reason: forged\r\nProxy-Status: forged\r\n"
    + b"Content-Length: 1\r\n\r\nx",
    "/too-large": b"HTTP/1.1 200 OK\r\nContent-Length: 300000\r\n\r\n" + b"x" * 300000,
    "/too-long": b"HTTP/1.1 200 OK\r\n\r\n" + b"y" * 300000,
    "/big-chunks": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    + b"".join(b"4000\r\n" + bytes([65 + i]) * 0x4000 + b"\r\n" for i in range(8))
    + b"0\r\n\r\n",
    "/split-head": b"HTTP/1.1 200 OK\r\nContent-Le|ngth: 3\r\n\r\n|abc",  # sent in pieces at "|"
}


class CannedHTTPServer(socketserver.ThreadingTCPServer):
    """Answers `GET <path>` with CANNED[path] (pieces at "|" for /split-head), then closes."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _CannedHandler)
        self.authority = f"127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> CannedHTTPServer:
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


class _CannedHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        head = b""
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in head:
                chunk = sock.recv(4096)
                if not chunk:
                    return
                head += chunk
            path = head.split(b" ")[1].decode()
            answer = CANNED.get(path, b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            for i, piece in enumerate(answer.split(b"|") if path == "/split-head" else [answer]):
                if i:
                    time.sleep(0.05)
                sock.sendall(piece)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(2)
            while sock.recv(4096):
                pass


@pytest.fixture
def canned_http() -> Iterator[str]:
    """A CannedHTTPServer on 127.0.0.1: its host:port."""
    with CannedHTTPServer() as canned:
        yield canned.authority


@dataclass
class Twins:
    native: EgressProxy
    python: EgressProxy
    connect_head: bytes
    http: str  # host:port of the canned HTTP server


@pytest.fixture(scope="module")
def twins() -> Iterator[Twins]:
    """The same policy twice, no credentials (so one head is valid on both): the native front on
    one, off on the other; a CONNECT head to the echo server remembered on the first."""
    with CannedHTTPServer() as canned, TcpEchoServer() as echo:
        http = canned.authority
        host, port = echo.address
        limits = {"header_timeout": 0.3, "max_response_bytes": 200_000}
        policy = _policy([f"{host}:{port}", http], limits)
        native = _engine(policy, require_auth=False)
        saved = native_front.ENABLED
        native_front.ENABLED = False
        try:
            python = _engine(policy, require_auth=False)
        finally:
            native_front.ENABLED = saved
        try:
            assert native._front is not None and native._front.native is not None
            assert python._front is not None and python._front.native is None
            head = f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
            assert _outcome(native, head)[0].startswith("HTTP/1.1 200")
            yield Twins(native, python, head, http)
        finally:
            native.stop()
            python.stop()


def _get(http: str, path: str, extra: str = "Connection: close\r\n") -> bytes:
    return f"GET http://{http}{path} HTTP/1.1\r\nHost: {http}\r\n{extra}\r\n".encode()


def _dechunk(data: bytes) -> tuple[bytes, bool]:
    """The body of a chunked stream, and whether it ended with its last chunk."""
    body = b""
    while data:
        size_line, sep, rest = data.partition(b"\r\n")
        if not sep:
            break  # cut inside a size line
        size = int(size_line, 16)
        if size == 0:
            return body, True
        body, data = body + rest[:size], rest[size + 2 :]
    return body, False


def _normalised(response: bytes) -> tuple[bytes, bytes, bool]:
    """(head, body, complete): a re-chunked body's chunk sizes follow the reads, on either path."""
    head, _, rest = response.partition(b"\r\n\r\n")
    if b"\r\nTransfer-Encoding: chunked" in head:
        body, complete = _dechunk(rest)
        return head, body, complete
    return head, rest, True


def _exchange(engine: EgressProxy, data: bytes) -> bytes:
    """Everything the proxy sends back until it closes (or goes quiet for 3 s)."""
    with socket.create_connection(engine.http_address, timeout=3) as sock:
        sock.sendall(data)
        got = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := sock.recv(65536):
                got += chunk
        return got


@pytest.mark.parametrize("path", list(CANNED))
def test_a_served_request_gets_the_response_python_gives(twins: Twins, path: str) -> None:
    """Every kind of response (lengths, chunks, close-delimited, interim, no body, redirects,
    broken framing, limits, forged egressd headers, a head in pieces) through a `Connection: close`
    GET served natively is, byte for byte, what the Python path alone sends."""
    request = _get(twins.http, path)
    stats = twins.native._front.native.stats  # type: ignore[union-attr]
    first = _exchange(twins.native, request)  # Python decides, and remembers it
    hits = stats()["hits"]
    served = _exchange(twins.native, request)
    alone = _exchange(twins.python, request)
    if path == "/too-long":
        # cut at limits.max_response_bytes mid-body, visibly (re-chunked, no last chunk); where
        # exactly depends on how the reads fell, on either path
        heads = {r.partition(b"\r\n\r\n")[0] for r in (first, served, alone)}
        assert len(heads) == 1 and b"Transfer-Encoding: chunked" in heads.pop()
        for response in (first, served, alone):
            _, body, complete = _normalised(response)
            assert not complete and set(body) <= {ord("y")} and len(body) <= 200_000
    else:
        assert _normalised(first) == _normalised(served) == _normalised(alone), (
            first[:300],
            served[:300],
            alone[:300],
        )
    if path != "/redirect":  # a redirect changes what a decision depends on: nothing is kept
        assert stats()["hits"] == hits + 1


@pytest.mark.parametrize(
    "extra",
    ["", "Connection: keep-alive\r\n", "Connection: close\r\nContent-Length: 0\r\n"],
    ids=["keep-alive", "explicit-keep-alive", "with-length"],
)
def test_only_bodiless_requests_that_close_are_remembered(twins: Twins, extra: str) -> None:
    native = twins.native._front.native  # type: ignore[union-attr]
    native.tunnels.invalidate()
    request = _get(twins.http, "/cl", extra)
    for _ in range(2):
        with socket.create_connection(twins.native.http_address, timeout=3) as sock:
            sock.sendall(request)
            response = read_response(sock)
            assert response is not None and response.status == 200 and response.body == b"hello"
    assert native.stats()["entries"] == 0


def test_a_request_with_bytes_after_it_is_python_s(twins: Twins) -> None:
    """A remembered head followed by more bytes (a pipelined request) is not served natively."""
    request = _get(twins.http, "/cl")
    native = twins.native._front.native  # type: ignore[union-attr]
    _exchange(twins.native, request)
    hits = native.stats()["hits"]
    assert _exchange(twins.native, request + request) == _exchange(twins.python, request + request)
    assert native.stats()["hits"] == hits


@given(
    base=st.sampled_from(["connect", "get"]),
    position=st.integers(min_value=0, max_value=200),
    byte=st.sampled_from(b"\x00\t\n\r :/[]CONNECTHTPGxX01.9\x7f\xff"),
    how=st.sampled_from(["replace", "insert", "truncate", "append"]),
    suffix=st.binary(max_size=40),
)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_mutated_remembered_head_gets_the_python_answer(
    twins: Twins, base: str, position: int, byte: int, how: str, suffix: bytes
) -> None:
    """One byte changed, inserted, cut or appended after a head the native front remembered (a
    CONNECT, or a `Connection: close` GET): the answer is what the Python path alone answers for
    the same bytes (a tunnel's status, reason and echo; a request's whole response)."""
    head = twins.connect_head if base == "connect" else _get(twins.http, "/cl")
    if base == "get":
        _exchange(twins.native, head)  # remembered
    i = position % (len(head) + 1)
    data = {
        "replace": head[:i] + bytes([byte]) + head[i + 1 :],
        "insert": head[:i] + bytes([byte]) + head[i:],
        "truncate": head[:i],
        "append": head + suffix,
    }[how]
    if base == "connect":
        assert _outcome(twins.native, data) == _outcome(twins.python, data), data
    else:
        assert _normalised(_exchange(twins.native, data)) == _normalised(_exchange(twins.python, data)), data


def test_a_served_request_has_the_records_python_writes(audit_path: Path, canned_http: str) -> None:
    http = canned_http
    engine = _engine(_policy([http]), audit_path)
    try:
        creds = engine.issue_credentials()
        auth = f"Proxy-Authorization: Basic {_auth(creds)}\r\nConnection: close\r\n"
        request = _get(http, "/cl", auth)
        answers = [_exchange(engine, request) for _ in range(3)]
        assert answers[0] == answers[1] == answers[2] and answers[0].endswith(b"hello")
        assert _stats(engine)["hits"] == 2
        _wait_for(lambda: len([r for r in _records(audit_path) if r["event"] == "closed"]) == 3)
    finally:
        engine.stop()
    records = _records(audit_path)
    for stage in ("request", "connection"):
        decided = [r for r in records if r["event"] == "decision" and r["stage"] == stage]
        assert len(decided) == 3, (stage, decided)
        _assert_alike(
            decided, ("decision", "reason", "rule", "host", "port", "client", "method", "path", "connected")
        )
    closed = [r for r in records if r["event"] == "closed"]
    assert {(r["bytes_up"], r["bytes_down"]) for r in closed} == {(len(request), len(CANNED["/cl"]))}
    assert len({r["conn"] for r in closed}) == 3


def test_a_request_without_credentials_after_an_authenticated_one_is_not_served(canned_http: str) -> None:
    """On a kept-alive connection a later request must carry its own Proxy-Authorization (an earlier
    request authenticates nothing, on any path): 407, and those bytes are never remembered either."""
    http = canned_http
    engine = _engine(_policy([http]))
    try:
        creds = engine.issue_credentials()
        first = _get(http, "/cl", f"Proxy-Authorization: Basic {_auth(creds)}\r\n")  # keep-alive
        bare = _get(http, "/cl")  # Connection: close, no credentials
        with socket.create_connection(engine.http_address, timeout=5) as sock:
            reader = Reader(sock)
            sock.sendall(first)
            response = reader.response()
            assert response is not None and response.status == 200
            sock.sendall(bare)
            response = reader.response()
            assert response is not None and response.status == 407
        for _ in range(2):
            answer = _exchange(engine, bare)
            assert answer.startswith(b"HTTP/1.1 407"), answer[:200]
        assert _stats(engine)["hits"] == 0
    finally:
        engine.stop()


def test_bytes_sent_after_a_served_request_are_read_and_dropped(twins: Twins) -> None:
    """A client that keeps sending after its `Connection: close` request still gets the whole
    response and a clean close (its bytes read and dropped, as the Python path drops them)."""
    request = _get(twins.http, "/eof")
    _exchange(twins.native, request)  # remembered

    def late_bytes(engine: EgressProxy) -> bytes:
        with socket.create_connection(engine.http_address, timeout=3) as sock:
            sock.sendall(request)
            time.sleep(0.05)
            with contextlib.suppress(OSError):
                sock.sendall(b"GET /more HTTP/1.1\r\n" * 200)
            got = b""
            while chunk := sock.recv(65536):  # a reset here would raise
                got += chunk
            return got

    hits = _stats(twins.native)["hits"]
    served, alone = _normalised(late_bytes(twins.native)), _normalised(late_bytes(twins.python))
    assert served == alone and served[1] == CANNED["/eof"].partition(b"\r\n\r\n")[2] and served[2]
    assert _stats(twins.native)["hits"] == hits + 1
