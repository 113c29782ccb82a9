"""Audit log (one JSON line per decision / closed connection) and the optional human trace.

It observes the admission pipeline's events (`observe`) and takes the CLI's own records (reloads).
Called from the proxy's event-loop thread and from the CLI. Each record goes to the file whole and
at once, before the decision it records is acted upon (egressd.observe.sink: a crash never loses a
decision that was already acted on; a full disk or a reader that stops reading makes `writable`
False and every lost record is counted in `lost`). Nothing here ever writes to stdout, which
belongs to the child (MCP/ACP speak JSON-RPC on it).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from datetime import UTC, datetime
from typing import Any, TextIO

from egressd.admission.events import Closed, Decided, Event, Notice
from egressd.observe.sink import LineSink
from egressd.policy.reasons import Reason
from egressd.policy.refusal import HintContext, Refusal

DECISION_KEYS: tuple[str, ...] = (
    "conn",
    "client",
    "profile",
    "method",
    "scheme",
    "host",
    "port",
    "path",
    "decision",
    "reason",
    "rule",
    "detail",
    "resolved",
    "connected",
)
CLOSED_KEYS: tuple[str, ...] = ("conn", "host", "port", "bytes_up", "bytes_down", "duration")

_second: tuple[int, str] = (-1, "")  # the last second formatted, shared by the records within it


def utc_timestamp(now: datetime | None = None) -> str:
    """RFC 3339 UTC with milliseconds, e.g. 2025-01-31T12:00:00.123Z."""
    global _second
    if now is not None:
        return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond // 1000:03d}Z"
    microseconds = time.time_ns() // 1000
    second, fraction = divmod(microseconds, 1_000_000)
    if _second[0] != second:  # a tuple swapped whole: safe between threads
        _second = (second, time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(second)))
    return f"{_second[1]}{fraction // 1000:03d}Z"


def redact_query(path: str | None) -> str | None:
    """Drop the query string (tokens and signed-URL secrets live there) but show that one existed."""
    if path is None:
        return None
    path = path.split("#", 1)[0]
    if "?" in path:
        return path.split("?", 1)[0] + "?<redacted>"
    return path


def _printable(value: object) -> str:
    """Escape control characters so a hostile host name cannot drive the user's terminal."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def _verdict(value: object) -> str | None:
    if isinstance(value, bool):
        return "allow" if value else "deny"
    return None if value is None else str(value)


