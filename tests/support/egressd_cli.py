"""Run the real `egressd` command line in tests: `exec` around a client, or `run` as a proxy.

Why: the integration tests prove what a user gets, so they go through the console entry point
(`python -m egressd`) exactly as a user would, never through the engine's internals.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

EGRESSD = [sys.executable, "-m", "egressd"]

TEST_POLICY = """\
version: 1
mode: enforce
allow:
  - up.test
  - other.test
  - 198.51.100.0/24
  - 2001:db8::/32
deny:
  - denied.test
"""


def write_policy(directory: Path, text: str = TEST_POLICY, name: str = "policy.yaml") -> Path:
    path = directory / name
    path.write_text(text)
    return path


def egressd_exec(
    options: Sequence[str],
    command: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 60,
    input: bytes | None = None,  # noqa: A002 - mirrors subprocess.run
) -> subprocess.CompletedProcess[bytes]:
    """`egressd exec OPTIONS -- COMMAND`, capturing stdout and stderr as bytes."""
    return subprocess.run(
        [*EGRESSD, "exec", *options, "--", *command],
        env=env if env is not None else dict(os.environ),
        input=input,
        capture_output=True,
        timeout=timeout,
    )


class EgressdRun:
    """`egressd run` in the background; `env` holds the export lines it printed. `wrapper`: a
    command that runs it (`prlimit --nofile=256:256 --`)."""

    def __init__(self, options: Sequence[str], wrapper: Sequence[str] = ()) -> None:
        self.options = list(options)
        self.wrapper = list(wrapper)
        self.proc: subprocess.Popen[str] | None = None
        self.env: dict[str, str] = {}
        self._stderr: list[str] = []
        self._stderr_thread: threading.Thread | None = None

    def start(self, timeout: float = 30) -> Self:
        self._spawn()
        assert self.proc is not None and self.proc.stdout is not None
        # `egressd run` closes its stdout after the export lines: read them all, up to EOF
        timer = threading.Timer(timeout, self.proc.kill)
        timer.start()
        try:
            for line in self.proc.stdout:
                self._parse_export(line)
        finally:
            timer.cancel()
        if "HTTP_PROXY" not in self.env:
            raise RuntimeError(f"egressd run printed no proxy settings; stderr: {self.stderr}")
        return self

    def _spawn(self) -> None:
        self.proc = subprocess.Popen(
            [*self.wrapper, *EGRESSD, "run", *self.options],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._stderr_thread = threading.Thread(target=self._read_stderr, daemon=True)
        self._stderr_thread.start()

    def _parse_export(self, line: str) -> None:
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            key, _, value = words[1].partition("=")
            self.env[key] = value

    def _read_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    @property
    def proxy_url(self) -> str:
        return self.env["HTTP_PROXY"]

    def child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env)
        return env

    def wait_for_stderr(self, text: str, timeout: float = 10) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.stderr:
                return True
            time.sleep(0.05)
        return False

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def stop(self, timeout: float = 20) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class GatewayRun(EgressdRun):
    """`egressd run --gateway` in the background: it prints nothing on stdout; `address` is where
    its stderr says it listens."""

    LISTENING = re.compile(r"gateway listening on (https?)://\[?([0-9a-fA-F.:]+)\]?:(\d+)")
    scheme = "http"

    def start(self, timeout: float = 30) -> Self:
        self._spawn()
        assert self.proc is not None and self.proc.stdout is not None
        assert self.proc.stdout.read() == "", "the gateway printed something on stdout"
        deadline = time.monotonic() + timeout
        while (found := self.LISTENING.search(self.stderr)) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"egressd run --gateway did not start; stderr: {self.stderr}")
            time.sleep(0.05)
        self.scheme, self.address = found.group(1), (found.group(2), int(found.group(3)))
        return self

    def url_for(self, name: str, token: str) -> str:
        host, port = self.address
        return f"{self.scheme}://{name}:{token}@{host}:{port}"
