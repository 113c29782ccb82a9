"""`egressd mcp run`: an MCP stdio server under egressd, whose failed tool calls say what egressd
refused.

Why: an MCP server reports a refused request its own way — mcp-server-fetch says only "status
code 403" — so the model and the user never learn that egressd refused it, why, or what would
allow it. egressd knows: while a `tools/call` is in flight, the refusals of this server's
connections are collected, and a call that fails (`isError` or a JSON-RPC error) gets them appended.
Every other line passes byte for byte; so does a successful result.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from typing import Any

from egressd.admission.events import Decided, Event
from egressd.agents.acp import event_notice
from egressd.agents.jsonrpc import Message, encode
from egressd.policy.refusal import HintContext

KEEP = 64  # refusals remembered (a call that fails long after many refusals gets the latest)


class McpBridge:
    """The two handlers of one wrapped MCP server, and the observer of its refusals."""

    def __init__(self, context: HintContext | None = None) -> None:
        self.context = context or HintContext("mcp run")  # where its notices' hints are read
        self._lock = threading.Lock()
        self._calls: dict[str, float] = {}  # tools/call id (JSON) -> when it was sent
        self._refusals: deque[tuple[float, str]] = deque(maxlen=KEEP)

    def observe(self, event: Event) -> None:
        """Pipeline observer (the proxy's thread): remember the refusal, nothing more."""
        if isinstance(event, Decided) and not event.allowed:
            text = event_notice(event, self.context)
            with self._lock:
                self._refusals.append((time.monotonic(), text))

    def from_client(self, line: bytes, message: Message | None) -> bytes:
        if message is None:
            return line
        for item in message.value if isinstance(message.value, list) else [message.value]:
            if isinstance(item, dict) and item.get("method") == "tools/call" and "id" in item:
                with self._lock:
                    self._calls[json.dumps(item["id"])] = time.monotonic()
        return line

    def from_server(self, line: bytes, message: Message | None) -> bytes:
        if message is None:
            return line
        changed = False
        for item in message.value if isinstance(message.value, list) else [message.value]:
            if isinstance(item, dict) and "method" not in item and "id" in item:
                changed |= self._annotate(item)
        return encode(message.value, message.terminator) if changed else line

    def _annotate(self, response: dict[str, Any]) -> bool:
        with self._lock:
            started = self._calls.pop(json.dumps(response["id"]), None)
            if started is None:
                return False
            texts = list(dict.fromkeys(text for when, text in self._refusals if when >= started))
        if not texts:
            return False
        result, error = response.get("result"), response.get("error")
        content = result.get("content") if isinstance(result, dict) else None
        if isinstance(result, dict) and result.get("isError") is True and isinstance(content, list):
            content.extend({"type": "text", "text": text} for text in texts)
            return True
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            error["message"] += "\n" + "\n".join(texts)
            return True
        return False
