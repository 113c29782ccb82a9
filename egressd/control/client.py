"""A small synchronous client of the control API (the CLI's `ps`, `pending`, `approve`, ...).

http.client over the Unix socket: no event loop and no aiohttp import, so a command answers in the
time Python takes to start.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from egressd.control import paths


class ControlError(Exception):
    """The instance could not be reached, or refused the request; the message says why."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float | None) -> None:
        super().__init__("egressd", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(str(self.unix_path))
        except OSError:
            sock.close()
            raise
        self.sock = sock


class ControlClient:
    def __init__(self, path: Path, timeout: float = 10.0) -> None:
        self.path = path
        self.timeout = timeout

    def call(self, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
        """One request; the JSON answer, or ControlError with the server's message."""
        conn = _UnixConnection(self.path, self.timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, url, body=data, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        except OSError as exc:
            raise ControlError(f"cannot reach egressd at {self.path}: {exc.strerror or exc}") from exc
        finally:
            conn.close()
        try:
            answer = json.loads(raw) if raw else {}
        except ValueError as exc:
            raise ControlError(f"egressd at {self.path} answered no JSON", response.status) from exc
        if response.status >= 400:
            message = answer.get("error") if isinstance(answer, dict) else None
            raise ControlError(message or f"HTTP {response.status}", response.status)
        return answer

    def stream(self, url: str) -> Iterator[dict[str, Any]]:
        """The lines of a newline-delimited JSON stream, until egressd closes it."""
        conn = _UnixConnection(self.path, None)
        try:
            conn.request("GET", url)
            response = conn.getresponse()
            if response.status >= 400:
                raise ControlError(f"HTTP {response.status}", response.status)
            while True:
                line = response.readline()
                if not line:
                    return
                try:
                    item = json.loads(line)
                except ValueError:
                    continue
                if isinstance(item, dict):
                    yield item
        except OSError as exc:
            raise ControlError(f"lost egressd at {self.path}: {exc.strerror or exc}") from exc
        finally:
            conn.close()


def find_instances(directory: Path | None = None) -> tuple[Path, list[paths.Found]]:
    """(the run directory, the live instances in it); ControlError if it is unsafe to use."""
    directory = paths.run_dir() if directory is None else directory
    if not directory.exists():
        return directory, []
    try:
        paths.check_run_dir(directory)
    except paths.RunDirError as exc:
        raise ControlError(f"not using the run directory: {exc}") from exc
    return directory, paths.instances(directory)
