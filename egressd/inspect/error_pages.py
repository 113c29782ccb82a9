"""Error responses mitmproxy generates itself (malformed request, failed upstream) in egressd's format.

mitmproxy 12.3.1 renders those with `_http1.make_error_response`; the replacement (installed by
egressd.inspect.patches) gives them the same Proxy-Status / X-Egressd-Reason headers and readable
body as every other refusal. A failure egressd recorded for the exchange (a connect, a timeout, the
upstream's answer) is rendered from its own Refusal (`failure_response`).
"""

from __future__ import annotations

import re

from mitmproxy import http
from mitmproxy.net.http import http1

from egressd.policy.reasons import Reason
from egressd.policy.refusal import Refusal
from egressd.wire import refusal as rendered

_STATUS_REASON = {
    400: Reason.BAD_REQUEST,
    413: Reason.BAD_REQUEST,
    414: Reason.BAD_REQUEST,
    431: Reason.BAD_REQUEST,
    502: Reason.CONNECT_ERROR,
    504: Reason.CONNECT_TIMEOUT,
}


# how mitmproxy words a failed TLS handshake with an intercepted host's upstream
_TLS_FAILURE = re.compile(r"certificate verify failed|tls handshake|ssl handshake", re.IGNORECASE)


def refusal_from_error(status_code: int, message: str) -> tuple[int, Refusal]:
    if _TLS_FAILURE.search(message):
        refusal = Refusal(Reason.UPSTREAM_TLS_ERROR, message)
        return refusal.status, refusal
    fallback = Reason.BAD_REQUEST if 400 <= status_code < 500 else Reason.CONNECT_ERROR
    reason = _STATUS_REASON.get(status_code, fallback)
    return status_code, Refusal(reason, message)


def refusal_response(refusal: Refusal, status: int | None = None) -> http.Response:
    """The mitmproxy response for a refusal (HTTP/1.1, Connection: close)."""
    headers = http.Headers([(k.encode(), v.encode()) for k, v in rendered.headers(refusal)])
    response = http.Response.make(status or refusal.status, rendered.body(refusal).encode(), headers)
    response.reason = rendered.phrase(refusal, response.status_code)  # the reason code on the status line
    return response


def make_error_response(status_code: int, message: str = "") -> bytes:
    status, refusal = refusal_from_error(status_code, message)
    return http1.assemble_response(refusal_response(refusal, status))


def failure_response(refusal: Refusal) -> bytes:
    return http1.assemble_response(refusal_response(refusal))
