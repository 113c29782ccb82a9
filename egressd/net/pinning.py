"""The pin step: upstream connections go ONLY to the addresses the pipeline validated.

Each address is tried in order, each attempt bounded by connect_timeout, all within twice that.
The embedded mitmproxy's upstream connections are opened here too (through `Pipeline.connect`, by
egressd.inspect.handler): nothing is resolved or connected behind the policy's back. A pin whose
connection goes through a parent proxy (`via`) is opened by the parent's dialer
(egressd.net.parent_proxy) instead, here and nowhere else, for every front and mitmproxy alike.
"""

from __future__ import annotations

import asyncio
import errno
import math
import socket
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from egressd.net.parent_proxy import ParentFailure, dial
from egressd.platform.descriptors import OUT_OF_DESCRIPTORS
from egressd.policy import IPAddress, UpstreamProxy, join_host_port
from egressd.policy.reasons import Reason


@dataclass(slots=True)
class Pin:
    """The admitted destination of one upstream connection."""

    host: str
    port: int
    addresses: tuple[IPAddress, ...]
    connect_timeout: float
    connected: tuple[str, int] | None = None
    attempts: list[str] = field(default_factory=list)
    via: UpstreamProxy | None = None  # the parent proxy this connection goes through, if any


TEXTS = 4096  # addresses whose text is remembered (then forgotten all at once)
_texts: dict[tuple[type, int, str | None], str] = {}


def address_text(address: IPAddress) -> str:
    """An address as text, remembered: ipaddress spells it in Python, slowly, and each is spelled to
    connect and again for the record. Remembered by its class, its integer and an IPv6 scope:
    what the text is made of, and a key hashed in C (an address's own hash is Python code that
    spells its integer in hex)."""
    key = (address.__class__, address._ip, getattr(address, "_scope_id", None))
    text = _texts.get(key)
    if text is None:
        if len(_texts) >= TEXTS:
            _texts.clear()
        text = _texts[key] = str(address)
    return text


class ConnectFailure(OSError):
    """Raised when no pinned address accepted: the reason code and what each attempt met."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


async def connect_protocol(pin: Pin, protocol: asyncio.BaseProtocol) -> tuple[str, int]:
    """Connect an asyncio protocol to the first pinned address that accepts (see try_addresses),
    or through the pin's parent proxy; the connected address is recorded in the pin. Raises
    ConnectFailure."""
    loop = asyncio.get_running_loop()
    if pin.via is not None:
        sock, pin.connected = await _through_parent(pin, pin.via)
        try:
            await loop.create_connection(lambda: protocol, sock=sock)
        except BaseException:
            sock.close()
            raise
        return pin.connected

    def open_one(address: str) -> Awaitable[tuple[asyncio.BaseTransport, asyncio.BaseProtocol]]:
        return loop.create_connection(lambda: protocol, address, pin.port)  # awaited by try_addresses

    _, connected = await try_addresses(pin.addresses, pin.port, pin.connect_timeout, open_one, pin.attempts)
    pin.connected = connected
    return connected


async def try_addresses[T](
    addresses: tuple[IPAddress, ...],
    port: int,
    connect_timeout: float,
    open_one: Callable[[str], Awaitable[T]],
    attempts: list[str] | None = None,
) -> tuple[T, tuple[str, int]]:
    """Try each address in order; each attempt bounded, all within 2x connect_timeout."""
    log = attempts if attempts is not None else []
    deadline = time.monotonic() + 2 * connect_timeout
    kinds: list[str] = []
    for address in addresses:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            kinds.append(Reason.CONNECT_TIMEOUT)
            log.append(f"{_fmt(address, port)}: not tried, 2x connect_timeout used up")
            break
        budget = connect_timeout if connect_timeout < remaining else remaining  # min() parses its arguments
        text = address_text(address)
        try:
            timed = _deadlines().enter(budget)
            try:
                opened = await open_one(text)
            except BaseException as exc:
                if timed.leave() and isinstance(exc, asyncio.CancelledError):
                    raise TimeoutError from exc
                raise
            timed.leave()
        except TimeoutError:
            kinds.append(Reason.CONNECT_TIMEOUT)
            log.append(f"{_fmt(address, port)}: timed out after {budget:.3g}s")
            continue
        except OSError as e:
            if e.errno in OUT_OF_DESCRIPTORS:  # egressd's own limit, not the address's: no next one
                kinds.append(Reason.OVERLOADED)
                log.append(f"{_fmt(address, port)}: not tried, no descriptor left ({e.strerror or e})")
                break
            refused = e.errno == errno.ECONNREFUSED
            kinds.append(Reason.CONNECT_REFUSED if refused else Reason.CONNECT_ERROR)
            log.append(f"{_fmt(address, port)}: {'connection refused' if refused else (e.strerror or e)}")
            continue
        return opened, (text, port)
    detail = "; ".join(log) or "no address to connect to"
    # one kind for all attempts names it; a mix is reported by the last attempt's kind
    raise ConnectFailure(kinds[-1] if kinds else Reason.CONNECT_ERROR, detail)


class _Deadline:
    """One attempt's deadline, as asyncio.timeout keeps it: the task cancelled when it passes, and
    the attempt's CancelledError then raised as TimeoutError unless someone else cancelled too."""

    __slots__ = ("cancelling", "expired", "owner", "task", "when")

    # set by _Deadlines.enter, which makes one per connect attempt: a class with an __init__ is
    # Python code its call enters from C
    owner: _Deadlines
    task: asyncio.Task[object]
    when: float
    cancelling: int
    expired: bool

    def leave(self) -> bool:
        """The attempt ended: no longer timed. True when this deadline cancelled it and nobody
        else did (a CancelledError it ended with is then a TimeoutError); its cancellation is
        taken back either way."""
        self.owner.pending.pop(self, None)
        return self.expired and self.task.uncancel() <= self.cancelling


