"""Reading egressd's audit log while egressd may be writing it.

A reader can catch a line half written (a write that crosses a page is seen page by page), so only
complete lines — up to the last newline — are records; the rest is read on the next poll.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["audit_records"]


def audit_records(path: Path) -> list[dict[str, Any]]:
    """The audit log's complete records so far ([] before the file exists)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]
