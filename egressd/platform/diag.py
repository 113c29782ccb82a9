"""Whether a connection's program can be looked up here, and the sock_diag socket of a child's
network namespace to look it up there (egressd.platform.peer asks it, and does the looking up).

Light on purpose: a wrapped command's start reads the one and makes the other before its child
starts; the lookup's code loads with the first lookup, once the child connects.
"""

from __future__ import annotations

import itertools
import socket
import sys
import threading

# /proc and sock_diag: the lookup runs on Linux only
SUPPORTED = sys.platform.startswith("linux")


class Diag:
    """A sock_diag socket made in another network namespace (a child's: a socket keeps the
    namespace it was made in), asking about the connections accepted on that namespace's
    listeners; shared by every lookup, one at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()  # one question at a time: held by peer.socket_inode's exchange
        self._seq = itertools.count(1)

    def next_seq(self) -> int:
        """The sequence number of the next question on this socket (a late answer to an earlier one
        is told apart by it)."""
        return next(self._seq) & 0xFFFFFFFF
