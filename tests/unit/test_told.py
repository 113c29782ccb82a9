"""Told: which decision records a live view (`ps`, the dashboard, `egressd watch`) shows."""

from __future__ import annotations

from egressd.admission.events import Told


def test_an_allowed_connection_record_after_a_told_decision_is_not_told_again() -> None:
    told = Told()
    assert told.first("c1", "connection", True)  # an allowed tunnel: its only record
    assert not told.first("c1", "connection", True)  # a second upstream connection of it
    assert told.first("c1", "connection", False)  # a refused or failed one always is
    assert told.first("c2", "request", True) and told.first("c2", "request", True)  # every request
    assert not told.first("c2", "connection", True)  # its upstream connection: the request told it
    assert told.first(None, "dns", False)  # a record of no client connection


def test_the_last_size_connections_are_remembered_and_a_told_one_counts_as_recent() -> None:
    told = Told(size=3)
    for conn in ("a", "b", "c"):
        assert told.first(conn, "connection", True)
    assert told.first("a", "request", True)  # told again: now the most recent
    assert told.first("d", "connection", True)  # the oldest, b, goes
    assert told.first("b", "connection", True)  # forgotten: told as new (and c goes)
    assert [not told.first(c, "connection", True) for c in ("a", "d", "b")] == [True, True, True]
    assert told.first("c", "connection", True)


def test_a_full_memory_stays_at_its_size_over_many_connections() -> None:
    told = Told(size=100)
    for i in range(10_000):
        assert told.first(f"c{i}", "connection", True)
        assert not told.first(f"c{i}", "connection", True)
    assert len(told._conns) == 100 and next(iter(told._conns)) == "c9900"
