"""Every patch egressd makes to mitmproxy's internals, each with its reason, for mitmproxy==12.3.1 only.

`install(pipeline)` refuses to run on another mitmproxy version: each patch below reaches into a
private part that the tests cover for exactly this version.

1. The pinned connect: mitmproxy opens every upstream TCP connection with
   `asyncio.open_connection(host, port)` inside `mitmproxy.proxy.server.ConnectionHandler.open_connection`,
   after running the `server_connect` hook in the same task. The policy addon's `server_connect`
   puts the pipeline's pin into `egressd.admission.pinning.current_pin`; `asyncio` as seen by that
   one module is replaced so that it connects only to the pinned addresses, and refuses a
   connection no hook pinned.
2. Error responses mitmproxy generates itself (a malformed request, a failed upstream) get egressd's
   refusal format (`egressd.inspect.error_pages`): `_http1.make_error_response` is replaced.
3. The request-head guard inside inspected tunnels (plain HTTP never reaches mitmproxy: egressd's
   front reads it, egressd.wire.http1; this guard is only for requests inside TLS tunnels that
   mitmproxy inspects, which only it reads): mitmproxy reads request heads with h11's line
   splitter, which accepts bare LF, and has no size limit on a head (its own FIXME). The raw bytes
   are checked first (`egressd.wire.http_head`) and refused 400/431 in egressd's format, so a head
   two parsers could read differently is never decided one way and forwarded another. A head
   mitmproxy's own parser rejects is refused here too, so every such refusal is recorded. Empty
   lines before a request line are dropped first (RFC 9112 2.2): h11 returns at each one and then
   waits for more bytes.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from egressd.admission.pinning import ConnectFailure, connect_pinned, current_pin
from egressd.wire.http_head import head_problem, leading_empty_lines

if TYPE_CHECKING:
    from egressd.admission.pipeline import Pipeline

MITMPROXY_VERSION = "12.3.1"


def check_version() -> None:
    """Refuse to run on an untested mitmproxy (cheap: mitmproxy's proxy core is not imported)."""
    from mitmproxy import version

    if version.VERSION != MITMPROXY_VERSION:
        raise RuntimeError(
            f"egressd needs mitmproxy=={MITMPROXY_VERSION} (found {version.VERSION}): "
            "its connect hook is tested against that version only"
        )


def install(pipeline: Pipeline | None = None) -> None:
    """Every patch (idempotent). `pipeline`: whose events record a refused request head."""
    check_version()
    _install_pinned_connect()
    _install_error_responses()
    _install_head_guard(pipeline)


# -- 1. the pinned connect ---------------------------------------------------------------------------
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
        reader, writer, connected = await connect_pinned(pin, local_addr=local_addr)
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


def _install_pinned_connect() -> None:
    import mitmproxy.proxy.server as server

    if not isinstance(server.asyncio, _AsyncioForMitmproxy):
        server.asyncio = _AsyncioForMitmproxy()  # type: ignore[assignment]


def installed() -> bool:
    import mitmproxy.proxy.server as server

    return isinstance(server.asyncio, _AsyncioForMitmproxy)


# -- 2. error responses --------------------------------------------------------------------------------
def _install_error_responses() -> None:
    import mitmproxy.proxy.layers.http._http1 as http1_layer

    from egressd.inspect.error_pages import make_error_response

    http1_layer.make_error_response = make_error_response  # type: ignore[assignment]


# -- 3. the request-head guard -------------------------------------------------------------------------
_head_events: Pipeline | None = None  # whose events record a refused head


def _install_head_guard(pipeline: Pipeline | None) -> None:
    global _head_events
    if pipeline is not None:
        _head_events = pipeline
    from mitmproxy.proxy import commands, events
    from mitmproxy.proxy.layers.http import _http1

    server = _http1.Http1Server
    original = server.read_headers
    if getattr(original, "egressd_guard", False):
        return

    def read_headers(self: Any, event: Any) -> Generator[Any, Any, None]:
        if isinstance(event, events.DataReceived):
            data = bytes(self.buf)
            skip = leading_empty_lines(data)
            for _ in range(skip // 2):
                self.buf.maybe_extract_lines()  # RFC 9112 2.2; h11 returns at each, then waits
            data = data[skip:]
            problem = head_problem(data) or _unreadable(data)
            if problem is not None:
                status, why = problem
                _audit(self.conn.id, why)
                yield commands.SendData(self.conn, _http1.make_error_response(status, why))
                yield commands.CloseConnection(self.conn)
                self.state = self.done
                return
        yield from original(self, event)

    read_headers.egressd_guard = True  # type: ignore[attr-defined]
    server.read_headers = read_headers  # type: ignore[method-assign]


def _unreadable(data: bytes) -> tuple[int, str] | None:
    """(400, why) when mitmproxy's parser would refuse the complete head at the start of data."""
    from mitmproxy.net.http import http1

    end = data.find(b"\r\n\r\n")  # head_problem passed: no bare LF, so CRLF ends every line
    if end < 0:
        return None
    try:
        http1.expected_http_body_size(http1.read_request_head(data[:end].split(b"\r\n")))
    except ValueError as exc:
        return 400, str(exc)
    return None


def _audit(client_id: str, why: str) -> None:
    rt = _head_events
    if rt is not None:
        rt.refused_early(None, None, None, "bad_request", why, stage="request")
