"""Audit log rotation: the file moved (with or without SIGHUP), deleted, copied and truncated, and
rotated by the real `logrotate` with the example of docs/audit.md. Every record lands in a file
someone can read: the rotated one before the rotation, the new one at the path after it."""

from __future__ import annotations

import gzip
import re
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.attempts import wait_until
from tests.support.audit_log import audit_records
from tests.support.audit_reading import get, whole_lines
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun, egressd_exec, write_policy
from tests.support.upstreams import EchoHTTPServer

DOCS = Path(__file__).resolve().parents[2] / "docs" / "audit.md"
EXAMPLE_PATH = "/var/log/egressd/audit.jsonl"


def paths(records: list[dict[str, Any]]) -> list[str]:
    """The paths of the allowed requests on record, in order."""
    return [r["path"] for r in records if r.get("stage") == "request" and r["decision"] == "allow"]


@pytest.fixture
def served(tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer) -> tuple[list[str], str]:
    """The options of an `egressd run` whose audit is tmp_path/log/audit.jsonl, and the base URL."""
    dns.add("up.test", upstream.host)
    (tmp_path / "log").mkdir(mode=0o700)
    audit = tmp_path / "log" / "audit.jsonl"
    options = ["--policy", str(write_policy(tmp_path)), "--nameserver", dns.nameserver, "--audit", str(audit)]
    return options, f"http://up.test:{upstream.port}"


def request(run: EgressdRun, url: str, audit: Path) -> None:
    """One request, served, and its record written (to the file at `audit`)."""
    assert get(run.proxy_url, url)[0] == 200
    path = "/" + url.split("/", 3)[3]
    wait_until(lambda: path in paths(audit_records(audit)), f"the record of {path} in {audit.name}")


def moved_and_sighup(audit: Path, rotated: Path, run: EgressdRun) -> None:
    audit.rename(rotated)
    run.signal(signal.SIGHUP)


def moved(audit: Path, rotated: Path, run: EgressdRun) -> None:
    """No signal: egressd notices that the path names no file any more."""
    audit.rename(rotated)


def deleted(audit: Path, rotated: Path, run: EgressdRun) -> None:
    """Records must not go on into a deleted file nobody can read."""
    audit.unlink()


def copied_and_truncated(audit: Path, rotated: Path, run: EgressdRun) -> None:
    """logrotate's copytruncate: egressd appends at the new end (no hole of zeros where the old
    end was)."""
    shutil.copyfile(audit, rotated)
    with audit.open("r+") as handle:
        handle.truncate(0)


@pytest.mark.parametrize("rotate", [moved_and_sighup, moved, deleted, copied_and_truncated])
def test_rotation(tmp_path: Path, served: tuple[list[str], str], rotate: Callable[..., None]) -> None:
    options, base = served
    audit, rotated = tmp_path / "log" / "audit.jsonl", tmp_path / "log" / "audit.jsonl.1"
    with EgressdRun(options) as run:
        request(run, f"{base}/one", audit)
        rotate(audit, rotated, run)
        wait_until(audit.exists, "an audit file at its path again", timeout=10)
        request(run, f"{base}/two", audit)
    text = audit.read_text()
    assert "\0" not in text
    whole_lines(text)
    assert paths(audit_records(audit)) == ["/two"]
    assert (audit.stat().st_mode & 0o777) == 0o600
    if rotate is not deleted:
        assert paths(audit_records(rotated)) == ["/one"]


def test_exec_notices_the_move_by_itself(tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer) -> None:
    """`egressd exec` passes SIGHUP to its child: rotation is noticed by itself. The child moves
    the audit file away between two requests and waits for egressd to make a new one."""
    dns.add("up.test", upstream.host)
    audit = tmp_path / "audit.jsonl"
    base = f"http://up.test:{upstream.port}"
    script = (
        f'curl -sS -o /dev/null "{base}/one" && mv "{audit}" "{audit}.1" && '
        f'for i in $(seq 100); do [ -e "{audit}" ] && break; sleep 0.1; done && '
        f'curl -sS -o /dev/null "{base}/two"'
    )
    options = ["--policy", str(write_policy(tmp_path)), "--nameserver", dns.nameserver, "--audit", str(audit)]
    done = egressd_exec(options, ["sh", "-c", script])
    assert done.returncode == 0, done.stderr
    assert paths(audit_records(Path(f"{audit}.1"))) == ["/one"]
    assert paths(audit_records(audit)) == ["/two"]


def logrotate_example() -> str:
    """The logrotate configuration docs/audit.md shows, exactly."""
    found = re.search(
        r"```\n(" + re.escape(EXAMPLE_PATH) + r" \{\n.*?\n\})\n```", DOCS.read_text(), re.DOTALL
    )
    assert found is not None, "docs/audit.md has no logrotate example for " + EXAMPLE_PATH
    return found.group(1) + "\n"


def test_logrotate_example(tmp_path: Path, served: tuple[list[str], str]) -> None:
    """The docs' example run by the real logrotate, twice (the second compresses the first
    rotation): every request is on record exactly once, in the file of its time."""
    logrotate = shutil.which("logrotate") or "/usr/sbin/logrotate"
    options, base = served
    audit = tmp_path / "log" / "audit.jsonl"
    config = tmp_path / "logrotate.conf"
    config.write_text(logrotate_example().replace(EXAMPLE_PATH, str(audit)))
    state = tmp_path / "logrotate.state"

    def rotate() -> None:
        done = subprocess.run(
            [logrotate, "-s", str(state), "-f", str(config)], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr

    with EgressdRun(options) as run:
        request(run, f"{base}/one", audit)
        rotate()
        wait_until(audit.exists, "egressd's new audit file after the rotation", timeout=10)
        request(run, f"{base}/two", audit)
        rotate()
        wait_until(audit.exists, "egressd's new audit file after the second rotation", timeout=10)
        request(run, f"{base}/three", audit)
    with gzip.open(f"{audit}.2.gz", "rt") as oldest:
        first = oldest.read()
    whole_lines(first)
    assert paths(audit_records(Path(f"{audit}.1"))) == ["/two"]
    assert paths(audit_records(audit)) == ["/three"]
    assert "/one" in first and "/two" not in first
