"""A listening socket made elsewhere that the front serves (ProxyServer.serve_socket): light, so
that its maker (the launcher's side, egressd.sandbox.launch) loads none of the front."""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from egressd.admission.credentials import ProxyCredentials
    from egressd.platform.diag import Diag


class Handed(NamedTuple):
    """A listening socket made elsewhere, for `kind` clients ("http" or "socks"); `implicit`: the
    credentials it grants (only the child reaches it); `diag`: where a connection's program is
    looked up (the socket's network namespace is not egressd's)."""

    sock: socket.socket
    kind: str
    implicit: ProxyCredentials | None = None
    diag: Diag | None = None
