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
4. Interim (1xx) responses from the server: mitmproxy's HTTP/1 client reads the first head it gets
   as THE response, so a `100 Continue` or `103 Early Hints` became the answer and the real one was
   dropped as "unexpected data" (the child waited forever). mitmproxy answers a client's `Expect:
   100-continue` itself and has no event for an interim response, so the server's interim heads are
   dropped (`Http1Client.read_headers`) and the final one is read as the response. (101 is final.)
5. Chunked trailers: mitmproxy's HTTP/1 body reader raises NotImplementedError on trailer fields
   (the tunnel died mid-response), and its HTTP/1 server side cannot send ResponseTrailers. The
   body reader keeps them aside (`make_body_reader`); a response's trailers become the
   ResponseTrailers event the HTTP layer knows (`read_body`; the policy addon masks them), and are
   written into the last chunk to the client (`Http1Server.send`). A request's trailers are dropped:
   nothing of them reaches the server unscanned.
6. Error pages (2. above) may quote what the server sent (`Invalid header line: b'...'`): every
   secret's value in them is masked (`Pipeline.secrets`), as every response is.
7. What failed on the upstream side: mitmproxy's HTTP/1 client reports a half response, a head it
   cannot parse or a server that closed as a protocol error whose message is plain text, which
   patch 2 would answer as a failed connect. Each such message from `_http1.Http1Client` gets
   egressd's failure marker: `upstream_timeout` when egressd closed the connection itself because
   no response head came within timeouts.response (the policy addon writes that marker on the
   server connection's `error` first), else `upstream_protocol_error`. The child gets 504 or 502
   with that reason, and the addon's error hook records it.
"""

from __future__ import annotations

import asyncio
import re
import types
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from egressd.admission.pinning import ConnectFailure, connect_pinned, current_pin
from egressd.refusal import failure_message, parse_failure
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
    """Every patch (idempotent). `pipeline`: whose events record a refused request head, and whose
    secrets are masked in error pages."""
    check_version()
    _install_pinned_connect()
    _install_head_guard(pipeline)
    _install_error_responses()
    _install_interim_drop()
    _install_trailers()
    _install_upstream_failures()


def _wrap(owner: Any, name: str, wrap: Callable[[Any], Any]) -> None:
    """owner.name becomes wrap(original), once: the replacement is marked as egressd's."""
    original = getattr(owner, name)
    if getattr(original, "egressd_patch", False):
        return
    replacement = wrap(original)
    replacement.egressd_patch = True
    setattr(owner, name, replacement)


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

    http1_layer.make_error_response = _error_response  # type: ignore[assignment]


def _error_response(status_code: int, message: str = "") -> bytes:
    """egressd's error page, with every secret's value masked in what it quotes (6.)."""
    from egressd.inspect.error_pages import make_error_response

    rt = _head_events
    return make_error_response(status_code, rt.secrets.mask_text(message) if rt is not None else message)


# -- 3. the request-head guard -------------------------------------------------------------------------
_head_events: Pipeline | None = None  # whose events record a refused head


def _install_head_guard(pipeline: Pipeline | None) -> None:
    global _head_events
    if pipeline is not None:
        _head_events = pipeline
    from mitmproxy.proxy import commands, events
    from mitmproxy.proxy.layers.http import _http1

    def wrap(original: Any) -> Any:
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

        return read_headers

    _wrap(_http1.Http1Server, "read_headers", wrap)


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


# -- 4. interim responses ----------------------------------------------------------------------------
# where a head ends in mitmproxy's ReceiveBuffer.maybe_extract_lines (h11's blank-line rule)
_HEAD_END = re.compile(rb"\n\r?\n", re.MULTILINE)
_INTERIM = re.compile(rb"HTTP/1\.[01] 1(?!01)[0-9]{2}(?:[ \t\r\n]|$)")


def _install_interim_drop() -> None:
    from mitmproxy.proxy import events
    from mitmproxy.proxy.layers.http import _http1

    def wrap(original: Any) -> Any:
        def read_headers(self: Any, event: Any) -> Generator[Any, Any, None]:
            if isinstance(event, events.DataReceived):
                while (data := bytes(self.buf)) and _INTERIM.match(data) and _HEAD_END.search(data):
                    self.buf.maybe_extract_lines()  # one complete interim head, dropped
            yield from original(self, event)

        return read_headers

    _wrap(_http1.Http1Client, "read_headers", wrap)


# -- 5. trailers ---------------------------------------------------------------------------------------
class _TrailerKeeper:
    """A body reader whose trailer fields are kept aside instead of reaching mitmproxy (which raises)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.trailers: list[tuple[bytes, bytes]] = []

    def __call__(self, buf: Any) -> Any:
        import h11

        event = self.inner(buf)
        if isinstance(event, h11.EndOfMessage) and event.headers:
            self.trailers = [(bytes(n), bytes(v)) for n, v in event.headers.raw_items()]
            return h11.EndOfMessage()
        return event

    def read_eof(self) -> Any:
        return self.inner.read_eof()


def _rewritten(
    generator: Generator[Any, Any, None], rewrite: Callable[[Any], list[Any]]
) -> Generator[Any, Any, None]:
    """A mitmproxy command generator with each command replaced by rewrite(command) (one or more
    commands); the reply to the last of them goes back to the generator."""
    reply = None
    while True:
        try:
            command = generator.send(reply)
        except StopIteration:
            return
        *before, last = rewrite(command)
        yield from before
        reply = yield last


def _install_trailers() -> None:
    from mitmproxy import http
    from mitmproxy.proxy import commands
    from mitmproxy.proxy.layers.http import ResponseEndOfMessage, ResponseTrailers, _http1
    from mitmproxy.proxy.layers.http._base import ReceiveHttp

    def keep_trailers(make_reader: Any) -> Any:
        def make_body_reader(expected_size: int | None) -> Any:
            reader = make_reader(expected_size)
            return _TrailerKeeper(reader) if expected_size is None else reader  # chunked

        return make_body_reader

    def deliver_trailers(read_body: Any) -> Any:
        def read_body_with_trailers(self: Any, event: Any) -> Generator[Any, Any, None]:
            def rewrite(command: Any) -> list[Any]:
                reader = self.body_reader
                if (
                    isinstance(command, ReceiveHttp)
                    and isinstance(command.event, ResponseEndOfMessage)
                    and isinstance(reader, _TrailerKeeper)
                    and reader.trailers
                ):
                    trailers, reader.trailers = reader.trailers, []
                    event = ResponseTrailers(command.event.stream_id, http.Headers(trailers))
                    return [ReceiveHttp(event), command]
                return [command]

            yield from _rewritten(read_body(self, event), rewrite)

        return read_body_with_trailers

    def send_trailers(send: Any) -> Any:
        def send_with_trailers(self: Any, event: Any) -> Generator[Any, Any, None]:
            if isinstance(event, ResponseTrailers):
                self.egressd_trailers = event.trailers  # written into the last chunk, at the end
                return
            trailers = getattr(self, "egressd_trailers", None)
            if not isinstance(event, ResponseEndOfMessage) or not trailers:
                yield from send(self, event)
                return
            self.egressd_trailers = None
            last_chunk = b"0\r\n" + b"".join(n + b": " + v + b"\r\n" for n, v in trailers.fields) + b"\r\n"

            def rewrite(command: Any) -> list[Any]:
                if isinstance(command, commands.SendData) and command.data == b"0\r\n\r\n":
                    return [commands.SendData(command.connection, last_chunk)]
                return [command]

            yield from _rewritten(send(self, event), rewrite)

        return send_with_trailers

    _wrap(_http1, "make_body_reader", keep_trailers)
    _wrap(_http1.Http1Connection, "read_body", deliver_trailers)
    _wrap(_http1.Http1Server, "send", send_trailers)


# -- 7. what failed on the upstream side ---------------------------------------------------------------
def _install_upstream_failures() -> None:
    from mitmproxy.proxy.layers.http import _http1
    from mitmproxy.proxy.layers.http._base import ReceiveHttp
    from mitmproxy.proxy.layers.http._events import ResponseProtocolError

    def mark_failures(handle_event: Any) -> Any:
        def handle_event_marked(self: Any, event: Any) -> Generator[Any, Any, None]:
            def rewrite(command: Any) -> list[Any]:
                if isinstance(command, ReceiveHttp) and isinstance(command.event, ResponseProtocolError):
                    failed = command.event
                    message = upstream_failure(failed.message, self.conn.error)
                    return [ReceiveHttp(ResponseProtocolError(failed.stream_id, message, failed.code))]
                return [command]

            yield from _rewritten(handle_event(self, event), rewrite)

        return handle_event_marked

    _wrap(_http1.Http1Client, "_handle_event", mark_failures)


def upstream_failure(message: str, note: str | None) -> str:
    """The marked message of a protocol error on the upstream side: egressd's own note on the
    connection (a response timeout it acted on), else a protocol error of the upstream (marked in
    front of the message, so bytes the server sent cannot pass for another marker)."""
    if note and parse_failure(note) is not None:
        return note
    return failure_message("upstream_protocol_error", message)
