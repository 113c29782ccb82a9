"""Following the streams of every running egressd — the ones running now and the ones that start
later — or of the one a pid names, whether it runs yet or not (`pending --follow`, `watch`).

Why every instance: an answer meant for one program must never land on another's question, and a
follower that picks "the one instance running now" either exits when there is none yet or silently
follows whichever it found. So a follower looks at the run directory every `scan` seconds, opens
each new instance's stream on a thread of its own, and says when one starts and ends.

`RemoteAsks` puts the asks of all of them behind the interface of the ask broker (`attach`,
`answer`), so the terminal prompt (`egressd.control.prompt`) answers them as it answers its own
egressd's.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from egressd.admission.asks import AskError, ask_instance
from egressd.control import paths
from egressd.control.client import ControlClient, ControlError, find_instances

SCAN = 0.5  # seconds between two looks at the run directory
RESCAN = 5.0  # and between two probes of its sockets when no name changed


@dataclass(frozen=True)
class Item:
    """One line of an instance's stream (`kind` "item"), or that instance starting or ending."""

    kind: str  # "item" | "started" | "ended"
    pid: int
    data: dict[str, Any] = field(default_factory=dict)


class Follow:
    """The lines of `url` on every instance (or only `pid`'s), as Items, until `stop()` — or, with
    `pid`, until that instance ends. ControlError when the run directory is unsafe."""

    def __init__(
        self, url: str, pid: int | None = None, *, directory: Path | None = None, scan: float = SCAN
    ):
        self.url = url
        self.pid = pid
        self.directory = directory
        self.scan = scan
        self._items: queue.Queue[Item] = queue.Queue()
        self._following: dict[int, tuple[int, int]] = {}  # pid -> the socket's (device, inode)
        self._ended: set[tuple[int, int, int]] = set()  # (pid, device, inode) of ended streams
        self._stop = threading.Event()
        self._names: frozenset[str] | None = None  # the run directory's names at the last probe
        self._probed = 0.0

    def stop(self) -> None:
        self._stop.set()

    def running(self) -> list[int]:
        return sorted(self._following)

    def __iter__(self) -> Iterator[Item]:
        seen_named = False
        looked = 0.0
        while not self._stop.is_set():
            if time.monotonic() - looked >= self.scan:  # not per line: a busy stream has many
                self._look()
                looked = time.monotonic()
            if self.pid is not None and self.pid in self._following:
                seen_named = True
            try:
                item = self._items.get(timeout=self.scan)
            except queue.Empty:
                continue
            if item.kind == "ended":
                self._following.pop(item.pid, None)
            yield item
            if item.kind == "ended" and seen_named and item.pid == self.pid:
                return

    def _look(self) -> None:
        """Start a stream for every instance not followed yet (an ended one only if its socket is
        a new one: the same pid started again). The sockets are probed (a connection each) only
        when the run directory's names changed, or every RESCAN seconds."""
        directory = paths.run_dir() if self.directory is None else self.directory
        try:
            names = frozenset(os.listdir(directory))
        except OSError:
            names = frozenset()
        if names == self._names and time.monotonic() - self._probed < RESCAN:
            return
        self._names, self._probed = names, time.monotonic()
        _directory, found = find_instances(self.directory)
        for instance in found:
            if self.pid is not None and instance.pid != self.pid:
                continue
            if instance.pid in self._following:
                continue
            try:
                info = os.stat(instance.path)
            except OSError:
                continue
            socket_id = (info.st_dev, info.st_ino)
            if (instance.pid, *socket_id) in self._ended:
                continue
            self._following[instance.pid] = socket_id
            thread = threading.Thread(
                target=self._read,
                args=(ControlClient(instance.path), instance.pid, socket_id),
                name=f"egressd-follow-{instance.pid}",
                daemon=True,
            )
            thread.start()

    def _read(self, client: ControlClient, pid: int, socket_id: tuple[int, int]) -> None:
        about: dict[str, Any] = {}
        with contextlib.suppress(ControlError):
            about = client.call("GET", "/v1/info")
        self._items.put(Item("started", pid, about))
        try:
            for line in client.stream(self.url):
                if self._stop.is_set():
                    return
                if line.get("event") != "keepalive":
                    self._items.put(Item("item", pid, line))
        except ControlError:
            pass
        finally:
            self._ended.add((pid, *socket_id))
            self._items.put(Item("ended", pid))


def client_for_ask(ask_id: str, pid: int | None = None, directory: Path | None = None) -> ControlClient:
    """The control client of the instance an ask ID belongs to; ControlError (with `status` 404
    for an ID that names no running instance) otherwise."""
    owner = ask_instance(ask_id)
    if owner is None:
        raise ControlError(f"{ask_id!r} is not an ask ID (egressd pending lists them, e.g. 4242-9f3a-1)", 400)
    if pid is not None and pid != owner:
        raise ControlError(f"ask {ask_id} belongs to the egressd with pid {owner}, not --pid {pid}", 400)
    run_dir, found = find_instances(directory)
    for instance in found:
        if instance.pid == owner:
            return ControlClient(instance.path)
    raise ControlError(
        f"no egressd with pid {owner} is running (sockets in {run_dir}): ask {ask_id} ended with it", 404
    )


class RemoteAsks:
    """The asks of every running egressd (or of `pid`'s) behind the ask broker's interface, for an
    interface that answers them from another process (`egressd pending --interactive`)."""

    def __init__(self, pid: int | None = None, *, directory: Path | None = None, scan: float = SCAN) -> None:
        self.follow = Follow("/v1/asks?follow=1", pid, directory=directory, scan=scan)
        self.directory = directory
        self._listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self._open: dict[int, set[str]] = {}  # pid -> its asks not ended yet

    def attach(
        self, listener: Callable[[str, dict[str, Any]], None], *, approver: bool | Callable[[], bool]
    ) -> Callable[[], None]:
        """Hear every ask; following the asks is what makes this process an approver of each
        instance (the control API counts a follower), so `approver` needs no more."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def answer(self, ask_id: str, kind: str, *, by: str = "egressd pending") -> dict[str, object]:
        try:
            reply = client_for_ask(ask_id, self.follow.pid, self.directory).call(
                "POST", f"/v1/asks/{ask_id}", {"answer": kind, "by": by}
            )
        except ControlError as exc:
            raise AskError(exc.status or 502, str(exc)) from exc
        return dict(reply)

    def items(self) -> Iterator[Item]:
        """Follow, telling the listeners; every Item is passed on too (to print who starts, ends).
        An instance that ends takes its asks with it: they end for the listeners."""
        for item in self.follow:
            if item.kind == "item":
                event, ask_id = str(item.data.get("event")), str(item.data.get("id"))
                ids = self._open.setdefault(item.pid, set())
                if event == "ask":
                    ids.add(ask_id)
                elif event != "waiting":  # over: answered, expired, withdrawn
                    ids.discard(ask_id)
                self._tell(event, item.data)
            elif item.kind == "ended":
                for ask_id in sorted(self._open.pop(item.pid, set())):
                    self._tell("ended", {"id": ask_id})
            yield item

    def _tell(self, kind: str, info: dict[str, Any]) -> None:
        for listener in list(self._listeners):
            listener(kind, info)
