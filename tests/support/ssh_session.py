"""Shared parts of the `egressd ssh` tests: the remote probe, a running client, waiting.

Used by the test modules that run a real sshd (tests/test_ssh_*.py, whose fixtures are in
ssh_fixtures.py); see ssh_lab.py for the topology.
"""

from __future__ import annotations

import json
import queue
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tests.support import ssh_lab
from tests.support.ssh_lab import PROBE
from tests.support.upstreams import EchoHTTPServer

# up.test and the internet namespace's addresses allowed, denied.test refused by name
POLICY = f"""\
version: 1
mode: enforce
allow:
  - up.test
  - {ssh_lab.INTERNET_NET}
deny:
  - denied.test
"""


def probe(*requests: str, python: str = "python3") -> list[str]:
    """The remote python3 probe (see ssh_lab.PROBE) as a command."""
    return [python, "-c", PROBE, *requests]


def results(stdout: bytes) -> dict[str, dict[str, Any]]:
    out = {}
    for line in stdout.decode().splitlines():
        if line.startswith("{"):
            item = json.loads(line)
            out[item["name"]] = item
    return out


def peers(server: EchoHTTPServer) -> set[str]:
    return {request["peer"][0] for request in server.requests}


class Running:
    """`egressd ssh` in the background, its stdout read line by line and stderr collected."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        self._lines: queue.Queue[bytes] = queue.Queue()
        self._stderr: list[bytes] = []
        self._readers = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)

    @property
    def stderr(self) -> str:
        return b"".join(self._stderr).decode(errors="replace")

    def line(self, timeout: float = 30) -> str:
        try:
            return self._lines.get(timeout=timeout).decode()
        except queue.Empty:
            raise AssertionError(f"no output line within {timeout}s; stderr: {self.stderr}") from None

    def wait_stderr(self, text: str, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.stderr:
            assert time.monotonic() < deadline, f"{text!r} not on stderr: {self.stderr}"
            time.sleep(0.05)

    def send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def finish(self, timeout: float = 30) -> int:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def __enter__(self) -> Running:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for reader in self._readers:
            reader.join(5)  # at the end of output (what the client started may hold it a while)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None and not any(reader.is_alive() for reader in self._readers):
                stream.close()


def sleepers(tag: str) -> list[int]:
    return [pid for pid, line in ssh_lab.all_cmdlines() if line == f"sleep {tag}"]


def listening(port: int) -> bool:
    """Something accepts on 127.0.0.1:port, in the calling thread's network namespace."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


def wait_for(condition: Callable[[], object], what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
