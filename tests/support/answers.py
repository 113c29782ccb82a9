"""Helpers that several test modules use (so none imports another), from the tests of: Real clients
through `egressd exec` to real servers in the test namespace."""

from __future__ import annotations

import subprocess


def parse_http(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (last wins, lower-case) and body of the LAST response in curl -i output."""
    text = raw
    blocks = []
    while text.startswith(b"HTTP/"):
        head, sep, rest = text.partition(b"\r\n\r\n")
        blocks.append(head)
        text = rest
        if not sep:
            break
    assert blocks, f"no HTTP response in {raw[:300]!r}"
    lines = blocks[-1].decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, text


def assert_refusal(
    result: subprocess.CompletedProcess[bytes], status: int, reason: str, error: str
) -> dict[str, str]:
    got_status, headers, body = parse_http(result.stdout)
    assert got_status == status, (result.stdout[:600], result.stderr[-600:])
    assert headers["x-egressd-reason"] == reason
    assert headers["proxy-status"].startswith(f"egressd; error={error}")
    return headers


