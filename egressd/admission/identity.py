"""The identity step: which program holds a client connection, looked up once per connection and
only when something needs it — an allow rule scoped by `exe`, the child-only credential-free
listener, or `identify` (the audit's pid and exe for every connection).

The lookup itself is `platform/peer.py` (/proc); this module decides when to run it and turns
its answer into what the decision (`policy.Program`) and the events (pid, exe) read. An owner
that cannot be determined — gone, ambiguous, not Linux — is None: a rule that needs it refuses.
"""

from __future__ import annotations

import ipaddress
import logging

from egressd.admission.state import ConnState, Identity
from egressd.platform import peer as peers
from egressd.platform.diag import SUPPORTED
from egressd.policy import Program

logger = logging.getLogger(__name__)


UNKNOWN = Identity(why="the connection's owner could not be determined")


def identify(conn: ConnState, root: int | None, *, tree_only: bool = False) -> Identity:
    """Look up (once; later calls return the first answer) who holds conn's client socket.

    root: the child's pid, whose tree is searched first; tree_only: search nowhere else (the
    child-only listener, which admits nothing outside that tree)."""
    if conn.identity is not None:
        return conn.identity
    conn.identity = _lookup(conn, root, tree_only)
    return conn.identity


def _lookup(conn: ConnState, root: int | None, tree_only: bool) -> Identity:
    if not SUPPORTED:
        return Identity(why="egressd identifies a connection's program on Linux only")
    if conn.ends is None:
        return UNKNOWN
    try:
        (client_host, client_port), (server_host, server_port) = conn.ends
        client = (ipaddress.ip_address(client_host), client_port)
        server = (ipaddress.ip_address(server_host), server_port)
        found = peers.lookup(client, server, root, tree_only=tree_only, diag=conn.diag)
    except (OSError, ValueError) as exc:  # never raise into admission: unknown is a refusal where needed
        logger.debug("peer lookup failed: %r", exc)
        return UNKNOWN
    if found is None:
        return Identity(why="the client's socket is gone (it closed before egressd looked)")
    if not found.holders:
        where = "the child or its descendants" if tree_only else "any process egressd may inspect"
        return Identity(why=f"the client's socket is held by none of {where}")
    owner = found.owner
    if owner is None or owner.exe is None:
        pids = ", ".join(str(h.pid) for h in found.holders)
        return Identity(
            pid=found.holders[0].pid,
            in_tree=found.descendant,
            why=f"the client's socket is held by processes running different programs (pids {pids})",
        )
    program = Program(owner.exe, peers.aliases(owner.exe))
    return Identity(owner.pid, owner.exe, owner.cmdline, found.descendant, program)
