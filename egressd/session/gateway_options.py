"""`egressd run --gateway`'s options: a module of their own, loaded only by a command line that has
them, so every other command (and the child it starts) waits for nothing of theirs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ssl


@dataclass(frozen=True)
class ListenerTLS:
    """The gateway's proxy port over TLS, so the clients' tokens do not cross a shared network in
    clear: a certificate and key of the operator's, or one minted for `names` from egressd's CA."""

    cert: Path | None = None
    key: Path | None = None
    names: tuple[str, ...] = ()

    def context(self, config_dir: Path | None) -> ssl.SSLContext:
        import ssl

        if self.cert is not None and self.key is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.set_alpn_protocols(["http/1.1"])
            context.load_cert_chain(self.cert, self.key)
            return context
        from egressd.inspect import ca
        from egressd.inspect.refusal_certs import listener_context

        config = config_dir or ca.config_dir()
        ca.ensure_ca(config)
        return listener_context(ca.ca_dir(config), list(self.names), config)


@dataclass(frozen=True)
class GatewayOptions:
    """`egressd run --gateway`: clients on other machines, named by the tokens in `tokens`."""

    tokens: Path
    allow_from: tuple[str, ...] = ()  # source networks (CIDR) every client must come from
    socks_listen: tuple[str, int] | None = None  # SOCKS5 listener (none without it)
    tls: ListenerTLS | None = None  # the proxy port speaks TLS (https:// proxy URLs)
