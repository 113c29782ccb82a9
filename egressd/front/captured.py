"""Connections a child's capture took from clients that ignored the proxy variables.

The capture in the child's network namespace (sandbox/intercept.py) hands egressd each such
connection itself, with the target it is decided as (the name whose DNS answer led to its address,
or the address) and where the client meant to go, over a socket only the launcher holds. egressd
admits it like a CONNECT of the child's to that target — the same pipeline, policy, audit, SNI
rule, inspection — and relays it; the client never asked a proxy, so nothing is said when it is
allowed, and a refusal is answered in the client's own protocol: an HTTP request gets egressd's
refusal (status, Proxy-Status, X-Egressd-Reason, the explaining body), HTTPS to port 443 the
refusal page inside TLS where `refusal_pages: tls` and inspection allow it, anything else a close.
The program holding the client's socket is looked up in the child's namespace, so the audit, the
exit summary and `egressd watch` name the programs that ignore the proxy variables.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import socket
from typing import TYPE_CHECKING

from egressd.admission.pipeline import Attempt
from egressd.front.refusal_page import BufferedTls, RefusalPage
from egressd.front.tunnel import FrontProtocol, Listeners
from egressd.platform.fdwait import ready
from egressd.policy.refusal import Refusal
from egressd.wire.refusal import http_response

if TYPE_CHECKING:
    from egressd.admission.credentials import ProxyCredentials
    from egressd.platform.diag import Diag

logger = logging.getLogger(__name__)

MAX_MESSAGE = 1024
MAX_HEAD = 65536  # read no more of a request that is answered the same whatever it says
HTTP_METHOD = re.compile(rb"[A-Z]{1,20}")
LINGER = 2.0  # after a refusal's answer: the client's remaining bytes are read, not reset away


def http_request(data: bytes) -> bool | None:
    """Whether the client's first bytes start an HTTP/1 request (a method, then a space); None
    while too few bytes have come to tell."""
    word, space, _ = data[:21].partition(b" ")
    if word and not HTTP_METHOD.fullmatch(word):
        return False
    if space:
        return bool(word)
    return None if len(word) < 20 else False


def parse_message(message: bytes) -> tuple[str, int, tuple[str, int]] | None:
    """`HOST PORT DEST_IP DEST_PORT` (the launcher's): the target and where the client connected."""
    try:
        host, port, dest, dest_port = message.decode("ascii").split(" ")
        return host, int(port), (dest, int(dest_port))
    except ValueError:
        return None


class CapturedProtocol(FrontProtocol):
    """One captured connection: admitted at once as a CONNECT to its target, with the child's
    credentials; relayed when allowed, its refusal answered in the client's protocol."""

    def __init__(
        self,
        front: Listeners,
        creds: ProxyCredentials,
        target: tuple[str, int],
        destination: tuple[str, int],
        diag: Diag | None,
    ) -> None:
        super().__init__(front, implicit=creds, diag=diag)
        self.target = target
        self.destination = destination
        self.owed = b""  # a refusal's answer, for a client that speaks HTTP
        self.timer: asyncio.TimerHandle | None = None

    def _ends(
        self, peer: tuple[str, int], transport: asyncio.BaseTransport
    ) -> tuple[tuple[str, int], tuple[str, int]] | None:
        """The client's own socket holds the address it connected to (the redirect was not its)."""
        return ((peer[0], peer[1]), self.destination) if peer[0] != "?" else None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.state is None or self.stage != "head":  # draining, or far beyond capacity
            return
        self.state.captured = True
        host, port = self.target
        # reading stops before the first byte: a refusal page's TLS must start from the ClientHello
        self._start_tunnel(Attempt("connect", host, port, scheme="connect", method="CONNECT"))

    def _page_inside_tls(self, refusal: Refusal, attempt: Attempt) -> bool:
        """The refusal page for a client that did not start an HTTP request (it spoke first: its
        ClientHello may be read already)."""
        return http_request(bytes(self.buffer[:21])) is not True and self._pages_inside_tls(refusal, attempt)

    async def _refuse_inside_tls(self, refusal: Refusal) -> None:
        """TLS as the refused host over what the client sent so far and what it sends (the
        BufferedTls of refusal_page), then the refusal as the answer to its first request."""
        transport = self.transport
        assert transport is not None and self.front.refusal_context is not None
        try:
            context = await self.front.refusal_context(refusal.host)
        except Exception as exc:  # noqa: BLE001 - closed, as without the page
            logger.error("egressd could not make a TLS refusal page for %s: %r", refusal.host, exc)
            self._refuse(refusal)
            return
        if transport.is_closing():
            return
        self.stage = "page"  # what the client sends goes to the page from now on
        timeout = self.pipeline.policies.get().limits.header_timeout
        first, self.buffer = bytes(self.buffer), bytearray()
        BufferedTls(transport, context, RefusalPage(self, refusal, timeout), first)  # type: ignore[arg-type]

    def _answer_overloaded_now(self, refusal: Refusal) -> None:
        """Closed: the client did not ask a proxy, and may not speak HTTP."""

    def established_answer(self, bound: tuple[str, int] | None) -> bytes:
        """Nothing: the client connected to its server, as it believes."""
        return b""

    def refusal_answer(self, refusal: Refusal) -> bytes:
        """Nothing, then closed: the inspection engine could not reach the server (what this
        class says to a refused client goes through _refuse)."""
        return b""

    def _refuse(self, refusal: Refusal) -> None:
        """The refusal, to an HTTP client once its request head is read; any other is closed."""
        state, transport = self.state, self.transport
        if transport is None or transport.is_closing():
            return
        if refusal.host == "" and state is not None and state.host:
            refusal = dataclasses.replace(refusal, host=state.host, port=state.port)
        self.owed = http_response(refusal)
        self.stage = "refused"
        timeout = self.pipeline.policies.get().limits.header_timeout
        self.timer = asyncio.get_running_loop().call_later(timeout, transport.close)
        transport.resume_reading()
        self._answer_when_read()

    def data_received(self, data: bytes) -> None:
        if self.stage == "refused":
            if len(self.buffer) < MAX_HEAD:
                self.buffer += data
            self._answer_when_read()
            return
        if self.stage == "answered":
            return  # read and dropped: a close with unread bytes would reset the answer away
        super().data_received(data)

    def _answer_when_read(self) -> None:
        transport = self.transport
        assert transport is not None
        speaks_http = http_request(bytes(self.buffer[:21]))
        if speaks_http is False:
            transport.close()
            return
        if speaks_http is None or (b"\r\n\r\n" not in self.buffer and len(self.buffer) < MAX_HEAD):
            return
        self.stage = "answered"
        transport.write(self.owed)
        if self.timer is not None:
            self.timer.cancel()
        if transport.can_write_eof():
            transport.write_eof()  # said; the client closes, or the linger ends it
            self.timer = asyncio.get_running_loop().call_later(LINGER, transport.close)
        else:
            transport.close()

    def eof_received(self) -> bool:
        if self.stage in ("refused", "answered"):
            return False
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        super().connection_lost(exc)


async def serve_captures(
    front: Listeners, channel: socket.socket, creds: ProxyCredentials, diag: Diag | None
) -> None:
    """Serve every connection a child's capture hands over on `channel` until the launcher hangs
    up (SOCK_SEQPACKET: one message per connection, its descriptor attached)."""
    channel.setblocking(False)
    try:
        while True:
            await ready(channel.fileno())
            while True:
                try:
                    message, fds, _, _ = socket.recv_fds(channel, MAX_MESSAGE, 1, socket.MSG_CMSG_CLOEXEC)
                except BlockingIOError:
                    break
                except OSError:
                    return
                if not message and not fds:
                    return  # the launcher is gone
                await _serve_one(front, message, fds, creds, diag)
    finally:
        channel.close()


async def _serve_one(
    front: Listeners, message: bytes, fds: list[int], creds: ProxyCredentials, diag: Diag | None
) -> None:
    for extra in fds[1:]:
        os.close(extra)
    if not fds:
        return
    sock = socket.socket(fileno=fds[0])
    parsed = parse_message(message)
    if parsed is None or sock.type != socket.SOCK_STREAM:
        sock.close()
        return
    host, port, destination = parsed
    try:
        await asyncio.get_running_loop().connect_accepted_socket(
            lambda: CapturedProtocol(front, creds, (host, port), destination, diag), sock
        )
    except OSError as exc:  # the client went away meanwhile
        logger.debug("a captured connection closed before it was served: %r", exc)
        with contextlib.suppress(OSError):
            sock.close()
