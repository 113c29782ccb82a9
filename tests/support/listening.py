"""The TCP sockets a process listens on, read from /proc (Linux).

Why: "every listener of egressd is refused as `self`" is proved on the listeners egressd really
has, not on a list the test keeps: a listener added later shows up here and is tried too.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path

_SOCKET = re.compile(r"socket:\[(\d+)\]")
_LISTEN = "0A"


def _inodes(pid: int) -> set[str]:
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            match = _SOCKET.fullmatch(os.readlink(fd))
        except OSError:  # closed meanwhile
            continue
        if match:
            found.add(match.group(1))
    return found


def _address(hex_address: str) -> tuple[str, int]:
    """/proc/net/tcp's `0100007F:1F90` (or tcp6's 32 hex digits): (address, port)."""
    raw, port = hex_address.split(":")
    data = bytes.fromhex(raw)
    # each 32-bit word is in host byte order (little-endian here)
    data = b"".join(data[i : i + 4][::-1] for i in range(0, len(data), 4))
    return str(ipaddress.ip_address(data)), int(port, 16)


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of each TCP socket `pid` holds in the listening state."""
    inodes = _inodes(pid)
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == _LISTEN and fields[9] in inodes:
                found.add(_address(fields[1]))
    return found
