"""Helpers that several test modules use (so none imports another), from the tests of: Plain HTTP in
egressd's front (egressd.front.plain_http) with real clients and a real scripted server."""

from __future__ import annotations

import base64
import json
import socket
import threading
import time

from tests.support.egressd_cli import EgressdRun

POLICY = """\
version: 1
mode: enforce
allow: [up.test]
deny: [denied.test]
"""


OK = b"HTTP/1.1 200 OK\r\n"


CHUNKED = OK + b"Transfer-Encoding: chunked\r\n\r\n"


CANNED = {
    b"/chunked": CHUNKED + b"5;x=1\r\nhello\r\n6\r\n world\r\n0\r\nT: 1\r\n\r\n",
    b"/bad-chunked": CHUNKED + b"5\r\nhelloXX6\r\n world\r\n0\r\n\r\n",
    b"/eof": OK + b"\r\n" + b"x" * 3000,
    b"/big": OK + b"Content-Length: 5000\r\n\r\n" + b"y" * 5000,
    b"/204": b"HTTP/1.1 204 No Content\r\n\r\n",
    b"/304": b"HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\n\r\n",
    b"/interim": b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK + b"Content-Length: 2\r\n\r\nok",
    b"/forged": OK + b"X-Egressd-Reason: forged\r\nProxy-Status: x\r\nContent-Length: 2\r\n\r\nok",
}


class ScriptedServer:
    """HTTP/1.1 on 127.0.0.1: answers by path, records request heads and bodies, counts connections."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []  # (head, body)
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                    if name.strip().lower() == b"transfer-encoding":  # raw chunks kept as the body
                        while b"0\r\n\r\n" not in buf:
                            buf += conn.recv(65536)
                        length = buf.index(b"0\r\n\r\n") + 5
                while len(buf) < length:
                    buf += conn.recv(65536)
                body, buf = buf[:length], buf[length:]
                with self._lock:
                    self.requests.append((head, body))
                if not self._answer(conn, head, body):
                    return

    def _answer(self, conn: socket.socket, head: bytes, body: bytes) -> bool:
        """Send the scripted response; False when the connection ends with it."""
        method, path = head.split(b" ")[:2]
        if path in CANNED:
            conn.sendall(CANNED[path])
            if path in (b"/bad-chunked", b"/eof"):
                time.sleep(0.5)
                return False
        elif path.startswith(b"/redirect"):
            target = path.split(b"to=")[1]
            conn.sendall(b"HTTP/1.1 302 Found\r\nLocation: " + target + b"\r\nContent-Length: 0\r\n\r\n")
        else:
            payload = json.dumps({"method": method.decode(), "path": path.decode(), "body": body.decode()})
            data = b"" if method == b"HEAD" else payload.encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), data))
        return True

    def heads(self) -> list[str]:
        return [h.decode() for h, _ in self.requests]

    def close(self) -> None:
        self.sock.close()


def _auth(run: EgressdRun) -> tuple[str, int, str]:
    url = run.proxy_url.removeprefix("http://")
    userinfo, _, hostport = url.rpartition("@")
    host, _, port = hostport.rpartition(":")
    return host, int(port), "Basic " + base64.b64encode(userinfo.encode()).decode()


class RawClient:
    """A raw socket to egressd's proxy port: send exact bytes, read exact responses."""

    def __init__(self, run: EgressdRun) -> None:
        host, port, self.auth = _auth(run)
        self.sock = socket.create_connection((host, port), timeout=10)
        self.buf = b""

    def get(self, url: str, *headers: str, method: str = "GET", body: bytes = b"") -> bytes:
        return self.request(url, *headers, method=method, body=body)

    def request_bytes(self, url: str, *headers: str, method: str = "GET", body: bytes = b"") -> bytes:
        host = url.split("/")[2]
        lines = [f"{method} {url} HTTP/1.1", f"Host: {host}", f"Proxy-Authorization: {self.auth}", *headers]
        if body:
            lines.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body

    def request(self, url: str, *headers: str, method: str = "GET", body: bytes = b"") -> bytes:
        self.sock.sendall(self.request_bytes(url, *headers, method=method, body=body))
        return self.response(head_only=method == "HEAD")

    def response(self, head_only: bool = False) -> bytes:
        while b"\r\n\r\n" not in self.buf:
            self._recv()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        head += b"\r\n\r\n"
        if head.startswith(b"HTTP/1.1 1"):
            return head + self.response(head_only)
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        if head_only or b" 204 " in head or b" 304 " in head:
            length = 0
        while len(self.buf) < length:
            self._recv()
        body, self.buf = self.buf[:length], self.buf[length:]
        return head + body

    def _recv(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError(f"closed; got {self.buf[:300]!r}")
        self.buf += data

    def rest(self) -> bytes:
        """Everything until the proxy closes the connection."""
        while True:
            try:
                data = self.sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                return self.buf
            if not data:
                return self.buf
            self.buf += data


def _url(server: ScriptedServer, path: str, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{server.port}{path}"


