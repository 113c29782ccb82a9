"""SOCKS5 on egressd's front: the handshake read by egressd.wire.socks5, every CONNECT admitted by
the admission pipeline exactly as an HTTP CONNECT is.

A SOCKS5 client is a FrontProtocol whose request head is a SOCKS5 handshake. Its credentials are
answered in the RFC 1929 sub-negotiation by the pipeline's credentials step; its request becomes an
Attempt of stage "socks" for FrontProtocol._open_tunnel — admission (credentials, limits, decision,
approver, inspection choice, resolution, pinning), the connect, the TLS SNI check of the client's
first bytes, the relay or the hand-over to mitmproxy for inspection, the records. Only the answers
differ: SOCKS5 reply codes instead of HTTP statuses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from egressd.admission.credentials import Presented
from egressd.admission.pipeline import Attempt
from egressd.front.tunnel import FrontProtocol, Listeners
from egressd.policy.reasons import Reason
from egressd.policy.refusal import Refusal
from egressd.wire.refusal import socks_reply
from egressd.wire.socks5 import (
    NO_AUTH,
    Credentials,
    Greeting,
    Reply,
    Request,
    Socks5Error,
    Socks5Server,
    TunnelData,
    auth_reply,
    reply,
)

if TYPE_CHECKING:
    from egressd.admission.credentials import ProxyCredentials
    from egressd.platform.diag import Diag


class SocksProtocol(FrontProtocol):
    """One SOCKS5 client of egressd's front."""

    early_stage = "socks"
    names_bound = True

    def __init__(
        self,
        front: Listeners,
        implicit: ProxyCredentials | None = None,
        *,
        diag: Diag | None = None,
        local: tuple[str, int] | None = None,
    ) -> None:
        super().__init__(front, implicit=implicit, diag=diag, local=local)
        # NO AUTH only where the listener grants credentials
        self.parser = Socks5Server(allow_no_auth=implicit is not None)
        self.presented: Presented = None  # the user and password the client sent, if it did

    # -- the handshake (stage "head": header_timeout bounds it) -----------------------------------
    def _on_head_bytes(self, last: bytes) -> None:
        """The handshake's bytes read so far: those kept in the buffer, then `last` (the last read)."""
        self.buffer += last
        if self.parser.done:
            return  # tunnel bytes arriving while the request is admitted: kept in the buffer
        data, self.buffer = bytes(self.buffer), bytearray()
        try:
            events = self.parser.feed(data)
        except Socks5Error as exc:
            self._refuse_handshake(exc)
            return
        assert self.transport is not None and self.state is not None
        for event in events:
            if isinstance(event, Greeting):
                self.transport.write(event.reply)
                if event.method == NO_AUTH and not self.pipeline.authenticate(self.state, None):
                    self.transport.close()  # the listener's credentials were revoked
                    return
            elif isinstance(event, Credentials):
                if not self._authenticate(event):  # wrong credentials are recorded, as on CONNECT
                    detail = "wrong proxy credentials (RFC 1929)"
                    self.pipeline.refused_early(
                        self.state, None, None, Reason.PROXY_AUTH_REQUIRED, detail, stage="socks"
                    )
                    self.transport.write(auth_reply(False))
                    self.transport.close()  # RFC 1929: a failure status, then the server closes
                    return
                self.transport.write(auth_reply(True))
            elif isinstance(event, Request):
                self._on_request(event)
            elif isinstance(event, TunnelData):
                self.buffer += event.data  # the tunnel's first bytes: relayed after the SNI check

    def _authenticate(self, credentials: Credentials) -> bool:
        """The pipeline's credentials step; bytes that are not UTF-8 are wrong credentials (never
        "none presented", which a credential-free listener would accept)."""
        if credentials.username is None or credentials.password is None:
            return False
        assert self.state is not None
        self.presented = (credentials.username, credentials.password)
        return self.pipeline.authenticate(self.state, self.presented)

    def _on_request(self, request: Request) -> None:
        attempt = Attempt("socks", request.host, request.port, scheme="socks5", credentials=self.presented)
        self._start_tunnel(attempt)

    def _refuse_handshake(self, error: Socks5Error) -> None:
        """A handshake egressd does not serve: its reply, then close. Recorded, unless it only lacks
        credentials (a CONNECT without them is answered 407 and not recorded either: the challenge
        a client answers next)."""
        if error.reason is not Reason.PROXY_AUTH_REQUIRED:
            self.pipeline.refused_early(self.state, None, None, error.reason, str(error), stage="socks")
        if self.transport is not None and not self.transport.is_closing():
            if error.reply:
                self.transport.write(error.reply)
            self.transport.close()

    # -- answers ------------------------------------------------------------------------------------
    def established_answer(self, bound: tuple[str, int] | None) -> bytes:
        return reply(Reply.SUCCEEDED, bound)

    def refusal_answer(self, refusal: Refusal) -> bytes:
        return socks_reply(refusal.reason)

    def _answer_overloaded_now(self, refusal: Refusal) -> None:
        """Before its greeting a SOCKS5 client can be told nothing: it is closed (and recorded)."""
