"""The control API's small client: the answers it takes, and the ones that are not egressd's.

A server on a Unix socket of the test's own answers each request with fixed bytes, as aiohttp
frames the control API's answers (a head with Content-Length, then the close; a stream chunked) or
otherwise. Whatever the bytes, the client returns the answer the server meant or raises
ControlError: never another exception, never a different answer.
"""

from __future__ import annotations

import contextlib
import re
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.control.client import MAX_ANSWER, ControlClient, ControlError

Answer = bytes | list[bytes]  # a list: its parts written one by one, a moment apart


class _Server:
    """Answers every request on its socket with `answer`, then closes the connection."""

    def __init__(self, path: Path, answer: Answer) -> None:
        self.path = path
        self.answer = answer
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        self._sock.listen(4)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data and (chunk := conn.recv(4096)):
                    data += chunk
                for part in [self.answer] if isinstance(self.answer, bytes) else self.answer:
                    conn.sendall(part)
                    time.sleep(0.01)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._sock.close()
        self._thread.join(5)


@contextlib.contextmanager
def _answering(answer: Answer) -> Iterator[_Server]:
    with tempfile.TemporaryDirectory(prefix="egressd-ctl-") as directory:
        server = _Server(Path(directory) / "control.sock", answer)
        try:
            yield server
        finally:
            server.close()


def _call(server: _Server) -> object:
    return ControlClient(server.path, timeout=5).call("GET", "/v1/info")


@pytest.mark.parametrize(
    ("answer", "json"),
    [
        (b'HTTP/1.1 200 OK\r\nContent-Length: 11\r\nConnection: close\r\n\r\n{"a": true}', {"a": True}),
        (b'HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{"b": 1}', {"b": 1}),  # up to the close
        (b'HTTP/1.0 200 OK\r\n\r\n{"c": 2}', {"c": 2}),
        (b"HTTP/1.1 204 No Content\r\n\r\n", {}),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", {}),
        (
            [b"HTTP/1.1 20", b"0 OK\r\nContent-Len", b"gth: 8\r\n\r", b'\n{"d"', b": 3}"],
            {"d": 3},
        ),  # split anywhere: the same answer
    ],
    ids=["content-length", "close-delimited", "http-1.0", "no-content", "after-100", "split"],
)
def test_answers_of_the_control_api(answer: Answer, json: object) -> None:
    with _answering(answer) as server:
        assert _call(server) == json


_HEAD = b"HTTP/1.1 200 OK\r\n"


@pytest.mark.parametrize(
    "answer",
    [
        _HEAD + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",  # not how it answers a request
        _HEAD + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        _HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",  # a malformed chunk
        b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
        _HEAD,  # closed inside the head
        b"",
        b"HTTP/1.1 200 OK",  # no line end
        b"HTTP/2 200\r\n\r\n{}",
        b"HTTP/1.1 2000 OK\r\nContent-Length: 2\r\n\r\n{}",
        b"HTTP/1.1 OK 200\r\nContent-Length: 2\r\n\r\n{}",
        _HEAD + b"Content-Length 2\r\n\r\n{}",  # a field line without its colon
        _HEAD + b"Content-Length: 2\r\n folded\r\n\r\n{}",
        _HEAD + b"X: a\x00b\r\nContent-Length: 2\r\n\r\n{}",
        _HEAD + b"Content-Length: abc\r\n\r\n{}",
        _HEAD + b"Content-Length: -2\r\n\r\n{}",
        _HEAD + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}x",
        _HEAD + b'Content-Length: 40\r\n\r\n{"a": 1}',  # a lying length: cut short by the close
        _HEAD + b'Content-Length: 2\r\n\r\n{}{"a": 1}',  # a lying length: more than it said
        _HEAD + b"Content-Length: 2\r\n\r\n{}HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",  # two answers
        _HEAD + b"X: " + b"a" * (200 * 1024) + b"\r\n\r\n",  # a head far over 64 KiB
        _HEAD + b"Content-Length: %d\r\n\r\n" % (MAX_ANSWER + 1) + b" " * (MAX_ANSWER + 1),
        _HEAD + b"\r\n" + b" " * (MAX_ANSWER + 1),  # oversize, up to the close
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n",
    ],
    ids=lambda answer: repr(answer[:60]),
)
def test_anything_else_is_not_the_control_api(answer: bytes) -> None:
    with _answering(answer) as server, pytest.raises(ControlError, match="cannot reach egressd"):
        _call(server)


