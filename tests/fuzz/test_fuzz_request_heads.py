"""Fuzzing the running proxy with random request heads (hypothesis, bounded).

Why: request-head parsing is mitmproxy's, the host checks are egressd's, and the two meet only in a
running proxy. Random heads — methods, targets in every host spelling, Host headers, framing
headers, odd line endings and bytes — go over a socket to one `egressd run`; whatever egressd
answers, no refused server may see a connection, anything that reached an upstream reached the
allowed one, and egressd keeps answering a normal request.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.support.corpus import ProxyClient, Reader, ServerSet
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun, write_policy

ALLOWED = "198.51.100.1"
REFUSED = ("198.51.100.9", "127.0.0.1", "::1", "192.0.2.1")

POLICY = f"""\
version: 1
allow: [allowed.test, {ALLOWED}]
loopback: {{allow: false}}
limits: {{dns_timeout: 1}}
"""


@dataclass
class Env:
    client: ProxyClient
    servers: ServerSet


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    policy = write_policy(Path(tmp_path_factory.mktemp("fuzz-heads")), POLICY)
    with DnsServer() as dns, ServerSet((ALLOWED, *REFUSED)) as servers:
        dns.add("allowed.test", ALLOWED)
        dns.add("evil.test", "198.51.100.9")
        dns.add("sneaky.allowed.test", "127.0.0.1")
        with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]) as run:
            yield Env(ProxyClient.from_env(run.env), servers)
        assert servers.reached(ALLOWED) == {}


HOSTS = [
    "allowed.test",
    "ALLOWED.TEST.",
    "sneaky.allowed.test",
    "evil.test",
    "allowed.test.evil.test",
    ALLOWED,
    "0xc6.0x33.0x64.1",
    "198.51.100.9",
    "127.0.0.1",
    "0x7f.1",
    "2130706433",
    "[::1]",
    "[::ffff:127.0.0.1]",
    "localhost",
    "0",
    "0.0.0.0",
    "[::]",
    "169.254.169.254",
    "[64:ff9b::a9fe:a9fe]",
    "192.0.2.1",
    "allowed.test@evil.test",
    "allowed%2etest",
    "[fe80::1%25lo]",
    "",
]


def _authority(host: str, port: int) -> str:
    return f"{host}:{port}" if host else f":{port}"


@st.composite
def request_heads(draw: st.DrawFn, port: int, auth: bytes) -> bytes:
    """A request head assembled from plausible and hostile pieces; most are well-formed (so the
    policy, not the parser, answers), some are broken on purpose, some get a byte-level mutation."""
    well_formed = draw(st.integers(0, 9)) < 7
    hosts = st.sampled_from(HOSTS)
    host = draw(hosts if well_formed else hosts | st.text(alphabet="abc.:[]0x7f@%-_", max_size=20))
    target_port = draw(st.sampled_from([port, port, port, 80, 1]))
    methods = ["GET", "POST", "HEAD", "CONNECT"]
    if not well_formed:
        methods += ["OPTIONS", "get", "G\x00T", "X" * 40]
    method = draw(st.sampled_from(methods))
    authority = _authority(host, target_port)
    targets = [authority] if method == "CONNECT" and well_formed else []
    targets += [f"http://{authority}/p", f"HTTP://{authority}", "/p"]
    if not well_formed:
        targets += [f"https://{authority}/", authority, "*", f"//{authority}/"]
    target = draw(st.sampled_from(targets))
    version = "HTTP/1.1" if well_formed else draw(st.sampled_from(["HTTP/1.0", "HTTP/2.0", "HTTP/1.1x", ""]))
    header_host = draw(st.sampled_from([host, host, *HOSTS]))
    choices = [
        ("Host", _authority(header_host, target_port)),
        ("Content-Length", draw(st.sampled_from(["0", "5", "-1", "1, 2", "99999999999"]))),
        ("Transfer-Encoding", draw(st.sampled_from(["chunked", "identity", "chunked, chunked", "x"]))),
        ("Connection", draw(st.sampled_from(["close", "keep-alive", "upgrade", "x-a"]))),
        ("Upgrade", "websocket"),
        ("X-Fold", "a\r\n b"),
        ("X-Nul", "a\x00b"),
        ("Expect", "100-continue"),
    ]
    headers = draw(
        st.lists(st.sampled_from(choices[:1] + choices[3:5] if well_formed else choices), max_size=4)
    )
    if well_formed and draw(st.booleans()):
        headers.insert(0, choices[0])
    eol = "\r\n" if well_formed else draw(st.sampled_from(["\r\n", "\n", "\r"]))
    lines = [" ".join(part for part in (method, target, version) if part)]
    lines += [f"{name}: {value}" for name, value in headers]
    head = eol.join(lines).encode("utf-8", "surrogateescape") + eol.encode()
    if well_formed or draw(st.booleans()):
        head += auth
    head += eol.encode()
    if not well_formed or method == "CONNECT":
        head += draw(st.binary(max_size=32))
    if not well_formed and draw(st.booleans()):  # a byte-level mutation
        position = draw(st.integers(0, len(head)))
        head = head[:position] + draw(st.binary(min_size=1, max_size=4)) + head[position:]
    return head


def _exchange(client: ProxyClient, raw: bytes) -> list[bytes]:
    """Send and collect what comes back (bodies of upstream 2xx answers).

    Answers come within milliseconds here, so a short wait suffices; a head still incomplete after
    it is half-closed (mitmproxy then drops the exchange, which is fine: nothing was forwarded).
    """
    bodies: list[bytes] = []
    outcome = "no answer"
    with client.open(3) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(raw)
        reader = Reader(sock)
        for attempt in range(4):
            try:
                response = reader.response(0.5 if attempt == 0 else 0.2)
            except TimeoutError:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)
                break
            except (OSError, AssertionError, ValueError, IndexError):
                break
            if response is None:
                break
            if outcome == "no answer":
                outcome = f"{response.status} {response.reason or 'upstream'}"
            if response.status < 300 and response.reason is None:
                bodies.append(response.body)
    event(outcome)
    return bodies


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_random_heads_never_reach_a_refused_server(env: Env, data: st.DataObject) -> None:
    raw = data.draw(request_heads(env.servers.port, env.client.auth_header), label="request head")
    before = env.servers.counts()
    for body in _exchange(env.client, raw):
        with contextlib.suppress(ValueError):
            assert json.loads(body)["server"] == f"http-{ALLOWED}", body[:200]
    after = env.servers.counts()
    assert {h: after[h] - before[h] for h in after if h != ALLOWED and after[h] != before[h]} == {}, raw


def test_proxy_still_serves_after_the_fuzzing(env: Env) -> None:
    """Runs after the property (file order): egressd survived every head and answers normally."""
    server = env.servers[ALLOWED]
    response = env.client.get(
        f"http://allowed.test:{env.servers.port}/after", host=f"allowed.test:{server.port}"
    )
    assert response is not None and response.status == 200
