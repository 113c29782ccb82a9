"""The control API's small client (`call`): the answers it takes, and the ones that are not egressd's.

A server on a Unix socket of the test's own answers each request with fixed bytes, as aiohttp
frames the control API's answers (a head with Content-Length, then the close) or otherwise.
"""

from __future__ import annotations

import contextlib
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressd.control.client import ControlClient, ControlError


@contextlib.contextmanager
def _answering(answer: bytes) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="egressd-ctl-") as directory:
        path = Path(directory) / "control.sock"
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(path))
        server.listen(4)

        def serve() -> None:
            with contextlib.suppress(OSError):
                while True:
                    conn, _ = server.accept()
                    with conn:
                        conn.settimeout(5)
                        data = b""
                        while b"\r\n\r\n" not in data and (chunk := conn.recv(4096)):
                            data += chunk
                        conn.sendall(answer)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            yield path
        finally:
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_RDWR)  # wakes the accept
            server.close()
            thread.join(5)


@pytest.mark.parametrize(
    ("answer", "json"),
    [
        (b'HTTP/1.1 200 OK\r\nContent-Length: 11\r\nConnection: close\r\n\r\n{"a": true}', {"a": True}),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}trailing", {}),  # the length, not the close
        (b'HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{"b": 1}', {"b": 1}),  # up to the close
    ],
)
def test_answers_of_the_control_api(answer: bytes, json: object) -> None:
    with _answering(answer) as path:
        assert ControlClient(path, timeout=5).call("GET", "/v1/info") == json


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",  # not how it answers
        b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n",  # closed inside the head
        b"",
    ],
)
def test_anything_else_is_not_the_control_api(answer: bytes) -> None:
    with _answering(answer) as path, pytest.raises(ControlError, match="cannot reach egressd"):
        ControlClient(path, timeout=5).call("GET", "/v1/info")


def test_an_error_answer_carries_the_servers_message_and_status() -> None:
    body = b'{"error": "no such child"}'
    answer = b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    with _answering(answer) as path, pytest.raises(ControlError, match="no such child") as caught:
        ControlClient(path, timeout=5).call("DELETE", "/v1/children/c9")
    assert caught.value.status == 404
