"""The front's state machine without sockets: bytes in, bytes out, in the manner of mitmproxy's Playbook.

A client connection of the HTTP proxy port (`egressd.front.tunnel.FrontProtocol`) is driven through
its asyncio protocol methods on a transport that is a byte buffer, with the real admission pipeline
behind it. Every answer that needs no upstream is checked here — CONNECT and absolute-form refusals,
unreadable heads, credentials, the gateway's health check, a head cut short or timed out — for every
way the client can split its bytes: the answer must not depend on where the reads fall, and every
answer has its record on the pipeline's event bus. The end-to-end tests keep what needs a network.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.admission.credentials import CredentialStore
from egressd.admission.events import Decided, Event, Notice
from egressd.admission.in_force import PolicyHolder
from egressd.admission.pipeline import Attempt, Pipeline
from egressd.front import tunnel
from egressd.front.server import Front
from egressd.front.tunnel import FrontProtocol
from egressd.policy import parse_policy
from egressd.wire.remembered import REMEMBERED_HEAD, REMEMBERED_HEADS, HeadMemory

POLICY = parse_policy(
    {
        "version": 1,
        "mode": "enforce",
        "allow": ["allowed.test"],
        "deny": ["denied.test"],
        "loopback": {"ports": [8080]},
    },
    "p.yaml",
)


class Wire(asyncio.Transport):
    """A transport with no socket: what the protocol wrote, whether it reads, whether it closed."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False
        self.reading = True
        self.protocol: Any = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self.closed:
            self.out += data

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def abort(self) -> None:
        self.close()

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 3128)}.get(name, default)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.protocol

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass


@dataclass
class Played:
    out: bytes
    closed: bool
    records: list[Decided]

    @property
    def status(self) -> int | None:
        line = self.out.split(b"\r\n", 1)[0].split(b" ")
        return int(line[1]) if len(line) > 1 and line[1].isdigit() else None

    def field(self, name: str) -> str | None:
        head = self.out.split(b"\r\n\r\n", 1)[0].decode("latin-1")
        for line in head.split("\r\n")[1:]:
            key, _, value = line.partition(":")
            if key.strip().lower() == name.lower():
                return value.strip()
        return None


def _auth() -> tuple[CredentialStore, str]:
    store = CredentialStore()
    creds = store.issue()
    return store, base64.b64encode(f"{creds.username}:{creds.token}".encode()).decode()


STORE, AUTH = _auth()


