"""Helpers that several test modules use (so none imports another), from the tests of: mode: ask
through the real commands: a request waits (nothing reaches the upstream) until an approver answers
— a script over the control API, or a person at the terminal (/dev/tty through a real pty) — or
until ask_timeout; identical asks are one question; always/deny-always edit the policy file (its
comments kept) and the reload applies them; without an approver, no_approver."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.answers import parse_http
from tests.support.control import ps_rows
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun


def start_curl(run: EgressdRun, url: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["curl", "-sS", "-i", "--max-time", "40", url], env=run.child_env(), stdout=subprocess.PIPE
    )


def finish(curl: subprocess.Popen[bytes]) -> tuple[int, str | None]:
    """(status, X-Egressd-Reason) of a finished curl."""
    out, _ = curl.communicate(timeout=60)
    status, headers, _ = parse_http(out)
    return status, headers.get("x-egressd-reason")


def attached() -> bool:
    rows = ps_rows()
    return bool(rows) and rows[0]["approvers"]["can_answer"]


def run_ask(policy: Path, dns: DnsServer, *extra: str) -> EgressdRun:
    return EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver, "--no-prompt", *extra])


