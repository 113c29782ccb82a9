"""`egressd remote-agent feed`: the remote end of the policy channel's SSH session.

It runs as a second multiplexed session next to the user's command. The user's stdin stays the
user's: policies arrive on THIS session's stdin instead, and go to the agent over a Unix socket in
the session's private (0700) directory. When SSH drops, this stdin ends, the socket closes, and
the agent stops the command rather than run on without its client.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys

from egressd.child.connect import relay
from egressd.remote.channel import encode

ACCEPT_TIMEOUT = 60.0


def run_feeder(socket_path: str) -> int:
    """Listen at socket_path, accept the agent, relay both ways until either side ends."""
    old = os.umask(0o077)
    try:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(socket_path)
    finally:
        os.umask(old)
    listener.listen(1)
    out = sys.stdout.buffer
    out.write(encode({"type": "listening"}))
    out.flush()
    listener.settimeout(ACCEPT_TIMEOUT)
    try:
        conn, _ = listener.accept()
    except TimeoutError:
        sys.stderr.write("egressd (remote): the agent never connected to the policy channel\n")
        return 1
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            os.unlink(socket_path)
    conn.settimeout(None)
    relay(conn, b"", sys.stdin.fileno(), sys.stdout.fileno())
    return 0
