"""Helpers that several test modules use (so none imports another), from the tests of: `egressd exec
--metrics`: Prometheus metrics scraped with a real HTTP client after real traffic."""

from __future__ import annotations

import re


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in the Prometheus text format (0 when absent)."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(3) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(4))
    return 0.0


