"""Pinned connecting: upstream connections go ONLY to addresses the policy validated.

mitmproxy 12.3.1 opens every upstream TCP connection with `asyncio.open_connection(host, port)` inside
`mitmproxy.proxy.server.ConnectionHandler.open_connection`, after running the `server_connect` hook in
the same task. Our `server_connect` hook puts the validated addresses into a context variable; the
shim installed here replaces `asyncio` as seen by that one module and connects only to those
addresses. A connection that no hook admitted fails closed: nothing is ever resolved or connected
behind the policy's back. The exact mitmproxy version is pinned and tests cover this hook.
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import socket
import time
import types
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from egressd.policy import IPAddress, join_host_port
from egressd.refusal import failure_message

MITMPROXY_VERSION = "12.3.1"


@dataclass
class Pin:
    """The admitted destination of one upstream connection."""

    host: str
    port: int
    addresses: tuple[IPAddress, ...]
    connect_timeout: float
    connected: tuple[str, int] | None = None
    attempts: list[str] = field(default_factory=list)
    failure: tuple[str, str] | None = None


current_pin: contextvars.ContextVar[Pin | None] = contextvars.ContextVar("egressd_pin", default=None)


class ConnectFailure(OSError):
    """Raised when no pinned address accepted; the message carries an egressd failure marker."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(failure_message(reason, detail))
        self.reason = reason
        self.detail = detail


async def connect_pinned(
    addresses: tuple[IPAddress, ...],
    port: int,
    connect_timeout: float,
    *,
    local_addr: tuple[str, int] | None = None,
    attempts: list[str] | None = None,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, tuple[str, int]]:
    """Streams to the first address that accepts (see try_addresses)."""

    async def open_streams(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(address, port, local_addr=local_addr)

    (reader, writer), connected = await try_addresses(
        addresses, port, connect_timeout, open_streams, attempts
    )
    _no_delay(writer.get_extra_info("socket"))
    return reader, writer, connected


async def connect_protocol(pin: Pin, protocol: asyncio.BaseProtocol) -> tuple[str, int]:
    """Connect an asyncio protocol to the first pinned address that accepts (see try_addresses);
    the connected address is recorded in the pin. Raises ConnectFailure."""
    loop = asyncio.get_running_loop()

    async def open_one(address: str) -> asyncio.BaseTransport:
        transport, _ = await loop.create_connection(lambda: protocol, address, pin.port)
        return transport

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
            kinds.append("connect_timeout")
            log.append(f"{_fmt(address, port)}: not tried, 2x connect_timeout used up")
            break
        budget = min(connect_timeout, remaining)
        text = str(address)
        try:
            opened = await asyncio.wait_for(open_one(text), timeout=budget)
        except TimeoutError:
            kinds.append("connect_timeout")
            log.append(f"{_fmt(address, port)}: timed out after {budget:.3g}s")
            continue
        except OSError as e:
            refused = e.errno == errno.ECONNREFUSED
            kinds.append("connect_refused" if refused else "connect_error")
            log.append(f"{_fmt(address, port)}: {'connection refused' if refused else (e.strerror or e)}")
            continue
        return opened, (text, port)
    detail = "; ".join(log) or "no address to connect to"
    # one kind for all attempts names it; a mix is reported by the last attempt's kind
    raise ConnectFailure(kinds[-1] if kinds else "connect_error", detail)


def _no_delay(sock: socket.socket | None) -> None:
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _fmt(address: IPAddress, port: int) -> str:
    return join_host_port(str(address), port)


async def _pinned_open_connection(
    host: str | None = None, port: int | None = None, *, local_addr: Any = None, **kwargs: Any
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    pin = current_pin.get()
    if pin is None or kwargs or (host, port) != (pin.host, pin.port):
        raise ConnectFailure(
            "internal_error", f"upstream connection to {host}:{port} was not admitted by the policy gate"
        )
    current_pin.set(None)  # one pin, one connection
    try:
        reader, writer, connected = await connect_pinned(
            pin.addresses, pin.port, pin.connect_timeout, local_addr=local_addr, attempts=pin.attempts
        )
    except ConnectFailure as e:
        pin.failure = (e.reason, e.detail)
        raise
    pin.connected = connected
    return reader, writer


class _AsyncioForMitmproxy(types.ModuleType):
    """`asyncio` as seen by mitmproxy.proxy.server: everything real except open_connection."""

    def __init__(self) -> None:
        super().__init__("asyncio")

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    open_connection = staticmethod(_pinned_open_connection)


def check_version() -> None:
    """Refuse to run on an untested mitmproxy (cheap: mitmproxy's proxy core is not imported)."""
    from mitmproxy import version

    if version.VERSION != MITMPROXY_VERSION:
        raise RuntimeError(
            f"egressd needs mitmproxy=={MITMPROXY_VERSION} (found {version.VERSION}): "
            "its connect hook is tested against that version only"
        )


def install() -> None:
    """Install the connect hook (idempotent); refuses to run on an untested mitmproxy."""
    check_version()
    import mitmproxy.proxy.server as server

    if not isinstance(server.asyncio, _AsyncioForMitmproxy):
        server.asyncio = _AsyncioForMitmproxy()  # type: ignore[assignment]


def installed() -> bool:
    import mitmproxy.proxy.server as server

    return isinstance(server.asyncio, _AsyncioForMitmproxy)
