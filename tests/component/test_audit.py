"""Audit log: one JSON line per decision / closed connection, queries redacted, never on stdout."""

from __future__ import annotations

import io
import re
import stat
import sys
import threading
from pathlib import Path

import pytest

from egressd.observe.audit import AuditLog, redact_query, utc_timestamp
from tests.support.audit_log import audit_records

TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def lines(path: Path) -> list[dict[str, object]]:
    return audit_records(path)


def test_decision_line_has_the_contract_keys(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    with AuditLog(path) as audit:
        audit.decision(
            conn="c1",
            client="egressd",
            profile=None,
            method="GET",
            scheme="https",
            host="api.example",
            port=443,
            path="/v1/items?token=secret&x=1",
            decision="allow",
            reason="allowlist",
            rule="allow: api.example",
            detail="matches",
            resolved=["203.0.113.7"],
            connected="203.0.113.7:443",
        )
    (record,) = lines(path)
    assert list(record)[:2] == ["time", "event"]
    assert TIME.match(str(record["time"]))
    assert record["event"] == "decision"
    for key in ("conn", "client", "profile", "method", "scheme", "host", "port", "path", "decision"):
        assert key in record
    assert record["path"] == "/v1/items?<redacted>"
    assert "secret" not in path.read_text()
    assert record["decision"] == "allow" and record["reason"] == "allowlist"
    assert record["resolved"] == ["203.0.113.7"] and record["connected"] == "203.0.113.7:443"


def test_decision_accepts_bool_and_defaults(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    audit = AuditLog(path)
    audit.decision(allowed=False, host="evil.test", port=443, reason="not_allowlisted")
    audit.close()
    (record,) = lines(path)
    assert record["decision"] == "deny"
    assert record["resolved"] == [] and record["connected"] is None and record["path"] is None


def test_closed_and_events(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    with AuditLog(path) as audit:
        audit.closed(conn="c1", host="h.test", port=80, bytes_up=10, bytes_down=2000, duration=1.23456)
        audit.event("reload", source="policy.yaml")
        audit.event("sni_mismatch", host="a.test", sni="b.test")
    closed, reload, sni = lines(path)
    assert closed["event"] == "closed"
    assert (closed["bytes_up"], closed["bytes_down"], closed["duration"]) == (10, 2000, 1.235)
    assert reload == {"time": reload["time"], "event": "reload", "source": "policy.yaml"}
    assert sni["event"] == "sni_mismatch" and sni["sni"] == "b.test"


def test_append_mode_and_private_permissions(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    for n in range(2):
        with AuditLog(path) as audit:
            audit.event("start", n=n)
    assert [r["n"] for r in lines(path)] == [0, 1]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_each_line_is_flushed_at_once(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    audit = AuditLog(path)
    audit.decision(decision="deny", host="x.test", port=1, reason="r")
    assert len(lines(path)) == 1  # readable before close
    audit.close()


def test_thread_safe_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    audit = AuditLog(path)

    def write(n: int) -> None:
        for i in range(200):
            audit.decision(conn=f"{n}-{i}", decision="allow", host="h.test", port=80, detail="x" * 500)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    audit.close()
    records = lines(path)
    assert len(records) == 1600
    assert len({r["conn"] for r in records}) == 1600


def test_trace_line_is_human_and_goes_only_to_the_trace(capsys: pytest.CaptureFixture[str]) -> None:
    trace = io.StringIO()
    audit = AuditLog(None, trace=trace)
    audit.decision(
        method=None,
        host="evil.test",
        port=443,
        decision="deny",
        reason="not_allowlisted",
        rule="mode: enforce",
    )
    audit.decision(
        method="GET", host="127.0.0.1", port=8080, path="/x?q=1", decision="allow", reason="loopback"
    )
    deny, allow = trace.getvalue().splitlines()
    assert deny.startswith("egressd: DENY  CONNECT evil.test:443  not_allowlisted (mode: enforce)")
    assert "egressd exec --allow evil.test" in deny
    assert allow.startswith("egressd: ALLOW GET 127.0.0.1:8080/x?<redacted>  loopback")
    assert capsys.readouterr().out == ""


def test_trace_escapes_control_characters() -> None:
    trace = io.StringIO()
    AuditLog(None, trace=trace).decision(
        host="evil\x1b[2J.test", port=1, decision="deny", reason="bad_target"
    )
    assert "\x1b" not in trace.getvalue() and "\\x1b" in trace.getvalue()


def test_trace_on_stdout_is_refused() -> None:
    with pytest.raises(ValueError):
        AuditLog(None, trace=sys.stdout)


def test_disabled_log_writes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    audit = AuditLog(None)
    assert not audit.enabled
    record = audit.decision(host="a.test", port=1, decision="allow")
    assert record["event"] == "decision"
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (None, None),
        ("/", "/"),
        ("/a/b", "/a/b"),
        ("/a?x=1", "/a?<redacted>"),
        ("/a?", "/a?<redacted>"),
        ("/a#frag", "/a"),
        ("http://h.test/p?sig=abc", "http://h.test/p?<redacted>"),
    ],
)
def test_redact_query(path: str | None, expected: str | None) -> None:
    assert redact_query(path) == expected


def test_ids_and_timestamps() -> None:
    assert TIME.match(utc_timestamp())


def test_undecodable_bytes_are_escaped_and_later_records_still_arrive(tmp_path: Path) -> None:
    """A client's non-UTF-8 byte reaches a record as a lone surrogate (surrogateescape): writing it
    raw fails the UTF-8 file, which lost the record (and said so only once)."""
    path = tmp_path / "audit.jsonl"
    trace = io.StringIO()
    with AuditLog(path, trace=trace) as audit:
        audit.decision(host="up.test", port=80, path="/caf\udce9", decision="deny", detail=["\ud800"])
        audit.event("internal_error", detail=ValueError("bad \udcff byte"))
        audit.decision(host="up.test", port=80, path="/after", decision="allow")
    first, second, third = lines(path)
    assert first["path"] == "/caf\\xe9" and first["detail"] == ["\\ud800"]
    assert second["detail"] == "bad \\xff byte"
    assert third["path"] == "/after"
    assert len(trace.getvalue().splitlines()) == 3
