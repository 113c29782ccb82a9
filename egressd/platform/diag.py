"""Whether a connection's program can be looked up here, and the sock_diag socket of a child's
network namespace to look it up there (egressd.platform.peer does the looking up).

Light on purpose: a wrapped command's start reads the one and makes the other before its child
starts; the lookup's code loads with the first lookup, once the child connects.
"""

from __future__ import annotations

import itertools
import socket
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from egressd.platform.peer import SocketRow
    from egressd.policy import IPAddress

# /proc and sock_diag: the lookup runs on Linux only
SUPPORTED = sys.platform.startswith("linux")


class Diag:
    """A sock_diag socket made in another network namespace (a child's: a socket keeps the
    namespace it was made in), asking about the connections accepted on that namespace's
    listeners; shared by every lookup, one at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()
        self._seq = itertools.count(1)

    def lookup(self, client: tuple[IPAddress, int], server: tuple[IPAddress, int]) -> SocketRow | None:
        from egressd.platform.peer import diag_answer, diag_request, parse_diag_reply

        with self._lock:
            seq = next(self._seq) & 0xFFFFFFFF
            self.sock.settimeout(1.0)
            self.sock.sendto(diag_request(client, server, seq), (0, 0))
            while True:  # an answer to an earlier question that timed out is skipped
                reply = self.sock.recv(8192)
                if diag_answer(reply) == seq:
                    break
        row = parse_diag_reply(reply)
        return row if row is not None and row.inode else None