class _Deadlines:
    """The connect attempts under way on one event loop, cancelled at their deadlines by one timer,
    set for the earliest: nearly every connect ends long before its deadline, and a timer set and
    cancelled for each (asyncio.timeout: a uvloop timer handle made, started, stopped and closed)
    was 6 % of a tunnel's instructions. The timer fires at most once per earliest deadline and
    looks at the attempts still under way."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: dict[_Deadline, None] = {}
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = math.inf

    def enter(self, delay: float) -> _Deadline:
        task = asyncio.current_task(self.loop)
        assert task is not None
        deadline = _Deadline()
        deadline.owner, deadline.task, deadline.when = self, task, self.loop.time() + delay
        deadline.cancelling, deadline.expired = task.cancelling(), False
        self.pending[deadline] = None
        if deadline.when < self.timer_at:
            self._arm(deadline.when)
        return deadline

    def _arm(self, when: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer, self.timer_at = self.loop.call_at(when, self._fire), when

    def _fire(self) -> None:
        self.timer, self.timer_at = None, math.inf
        # a timer may fire a clock tick early (uvloop counts milliseconds): those are due too
        due = self.loop.time() + 0.001
        earliest = math.inf
        for deadline in list(self.pending):
            if deadline.when <= due:
                del self.pending[deadline]
                if not deadline.task.done():
                    deadline.expired = True
                    deadline.task.cancel()
            else:
                earliest = min(earliest, deadline.when)
        if earliest < math.inf:
            self._arm(earliest)


_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Deadlines] = weakref.WeakKeyDictionary()
_this_thread = threading.local()  # the last loop's, so a connect asks no weak dictionary


def _deadlines() -> _Deadlines:
    loop = asyncio.get_running_loop()
    found: _Deadlines | None = getattr(_this_thread, "deadlines", None)
    if found is None or found.loop is not loop:
        found = _by_loop.get(loop)
        if found is None:
            found = _by_loop[loop] = _Deadlines(loop)
        _this_thread.deadlines = found
    return found


async def _through_parent(pin: Pin, parent: UpstreamProxy) -> tuple[socket.socket, tuple[str, int]]:
    """The parent's tunnel to the pinned addresses (connect_by: address) or the canonical name."""
    targets = (pin.host,) if parent.connect_by == "name" else tuple(map(address_text, pin.addresses))
    try:
        return await dial(parent, targets, pin.port, pin.connect_timeout, pin.attempts)
    except ParentFailure as e:
        raise ConnectFailure(e.reason, e.detail) from None


def _fmt(address: IPAddress, port: int) -> str:
    return join_host_port(address_text(address), port)
