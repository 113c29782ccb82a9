"""A relay for newline-delimited JSON-RPC (ACP, MCP stdio) that rewrites only what it must.

Why: an editor and an agent (or an MCP client and server) trust their stdio stream; egressd sits in
it to keep what the child launches under its policy. Every line it does not rewrite is forwarded
byte for byte (terminator included), in order; lines that are not JSON pass untouched. A message
that matters to egressd is judged on egressd's own parse and, when rewritten, re-encoded from it;
a message holding a duplicate key is re-encoded too, so the peer can never read a different
message than the one egressd judged (another parser may keep the first of two `"method"` keys).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# Longest line parsed. The ACP SDK's own stdio buffer is 50 MiB; a longer line is not a message
# any peer reads, and holding it would let a child grow egressd's memory without bound.
MAX_LINE = 64 * 1024 * 1024
READ_SIZE = 256 * 1024


class Message:
    """One parsed line: the JSON value, its terminator, and whether re-encoding is required."""

    __slots__ = ("value", "terminator", "ambiguous")

    def __init__(self, value: Any, terminator: bytes, ambiguous: bool) -> None:
        self.value = value
        self.terminator = terminator
        self.ambiguous = ambiguous


def parse(line: bytes) -> Message | None:
    """The JSON value of one line, or None when it is not JSON (such a line is passed through).

    Invalid UTF-8 is read as a lenient peer would (replacement characters): if that reading is
    JSON, egressd judges it — a strict peer rejects the line anyway.
    """
    body = line.rstrip(b"\n")
    terminator = line[len(body) :]
    if body.endswith(b"\r"):
        body, terminator = body[:-1], b"\r" + terminator
    duplicate = False

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal duplicate
        result = dict(items)
        if len(result) != len(items):
            duplicate = True
        return result

    text = body.decode("utf-8", "replace")
    try:
        value = json.loads(text, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return None
    lenient = "\ufffd" in text and b"\xef\xbf\xbd" not in body  # invalid UTF-8 was replaced
    return Message(value, terminator, duplicate or lenient)


def encode(value: Any, terminator: bytes = b"\n") -> bytes:
    """One message as a line: compact JSON, UTF-8, no raw newline inside (JSON escapes them)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode() + (terminator or b"\n")


class Writer:
    """Whole-line writes to one fd from several threads; a broken peer makes writes no-ops."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._lock = threading.Lock()
        self.broken = False

    def write(self, data: bytes) -> bool:
        with self._lock:
            if self.broken:
                return False
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(self.fd, view) :]
            except OSError:
                self.broken = True
                return False
            return True

    def close(self) -> None:
        with self._lock:
            self.broken = True
            with contextlib.suppress(OSError):
                os.close(self.fd)


# What a direction does with one line: the bytes to forward (the line itself to pass it on, b""
# to drop it). It is called with the raw line and its parse (None when not JSON).
Handler = Callable[[bytes, Message | None], bytes]


def pump(
    source: int,
    sink: Writer,
    handler: Handler,
    *,
    strict: bool,
    name: str,
    max_line: int = MAX_LINE,
    warn: Callable[[str], None] | None = None,
) -> None:
    """Copy `source` to `sink` line by line through `handler` until EOF or a broken sink.

    strict: the direction egressd must judge (the child's messages to the client). A line over
    `max_line` is dropped there, and a handler failure drops the line; in the other direction both
    pass through untouched. A last line without a terminator is handled at EOF like any other.
    """
    buffer = bytearray()
    skipping = False  # inside an over-long line: forwarded raw (lenient) or dropped (strict)

    def emit(line: bytes) -> None:
        try:
            out = handler(line, parse(line))
        except Exception:  # noqa: BLE001 - never crash the stream
            logger.exception("egressd %s: handler failed", name)
            out = b"" if strict else line
            if strict and warn is not None:
                warn(f"{name}: dropped a message egressd could not judge")
        if out:
            sink.write(out)

    while not sink.broken:
        try:
            chunk = os.read(source, READ_SIZE)
        except InterruptedError:
            continue
        except OSError:
            break
        if not chunk:
            break
        start = 0
        while start < len(chunk):
            newline = chunk.find(b"\n", start)
            end = len(chunk) if newline < 0 else newline + 1
            piece = chunk[start:end]
            start = end
            if skipping:
                if not strict:
                    sink.write(piece)
                skipping = newline < 0
                continue
            buffer += piece
            if len(buffer) > max_line:  # never parsed: dropped (strict) or passed on raw
                if strict:
                    if warn is not None:
                        warn(f"{name}: dropped a message longer than {max_line} bytes")
                else:
                    sink.write(bytes(buffer))
                buffer = bytearray()
                skipping = newline < 0
            elif newline >= 0:
                line, buffer = bytes(buffer), bytearray()
                emit(line)
    if buffer and not skipping:
        emit(bytes(buffer))
