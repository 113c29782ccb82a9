"""Property: whatever Connection / Upgrade fields a child writes, the only upgrade egressd forwards is
a WebSocket handshake the policy lets upgrade, and HTTP2-Settings is never forwarded.

Why: the request rules (egressd.admission.http_rules) decide whether a request may switch protocols,
and the wire layer (egressd.wire.http1.upstream_headers, and the same hop-by-hop rule inside
inspection) decides which fields go upstream. Two readers of the same fields must agree: a request
the rules took for no upgrade must not reach the server with an Upgrade field it could act on.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.admission.http_rules import request_refusal
from egressd.policy import make_target
from egressd.wire.http1 import RequestHead, upstream_headers

TARGET = make_target("api.test", 80)
TOKENS = ["websocket", "WebSocket", "h2c", "upgrade", "Upgrade", "keep-alive", "close", "tls/1.2", "", " "]


def _list(tokens: list[str]) -> str:
    return ",".join(tokens)


FIELDS = st.lists(
    st.one_of(
        st.tuples(
            st.sampled_from(["Connection", "connection", "CONNECTION"]),
            st.lists(st.sampled_from(TOKENS)).map(_list),
        ),
        st.tuples(st.sampled_from(["Upgrade", "upgrade"]), st.lists(st.sampled_from(TOKENS)).map(_list)),
        st.tuples(st.sampled_from(["HTTP2-Settings", "http2-settings"]), st.just("AAMAAABkAARAAAAAAAIAAAAA")),
        st.tuples(st.just("Sec-WebSocket-Key"), st.just("dGhlIHNhbXBsZSBub25jZQ==")),
        st.tuples(st.just("Sec-WebSocket-Version"), st.sampled_from(["13", "8"])),
        st.tuples(st.just("X-Other"), st.just("1")),
    ),
    max_size=8,
)


@settings(max_examples=600, deadline=None)
@given(
    fields=FIELDS,
    method=st.sampled_from(["GET", "get", "POST"]),
    websocket=st.booleans(),
    upgrade=st.booleans(),
)
def test_only_an_admitted_websocket_upgrade_is_forwarded(
    fields: list[tuple[str, str]], method: str, websocket: bool, upgrade: bool
) -> None:
    refusal = request_refusal(TARGET, fields, websocket=websocket, upgrade=upgrade, method=method)
    if refusal is not None:
        return  # nothing is forwarded
    request = RequestHead(method, "http", "api.test", 80, "/", "1.1", fields)
    sent = upstream_headers(request, "api.test", 80, set())
    names = [n.lower() for n, _ in sent]
    assert "http2-settings" not in names
    upgrades = [v for n, v in sent if n.lower() == "upgrade"]
    if upgrades:
        assert websocket and upgrade and method == "GET"
        assert [t.strip().lower() for v in upgrades for t in v.split(",") if t.strip()] == ["websocket"]
        assert ("Connection", "Upgrade") in sent
    else:
        assert not any(v.strip().lower() == "upgrade" for n, v in sent if n.lower() == "connection")
