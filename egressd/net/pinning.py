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
import functools
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from egressd.net.parent_proxy import ParentFailure, dial
from egressd.platform.descriptors import OUT_OF_DESCRIPTORS
from egressd.policy import IPAddress, UpstreamProxy, join_host_port
from egressd.policy.reasons import Reason


@dataclass
class Pin:
    """The admitted destination of one upstream connection."""

    host: str
    port: int
    addresses: tuple[IPAddress, ...]
    connect_timeout: float
    connected: tuple[str, int] | None = None
    attempts: list[str] = field(default_factory=list)
    via: UpstreamProxy | None = None  # the parent proxy this connection goes through, if any


@functools.lru_cache(maxsize=4096)
def address_text(address: IPAddress) -> str:
    """An address as text, remembered: ipaddress spells it in Python, slowly, and each is spelled to
    connect and again for the record."""
    return str(address)


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
        budget = min(connect_timeout, remaining)
        text = address_text(address)
        try:
            async with asyncio.timeout(budget):
                opened = await open_one(text)
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


async def _through_parent(pin: Pin, parent: UpstreamProxy) -> tuple[socket.socket, tuple[str, int]]:
    """The parent's tunnel to the pinned addresses (connect_by: address) or the canonical name."""
    targets = (pin.host,) if parent.connect_by == "name" else tuple(map(address_text, pin.addresses))
    try:
        return await dial(parent, targets, pin.port, pin.connect_timeout, pin.attempts)
    except ParentFailure as e:
        raise ConnectFailure(e.reason, e.detail) from None


def _fmt(address: IPAddress, port: int) -> str:
    return join_host_port(address_text(address), port)
