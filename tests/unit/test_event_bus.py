"""EventBus: every observer gets the events of the kinds it subscribed to, in subscription order."""

from __future__ import annotations

from egressd.admission.events import Closed, Decided, Event, EventBus, Notice


def _closed() -> Closed:
    return Closed(conn="c1", client=None, host="h", port=1, bytes_up=5, bytes_down=7, duration=0.1)


def test_an_observer_of_some_kinds_gets_only_those_and_every_other_gets_all() -> None:
    bus = EventBus()
    seen: list[tuple[str, str]] = []

    def named(name: str) -> object:
        return lambda event: seen.append((name, type(event).__name__))

    everything, decisions, notices = named("all"), named("decided"), named("notice")
    bus.subscribe(everything)  # type: ignore[arg-type]
    bus.subscribe(decisions, kinds=(Decided,))  # type: ignore[arg-type]
    bus.subscribe(notices, kinds=(Notice, Decided))  # type: ignore[arg-type]
    bus.emit(_closed())
    bus.emit(Notice("header_timeout", {}))
    assert seen == [("all", "Closed"), ("all", "Notice"), ("notice", "Notice")]
    bus.unsubscribe(notices)  # type: ignore[arg-type]
    late: list[Event] = []
    bus.subscribe(late.append, kinds=(Closed,))
    seen.clear()
    bus.emit(_closed())
    bus.emit(Notice("header_timeout", {}))
    assert seen == [("all", "Closed"), ("all", "Notice")] and len(late) == 1
