"""egressd's own TCP listeners, each registered as egressd's own address the moment it exists.

Why: a child reaches anything on loopback through the proxy unless the decision knows the port is
egressd's (`self`): the proxy and SOCKS ports, the credential-free port of one child, the
metrics endpoint, the dashboard — and whatever listener comes next. So every listener goes through
here: `listen` opens a socket of egressd's own making and registers it before it accepts anything;
`register` takes the address of a listener a library bound itself (asyncio's servers,
prometheus_client's). `own` is the running egressd's registry:
its decider (`add_self_address`), or for a process attached to it (`egressd dashboard`) its
control API. tests/e2e/test_self_listeners.py finds every listening socket of a running egressd in
/proc and checks that each is refused as `self`, so a listener opened anywhere else is caught.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from typing import Protocol

__all__ = ["OwnAddresses", "listen", "listen_all", "register"]


class OwnAddresses(Protocol):
    """Where egressd's own addresses are kept (the decider, or a running egressd's control API)."""

    def add_self_address(self, host: str, port: int) -> None: ...


def register(own: OwnAddresses, addresses: Iterable[tuple[str, int] | tuple[str, int, int, int]]) -> None:
    """Each bound address (a socket's getsockname()) is egressd's own; an unspecified one (0.0.0.0,
    ::) is reached at loopback as well, and registered there too."""
    for address in addresses:
        host, port = str(address[0]), int(address[1])
        own.add_self_address(host, port)
        ip = ipaddress.ip_address(host.split("%", 1)[0])
        if ip.is_unspecified:
            own.add_self_address("127.0.0.1" if ip.version == 4 else "::1", port)


def listen(own: OwnAddresses, host: str, port: int = 0, *, backlog: int = 128) -> socket.socket:
    """A listening TCP socket on host:port (0: a free port), registered before it listens."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        register(own, [sock.getsockname()])
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def listen_all(own: OwnAddresses, host: str, port: int = 0, *, backlog: int = 128) -> list[socket.socket]:
    """A listening TCP socket on each address `host` names (`localhost`: 127.0.0.1 and ::1), as
    asyncio's create_server binds them, each registered before it listens; port 0: each a free port."""
    # an ASCII name as bytes: a str goes through the idna codec (encodings.idna, stringprep, unicodedata)
    name: str | bytes = host.encode("ascii") if host.isascii() else host
    infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    made: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            made.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            register(own, [sock.getsockname()])
            sock.listen(backlog)
    except BaseException:
        for sock in made:
            sock.close()
        raise
    return made
