"""This machine's own interface addresses (getifaddrs through ctypes: Linux and macOS).

Why: through the relay, a remote command that asks for the client's LAN address reaches the
client's own services just as 127.0.0.1 would; relay mode puts those addresses under the
loopback rules.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import socket
import sys

from egressd.policy.hosts import IPAddress


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [
    ("ifa_next", ctypes.POINTER(_Ifaddrs)),
    ("ifa_name", ctypes.c_char_p),
    ("ifa_flags", ctypes.c_uint),
    ("ifa_addr", ctypes.c_void_p),
    ("ifa_netmask", ctypes.c_void_p),
    ("ifa_ifu", ctypes.c_void_p),
    ("ifa_data", ctypes.c_void_p),
]

# BSD-style sockaddr starts with sa_len (1 byte) and sa_family (1 byte); Linux has a 2-byte family
_BSD = sys.platform == "darwin" or "bsd" in sys.platform
# (offset of the address, its length) in sockaddr_in / sockaddr_in6
_LAYOUT = {socket.AF_INET: (4, 4), socket.AF_INET6: (8, 16)}


def _family(sockaddr: int) -> int:
    raw = ctypes.string_at(sockaddr, 2)
    return raw[1] if _BSD else int.from_bytes(raw, sys.byteorder)


def libc_name() -> str | None:
    """The C library to load: on Linux the process's own symbols (None), which hold libc's, found
    without ctypes.util.find_library (it runs `ldconfig -p`, a process of its own, on every call)."""
    return None if sys.platform.startswith("linux") else ctypes.util.find_library("c")


def local_addresses() -> frozenset[IPAddress]:
    """Every address of this machine's interfaces; empty where getifaddrs is unavailable."""
    try:
        libc = ctypes.CDLL(libc_name(), use_errno=True)
        getifaddrs, freeifaddrs = libc.getifaddrs, libc.freeifaddrs
    except (OSError, AttributeError):
        return frozenset()
    head = ctypes.POINTER(_Ifaddrs)()
    if getifaddrs(ctypes.byref(head)) != 0:
        return frozenset()
    found: set[IPAddress] = set()
    try:
        entry = head
        while entry:
            sockaddr = entry.contents.ifa_addr
            if sockaddr:
                layout = _LAYOUT.get(_family(sockaddr))
                if layout is not None:
                    offset, size = layout
                    found.add(ipaddress.ip_address(ctypes.string_at(sockaddr + offset, size)))
            entry = entry.contents.ifa_next
    finally:
        freeifaddrs(head)
    return frozenset(found)
