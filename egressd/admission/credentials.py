"""The credentials step: a fresh random token for every child, checked in constant time."""

from __future__ import annotations

import binascii
import hmac
import secrets
import threading

from egressd.admission.state import DEFAULT_USERNAME, ConnState, ProxyCredentials

VERIFIED = 256  # Proxy-Authorization values remembered as valid, at most (then forgotten at once)


class CredentialStore:
    """Tokens issued by this egressd; thread-safe because the CLI issues while the proxy checks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[str, ProxyCredentials] = {}
        # what check() compares against, as bytes, replaced whole on every change: the proxy's
        # thread reads it without the lock and never sees a half-made list
        self._issued: tuple[tuple[ProxyCredentials, bytes, bytes], ...] = ()
        # Proxy-Authorization values found valid, with whose they are, for the `state` they were
        # checked in (check_basic)
        self._verified: tuple[object, dict[tuple[str, str | None], ProxyCredentials]] = (None, {})

    def issue(self, profile: str | None = None, label: str | None = None) -> ProxyCredentials:
        creds = ProxyCredentials(profile or DEFAULT_USERNAME, secrets.token_urlsafe(24), label=label)
        with self._lock:
            self._tokens[creds.token] = creds
            self._refresh()
        return creds

    def revoke(self, creds: ProxyCredentials) -> None:
        with self._lock:
            self._tokens.pop(creds.token, None)
            self._refresh()

    def _refresh(self) -> None:
        self._issued = tuple((c, c.token.encode(), c.username.encode()) for c in self._tokens.values())

    @property
    def state(self) -> object:
        """What check() answers from, replaced whole on every change (remembered answers compare it)."""
        return self._issued

    def valid(self, creds: ProxyCredentials) -> bool:
        """Still issued (a revoked child's credential-free listener admits nothing more)."""
        with self._lock:
            return self._tokens.get(creds.token) == creds

    def check(self, username: str, token: str, peer: str | None = None) -> ProxyCredentials | None:
        """Whose credentials these are; `peer` ("ip:port") matters to the gateway's store only."""
        found = None
        # surrogatepass: a client's undecodable bytes (surrogateescape) compare unequal, never raise
        user, secret = username.encode("utf-8", "surrogatepass"), token.encode("utf-8", "surrogatepass")
        for creds, issued_token, issued_user in self._issued:  # constant time, every issued token
            if hmac.compare_digest(issued_token, secret) and hmac.compare_digest(issued_user, user):
                found = creds
        return found

    def check_basic(self, header_value: str | None, peer: str | None = None) -> ProxyCredentials | None:
        """Check a `Proxy-Authorization: Basic ...` value.

        A child presents the same value on every CONNECT (the remembered CONNECT head carries the
        same string): a value found valid is remembered, with whose it is, for the credentials in
        force when it was checked (`state`, replaced whole when a token is issued or revoked, or a
        gateway's token file reloaded), so a revoked token is refused on its next use. Only valid
        values are kept (at most VERIFIED), so a client cannot fill it with guesses."""
        if not header_value:
            return None
        state = self.state
        key = (header_value, self.source_of(peer))
        held, verified = self._verified
        if held is state:
            found = verified.get(key)
            if found is not None:
                return found
        else:
            verified = {}
            self._verified = (state, verified)
        found = self._check_basic(header_value, peer)
        if found is not None:
            if len(verified) >= VERIFIED:
                verified.clear()
            verified[key] = found
        return found

    def source_of(self, peer: str | None) -> str | None:
        """What of the client's address a check depends on: nothing here (a gateway: its IP)."""
        return None

    def _check_basic(self, header_value: str, peer: str | None) -> ProxyCredentials | None:
        scheme, _, encoded = header_value.strip().partition(" ")
        if scheme.lower() != "basic":
            return None
        # non-ASCII text, anything but strict base64 (binascii.Error), bytes that are not UTF-8: all
        # ValueErrors, wrong credentials, never a 500
        try:
            decoded = binascii.a2b_base64(encoded.strip(), strict_mode=True).decode("utf-8")
        except ValueError:
            return None
        username, sep, token = decoded.partition(":")
        if not sep:
            return None
        return self.check(username, token, peer)


# What a client presented: a Proxy-Authorization value (HTTP), a SOCKS5 user and password, or nothing.
Presented = str | tuple[str, str] | None


def authenticate(store: CredentialStore, conn: ConnState, presented: Presented) -> bool:
    """Whether a CONNECT, SOCKS5 connect or request with these credentials may go on, the same on
    every front. Each request is checked on its own: an earlier request on a kept-alive connection
    authenticates nothing. Requests inside a tunnel carry none: its CONNECT or SOCKS5 handshake
    counts. Sets conn.creds to whose request it is."""
    if conn.tunnel:
        return conn.creds is not None
    if presented is None and conn.implicit is not None:
        if conn.tree_only and (conn.identity is None or not conn.identity.in_tree):
            conn.creds = None  # the child-only listener: held by someone outside the child's tree
            return False
        conn.creds = conn.implicit
        return store.valid(conn.implicit)
    if presented is None:
        conn.creds = None
    elif isinstance(presented, tuple):
        conn.creds = store.check(*presented, peer=conn.peer)
    else:
        conn.creds = store.check_basic(presented, peer=conn.peer)
    return conn.creds is not None
