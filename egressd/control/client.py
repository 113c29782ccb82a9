"""A small synchronous client of the control API (the CLI's `ps`, `pending`, `approve`, ...).

No event loop and no aiohttp import, so a command answers in the time Python takes to start. The
answers are read by h11's client role, the one HTTP parser of egressd's own clients: `call` takes an
answer whole (the control API sends each with a Content-Length), `stream` the chunked lines of a
stream as they come. A malformed, truncated or oversize answer is a ControlError.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h11

from egressd.control import paths

MAX_HEAD = 64 * 1024
MAX_ANSWER = 16 * 1024 * 1024  # a control answer (or a stream's line) larger than this is not egressd's


class ControlError(Exception):
    """The instance could not be reached, or refused the request; the message says why."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class _NotControl(Exception):
    """The answer is not one egressd's control API sends."""


_FAILURES = (OSError, h11.ProtocolError, _NotControl)


def _why(exc: BaseException) -> object:
    return getattr(exc, "strerror", None) or exc


def _connect(path: Path, timeout: float | None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        raise
    return sock


class _Exchange:
    """One request with `Connection: close` on its own connection, and its answer's h11 events."""

    def __init__(self, path: Path, timeout: float | None, method: str, url: str, data: bytes | None) -> None:
        self._h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        headers = [("Host", "egressd"), ("Connection", "close")]
        if data is not None:
            headers += [("Content-Type", "application/json"), ("Content-Length", str(len(data)))]
        out = self._h11.send(h11.Request(method=method, target=url, headers=headers))
        out += self._h11.send(h11.Data(data=data)) if data else b""
        out += self._h11.send(h11.EndOfMessage())
        self.sock = _connect(path, timeout)
        try:
            self.sock.sendall(out)
        except OSError:
            self.sock.close()
            raise

    def response(self) -> h11.Response:
        """The answer's head (1xx answers skipped)."""
        while True:
            event = self._next()
            if isinstance(event, h11.Response):
                return event
            if not isinstance(event, h11.InformationalResponse):
                raise _NotControl("no answer")

    def body(self) -> Iterator[bytes]:
        """The answer's body as it comes, up to its end."""
        while isinstance(event := self._next(), h11.Data):
            yield bytes(event.data)

    def whole(self) -> tuple[int, bytes]:
        """(status, body) of an answer sent whole (a Content-Length, or up to the close), bounded, and
        up to the server's close: after the answer to `Connection: close` there is nothing."""
        response = self.response()
        if any(name == b"transfer-encoding" for name, _ in response.headers):
            raise _NotControl("not an answer of egressd's control API")  # it sends every answer whole
        body = bytearray()
        for data in self.body():
            body += data
            if len(body) > MAX_ANSWER:
                raise _NotControl(f"an answer over {MAX_ANSWER} bytes")
        if not isinstance(self._next(), h11.ConnectionClosed):
            raise _NotControl("more than one answer")
        return response.status_code, bytes(body)

    def _next(self) -> h11.Event:
        while (event := self._h11.next_event()) is h11.NEED_DATA:
            self._h11.receive_data(self.sock.recv(65536))
        return event  # type: ignore[return-value]  # not PAUSED: no CONNECT, no Upgrade is sent


class ControlClient:
    def __init__(self, path: Path, timeout: float = 10.0) -> None:
        self.path = path
        self.timeout = timeout

    def call(self, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
        """One request; the JSON answer, or ControlError with the server's message."""
        data = json.dumps(body).encode() if body is not None else None
        try:
            exchange = _Exchange(self.path, self.timeout, method, url, data)
            try:
                status, raw = exchange.whole()
            finally:
                exchange.sock.close()
        except _FAILURES as exc:
            raise ControlError(f"cannot reach egressd at {self.path}: {_why(exc)}") from exc
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
        try:
            exchange = _Exchange(self.path, None, "GET", url, None)
        except _FAILURES as exc:
            raise ControlError(f"cannot reach egressd at {self.path}: {_why(exc)}") from exc
        try:
            response = exchange.response()
            if response.status_code >= 400:
                raise ControlError(f"HTTP {response.status_code}", response.status_code)
            pending = b""
            for data in exchange.body():
                *lines, pending = (pending + data).split(b"\n")
                if len(pending) > MAX_ANSWER:
                    raise _NotControl(f"a line over {MAX_ANSWER} bytes")
                yield from _objects(lines)
            yield from _objects([pending])
        except _FAILURES as exc:
            raise ControlError(f"lost egressd at {self.path}: {_why(exc)}") from exc
        finally:
            exchange.sock.close()


def _objects(lines: list[bytes]) -> Iterator[dict[str, Any]]:
    """The lines that are JSON objects (a stream's other lines are not for this client)."""
    for line in lines:
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict):
            yield item


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
