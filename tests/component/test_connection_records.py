"""An allowed upstream connection's record carries its addresses for every observer that reads them.

The pipeline leaves an allowed connection's addresses (resolved, connected, attempts) unformatted
while only counters listen (subscribed with `addresses=False`); an observer that reads them — the
audit, a trace, `egressd watch` subscribing later — must get them, and a refused or failed
connection's record always has them. Through the real pipeline, connecting to a real server on
127.0.0.1.
"""

from __future__ import annotations

import asyncio
import base64
import socket
from collections.abc import Iterator

import pytest

from egressd.admission.credentials import CredentialStore
from egressd.admission.events import Decided, Event
from egressd.admission.in_force import PolicyHolder
from egressd.admission.pipeline import Admitted, Attempt, Pipeline
from egressd.policy import parse_policy

POLICY = parse_policy({"version": 1, "allow": ["127.0.0.1"]}, "p.yaml")


def _pipeline() -> tuple[Pipeline, str]:
    """A pipeline and the Proxy-Authorization of the child it issued credentials to."""
    store = CredentialStore()
    creds = store.issue()
    basic = base64.b64encode(f"{creds.username}:{creds.token}".encode()).decode()
    return Pipeline(PolicyHolder(POLICY), credentials=store), f"Basic {basic}"


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.create_server(("127.0.0.1", 0))
    yield sock
    sock.close()


class _Kept(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport


def _connect(pipeline: Pipeline, auth: str, port: int) -> None:
    """Admit and open one tunnel to 127.0.0.1:port, then close it."""

    async def run() -> None:
        conn = pipeline.open_conn("127.0.0.1:1")
        admitted = await pipeline.admit(conn, Attempt("connect", "127.0.0.1", port, credentials=auth))
        assert isinstance(admitted, Admitted), admitted
        protocol = _Kept()
        assert await pipeline.connect(conn, admitted, protocol, "up") is None
        assert protocol.transport is not None
        protocol.transport.close()
        pipeline.disconnected("up")
        pipeline.close_conn(conn)

    asyncio.run(run())


def _records(seen: list[Event]) -> list[Decided]:
    return [e for e in seen if type(e) is Decided and e.stage == "connection"]


def test_an_observer_that_reads_addresses_gets_them_beside_counters(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    pipeline, auth = _pipeline()
    counted: list[Event] = []
    pipeline.events.subscribe(counted.append, addresses=False)
    _connect(pipeline, auth, port)
    assert [(r.allowed, r.reason) for r in _records(counted)] == [(True, "loopback")]
    read: list[Event] = []
    pipeline.events.subscribe(read.append)  # a follower that reads them, subscribed later
    _connect(pipeline, auth, port)
    record = _records(read)[0]
    assert record.allowed and record.connected == f"127.0.0.1:{port}", record
    assert record.resolved == ("127.0.0.1",) and record.attempts == (), record
    assert _records(counted)[-1] == record  # the counters get the same record
    pipeline.events.unsubscribe(read.append)
    assert not pipeline.events.wants_addresses


def test_a_failed_connection_is_recorded_with_its_attempts_for_counters_too() -> None:
    free = socket.create_server(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there: refused
    pipeline, auth = _pipeline()
    counted: list[Event] = []
    pipeline.events.subscribe(counted.append, addresses=False)

    async def run() -> None:
        conn = pipeline.open_conn("127.0.0.1:1")
        admitted = await pipeline.admit(conn, Attempt("connect", "127.0.0.1", port, credentials=auth))
        assert isinstance(admitted, Admitted), admitted
        assert await pipeline.connect(conn, admitted, asyncio.Protocol(), "up") is not None

    asyncio.run(run())
    record = _records(counted)[0]
    assert not record.allowed and record.reason == "connect_refused", record
    assert record.resolved == ("127.0.0.1",) and record.attempts and "refused" in record.attempts[0], record


def test_every_event_of_a_tunnel_has_all_its_fields(listener: socket.socket) -> None:
    """The pipeline builds its events by position from a tuple of every field (built_from, which
    checks no count): each one made for an allowed tunnel, a refused one and a closed connection
    has its type's fields, no more, no fewer."""
    port = listener.getsockname()[1]
    pipeline, auth = _pipeline()
    seen: list[Event] = []
    pipeline.events.subscribe(seen.append)
    _connect(pipeline, auth, port)

    async def refused() -> None:
        conn = pipeline.open_conn("127.0.0.1:2")
        answer = await pipeline.admit(conn, Attempt("connect", "example.com", 443, credentials=auth))
        assert not isinstance(answer, Admitted), answer
        pipeline.close_conn(conn)

    asyncio.run(refused())
    pipeline.refused_early(None, "example.com", 443, "bad_request", "unreadable", stage="request")
    kinds = {type(e).__name__ for e in seen}
    assert kinds == {"Decided", "Closed"}, kinds
    assert all(len(e) == len(type(e)._fields) for e in seen), seen
