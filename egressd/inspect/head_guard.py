"""Refuse ambiguous, oversized or unreadable HTTP/1 request heads before mitmproxy parses them.

mitmproxy 12.3.1 reads request heads with h11's line splitter, which accepts bare LF, and has no
size limit on a head (its own FIXME). The wrapper installed here looks at the raw bytes first
(egressd.wire.http_head) and answers 400/431 in egressd's format, so a head that two parsers
could read differently is never decided one way and forwarded another. A head mitmproxy's own
parser rejects (a non-ASCII byte in the request line, say) is refused here too, with the same
parser, so that every such refusal is audited: mitmproxy answers those itself, unrecorded. Empty
lines before a request line are dropped first (RFC 9112 2.2): h11 returns at each one and then
waits for more bytes, so a request behind one hung until header_timeout.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from egressd.wire.http_head import head_problem, leading_empty_lines

if TYPE_CHECKING:
    from egressd.admission.pipeline import Pipeline

_runtime: Pipeline | None = None  # whose audit records a refused head


def install(runtime: Pipeline) -> None:
    global _runtime
    _runtime = runtime
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
    rt = _runtime
    if rt is not None:
        rt.refused_early(None, None, None, "bad_request", why, stage="request")
