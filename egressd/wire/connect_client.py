"""The client side of one CONNECT through egressd's proxy, sans-I/O on h11's client role.

egressd opens tunnels through a proxy: its own, where a program cannot (the SSH ProxyCommand,
`egressd.child.connect`; the sandbox's capture of clients that ignore the proxy, `sandbox/intercept.py`),
and a parent proxy it is told to go through (`net/parent_proxy.py`).
Both need the same two things: the request, and where the proxy's answer ends — a `200`'s head,
after which every byte is the tunnel's, or a refusal with its reason and text. h11 frames the
answer, so a body or a head split across reads is read the same way the front writes it.
"""

from __future__ import annotations

import base64

import h11

MAX_HEAD = 64 * 1024
MAX_BODY = 16 * 1024  # of a refusal's text: enough for egressd's explanation


class AnswerError(Exception):
    """The proxy's answer is not HTTP, or too long."""


def authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def basic(user: str, password: str) -> str:
    """A `Proxy-Authorization` value for these credentials."""
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")


class ConnectClient:
    """One CONNECT: `request` to send, then `feed` the proxy's bytes until it answers True."""

    def __init__(self, host: str, port: int, authorization: str | None = None) -> None:
        self._h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        target = authority(host, port)
        headers = [("Host", target)]
        if authorization is not None:
            headers.append(("Proxy-Authorization", authorization))
        self.request = self._h11.send(h11.Request(method="CONNECT", target=target, headers=headers))
        self._h11.send(h11.EndOfMessage())
        self.status = 0  # the answer's status once its head was read
        self.reason = ""
        self.status_line = ""
        self.headers: dict[str, str] = {}
        self.body = bytearray()  # a refusal's text (at most MAX_BODY)
        self.tunnel = b""  # what followed a 200's head: the tunnel's first bytes
        self.done = False

    @property
    def admitted(self) -> bool:
        return self.done and self.status == 200

    def feed(self, data: bytes) -> bool:
        """The proxy's next bytes (b"" when it closed); True once the answer is complete: a
        2xx's head, or a refusal's body (up to MAX_BODY, or as far as the proxy sent it)."""
        if self.done:
            return True
        self._h11.receive_data(data)
        try:
            while not self.done:
                event = self._h11.next_event()
                if event is h11.NEED_DATA:
                    if not data:  # closed before the answer was whole
                        if not self.status:
                            raise AnswerError("the proxy closed the connection without answering")
                        self.done = True
                    break
                if event is h11.PAUSED:  # a 2xx to CONNECT: the rest is the tunnel's
                    self.tunnel = self._h11.trailing_data[0]
                    self.done = True
                elif isinstance(event, h11.Response):
                    self._head(event)
                elif isinstance(event, h11.Data):
                    self.body += event.data[: MAX_BODY - len(self.body)]
                    self.done = len(self.body) >= MAX_BODY
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    self.done = True
        except h11.RemoteProtocolError as exc:
            if self.status:  # cut short in a refusal's text: what came of it is the answer
                self.done = True
            elif not data:
                raise AnswerError("the proxy closed the connection without answering") from None
            else:
                raise AnswerError(f"not an HTTP answer: {exc}") from None
        return self.done

    def _head(self, response: h11.Response) -> None:
        self.status = response.status_code
        self.reason = response.reason.decode("latin-1")
        self.status_line = f"HTTP/{response.http_version.decode()} {self.status} {self.reason}".rstrip()
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in response.headers}

    def refusal(self) -> str:
        """What the proxy said, for a person: its status line, egressd's reason and its text."""
        reason = self.headers.get("x-egressd-reason")
        text = f"the proxy answered: {self.status_line}" + (f" (reason: {reason})" if reason else "")
        detail = bytes(self.body).decode("utf-8", "replace").strip()
        return text + (f"\n{detail}" if detail else "")
