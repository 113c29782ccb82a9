"""A refused HTTPS CONNECT answered inside TLS (`refusal_pages: tls`): the same 403 and body.

The pipeline refused the tunnel: no address was resolved or pinned, and nothing here connects
anywhere. The client is told 200, its TLS is accepted with egressd's certificate for the refused
host (egressd.inspect.refusal_certs), and its first request is answered with the refusal egressd
would have sent on the CONNECT (status line, Proxy-Status, X-Egressd-Reason, the explaining body),
then the connection closes. The refusal itself was recorded by the pipeline when it was decided.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from typing import TYPE_CHECKING

from egressd.policy.reasons import Reason
from egressd.policy.refusal import Refusal
from egressd.wire.refusal import http_response

if TYPE_CHECKING:
    from egressd.front.relay import RelayOwner

MAX_HEAD = 65536  # read no more of a request that is answered the same whatever it says


def wants_page(refusal: Refusal, stage: str, port: int) -> bool:
    """A policy refusal of an HTTP CONNECT to port 443: a client that will speak TLS first. (Other
    ports may carry protocols whose server speaks first, which a 200 would leave waiting.)"""
    policy = refusal.is_policy and refusal.reason is not Reason.INVALID_TARGET
    return stage == "connect" and port == 443 and policy


class RefusalPage(asyncio.Protocol):
    """The decrypted side of the refused tunnel: answers the first request head, then closes."""

    def __init__(self, owner: RelayOwner, refusal: Refusal, timeout: float) -> None:
        self.owner = owner
        self.refusal = refusal
        self.timeout = timeout
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.timer: asyncio.TimerHandle | None = None
        self.answered = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.attach(transport)

    def attach(self, transport: asyncio.BaseTransport) -> None:
        """The TLS transport: start_tls returns it without calling connection_made, and a request
        may have arrived before it returned (kept in the buffer until now)."""
        if self.transport is not None:
            return
        self.transport = transport  # type: ignore[assignment]
        self.timer = asyncio.get_running_loop().call_later(self.timeout, transport.close)
        self._answer_when_read()

    def data_received(self, data: bytes) -> None:
        if self.answered:
            return
        self.buffer += data
        self._answer_when_read()

    def _answer_when_read(self) -> None:
        if self.answered or self.transport is None:
            return
        if b"\r\n\r\n" in self.buffer or len(self.buffer) > MAX_HEAD:
            self.answered = True
            self.transport.write(http_response(self.refusal))
            self.transport.close()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.owner.finish()


class BufferedTls(asyncio.Protocol):
    """The refusal page's TLS over memory BIOs, for a client whose first TLS bytes egressd has read
    already (a captured client speaks first; an event loop may read an accepted socket before its
    protocol can pause it, and start_tls would lose them): fed what was read, then what comes."""

    def __init__(
        self, transport: asyncio.Transport, context: ssl.SSLContext, page: RefusalPage, first: bytes
    ) -> None:
        self.raw = transport
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_side=True)
        self.page = page
        self.shaken = False
        self.timer = asyncio.get_running_loop().call_later(page.timeout, transport.close)
        transport.set_protocol(self)
        if first:
            self.data_received(first)
        transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.incoming.write(data)
        try:
            if not self.shaken:
                self.tls.do_handshake()
                self.shaken = True
                self.timer.cancel()
                self.page.attach(_TlsWriter(self))  # type: ignore[arg-type]
            while chunk := self.tls.read(65536):
                self.page.data_received(chunk)
        except ssl.SSLWantReadError:
            pass
        except (ssl.SSLError, OSError):  # not TLS, a CA the client does not trust: closed
            self.raw.close()
        self.flush()

    def flush(self) -> None:
        if data := self.outgoing.read():
            self.raw.write(data)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.timer.cancel()
        self.page.connection_lost(exc)


class _TlsWriter:
    """What the page writes to, encrypted to the client."""

    def __init__(self, tls: BufferedTls) -> None:
        self.tls = tls

    def write(self, data: bytes) -> None:
        self.tls.tls.write(data)
        self.tls.flush()

    def close(self) -> None:
        with contextlib.suppress(ssl.SSLError, OSError):
            self.tls.tls.unwrap()
        self.tls.flush()
        self.tls.raw.close()

    def is_closing(self) -> bool:
        return self.tls.raw.is_closing()