async def _until(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Let the loop run until `check` holds (no socket: only the pipeline's own steps run)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.001)
    return True


async def _inspection_unused() -> Any:
    raise AssertionError("nothing here is inspected")


def play(
    chunks: Sequence[bytes],
    *,
    eof: bool = False,
    health: bool = False,
    then: Callable[[FrontProtocol], None] | None = None,
    seen: list[Event] | None = None,
) -> Played:
    """One client connection: `chunks` read one after another (each only while the protocol reads),
    then an EOF or `then`; what it wrote, whether it closed, and the records of its decisions."""

    async def run() -> Played:
        pipeline = Pipeline(PolicyHolder(POLICY), credentials=STORE)
        events: list[Event] = [] if seen is None else seen
        pipeline.events.subscribe(events.append)
        front = Front(pipeline, _inspection_unused, health=health)
        protocol = FrontProtocol(front)
        wire = Wire()
        wire.protocol = protocol
        protocol.connection_made(wire)
        for chunk in chunks:
            if not await _until(lambda: wire.reading or wire.closed) or wire.closed:
                break
            wire.protocol.data_received(chunk)  # the plain-HTTP path takes the transport over
        if eof and not wire.closed and not wire.protocol.eof_received():
            wire.close()
        if then is not None and not wire.closed:
            then(protocol)
        await _until(lambda: wire.closed)
        await asyncio.sleep(0)  # connection_lost, scheduled by close
        front.close()
        records = [e for e in events if isinstance(e, Decided)]
        return Played(bytes(wire.out), wire.closed, records)

    return asyncio.run(run())


def connect(target: str, *fields: str, auth: str | None = AUTH) -> bytes:
    lines = [f"CONNECT {target} HTTP/1.1", f"Host: {target}", *fields]
    if auth is not None:
        lines.append(f"Proxy-Authorization: Basic {auth}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def get(url: str, host: str, auth: str | None = AUTH) -> bytes:
    lines = [f"GET {url} HTTP/1.1", f"Host: {host}"]
    if auth is not None:
        lines.append(f"Proxy-Authorization: Basic {auth}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


WRONG = base64.b64encode(b"egressd-child:not-the-token").decode()


def recorded(sent: bytes, reason: str) -> list[str]:
    """The refusals recorded for an answer: all but a 407 to a client that sent no credentials (the
    challenge a client that authenticates only when asked answers next)."""
    if reason == "proxy_auth_required" and b"Proxy-Authorization" not in sent:
        return []
    return [reason]


# (id, the client's bytes, the status, the reason) — every answer that needs no upstream
ANSWERS = [
    ("connect-denied", connect("denied.test:443"), 403, "denylist"),
    ("connect-not-allowed", connect("other.test:443"), 403, "not_allowlisted"),
    ("connect-metadata-literal", connect("169.254.169.254:80"), 403, "forbidden_address"),
    ("connect-private-literal", connect("10.0.0.1:443"), 403, "private_address"),
    ("connect-ipv6-loopback-off-port", connect("[::1]:1"), 403, "loopback_port"),
    ("connect-without-credentials", connect("allowed.test:443", auth=None), 407, "proxy_auth_required"),
    ("connect-wrong-credentials", connect("allowed.test:443", auth=WRONG), 407, "proxy_auth_required"),
    (
        "connect-without-port",
        b"CONNECT denied.test HTTP/1.1\r\nHost: denied.test\r\n\r\n",
        400,
        "bad_request",
    ),
    ("connect-origin-form", b"CONNECT / HTTP/1.1\r\nHost: denied.test:443\r\n\r\n", 400, "bad_request"),
    ("connect-bare-lf", b"CONNECT denied.test:443 HTTP/1.1\nHost: denied.test:443\n\n", 400, "bad_request"),
    ("connect-leading-empty-lines", b"\r\n\r\n" + connect("denied.test:443"), 403, "denylist"),
    ("connect-port-zero", connect("denied.test:0"), 400, "bad_request"),
    ("connect-port-too-large", connect("denied.test:65536"), 400, "bad_request"),
    ("plain-denied", get("http://denied.test/x", "denied.test"), 403, "denylist"),
    ("plain-not-allowed", get("http://other.test/x", "other.test"), 403, "not_allowlisted"),
    (
        "plain-without-credentials",
        get("http://allowed.test/x", "allowed.test", auth=None),
        407,
        "proxy_auth_required",
    ),
    ("plain-host-mismatch", get("http://allowed.test/x", "denied.test"), 400, "host_mismatch"),
]


@pytest.mark.parametrize(("sent", "status", "reason"), [a[1:] for a in ANSWERS], ids=[a[0] for a in ANSWERS])
def test_each_answer_whole_and_a_byte_at_a_time(sent: bytes, status: int, reason: str) -> None:
    """The answer and its record, the same whether the head came in one read or one byte a read."""
    for chunks in ([sent], [sent[i : i + 1] for i in range(len(sent))]):
        played = play(chunks)
        assert (played.status, played.field("X-Egressd-Reason")) == (status, reason), played.out
        assert played.closed
        assert [r.reason for r in played.records if not r.allowed] == recorded(sent, reason), played.records
        assert "egressd; error=" in (played.field("Proxy-Status") or "")


@settings(max_examples=60, deadline=None)
@given(
    which=st.sampled_from(ANSWERS),
    cuts=st.lists(st.integers(min_value=1, max_value=400), max_size=12),
)
def test_the_answer_does_not_depend_on_where_the_reads_fall(
    which: tuple[str, bytes, int, str], cuts: list[int]
) -> None:
    _, sent, status, reason = which
    points = sorted({c for c in cuts if c < len(sent)})
    chunks = [sent[a:b] for a, b in zip([0, *points], [*points, len(sent)], strict=True)]
    played = play(chunks)
    assert (played.status, played.field("X-Egressd-Reason")) == (status, reason)
    assert [r.reason for r in played.records if not r.allowed] == recorded(sent, reason)


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[Attempt]:
    """Every attempt the front asks the pipeline to admit, in order."""
    attempts: list[Attempt] = []
    admit = Pipeline.admit

    async def recording(self: Pipeline, conn: Any, attempt: Attempt) -> Any:
        attempts.append(attempt)
        return await admit(self, conn, attempt)

    monkeypatch.setattr(Pipeline, "admit", recording)
    return attempts


def test_a_connect_is_admitted_as_an_attempt_with_every_field(asked: list[Attempt]) -> None:
    """The front builds a CONNECT's Attempt by position from a tuple of every field (built_from,
    which checks no count): the pipeline gets all of them, as the client wrote them."""
    play([connect("denied.test:443")])
    assert len(asked) == 1 and len(asked[0]) == len(Attempt._fields), asked
    assert asked[0] == Attempt(
        "connect", "denied.test", 443, "connect", "CONNECT", None, f"Basic {AUTH}", None
    ), asked


def test_a_connect_head_read_again_is_admitted_as_the_attempt_read_from_it(
    asked: list[Attempt], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every CONNECT head read is remembered with its attempt, however its bytes arrived: the same
    head again, read whole as a connection's first bytes, in pieces or after empty lines, is
    admitted as that attempt, answered and recorded as the first time. A head refused as unreadable
    is not remembered, nor a long one; the memory is bounded."""
    monkeypatch.setattr(tunnel, "_read_connects", HeadMemory())
    heads = [connect("denied.test:443"), connect("other.test:443", auth=WRONG), connect("[::1]:1")]
    for sent in heads:
        first = play([sent])
        assert tunnel._read_connects[sent] is asked[-1]
        for chunks in ([sent], [sent[:9], sent[9:]], [b"\r\n" + sent]):
            again = play(chunks)
            assert asked[-1] is tunnel._read_connects[sent]
            assert (again.status, again.field("X-Egressd-Reason")) == (
                first.status,
                first.field("X-Egressd-Reason"),
            )
            assert [r.reason for r in again.records] == [r.reason for r in first.records]
    pieces = connect("denied.test:8443")
    play([pieces[:9], pieces[9:]])
    assert tunnel._read_connects[pieces] is asked[-1]
    unread = connect("denied.test")  # no port: 400
    for _ in range(2):
        assert play([unread]).status == 400
    long_head = connect("denied.test:443", "X-Pad: " + "a" * REMEMBERED_HEAD)
    assert play([long_head]).status == first.status
    assert list(tunnel._read_connects) == [*heads, pieces]
    for n in range(REMEMBERED_HEADS):
        play([connect(f"h{n}.test:443")])
    assert len(tunnel._read_connects) < REMEMBERED_HEADS


def test_a_head_cut_short_by_eof_is_closed_without_an_answer() -> None:
    played = play([connect("denied.test:443")[:20]], eof=True)
    assert played.closed and played.out == b""


def test_a_head_that_never_ends_is_closed_and_recorded_when_it_times_out() -> None:
    seen: list[Event] = []
    played = play([b"CONNECT denied.test:443 HTTP/1.1\r\n"], then=lambda p: p.head_timed_out(1.0), seen=seen)
    assert played.closed and played.out == b""
    assert [e.kind for e in seen if isinstance(e, Notice)] == ["header_timeout"]


def test_the_gateways_health_check_is_answered_and_nothing_else_is_read() -> None:
    played = play([b"GET /healthz HTTP/1.1\r\n\r\n"], health=True)
    assert played.status == 200 and played.out.endswith(b"ok\n") and played.closed
    assert played.records == []


def test_without_the_health_check_the_same_request_is_a_plain_refusal() -> None:
    played = play([b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"])
    assert played.status == 400 and played.closed, played.out


def test_bytes_after_a_refused_connect_head_are_never_read_as_a_second_request() -> None:
    """A client that pipelines a request after its CONNECT gets one answer: the CONNECT's."""
    played = play([connect("denied.test:443") + get("http://allowed.test/", "allowed.test")])
    assert played.out.count(b"HTTP/1.1 ") == 1 and played.status == 403
    assert [r.reason for r in played.records if not r.allowed] == ["denylist"]
