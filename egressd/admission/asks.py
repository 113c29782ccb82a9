"""Ask mode's approver: the registry of pending asks that every human interface answers through.

The pipeline awaits `AskBroker.ask` between the decision and resolution, so nothing is resolved,
connected or sent upstream while a question waits. Identical concurrent asks are ONE pending
question, and one answer releases every request waiting on it — so identical means everything the
person is shown: the same client, scheme, method, host, port and path with its query (a tunnel:
the same client, host and port). `GET /public` and `POST /admin/delete` to one host are two
questions, never one card saying "GET /public, 2 waiting". A question waits at most the policy's
`ask_timeout`, then every waiter is refused (`ask_timeout`).

Interfaces attach as listeners (`attach`): the control API's followers, the terminal prompt, a
dashboard. Any thread may `answer`; the waiting requests are released on the proxy's loop. Who
"can answer" is decided here once: `--approve-all`, an attached approver (the /dev/tty prompt, a
client following the asks, the dashboard), or a client that listed the pending asks within the
last `poll_grace` seconds. With none, an ask is refused at once (`no_approver`): a request must not
hang for a minute when nobody will ever see the question.

A grant made while requests wait (`egressd grant`, or a `run` answer to another question) answers
the questions it covers: each waiting request checks the grants again, as the pipeline did before
asking (a one-shot grant admits one of them), and leaves the question when a grant admits it.

An ask's ID names its egressd: `PID-RANDOM-N` (`4242-9f3a-1`), the pid of the instance whose
control socket answers it, a random part of this broker's own (a later egressd that gets the same
pid never takes an ID of the earlier one) and a counter. `egressd approve ID` finds the instance
from the ID alone, so an answer never lands on another program's question.

Answers: `once` (the waiting requests only), `run` (an exact host:port grant until egressd exits),
`always` (an allow rule written to the policy file; the reload applies it, a run grant bridges the
moment until it does), `deny` (the waiting requests), `deny-always` (a deny rule written to the
file, and refused for the rest of this run).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from egressd.admission.approver import NO_APPROVER, Answer, Recheck
from egressd.admission.events import EventBus, Notice
from egressd.admission.grants import Grant, GrantStore
from egressd.admission.state import ConnState, asker
from egressd.platform.log import Logger
from egressd.policy import Decision
from egressd.policy.reasons import DENIED_ALWAYS, Reason

if TYPE_CHECKING:
    import asyncio

logger = Logger(__name__)

ANSWERS = ("once", "run", "always", "deny", "deny-always")
POLL_GRACE = 30.0  # a client that listed the pending asks this recently counts as an approver

Listener = Callable[[str, dict[str, object]], None]  # (kind, ask as JSON); must not block
RuleWriter = Callable[[str, str], str]  # (list: "allow"/"deny", rule) -> what was written where
_ASK_ID = re.compile(r"([1-9][0-9]{0,9})-[0-9a-f]{4}-[1-9][0-9]*")


def ask_instance(ask_id: str) -> int | None:
    """The pid of the egressd an ask ID belongs to; None when the text is no ask ID."""
    found = _ASK_ID.fullmatch(ask_id)
    return int(found.group(1)) if found else None


class Answerer(Protocol):
    """What an interface (the terminal prompt, the editor's dialog, `pending --interactive`) needs
    of the asks: hear each one and its end, and answer. AskBroker is one; the CLI's view of every
    running instance (egressd.control.follow) is another."""

    def attach(
        self, listener: Callable[[str, dict[str, Any]], None], *, approver: bool | Callable[[], bool]
    ) -> Callable[[], None]: ...

    def answer(self, ask_id: str, kind: str, *, by: str = ...) -> dict[str, object]: ...


class AskError(Exception):
    """An answer that cannot be applied; `status` is the HTTP status the control API answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# what a question shows, and so what makes two requests one question (see the module docstring)
AskKey = tuple[str, str | None, str | None, str, int, str | None]


def ask_key(client_key: str, decision: Decision) -> AskKey:
    target = decision.target
    assert target is not None
    return (client_key, target.scheme, target.method, target.host.text, target.port, target.path)


class PendingAsk:
    """One question: a request a client wants to make, with every identical request waiting for
    the answer. A plain class: made by the broker, read and updated, never compared nor copied (a
    dataclass would only add start-up time)."""

    __slots__ = (
        "id",
        "key",
        "host",
        "port",
        "scheme",
        "method",
        "path",
        "client",
        "profile",
        "conn",
        "timeout",
        "loop",
        "future",
        "wake",
        "created",
        "started",
        "requests",
    )

    def __init__(
        self,
        id: str,
        key: AskKey,
        host: str,
        port: int,
        scheme: str | None,
        method: str | None,
        path: str | None,
        client: str | None,
        profile: str | None,
        conn: str,
        timeout: float,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[Answer],
        # settled (and replaced) when a grant that may cover this question is made
        wake: asyncio.Future[None] | None = None,
        # each request waiting on the question: its connection and, when known, the program holding it
        requests: list[dict[str, object]] | None = None,
    ) -> None:
        self.id = id
        self.key = key
        self.host = host
        self.port = port
        self.scheme = scheme
        self.method = method
        self.path = path
        self.client = client
        self.profile = profile
        self.conn = conn
        self.timeout = timeout
        self.loop = loop
        self.future = future
        self.wake = wake
        self.created = time.time()
        self.started = time.monotonic()
        self.requests = requests if requests is not None else []

    @property
    def waiters(self) -> int:
        return len(self.requests)

    @property
    def rule(self) -> str:
        """The policy rule an `always` answer writes: this host and port."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def to_json(self, command: Sequence[str] = (), always: bool = True) -> dict[str, object]:
        left = max(0.0, self.timeout - (time.monotonic() - self.started))
        return {
            "id": self.id,
            "host": self.host,
            "port": self.port,
            "scheme": self.scheme,
            "method": self.method,
            "path": self.path,
            "client": self.client,
            "profile": self.profile,
            "asker": asker(self.client, self.profile),  # who asks, as a person is told
            "conn": self.conn,
            "command": list(command),
            "waiting": self.waiters,
            "requests": [dict(r) for r in self.requests],
            "rule": self.rule,
            "created": self.created,
            "expires_in": round(left, 1),
            "answers": [a for a in ANSWERS if always or "always" not in a],
        }


class AskBroker:
    """The one approver of an egressd: pending asks, their answers, and who is listening."""

    def __init__(
        self,
        grants: GrantStore,
        *,
        timeout: Callable[[], float],
        command: Sequence[str] = (),
        write_rule: RuleWriter | None = None,
        approve_all: bool = False,
        events: EventBus | None = None,
        poll_grace: float = POLL_GRACE,
        instance: int | None = None,
    ) -> None:
        """`instance`: the pid whose control socket answers these asks (this process's)."""
        self.grants = grants
        self.timeout = timeout
        self.command = tuple(command)
        self.write_rule = write_rule
        self.approve_all = approve_all
        self.events = events
        self.poll_grace = poll_grace
        self._lock = threading.Lock()
        self.write_lock = threading.Lock()
        self._pending: dict[str, PendingAsk] = {}
        self._by_key: dict[AskKey, PendingAsk] = {}
        self._denied: set[tuple[str, int]] = set()
        self._listeners: dict[int, tuple[Listener, bool | Callable[[], bool]]] = {}
        self._tokens = itertools.count(1)
        self._last_poll: float | None = None
        self._prefix = f"{os.getpid() if instance is None else instance}-{secrets.token_hex(2)}-"
        self._ids = itertools.count(1)
        grants.added(self._granted)

    # -- who can answer --------------------------------------------------------------------------
    def attach(self, listener: Listener, *, approver: bool | Callable[[], bool]) -> Callable[[], None]:
        """Hear every ask and its end; `approver`: this listener can answer (a prompt, a UI, a
        client following the asks), or a function saying whether it can now (the terminal, only
        while egressd is in its foreground). Returns the function that detaches it."""
        token = next(self._tokens)
        with self._lock:
            self._listeners[token] = (listener, approver)

        def detach() -> None:
            with self._lock:
                self._listeners.pop(token, None)

        return detach

    def polled(self) -> None:
        """A client listed the pending asks: it is taken to be answering for `poll_grace` s."""
        self._last_poll = time.monotonic()

    def can_answer(self) -> bool:
        with self._lock:
            approvers = [approver for _, approver in self._listeners.values()]
        if self.approve_all or any(a() if callable(a) else a for a in approvers):
            return True
        last = self._last_poll
        return last is not None and time.monotonic() - last < self.poll_grace

    # -- the approver the pipeline awaits ----------------------------------------------------------
    async def ask(
        self, decision: Decision, client: ConnState, recheck: Recheck | None = None
    ) -> Answer | Decision:
        """The answer for this request; `recheck`: the grants step again (the decision a grant
        makes of it, or None), asked when a grant is made while it waits."""
        target = decision.target
        if target is None:
            return Answer(False, Reason.ASK_REFUSED, "nothing to ask about", "mode: ask")
        host, port = target.host.text, target.port
        if self.approve_all:
            return Answer(True, Reason.APPROVED, f"{host}:{port} approved by --approve-all", "--approve-all")
        if (host, port) in self._denied:
            detail = f"{host}:{port} was denied for this run"
            return Answer(False, Reason.ASK_REFUSED, detail, DENIED_ALWAYS)
        if not self.can_answer():
            return NO_APPROVER
        key = ask_key(client.client_key, decision)
        with self._lock:
            pending = self._by_key.get(key)
            if pending is not None and not pending.future.done():
                pending.requests.append(_request(client))
                created = False
            else:
                pending = self._new(key, decision, client)
                created = True
        # a request that joins changes what the question covers ("Allow once" releases it too):
        # every surface that shows the count hears it
        self._notify("ask" if created else "waiting", pending)
        import asyncio  # loaded with the proxy's loop, which runs this

        try:
            return await self._wait(pending, recheck, client.conn_id)
        except asyncio.CancelledError:
            self._leave(pending, client.conn_id, "withdrawn")
            raise

    async def _wait(self, pending: PendingAsk, recheck: Recheck | None, conn: str) -> Answer | Decision:
        """The question's answer, or the decision of a grant made meanwhile that admits this
        request. Grants are checked once on joining too: one made between the pipeline's grants
        step and this question's registration woke nobody."""
        import asyncio

        while True:
            wake = pending.wake
            if recheck is not None and self.grants:
                granted = recheck()
                if granted is not None:
                    self._leave(pending, conn, "answered", answer="grant", by=granted.rule or "a grant")
                    return granted
            assert wake is not None
            await asyncio.wait((pending.future, wake), return_when=asyncio.FIRST_COMPLETED)
            if pending.future.done():
                return pending.future.result()

    def _granted(self, grant: Grant) -> None:
        """A grant was made (from any thread): the questions it may cover check the grants again."""
        with self._lock:
            woken = [p for p in self._pending.values() if grant.covers(p.host, p.port)]
        for pending in woken:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                pending.loop.call_soon_threadsafe(_wake, pending)

    def _new(self, key: AskKey, decision: Decision, client: ConnState) -> PendingAsk:
        """A new pending ask (under the lock), with its timeout on the proxy's loop."""
        target = decision.target
        assert target is not None
        import asyncio

        loop = asyncio.get_running_loop()
        timeout = float(self.timeout())
        pending = PendingAsk(
            id=f"{self._prefix}{next(self._ids)}",
            key=key,
            host=target.host.text,
            port=target.port,
            scheme=target.scheme,
            method=target.method,
            path=target.path,
            client=client.client_name,
            profile=client.profile,
            conn=client.conn_id,
            timeout=timeout,
            loop=loop,
            future=loop.create_future(),
            wake=loop.create_future(),
            requests=[_request(client)],
        )
        self._pending[pending.id] = pending
        self._by_key[key] = pending
        loop.call_later(timeout, self._expire, pending.id)
        return pending

    def _expire(self, ask_id: str) -> None:
        pending = self._pop(ask_id)
        if pending is None:
            return
        detail = f"nobody answered within ask_timeout ({pending.timeout:g}s)"
        _settle(pending.future, Answer(False, Reason.ASK_TIMEOUT, detail, "mode: ask (ask_timeout)"))
        self._notify("expired", pending)

    def _leave(self, pending: PendingAsk, conn: str, kind: str, **extra: object) -> None:
        """A waiting request went away (`withdrawn`) or a grant admitted it (`answered`); the
        question goes with the last one."""
        with self._lock:
            for i, request in enumerate(pending.requests):
                if request["conn"] == conn:
                    del pending.requests[i]
                    break
            current = self._pending.get(pending.id) is pending
            left = pending.waiters
        if not current:
            return
        if left > 0:
            self._notify("waiting", pending)
        elif self._pop(pending.id) is not None:
            self._notify(kind, pending, **extra)

    def _pop(self, ask_id: str) -> PendingAsk | None:
        with self._lock:
            pending = self._pending.pop(ask_id, None)
            if pending is not None and self._by_key.get(pending.key) is pending:
                del self._by_key[pending.key]
            return pending

    # -- answers -----------------------------------------------------------------------------------
    def pending(self) -> list[PendingAsk]:
        with self._lock:
            return list(self._pending.values())

    def describe(self, pending: PendingAsk) -> dict[str, object]:
        return pending.to_json(self.command, always=self.write_rule is not None)

    def answer(self, ask_id: str, kind: str, *, by: str = "api") -> dict[str, object]:
        """Answer a pending ask from any thread; AskError (404, 400, 409) when it cannot be."""
        if kind not in ANSWERS:
            raise AskError(400, f"unknown answer {kind!r} (one of: {', '.join(ANSWERS)})")
        with self._lock:
            pending = self._pending.get(ask_id)
        if pending is None:
            raise AskError(404, f"no pending ask {ask_id!r} (answered, expired or withdrawn)")
        written = None
        if kind in ("always", "deny-always"):
            written = self._write(pending, "allow" if kind == "always" else "deny")
        if self._pop(ask_id) is None:
            raise AskError(404, f"ask {ask_id!r} was answered or expired meanwhile")
        target = f"{pending.host}:{pending.port}"
        if kind == "run" or kind == "always":
            self.grants.add_run(pending.host, pending.port)
        if kind == "deny-always":
            self._denied.add((pending.host, pending.port))
        if kind in ("once", "run", "always"):
            how = {"once": "once", "run": "for this run", "always": "always"}[kind]
            detail, rule = f"{target} approved {how} by {by}", f"mode: ask (approved {how})"
            result = Answer(True, Reason.APPROVED, detail, rule)
        else:
            how = "once" if kind == "deny" else "always"
            rule = "mode: ask (denied once)" if kind == "deny" else DENIED_ALWAYS
            detail = f"{target} denied {how} by {by}"
            result = Answer(False, Reason.ASK_REFUSED, detail, rule)
        pending.loop.call_soon_threadsafe(_settle, pending.future, result)
        self._notify("answered", pending, answer=kind, by=by)
        reply: dict[str, object] = {"id": ask_id, "answer": kind, "released": pending.waiters}
        if written is not None:
            reply["written"] = written
        return reply

    def _write(self, pending: PendingAsk, which: str) -> str:
        if self.write_rule is None:
            raise AskError(409, "no policy file to write to (egressd runs without --policy FILE); answer run")
        with self.write_lock:
            try:
                return self.write_rule(which, pending.rule)
            except Exception as exc:  # noqa: BLE001 - reported to whoever answered
                raise AskError(409, f"could not write the policy file: {exc}") from exc

    # -- listeners -----------------------------------------------------------------------------------
    def _notify(self, kind: str, pending: PendingAsk, **extra: object) -> None:
        info = {**self.describe(pending), **extra}
        with self._lock:
            listeners = [listener for listener, _ in self._listeners.values()]
        for listener in listeners:
            try:
                listener(kind, info)
            except Exception:  # noqa: BLE001 - a listener never changes an answer
                logger.exception("egressd: an ask listener failed")
        if self.events is not None and kind != "waiting":
            # the audit records asks too (not a change of their count: each request has its own
            # decision record): the query redacted, as in its decision records
            # (not the waiting programs' command lines: an argument may be a secret)
            skip = ("command", "answers", "expires_in", "requests")
            fields = {k: v for k, v in info.items() if k not in skip}
            path = fields.get("path")
            if isinstance(path, str) and "?" in path:
                fields["path"] = path.partition("?")[0] + "?<redacted>"
            self.events.emit(Notice(f"ask_{kind}" if kind != "ask" else "ask", fields))


def _request(client: ConnState) -> dict[str, object]:
    """One waiting request as an ask shows it: its connection, and the program holding it when the
    identity step looked it up (pid, executable, command line)."""
    who = client.identity
    request: dict[str, object] = {"conn": client.conn_id}
    if who is not None and who.pid is not None:
        request.update(pid=who.pid, exe=who.exe, cmdline=list(who.cmdline))
    return request


def _settle[T](future: asyncio.Future[T] | None, answer: T) -> None:
    import asyncio

    with contextlib.suppress(asyncio.InvalidStateError):
        if future is not None and not future.done():
            future.set_result(answer)


def _wake(pending: PendingAsk) -> None:
    """On the question's loop: wake its waiters, and give the next grant a fresh future to settle."""
    wake, pending.wake = pending.wake, pending.loop.create_future()
    _settle(wake, None)
