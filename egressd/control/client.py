"""A small synchronous client of the control API (the CLI's `ps`, `pending`, `approve`, ...).

No event loop and no aiohttp import, so a command answers in the time Python takes to start. One
request (`call`) is written and read on the Unix socket directly: `egressd exec --attach` makes one
per child it starts, and neither http.client (email, ssl) nor h11 (typing) may load on that path
(tests/e2e/test_attach.py checks it). The control API answers a request whole, with a Content-Length
and `Connection: close`, so the answer is its head and the bytes up to the close; anything else is
not the control API. The streams (`stream`) use http.client.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

from egressd.control import paths

TYPE_CHECKING = False  # not typing's: `exec --attach` imports this module and not typing
if TYPE_CHECKING:
    import http.client
    from typing import Any

MAX_ANSWER = 16 * 1024 * 1024  # a control answer larger than this is not egressd's


class ControlError(Exception):
    """The instance could not be reached, or refused the request; the message says why."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def _unix_connection(path: Path, timeout: float | None) -> http.client.HTTPConnection:
    import http.client

    class UnixConnection(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = _connect(path, self.timeout)

    return UnixConnection("egressd", timeout=timeout)


def _connect(path: Path, timeout: float | None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        raise
    return sock


def _exchange(path: Path, timeout: float, method: str, url: str, data: bytes | None) -> tuple[int, bytes]:
    """One HTTP/1.1 request with `Connection: close`; (status, body) read up to the server's close."""
    head = [f"{method} {url} HTTP/1.1", "Host: egressd", "Connection: close"]
    if data is not None:
        head += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
    sock = _connect(path, timeout)
    try:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode("ascii") + (data or b""))
        chunks, size = [], 0
        while chunk := sock.recv(65536):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_ANSWER:
                raise OSError(f"an answer over {MAX_ANSWER} bytes")
    finally:
        sock.close()
    raw = b"".join(chunks)
    header, sep, body = raw.partition(b"\r\n\r\n")
    lines = header.decode("latin-1").split("\r\n")
    status = lines[0].split(" ", 2)
    if not sep or len(status) < 2 or not status[0].startswith("HTTP/1.") or not status[1].isdigit():
        raise OSError("not an HTTP answer")
    fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if "transfer-encoding" in fields:  # the control API sends every answer to a request whole
        raise OSError("not an answer of egressd's control API")
    if fields.get("content-length", "").isdigit():
        body = body[: int(fields["content-length"])]
    return int(status[1]), body


class ControlClient:
    def __init__(self, path: Path, timeout: float = 10.0) -> None:
        self.path = path
        self.timeout = timeout

    def call(self, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
        """One request; the JSON answer, or ControlError with the server's message."""
        data = json.dumps(body).encode() if body is not None else None
        try:
            status, raw = _exchange(self.path, self.timeout, method, url, data)
        except (OSError, ValueError) as exc:
            why = getattr(exc, "strerror", None) or exc
            raise ControlError(f"cannot reach egressd at {self.path}: {why}") from exc
        try:
            answer = json.loads(raw) if raw else {}
        except ValueError as exc:
            raise ControlError(f"egressd at {self.path} answered no JSON", status) from exc
        if status >= 400:
            message = answer.get("error") if isinstance(answer, dict) else None
            raise ControlError(message or f"HTTP {status}", status)
        return answer

    def stream(self, url: str) -> Iterator[dict[str, Any]]:
        """The lines of a newline-delimited JSON stream, until egressd closes it."""
        conn = _unix_connection(self.path, None)
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
