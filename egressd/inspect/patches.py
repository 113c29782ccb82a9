"""Every patch egressd makes to mitmproxy's internals, each with its reason, for mitmproxy==12.3.1 only.

`install(pipeline)` refuses to run on another mitmproxy version: each patch below reaches into a
private part that the tests cover for exactly this version (tests/unit/test_mitmproxy_contract.py
fails when the source of any part egressd wraps or mirrors changes).

Not a patch, but the one place egressd's code stands in for mitmproxy's: the upstream connect. The
tunnels egressd hands over are served by egressd's own subclass of mitmproxy's connection handler
(egressd.inspect.handler.TunnelHandler), whose `open_connection` is mitmproxy's with the streams
taken from the pipeline's pinned `connect` (each admitted address in turn, or the parent proxy) —
mitmproxy's `server_connect` hook can name one address to connect to, not a list to try in order
within a deadline, nor a parent proxy's tunnel. The address and SNI are set in that documented hook
(egressd.addons.policy_gate). Nothing of mitmproxy is replaced for it.

1. Error responses mitmproxy generates itself (a malformed request, a failed upstream) get egressd's
   refusal format (`egressd.inspect.error_pages`): `_http1.make_error_response` is replaced, and the
   page `Http1Server.send` writes for a failed exchange is the tunnel's own failure when one was
   recorded (`InspectedTunnel.failure`: a connect that failed, a response timeout, an upstream that did not
   speak HTTP/1), so the reason travels as a `Refusal`, not as text in mitmproxy's message.
2. Error pages may quote what the server sent (`Invalid header line: b'...'`): every secret's value
   in them is masked (`Pipeline.secrets`), as every response is.
3. The request-head guard inside inspected tunnels (plain HTTP never reaches mitmproxy: egressd's
   front reads it, egressd.wire.http1; this guard is only for requests inside TLS tunnels that
   mitmproxy inspects, which only it reads): mitmproxy reads request heads with h11's line
   splitter, which accepts bare LF, and has no size limit on a head (its own FIXME). The raw bytes
   are checked first (`egressd.wire.http_head`) and refused 400/431 in egressd's format, so a head
   two parsers could read differently is never decided one way and forwarded another. A complete
   head is then parsed once, by mitmproxy's own parser, in `Http1Server.read_headers`'s place (its
   steps for a head, as in 12.3.1); one that parser rejects is refused the same way, so every such
   refusal is recorded and no request event is made of it. Empty lines before a request line are
   dropped first (RFC 9112 2.2): h11 returns at each one and then waits for more bytes. mitmproxy
   has no hook before it parses a head.
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
6. What failed on the upstream side: mitmproxy's HTTP/1 client reports a half response, a head it
   cannot parse or a server that closed as a protocol error with a plain-text message
   (ResponseProtocolError, GENERIC_SERVER_ERROR), which the HTTP layer's stream handles in
   `HttpStream.handle_protocol_error` (only ever called for a failed exchange). Each is recorded on
   the tunnel as `upstream_protocol_error` there — unless egressd failed the exchange first (the
   policy addon closed the connection because no response head came within timeouts.response:
   `upstream_timeout`; a connect that failed). The child gets 502 or 504 with that reason (1.), and
   the addon's error hook records it. The public `error` hook cannot tell the server's protocol
   errors from the client's.
7. A streamed body that one of egressd's stream hooks cut (the placeholder scan of a request body,
   the limit on a response body; the hook's `cut` turns true): mitmproxy's HTTP layer sends what
   the hook returns and then, at the body's end, the message's end, whatever the hook decided. A
   body that arrived whole at once was then ended without its cut part: the server took a request
   without the refused part and answered it, the client took a shortened response as complete.
   Once a hook cut, `HttpStream.state_stream_request_body` and `state_stream_response_body` end the
   exchange as mitmproxy ends a killed flow, before the message's end is sent: the server
   connection closed, the client's stream ended without (more of) a response.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from egressd.policy.reasons import Reason
from egressd.wire.http_head import head_problem, leading_empty_lines

if TYPE_CHECKING:
    from egressd.admission.pipeline import Pipeline
    from egressd.inspect.inspected import InspectedTunnel
    from egressd.policy.refusal import Refusal

MITMPROXY_VERSION = "12.3.1"


def check_version() -> None:
    """Refuse to run on an untested mitmproxy (cheap: mitmproxy's proxy core is not imported)."""
    from mitmproxy import version

    if version.VERSION != MITMPROXY_VERSION:
        raise RuntimeError(
            f"egressd needs mitmproxy=={MITMPROXY_VERSION} (found {version.VERSION}): "
            "its hooks into mitmproxy are tested against that version only"
        )


def install(pipeline: Pipeline | None = None) -> None:
    """Every patch (idempotent). `pipeline`: whose events record a refused request head, and whose
    secrets are masked in error pages."""
    check_version()
    _install_head_guard(pipeline)
    _install_error_responses()
    _install_interim_drop()
    _install_trailers()
    _install_upstream_failures()
    _install_cut_bodies()


def _wrap(owner: Any, name: str, wrap: Callable[[Any], Any]) -> None:
    """owner.name becomes wrap(original), once per wrap: the replacement remembers which of
    egressd's wraps it holds (two patches may wrap one method)."""
    original = getattr(owner, name)
    held = getattr(original, "egressd_patches", frozenset())
    if wrap.__qualname__ in held:
        return
    replacement = wrap(original)
    replacement.egressd_patches = held | {wrap.__qualname__}
    setattr(owner, name, replacement)


def _tunnel(client: Any) -> InspectedTunnel | None:
    """The tunnel a client connection carries (every one mitmproxy has here carries one)."""
    from egressd.inspect.handler import TunnelClient

    return client.tunnel if isinstance(client, TunnelClient) else None


# -- 1. error responses, 2. secrets masked in them --------------------------------------------------
def _install_error_responses() -> None:
    from mitmproxy.proxy import commands
    from mitmproxy.proxy.layers.http import ResponseProtocolError, _http1

    _http1.make_error_response = _error_response  # type: ignore[assignment]

    def wrap(send: Any) -> Any:
        def send_failure(self: Any, event: Any) -> Generator[Any, Any, None]:
            if not isinstance(event, ResponseProtocolError):
                yield from send(self, event)
                return

            def rewrite(command: Any) -> list[Any]:
                if not isinstance(command, commands.SendData):
                    return [command]
                tunnel = _tunnel(self.context.client)
                failure = tunnel.take_failure() if tunnel is not None else None
                if failure is None:
                    return [command]
                return [commands.SendData(command.connection, _failure_response(failure))]

            yield from _rewritten(send(self, event), rewrite)

        return send_failure

    _wrap(_http1.Http1Server, "send", wrap)


def _error_response(status_code: int, message: str = "") -> bytes:
    """egressd's error page for mitmproxy's own error, with every secret's value masked in what it
    quotes (2.)."""
    from egressd.inspect.error_pages import make_error_response

    rt = _head_events
    return make_error_response(status_code, rt.secrets.mask_text(message) if rt is not None else message)


def _failure_response(failure: Refusal) -> bytes:
    """egressd's error page for a failure of the tunnel's, its detail masked (2.)."""
    from egressd.inspect.error_pages import failure_response

    rt = _head_events
    if rt is not None:
        failure = dataclasses.replace(failure, detail=rt.secrets.mask_text(failure.detail))
    return failure_response(failure)


# -- 3. the request-head guard -------------------------------------------------------------------------
_head_events: Pipeline | None = None  # whose events record a refused head


def _install_head_guard(pipeline: Pipeline | None) -> None:
    global _head_events
    if pipeline is not None:
        _head_events = pipeline
    from mitmproxy.net.http import http1
    from mitmproxy.proxy import commands, events
    from mitmproxy.proxy.layers.http import RequestHeaders, _http1
    from mitmproxy.proxy.layers.http._base import ReceiveHttp

    def wrap(original: Any) -> Any:
        def read_headers(self: Any, event: Any) -> Generator[Any, Any, None]:
            """mitmproxy's read_headers for a complete head, after egressd's check of its raw bytes
            and with a head mitmproxy's parser refuses answered like one the check refuses: each
            head is parsed once, by mitmproxy's parser."""
            if not isinstance(event, events.DataReceived):
                yield from original(self, event)
                return
            data = bytes(self.buf)
            skip = leading_empty_lines(data)
            for _ in range(skip // 2):
                self.buf.maybe_extract_lines()  # RFC 9112 2.2; h11 returns at each, then waits
            problem = head_problem(data[skip:])
            lines = self.buf.maybe_extract_lines() if problem is None else None
            if problem is None and not lines:
                return  # not complete yet (head_problem bounds its size)
            if problem is None:
                try:
                    self.request = http1.read_request_head([bytes(line) for line in lines])
                    expected_body_size = http1.expected_http_body_size(self.request)
                except ValueError as exc:
                    problem = 400, str(exc)
            if problem is not None:
                status, why = problem
                _audit(self.conn.id, why)
                yield commands.SendData(self.conn, _http1.make_error_response(status, why))
                yield commands.CloseConnection(self.conn)
                self.state = self.done
                return
            yield ReceiveHttp(RequestHeaders(self.stream_id, self.request, expected_body_size == 0))
            self.body_reader = _http1.make_body_reader(expected_body_size)
            self.state = self.read_body
            yield from self.state(event)

        return read_headers

    _wrap(_http1.Http1Server, "read_headers", wrap)


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
            reader = self.body_reader
            if not isinstance(reader, _TrailerKeeper):  # no chunked body: no trailers
                yield from read_body(self, event)
                return

            def rewrite(command: Any) -> list[Any]:
                if (
                    isinstance(command, ReceiveHttp)
                    and isinstance(command.event, ResponseEndOfMessage)
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


# -- 6. what failed on the upstream side ---------------------------------------------------------------
def _install_upstream_failures() -> None:
    from mitmproxy.proxy.layers.http import ErrorCode, HttpStream, ResponseProtocolError

    def record_failures(handle_protocol_error: Any) -> Any:
        def handle_protocol_error_recorded(self: Any, event: Any) -> Generator[Any, Any, None]:
            if isinstance(event, ResponseProtocolError) and event.code is ErrorCode.GENERIC_SERVER_ERROR:
                tunnel = _tunnel(self.context.client)
                if tunnel is not None:
                    tunnel.fail(tunnel.refusal(Reason.UPSTREAM_PROTOCOL_ERROR, event.message))
            yield from handle_protocol_error(self, event)

        return handle_protocol_error_recorded

    _wrap(HttpStream, "handle_protocol_error", record_failures)


# -- 7. a body a stream hook cut ends the exchange on both sides ---------------------------------------
def _install_cut_bodies() -> None:
    from mitmproxy import flow
    from mitmproxy.proxy.layers.http import (
        ErrorCode,
        HttpStream,
        RequestProtocolError,
        SendHttp,
    )

    def kill(self: Any) -> Generator[Any, Any, None]:
        """The server connection closed (its connection layer closes on a request error), then the
        flow ended by mitmproxy's own HttpStream.check_killed: nothing more goes either way."""
        killed = flow.Error.KILLED_MESSAGE
        self.flow.error = flow.Error(killed)  # as flow.kill() marks a flow
        self.client_state = self.server_state = self.state_errored
        yield SendHttp(RequestProtocolError(self.stream_id, killed, ErrorCode.KILL), self.context.server)
        yield from self.check_killed(True)

    def end_cut(side: str) -> Callable[[Any], Any]:
        """The wrap of `state_stream_<side>_body`, for side "request" (the client's state) or
        "response" (the server's)."""

        def wrap(state_stream_body: Any) -> Any:
            def state_stream_body_cut(self: Any, event: Any) -> Generator[Any, Any, None]:
                if not _cut(getattr(self.flow, side)):
                    yield from state_stream_body(self, event)
                state = self.client_state if side == "request" else self.server_state
                if _cut(getattr(self.flow, side)) and state == getattr(self, f"state_stream_{side}_body"):
                    yield from kill(self)

            return state_stream_body_cut

        return wrap

    _wrap(HttpStream, "state_stream_request_body", end_cut("request"))
    _wrap(HttpStream, "state_stream_response_body", end_cut("response"))


def _cut(message: Any) -> bool:
    return message is not None and getattr(message.stream, "cut", False) is True
