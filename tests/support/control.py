"""Helpers for the control-API and ask-mode tests: the policy, the CLI, a scripted approver.

Why: ask mode is proved through the real commands — `egressd run`/`exec`, a real client, a real
upstream on 127.0.0.1 — and the approver is the real CLI (`egressd pending --follow`, `egressd
approve`), the way a script or another UI would drive it.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.egressd_cli import EGRESSD

ASK_POLICY = """\
version: 1
# the human loop under test: a comment the "always" answers must keep
mode: ask
ask_timeout: {timeout}
allow:
  - allowed.test   # listed up front
deny:
  - denied.test
private:
  allow: true   # the test upstream listens on 127.0.0.1
"""


def ask_policy(directory: Path, *, timeout: float = 30, mode: str = "ask", private: bool = True) -> Path:
    text = ASK_POLICY.format(timeout=timeout).replace("mode: ask", f"mode: {mode}")
    if not private:
        text = text.replace("allow: true   # the test", "allow: false   # the test")
    path = directory / "policy.yaml"
    path.write_text(text)
    return path


def cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """One control command (`ps`, `pending`, `approve`, ...) as a user types it."""
    return subprocess.run([*EGRESSD, *args], capture_output=True, text=True, timeout=timeout)


def cli_json(*args: str) -> Any:
    result = cli(*args)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def ps_rows() -> list[dict[str, Any]]:
    """`egressd ps --json`: one JSON array, an object per running instance."""
    result = cli("ps", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert isinstance(rows, list), result.stdout
    return rows


def approver_attached() -> bool:
    """The one running egressd has an approver that can answer now (a follower, an open page)."""
    rows = ps_rows()
    return bool(rows) and rows[0]["approvers"]["can_answer"]


def wait_for(check: Callable[[], Any], timeout: float = 20, what: str = "condition") -> Any:
    """Poll `check` until it answers something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class Follower:
    """`egressd pending --follow --json` in the background: an attached approver whose asks
    the test reads (and answers with `egressd approve`/`deny`)."""

    def __init__(self, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [*EGRESSD, "pending", "--follow", "--json", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._lock:
                self.events.append(json.loads(line))

    def of(self, event: str) -> list[dict[str, Any]]:
        """The events of one kind heard so far."""
        with self._lock:
            return [e for e in self.events if e.get("event") == event]

    def asks(self) -> list[dict[str, Any]]:
        return self.of("ask")

    def next_ask(self, seen: int = 0, timeout: float = 20) -> dict[str, Any]:
        return wait_for(lambda: self.asks()[seen] if len(self.asks()) > seen else None, timeout, "an ask")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Terminal:
    """A command run in a new session whose controlling terminal is a pty (its stdin), with stdout
    and stderr on pipes: what a person at egressd's terminal sees (`/dev/tty`) is read from the pty
    master, and what they type is written there."""

    def __init__(self, command: list[str]) -> None:
        import pty

        self.master, self._slave = pty.openpty()
        # setsid --ctty makes its stdin (the pty) the controlling terminal; egressd's stdio are pipes
        self.proc = subprocess.Popen(
            ["setsid", "--ctty", "sh", "-c", 'exec "$@" </dev/null', "sh", *command],
            stdin=self._slave,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.seen = b""  # the slave stays open here too: the master reads no EIO before egressd opens it

    def read_until(self, text: bytes, timeout: float = 30) -> bytes:
        """Everything shown since the last call, once it contains `text`."""
        import os
        import select

        start = len(self.seen)
        deadline = time.monotonic() + timeout
        while text not in self.seen[start:]:
            assert time.monotonic() < deadline, self.seen[start:]
            ready, _, _ = select.select([self.master], [], [], 0.5)
            if ready:
                self.seen += os.read(self.master, 4096)
        return self.seen[start:]

    def type(self, line: str) -> None:
        import os

        os.write(self.master, line.encode() + b"\n")

    def finish(self, timeout: float = 40) -> tuple[bytes, bytes]:
        """The command's (stdout, stderr) once it exits."""
        return self.proc.communicate(timeout=timeout)

    def close(self) -> None:
        import os

        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)
        os.close(self._slave)

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
