"""Refuse ambiguous or oversized HTTP/1 request heads before mitmproxy parses them.

mitmproxy 12.3.1 reads request heads with h11's line splitter, which accepts bare LF, and has no
size limit on a head (its own FIXME). The wrapper installed here looks at the raw bytes first
(egressd.engine.http_head) and answers 400/431 in egressd's format, so a head that two parsers
could read differently is never decided one way and forwarded another.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from egressd.engine.http_head import head_problem


def install() -> None:
    from mitmproxy.proxy import commands, events
    from mitmproxy.proxy.layers.http import _http1

    server = _http1.Http1Server
    original = server.read_headers
    if getattr(original, "egressd_guard", False):
        return

    def read_headers(self: Any, event: Any) -> Generator[Any, Any, None]:
        if isinstance(event, events.DataReceived):
            problem = head_problem(bytes(self.buf))
            if problem is not None:
                status, why = problem
                yield commands.SendData(self.conn, _http1.make_error_response(status, why))
                yield commands.CloseConnection(self.conn)
                self.state = self.done
                return
        yield from original(self, event)

    read_headers.egressd_guard = True  # type: ignore[attr-defined]
    server.read_headers = read_headers  # type: ignore[method-assign]
