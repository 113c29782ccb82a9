"""Helpers that several test modules use (so none imports another), from the tests of: The audit log
when it cannot be written: a full disk, a FIFO whose reader stops reading."""

from __future__ import annotations

import contextlib
import urllib.error
import urllib.parse
import urllib.request


def get(proxy: str, url: str, timeout: float = 15) -> tuple[int, str | None]:
    """(status, X-Egressd-Reason) of one GET through the proxy, on a connection of its own. A
    client left waiting longer than `timeout` fails the test: egressd must answer."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy}))
    try:
        with opener.open(url, timeout=timeout) as response:
            response.read()
            return response.status, response.headers.get("X-Egressd-Reason")
    except urllib.error.HTTPError as exc:
        with contextlib.closing(exc):
            exc.read()
            proxy_status = exc.headers.get("Proxy-Status") or ""
            reason = exc.headers.get("X-Egressd-Reason")
            if reason == "audit_unavailable":  # the child is told why, in the standard header too
                assert "error=proxy_internal_error" in proxy_status, proxy_status
            return exc.code, reason


def whole_lines(text: str) -> None:
    """No torn line: the file ends with a newline and every line is one JSON record."""
    assert text.endswith("\n"), text[-200:]
    for number, line in enumerate(text.splitlines(), 1):
        assert line.startswith("{") and line.endswith("}"), f"line {number} is torn: {line[:200]!r}"


