"""The response of a plain-HTTP request the native front serves, read by the lean path's own reader.

The native front (egressd/engine/_tunnels.c) serves a remembered `Connection: close` request itself:
it connects, sends the head Python wrote for it, and hands every upstream read to `feed`. `feed`
runs the very `Upstream` state machine of egressd/engine/plain_http.py — strict framing, interim
responses, `max_response_bytes`, the redirect memory, egressd's own headers never forwarded — with
this adapter standing in for the client side, and returns what the client gets and whether the
exchange is over. So a served request's response is read by the same code, byte for byte, as one
the Python path serves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from egressd.engine.fastpath import render
from egressd.engine.http_rules import audit_response_cut
from egressd.engine.plain_http import (
    LOST_MID_RESPONSE,
    Request,
    Upstream,
    broken_refusal,
    request_url,
    too_large_refusal,
)

if TYPE_CHECKING:
    from egressd.engine.runtime import ConnState, Runtime
    from egressd.refusal import Refusal


class NativeExchange:
    """What `Upstream` asks of a client (PlainClient's interface), for one served request."""

    def __init__(
        self, rt: Runtime, state: ConnState, request: Request, key: tuple[str, int], client_key: str
    ):
        self.rt = rt
        self.state = state
        self.request = request
        self.client_key = client_key
        self.url = request_url(key, request.path)
        self.limit = rt.policies.get().limits.max_response_bytes
        self.out: list[bytes] = []
        self.done = False
        self.upstream = Upstream(self, key)  # type: ignore[arg-type]
        self.upstream.request, self.upstream.phase = request, "head"

    def feed(self, data: bytes | None) -> tuple[bytes, bool]:
        """Upstream bytes (None: the upstream closed) -> (bytes for the client, exchange over)."""
        if not self.done:
            if data is None:
                self.upstream.connection_lost(None)
                self._end()
            else:
                self.upstream.data_received(data)
        out = b"".join(self.out)
        self.out.clear()
        return out, self.done

    # -- PlainClient's interface, as Upstream uses it -----------------------------------------------
    def count_down(self, n: int) -> None:
        self.state.bytes_down += n

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def flush(self) -> None:
        pass  # the native front sends what feed() returns

    def pause_reading(self) -> None:
        pass  # back-pressure is the native front's

    def resume_reading(self) -> None:
        pass

    def remember_redirect(self, location: str) -> None:
        self.rt.redirects.remember(self.client_key, self.url, location)

    def _end(self) -> None:
        """The exchange is over: the reader lets go of the upstream at once, as PlainClient's
        _drop_upstream does (nothing more it reads is forwarded), and the native front closes."""
        self.done = True
        self.upstream.close()

    def response_done(self, upstream: Upstream) -> None:
        self._end()  # a `Connection: close` request: the client connection ends here

    def too_large(self, upstream: Upstream, length: int, limit: int) -> None:
        self._audit_cut(length, limit)
        self._refuse(too_large_refusal(upstream.key, length, limit))

    def cut(self, upstream: Upstream, limit: int) -> None:
        self._audit_cut(upstream.seen, limit)
        self._end()

    def _audit_cut(self, seen: int, limit: int) -> None:
        state = self.state
        assert state.host is not None and state.port is not None
        audit_response_cut(self.rt, state, state.host, state.port, self.request.path, limit, seen)

    def upstream_broke(self, upstream: Upstream, why: str) -> None:
        refusal = broken_refusal(upstream, why)
        if refusal is None:
            self._end()
        else:
            self._refuse(refusal)

    def upstream_lost(self, upstream: Upstream) -> None:
        if upstream.phase == "idle":
            self._end()
            return
        self.upstream_broke(upstream, LOST_MID_RESPONSE)

    def internal_error(self, exc: BaseException) -> None:
        refusal = self.rt.internal_error("plain_http", exc)
        if self.upstream.started:
            self._end()
        else:
            self._refuse(refusal)

    def _refuse(self, refusal: Refusal) -> None:
        self.out.append(render(refusal))
        self._end()