class AuditLog:
    """Thread-safe JSON-lines audit file plus an optional human trace stream (normally stderr)."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        trace: TextIO | None = None,
        *,
        on_failure: str = "refuse",
        max_queue_bytes: int = 4 * 1024 * 1024,
        context: HintContext | None = None,
    ) -> None:
        if trace is not None and trace in (sys.stdout, sys.__stdout__):
            raise ValueError("the trace must not go to stdout: stdout belongs to the child")
        self._lock = threading.Lock()
        self._trace = trace
        self.context = context  # where the trace is read: its hints name what that person can change
        self._failed = False
        self._sink: LineSink | None = None
        if path is not None:
            self._sink = LineSink(
                path,
                count_line=_dropped_line,
                say=_say,
                max_queue_bytes=max_queue_bytes,
                on_failure=on_failure,
            )
        self.path = None if path is None else os.fspath(path)

    @property
    def enabled(self) -> bool:
        return self._sink is not None or self._trace is not None

    # -- the file's health (egressd.observe.sink) ------------------------------------------------
    @property
    def writable(self) -> bool:
        """A record given now would be written: False while the disk is full or the reader of a
        FIFO has stopped reading (and its queue is full)."""
        return self._sink is None or self._sink.writable

    @property
    def lost(self) -> int:
        """Records that could not be written, since the start."""
        return 0 if self._sink is None else self._sink.lost

    @property
    def queued_bytes(self) -> int:
        """Bytes of records waiting for a pipe's reader."""
        return 0 if self._sink is None else self._sink.queued

    @property
    def problem(self) -> str:
        return "" if self._sink is None else self._sink.problem

    def configure(self, on_failure: str, max_queue_bytes: int) -> None:
        """The policy's `audit` settings (at start and on every reload)."""
        if self._sink is not None:
            self._sink.on_failure = on_failure
            self._sink.max_queue_bytes = max_queue_bytes

    def reopen(self) -> None:
        """Open the file again by its path (SIGHUP: it was rotated); any thread."""
        if self._sink is not None:
            self._sink.reopen()

    # -- the pipeline's events ------------------------------------------------------------------
    def observe(self, event: Event) -> None:
        """One audit line for each event of the admission pipeline (subscribed to its bus)."""
        if isinstance(event, Decided):
            fields = _fields(event)
            fields["stage"] = "request" if event.stage == "inner" else event.stage
            fields["decision"] = "allow" if fields.pop("allowed") else "deny"
            attempts = fields.pop("attempts")
            if attempts is not None:  # the connection records: the addresses tried
                fields["attempts"] = list(attempts) or None
            if fields.get("would_be") is None:  # only mode: learn's allows carry it
                fields.pop("would_be", None)
            if fields.get("via") is None:  # only connections through a parent proxy carry it
                fields.pop("via", None)
            if event.pid is None and event.exe is None:  # the owner was not looked up
                fields.pop("pid")
                fields.pop("exe")
            if not event.captured:  # only connections the capture took carry it
                fields.pop("captured")
            self.decision(**fields)
        elif isinstance(event, Closed):
            self.closed(**_fields(event))
        elif isinstance(event, Notice):
            self.event(event.kind, **event.fields)
        # Resolved (a lookup's latency) is for metrics: the decision record names the addresses

    # -- records -------------------------------------------------------------------------------
    def decision(self, **fields: Any) -> dict[str, Any]:
        """Record one decision. `decision` may be "allow"/"deny" or a bool; `allowed=` works too."""
        if "decision" not in fields and "allowed" in fields:
            fields["decision"] = fields.pop("allowed")
        fields["decision"] = _verdict(fields.get("decision"))
        fields["path"] = redact_query(fields.get("path"))
        resolved = fields.get("resolved")
        fields["resolved"] = [str(a) for a in resolved] if resolved else []
        if fields.get("connected") is not None:
            fields["connected"] = str(fields["connected"])
        record = self._record("decision", DECISION_KEYS, fields)
        if self._trace is not None:
            self._trace_line(_decision_line(record, self.context))
        return record

    def closed(self, **fields: Any) -> dict[str, Any]:
        """Record the end of a connection: bytes each way and duration in seconds."""
        if isinstance(fields.get("duration"), float):
            fields["duration"] = round(fields["duration"], 3)
        return self._record("closed", CLOSED_KEYS, fields)

    def event(self, kind: str, *, traced: bool = True, **fields: Any) -> dict[str, Any]:
        """Record anything else (sni_mismatch, reload, reload_failed, ...); also traced unless
        `traced` is false (a record for readers of the file, not news for the person watching)."""
        record = self._record(kind, (), fields)
        if self._trace is not None and traced:
            extra = " ".join(f"{k}={_printable(v)}" for k, v in fields.items() if v not in (None, ""))
            self._trace_line(f"egressd: {kind}" + (f"  {extra}" if extra else ""))
        return record

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------
    def _record(self, event: str, keys: tuple[str, ...], fields: dict[str, Any]) -> dict[str, Any]:
        record: dict[str, Any] = {"time": utc_timestamp(), "event": event}
        for key in keys:
            record[key] = fields.pop(key, None)
        record.update(fields)
        if self._sink is not None:
            try:
                data = _encoded(record)
            except Exception:
                self._sink.drop("a record could not be formatted")  # counted: never acted upon silently
                raise
            self._sink.write(data)
        return record

    def _trace_line(self, line: str) -> None:
        if self._trace is not None:
            self._write(self._trace, line if _encodable(line) else _escaped(line))

    def _write(self, stream: TextIO, line: str) -> None:
        with self._lock:
            try:
                stream.write(line + "\n")
                stream.flush()
            except (OSError, ValueError) as exc:
                # a trace that cannot be written must not take the proxy down; say so once
                if not self._failed:
                    self._failed = True
                    _say(f"egressd: trace write failed: {exc}")


def _say(text: str) -> None:
    """A line on egressd's stderr (the audit file's failures), never on stdout."""
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


