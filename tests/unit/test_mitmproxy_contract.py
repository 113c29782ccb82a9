"""The parts of mitmproxy egressd's inspection stands on are the ones it was written against.

Why: egressd pins mitmproxy==12.3.1 because it mirrors or wraps private parts of it
(egressd.inspect.handler, egressd.inspect.patches) and relies on what some documented hooks do
(server_connect may set the address, the SNI and an error before the connect). A new mitmproxy
whose source of any of these parts differs fails here, naming the part and what of egressd's
depends on it, before anything runs on it: the version check alone would pass a patched build of
the same version. The fingerprints are of the source as mitmproxy's files have it, read with `ast`
(not of the objects, which egressd's patches may have replaced in this process).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from pathlib import Path

import pytest

from egressd.inspect import patches

# (module, qualified name, sha256 of its source [:16], what of egressd's stands on it)
PARTS = [
    ("mitmproxy.proxy.server", "ConnectionHandler.open_connection", "cef8d73a19a787df",
     "TunnelHandler.open_connection mirrors it, with the pipeline's connect"),
    ("mitmproxy.proxy.server", "ConnectionHandler.__init__", "f695401fcc32e556",
     "TunnelHandler.__init__ calls it with egressd's client"),
    ("mitmproxy.proxy.server", "LiveConnectionHandler.__init__", "7c98652ee306d53a",
     "TunnelHandler.__init__ does its set-up with egressd's client"),
    ("mitmproxy.proxy.mode_servers", "ProxyConnectionHandler.__init__", "ade673b0266ba77c",
     "TunnelHandler.__init__ stands in for it"),
    ("mitmproxy.proxy.mode_servers", "ProxyConnectionHandler.handle_hook", "ed5dcb7ade7e07a5",
     "TunnelHandler.handle_hook calls the addons as it does"),
    ("mitmproxy.proxy.mode_servers", "ServerInstance.handle_stream", "84b984e0472ccf7a",
     "InspectionEngine.serve and _handle take a connection as it does"),
    ("mitmproxy.addonmanager", "AddonManager.handle_lifecycle", "5975604ee789b1a2",
     "TunnelHandler.handle_hook: the hook, then update for a flow"),
    ("mitmproxy.addonmanager", "AddonManager.trigger_event", "31ac3d2c14cecbca",
     "TunnelHandler.handle_hook: the chain in order, AddonHalt ends it"),
    ("mitmproxy.addonmanager", "AddonManager.invoke_addon", "a050cb56056ef9a4",
     "TunnelHandler.handle_hook: a hook's awaitable awaited"),
    ("mitmproxy.addonmanager", "AddonManager._iter_hooks", "3272db94de93ff9e",
     "Hooks: which attributes are a hook's callables"),
    ("mitmproxy.addonmanager", "traverse", "7235ad007525990a", "Hooks: the order of the addons"),
    ("mitmproxy.addonmanager", "safecall", "b54a129802a53182",
     "TunnelHandler.handle_hook: an addon's error logged, the chain goes on"),
    ("mitmproxy.proxy.server_hooks", "ServerConnectionHookData", "b02d0915c8ffcc72",
     "PolicyGate.server_connect reads its client and server"),
    ("mitmproxy.proxy.server_hooks", "ServerConnectHook", "25221d35f8014a9a",
     "PolicyGate.server_connect: an error set there kills the connection"),
    ("mitmproxy.addons.tlsconfig", "TlsConfig.tls_start_server", "7ec96721e0442d9f",
     "PolicyGate.server_connect sets the SNI that this uses and verifies"),
    ("mitmproxy.proxy.layers.http._http1", "Http1Server.read_headers", "23fa629cea80477d",
     "patch 3 takes its place for a head"),
    ("mitmproxy.proxy.layers.http._http1", "Http1Server.send", "eaaa373dedd307e2",
     "patches 1 and 5 wrap it"),
    ("mitmproxy.proxy.layers.http._http1", "Http1Client.read_headers", "4cdd1074c9589313",
     "patch 4 wraps it"),
    ("mitmproxy.proxy.layers.http._http1", "Http1Connection.read_body", "9d64abb7fef741e6",
     "patch 5 wraps it"),
    ("mitmproxy.proxy.layers.http._http1", "make_body_reader", "ebebb6e1a1e8005f", "patch 5 wraps it"),
    ("mitmproxy.proxy.layers.http._http1", "make_error_response", "1ebe7083b78d5937",
     "patch 1 replaces it"),
    ("mitmproxy.proxy.layers.http", "HttpStream.handle_protocol_error", "16ebb14649f2940b",
     "patch 6 wraps it"),
    ("mitmproxy.proxy.layers.http", "HttpStream.state_stream_request_body", "6a5cfb3cf7d4984b",
     "patch 7 wraps it: it sends the request's end whatever the stream hook decided"),
    ("mitmproxy.proxy.layers.http", "HttpStream.state_stream_response_body", "5deadcd637f5f796",
     "patch 7 wraps it: it sends the response's end whatever the stream hook decided"),
    ("mitmproxy.proxy.layers.http", "HttpStream.check_killed", "ce8162a91be58671",
     "patch 7 calls it to end a cut exchange as a killed flow"),
]  # fmt: skip


def _source(module: str, qualname: str) -> str:
    """The source of `qualname` as the module's file has it."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    text = Path(spec.origin).read_text()
    nodes: list[ast.AST] = [ast.parse(text)]
    for name in qualname.split("."):
        found = [
            n
            for parent in nodes
            for n in ast.iter_child_nodes(parent)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n.name == name
        ]
        assert found, f"{module}.{qualname}: {name} is gone"
        nodes = found[:1]
    segment = ast.get_source_segment(text, nodes[0])
    assert segment is not None
    return segment


@pytest.mark.parametrize(("module", "qualname", "fingerprint", "why"), PARTS, ids=[p[1] for p in PARTS])
def test_the_part_of_mitmproxy_egressd_stands_on_is_unchanged(
    module: str, qualname: str, fingerprint: str, why: str
) -> None:
    got = hashlib.sha256(_source(module, qualname).encode()).hexdigest()[:16]
    assert got == fingerprint, f"mitmproxy's {module}.{qualname} changed ({got}): {why}; review it"


def test_the_pinned_version_is_the_one_installed() -> None:
    from mitmproxy import version

    assert version.VERSION == patches.MITMPROXY_VERSION
    patches.check_version()


def test_each_patch_wraps_once_however_often_it_is_installed() -> None:
    """install() runs at every engine start in a process: a wrap is never stacked on itself."""
    from mitmproxy.proxy.layers.http import HttpStream, _http1

    patches.install()
    patches.install()
    assert len(_http1.Http1Server.send.egressd_patches) == 2  # error pages (1.) and trailers (5.)
    for wrapped in (
        _http1.Http1Server.read_headers,
        _http1.Http1Client.read_headers,
        _http1.Http1Connection.read_body,
        HttpStream.handle_protocol_error,
        HttpStream.state_stream_request_body,
        HttpStream.state_stream_response_body,
    ):
        assert len(wrapped.egressd_patches) == 1, wrapped
