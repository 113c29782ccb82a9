"""The tests' audit reader takes only complete lines: a record half written is read on the next poll."""

from __future__ import annotations

from pathlib import Path

from tests.support.audit_log import audit_records


def test_a_half_written_record_is_left_for_the_next_read(tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    assert audit_records(audit) == []
    audit.write_text('{"event":"decision","host":"a.test"}\n{"event":"closed","host":"gone.te')
    assert audit_records(audit) == [{"event": "decision", "host": "a.test"}]
    with audit.open("a") as handle:
        handle.write('st"}\n\n')
    assert [r["host"] for r in audit_records(audit)] == ["a.test", "gone.test"]
