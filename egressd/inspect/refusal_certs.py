"""Certificates for answering a refused HTTPS CONNECT inside TLS (`refusal_pages: tls`).

A client that shows nothing of a refused CONNECT (most do: "403" at best) prints what an HTTPS
server answers. With `refusal_pages: tls` and inspection on (the child trusts egressd's CA through
the bundle egressd put in its environment), egressd's front answers the CONNECT 200 and then speaks
TLS itself, as the refused host, to answer each request with the refusal. mitmproxy's CertStore
mints the host's certificate from egressd's CA, as it does for inspected hosts; nothing here, nor
in the front's page (egressd.front.refusal_page), ever connects upstream.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import ssl
import tempfile
import threading
from pathlib import Path
from typing import Any

from egressd.inspect.ca import KEY_SIZE, MITMPROXY_BASENAME

MAX_CACHED = 256  # hosts whose context is kept (a child trying many names mints again, bounded)


class RefusalCerts:
    """One TLS server context per refused host name, minted on first need and kept (bounded)."""

    def __init__(self, confdir: Path) -> None:
        self.confdir = confdir
        self._store: Any = None  # mitmproxy.certs.CertStore, loaded on first need (not at start)
        self._lock = threading.Lock()
        self._contexts: dict[str, ssl.SSLContext] = {}

    async def context(self, host: str) -> ssl.SSLContext:
        """The server context for `host`: minted in a worker thread (RSA signing, file reads)."""
        found = self._contexts.get(host)
        if found is not None:
            return found
        return await asyncio.get_running_loop().run_in_executor(None, self._mint, host)

    def _mint(self, host: str) -> ssl.SSLContext:
        from mitmproxy.certs import CertStore

        with self._lock:
            found = self._contexts.get(host)
            if found is not None:
                return found
            if self._store is None:
                self._store = CertStore.from_store(self.confdir, MITMPROXY_BASENAME, KEY_SIZE)
            context = minted_context(self._store, [host], self.confdir)
            if len(self._contexts) >= MAX_CACHED:
                self._contexts.clear()
            self._contexts[host] = context
            return context


def minted_context(store: Any, names: list[str], scratch: Path) -> ssl.SSLContext:
    """A TLS server context (HTTP/1.1 only) with a certificate for `names` from egressd's CA; its key
    passes through a private file under `scratch` (see _load_chain)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    sans: list[x509.GeneralName] = []
    for name in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            sans.append(x509.DNSName(name))
    entry = store.get_cert(names[0], sans)
    key = entry.privatekey.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])  # egressd speaks HTTP/1.1: never offer h2
    _load_chain(context, entry.cert.to_pem() + key, scratch)
    return context


def listener_context(confdir: Path, names: list[str], scratch: Path) -> ssl.SSLContext:
    """The context of a TLS proxy listener (`run --gateway --tls-name`): a certificate for the names
    clients reach it by, from egressd's CA (the bundle they trust already). `scratch`: egressd's own
    private directory (the CA's may be mounted read-only, as in the compose file)."""
    from mitmproxy.certs import CertStore

    return minted_context(CertStore.from_store(confdir, MITMPROXY_BASENAME, KEY_SIZE), names, scratch)


def _load_chain(context: ssl.SSLContext, pem: bytes, confdir: Path) -> None:
    """ssl loads a certificate and key from a file only: a private one in egressd's CA directory
    (hidden from a sandboxed child, unlike $TMPDIR), gone once loaded."""
    directory = tempfile.mkdtemp(prefix="page-", dir=confdir)  # 0700
    path = os.path.join(directory, "leaf.pem")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as file:
            file.write(pem)
        context.load_cert_chain(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(directory)
