"""A tiny real MCP server over stdio (newline-delimited JSON-RPC 2.0) with one tool, ``fetch``.

Why: egressd wraps MCP stdio servers; the tests need one that (a) proves stdio passes through
byte-exact (egressd must write nothing to the child's stdout) and (b) makes HTTP requests the way a
real tool would — with urllib, which honours HTTP_PROXY/HTTPS_PROXY/NO_PROXY from its environment —
so the proxy's verdict (status, X-Egressd-Reason) comes back as the tool result.

Run: ``python tests/support/mcp_echo_server.py``. Stdlib only. Logs go to stderr, never stdout.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from typing import Any

PROTOCOL_VERSION = "2025-06-18"
SERVER_INFO = {"name": "egressd-test-mcp-echo", "version": "1.0.0"}

FETCH_TOOL = {
    "name": "fetch",
    "description": "HTTP GET a URL (through the proxy from the environment) and return status and body start",
    "inputSchema": {
        "type": "object",
        "properties": {"url": {"type": "string", "description": "absolute http(s) URL"}},
        "required": ["url"],
    },
}


def log(msg: str) -> None:
    """Diagnostics go to stderr: stdout belongs to the JSON-RPC stream."""
    print(f"mcp-echo: {msg}", file=sys.stderr, flush=True)


def _text(text: str, is_error: bool) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": is_error}


def fetch(url: str, timeout: float = 30.0) -> dict[str, Any]:
    """GET ``url`` with urllib (environment proxies honoured); a tools/call result."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - test tool
            body = resp.read(200).decode("utf-8", "replace")
            return _text(f"status: {resp.status}\n{body}", False)
    except urllib.error.HTTPError as exc:
        reason = exc.headers.get("X-Egressd-Reason", "") if exc.headers else ""
        try:
            body = exc.read(200).decode("utf-8", "replace")
        except Exception:  # noqa: BLE001 - best effort
            body = ""
        return _text(f"status: {exc.code}\nx-egressd-reason: {reason}\n{body}", True)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return _text(f"error: {reason}", True)


def handle(msg: dict[str, Any]) -> dict[str, Any] | None:
    """The reply to one JSON-RPC message, or None for notifications."""
    method = msg.get("method")
    msg_id = msg.get("id")
    params = msg.get("params") or {}
    if msg_id is None:  # notification (notifications/initialized, cancelled, ...)
        log(f"notification {method}")
        return None

    def ok(result: dict[str, Any]) -> dict[str, Any]:
        return {"jsonrpc": "2.0", "id": msg_id, "result": result}

    def err(code: int, message: str) -> dict[str, Any]:
        return {"jsonrpc": "2.0", "id": msg_id, "error": {"code": code, "message": message}}

    if method == "initialize":
        return ok(
            {"protocolVersion": PROTOCOL_VERSION, "serverInfo": SERVER_INFO, "capabilities": {"tools": {}}}
        )
    if method == "ping":
        return ok({})
    if method == "tools/list":
        return ok({"tools": [FETCH_TOOL]})
    if method == "tools/call":
        if params.get("name") != "fetch":
            return err(-32602, f"unknown tool: {params.get('name')!r}")
        url = (params.get("arguments") or {}).get("url")
        if not isinstance(url, str):
            return err(-32602, "fetch needs a string argument 'url'")
        log(f"fetch {url}")
        return ok(fetch(url))
    return err(-32601, f"method not found: {method}")


def main() -> int:
    """Serve JSON-RPC on stdin/stdout until EOF."""
    log("ready")
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            msg = json.loads(line)
        except json.JSONDecodeError as exc:
            reply: dict[str, Any] | None = {
                "jsonrpc": "2.0",
                "id": None,
                "error": {"code": -32700, "message": f"parse error: {exc}"},
            }
        else:
            reply = (
                handle(msg)
                if isinstance(msg, dict)
                else {
                    "jsonrpc": "2.0",
                    "id": None,
                    "error": {"code": -32600, "message": "invalid request"},
                }
            )
        if reply is not None:
            sys.stdout.write(json.dumps(reply, separators=(",", ":")) + "\n")
            sys.stdout.flush()
    log("stdin closed, exiting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
