"""limits.max_response_bytes for HTTP responses egressd sees (plain HTTP and intercepted HTTPS).

A response whose Content-Length is over the limit is replaced, before any of its body is sent, by
egressd's own error (502, reason response_too_large). A response of unknown length is streamed and,
once it passes the limit, the exchange ends mid-body (`cut`: egressd.inspect.patches ends it before
the response's end is sent); it is sent chunked, so the client sees a truncated transfer, never a
silently shortened but complete-looking one. The caller audits both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from mitmproxy import http

from egressd.inspect.error_pages import refusal_response
from egressd.policy.refusal import Refusal


def apply(flow: http.HTTPFlow, limit: int, on_cut: Callable[[int], None]) -> None:
    response = flow.response
    assert response is not None
    length = _content_length(response)
    if length is not None and length > limit:
        _replace_with_refusal(flow, limit, length)
        on_cut(length)
        return
    if length is None and "chunked" not in response.headers.get("transfer-encoding", "").lower():
        # a close-delimited body cut short would look complete: chunked framing makes the cut visible
        response.headers["transfer-encoding"] = "chunked"
    response.stream = _Limiter(flow, limit, on_cut)


def _content_length(response: http.Response) -> int | None:
    value = response.headers.get("content-length", "")
    return int(value) if value.isdigit() else None


def _replace_with_refusal(flow: http.HTTPFlow, limit: int, length: int) -> None:
    assert flow.response is not None
    refusal = Refusal(
        "response_too_large",
        f"the response is {length} bytes; limits.max_response_bytes is {limit}",
        flow.request.host,
        flow.request.port,
    )
    replacement = refusal_response(refusal)
    body = replacement.content or b""
    flow.response.status_code = replacement.status_code
    flow.response.reason = replacement.reason
    flow.response.headers = replacement.headers
    flow.response.headers["content-length"] = str(len(body))
    sent = False

    def send_once(_chunk: bytes) -> Iterable[bytes]:
        # the upstream body is dropped; egressd's explanation goes out with its first chunk
        nonlocal sent
        if sent:
            return []
        sent = True
        return [body]

    flow.response.stream = send_once


class _Limiter:
    def __init__(self, flow: http.HTTPFlow, limit: int, on_cut: Callable[[int], None]) -> None:
        self.flow = flow
        self.limit = limit
        self.on_cut = on_cut
        self.seen = 0
        self.cut = False

    def __call__(self, chunk: bytes) -> Iterable[bytes]:
        if self.cut:
            return []
        self.seen += len(chunk)
        if self.seen <= self.limit:
            return [chunk]
        self.cut = True
        self.on_cut(self.seen)
        return []