@pytest.mark.parametrize(
    "answer",
    [
        _HEAD + b'Content-Length: 5\r\n\r\n{"a":',  # the length is kept, and that is no JSON
        _HEAD + b"Content-Length: 5\r\n\r\n<html",
        b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 5\r\n\r\nnope!",
    ],
)
def test_an_answer_that_is_no_json_is_an_error(answer: bytes) -> None:
    with _answering(answer) as server, pytest.raises(ControlError, match="answered no JSON"):
        _call(server)


def test_an_error_answer_carries_the_servers_message_and_status() -> None:
    body = b'{"error": "no such child"}'
    answer = b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    with _answering(answer) as server, pytest.raises(ControlError, match="no such child") as caught:
        ControlClient(server.path, timeout=5).call("DELETE", "/v1/children/c9")
    assert caught.value.status == 404


def _chunked(*chunks: bytes, last: bytes = b"0\r\n\r\n") -> list[bytes]:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"
    return [head, *(b"%x\r\n%s\r\n" % (len(chunk), chunk) for chunk in chunks), last]


def _stream(server: _Server) -> list[dict[str, object]]:
    return list(ControlClient(server.path).stream("/v1/events"))


def test_a_stream_s_lines_are_read_across_chunks() -> None:
    answer = _chunked(b'{"a": 1}\n{"b"', b': 2}\nnot json\n[1]\n{"c":', b" 3}")
    with _answering(answer) as server:
        assert _stream(server) == [{"a": 1}, {"b": 2}, {"c": 3}]
    with _answering(b'HTTP/1.0 200 OK\r\n\r\n{"d": 4}\n') as server:  # up to the close
        assert _stream(server) == [{"d": 4}]


@pytest.mark.parametrize(
    "answer",
    [
        _chunked(b'{"a": 1}\n', last=b"zz\r\n"),  # a malformed chunk
        _chunked(b'{"a": 1}\n', last=b""),  # closed before its last chunk
        _chunked(b'{"a": 1}\n', last=b"10\r\nshort"),  # closed inside a chunk
        [b"HTTP/1.1 200 OK\r\nContent-Length: 40\r\n\r\n", b'{"a": 1}\n'],  # a lying length
    ],
)
def test_a_broken_stream_is_an_error_after_its_whole_lines(answer: list[bytes]) -> None:
    with _answering(answer) as server:
        items = ControlClient(server.path).stream("/v1/events")
        assert next(items) == {"a": 1}
        with pytest.raises(ControlError, match="lost egressd"):
            next(items)


@pytest.mark.parametrize(
    "answer",
    [b"HTTP/1.1 403 Forbidden\r\nContent-Length: 2\r\n\r\n{}", b"SSH-2.0-OpenSSH_9.6\r\n\r\n", b""],
)
def test_a_stream_that_is_refused_or_not_http_is_an_error(answer: bytes) -> None:
    with _answering(answer) as server, pytest.raises(ControlError):
        _stream(server)


def test_a_stream_line_over_the_bound_is_an_error() -> None:
    chunk = b"x" * (1024 * 1024)
    with _answering(_chunked(*[chunk] * 17)) as server, pytest.raises(ControlError, match="a line over"):
        _stream(server)


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    with _answering(b"") as server:
        yield server


_ANSWERS = st.one_of(
    st.binary(max_size=200),
    st.builds(
        lambda status, fields, body: b"HTTP/1.1 %s\r\n%s\r\n%s" % (status, fields, body),
        st.sampled_from([b"200 OK", b"404 Not Found", b"100 Continue", b"200", b"999 X", b"20 OK"]),
        st.lists(
            st.sampled_from(
                [
                    b"Content-Length: 2",
                    b"Content-Length: 9",
                    b"Transfer-Encoding: chunked",
                    b"X:\x01",
                    b"Connection: close",
                ]
            ),
            max_size=3,
        ).map(lambda lines: b"".join(line + b"\r\n" for line in lines)),
        st.sampled_from([b"{}", b'{"error": "x"}', b"2\r\n{}\r\n0\r\n\r\n", b"[1]", b""]),
    ),
)


@settings(max_examples=150, deadline=None)
@given(answer=_ANSWERS)
def test_any_answer_is_json_or_a_control_error(server: _Server, answer: bytes) -> None:
    server.answer = answer
    try:
        _call(server)
    except ControlError:
        return
    assert re.match(rb"HTTP/[0-9]\.[0-9] [23][0-9][0-9]", answer), answer  # a status of no error