def _dropped_line(count: int, since: float, error: str) -> bytes:
    """The record counting the records that could not be written, once writing works again."""
    record = {
        "time": utc_timestamp(),
        "event": "audit_dropped",
        "count": count,
        "since": utc_timestamp(datetime.fromtimestamp(since, UTC)),
        "error": error,
    }
    return (_json_line(_escaped(record)) + "\n").encode()


def _fields(event: Decided | Closed) -> dict[str, Any]:
    """An event's fields as a dict: a shallow copy (an event's values are immutable — strings,
    numbers, tuples of strings)."""
    return event._asdict()


def _encoded(record: dict[str, Any]) -> bytes:
    """The record's line as UTF-8 bytes, newline included."""
    try:
        return (_json_line(record) + "\n").encode()
    except UnicodeEncodeError:  # a lone surrogate (an undecodable byte a client sent)
        return (_json_line(_escaped(record)) + "\n").encode()


def _json_line(record: dict[str, Any]) -> str:
    return json.dumps(record, default=str, ensure_ascii=False, separators=(",", ":"))


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _escaped(value: Any) -> Any:
    """value with every string made UTF-8-encodable: bytes a client sent that were not UTF-8 (lone
    surrogates from surrogateescape) become `\\xNN`, other lone surrogates `\\udNNN`."""
    if isinstance(value, dict):
        return {_escaped(k): _escaped(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_escaped(v) for v in value]
    if not isinstance(value, str | int | float | None):
        value = str(value)  # what json.dumps(default=str) would write
    if not isinstance(value, str) or _encodable(value):
        return value
    try:
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")


# What a decision without an HTTP method was about (the engine's `stage` field).
_STAGE_LABELS = {"connection": "connect", "tls": "TLS", "socks": "SOCKS"}


def _decision_line(record: dict[str, Any], context: HintContext | None = None) -> str:
    """`egressd: DENY  CONNECT evil.test:443  not_allowlisted (mode: enforce) - run: ...`; a
    network failure is FAIL, never DENY (`egressd: FAIL  CONNECT up.test:443  dns_timeout - ...`).
    A refusal an edit lifts names it instead of the detail (the command to rerun, where there is
    one)."""
    verdict = (record.get("decision") or "?").upper()
    code = Reason.parse(record.get("reason"))
    if verdict == "DENY" and code is not None and code.failure:
        verdict = "FAIL"
    method = record.get("method") or _STAGE_LABELS.get(record.get("stage") or "", "CONNECT")
    host = record.get("host") or "?"
    port = record.get("port")
    where = f"[{host}]" if ":" in str(host) else str(host)
    if port is not None:
        where += f":{port}"
    path = record.get("path")
    if path and path != "/" and not str(path).startswith("/"):
        path = "/" + str(path)
    target = where + (path if path and method != "CONNECT" else "")
    reason = record.get("reason") or ""
    if record.get("rule"):
        reason += f" ({record['rule']})"
    line = f"egressd: {verdict:<5} {method} {target}  {reason}".rstrip()
    if record.get("exe") or record.get("pid"):
        line += f"  [{os.path.basename(record.get('exe') or '?')} pid {record.get('pid') or '?'}]"
    if record.get("captured"):
        line += "  (captured: it ignored the proxy variables)"
    refusal = _refusal(record, code, context) if verdict == "DENY" else None
    from egressd.wire.refusal import rerun_hint, short_hint  # the hints: with the first trace line

    if refusal is not None and (hint := rerun_hint(refusal)):
        line += f" - run: {hint}"
    elif refusal is not None and (hint := short_hint(refusal)):
        line += f" - {hint}"
    elif verdict in ("DENY", "FAIL") and record.get("detail"):
        line += f" - {record['detail']}"
    if record.get("connected"):
        line += f" -> {record['connected']}"
    if record.get("via"):
        line += f" via {record['via']}"
    return _printable(line)


def _refusal(record: dict[str, Any], reason: Reason | None, context: HintContext | None) -> Refusal | None:
    """The refusal a decision record tells, for its hint (None for a record of no refusal)."""
    host, port = record.get("host"), record.get("port")
    if reason is None or not isinstance(host, str) or not isinstance(port, int | None):
        return None
    resolved = tuple(str(a) for a in record.get("resolved") or ())
    return Refusal(
        reason,
        str(record.get("detail") or ""),
        host,
        port,
        record.get("rule"),
        profile=record.get("profile"),
        addresses=resolved,
        context=context,
    )
