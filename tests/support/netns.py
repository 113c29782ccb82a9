"""Move the test process into a fresh, isolated network namespace.

Why: integration tests run a real proxy and real clients against real servers. Inside a new network
namespace the only interface is ``lo``, so even a bug that lets refused traffic through cannot reach
anything outside this process tree. Child processes (curl, node, egressd) inherit the namespace.

Addressing findings (measured on Linux 6.x):

* Adding ``198.51.100.254/24`` to ``lo`` installs a ``local 198.51.100.0/24`` route, exactly like
  ``127.0.0.0/8``: every address of the /24 can be bound and connected to. So the IPv4 documentation
  ranges are added as whole /24s, with .254 as the interface address.
* IPv6 has no such behaviour for binding (a /64 on ``lo`` does not make its addresses bindable without
  ``IP_FREEBIND``), so each IPv6 address is added as its own /128 with ``nodad`` (no duplicate address
  detection delay, usable at once).
* Connections from ``127.0.0.1`` to one of these addresses get the address of the matching ``lo``
  route as source (e.g. ``198.51.100.254``), not ``127.0.0.1``.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

#: IPv4 "upstream hosts": 198.51.100.0/24 (TEST-NET-2) is local as a whole; these are the named ones.
UPSTREAM_V4: list[str] = [f"198.51.100.{i}" for i in range(1, 21)]
#: Alternative IPv4 hosts: 203.0.113.0/24 (TEST-NET-3) is local as a whole.
ALT_V4: list[str] = [f"203.0.113.{i}" for i in range(1, 11)]
#: More IPv4 hosts: 192.0.2.0/24 (TEST-NET-1) is local as a whole too.
EXTRA_V4: list[str] = [f"192.0.2.{i}" for i in range(1, 11)]
#: IPv6 "upstream hosts" (each a /128 on lo, nodad).
UPSTREAM_V6: list[str] = [f"2001:db8::{i:x}" for i in range(1, 17)]

#: Hosts that clients with their own SSRF guard take for public ones: 3fff::/20 is IPv6's newer
#: documentation prefix (RFC 9637, never routed), which Python 3.12's ipaddress and such guards still
#: count as global (egressd counts it as the documentation range it is). Local by a route, bindable
#: by a sysctl of the namespace, and none of them an interface address (not the host's own).
PUBLIC_V6: list[str] = [f"3fff::{i:x}" for i in range(1, 5)]
PUBLIC_V6_NET = "3fff::/64"

#: Whole prefixes that are local inside the namespace.
LOCAL_V4_NETWORKS: list[str] = ["198.51.100.0/24", "203.0.113.0/24", "192.0.2.0/24"]
#: The namespace's own IPv4 interface addresses (on lo, making their /24 local): the last of each
#: prefix, so the upstream hosts above are reached as other machines, not as this one's own
#: addresses (which a sandbox or a gateway treats as its loopback).
INTERFACE_V4: list[str] = [net.replace(".0/24", ".254") for net in LOCAL_V4_NETWORKS]

ENV_FLAG = "EGRESSD_TEST_NETNS"

_state: dict[str, str] = {}
_lock = threading.Lock()


class NetnsError(RuntimeError):
    """The isolated namespace could not be created or configured."""


def _write(path: str, text: str) -> None:
    Path(path).write_text(text)


def _map_ids(uid_map: str, gid_map: str) -> None:
    with contextlib.suppress(OSError):  # kernels before 3.19 have no setgroups file
        _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", uid_map)
    _write("/proc/self/gid_map", gid_map)


def _unshare() -> str:
    """Enter a new network namespace (as root) or a user+network namespace (otherwise)."""
    if not hasattr(os, "unshare"):
        raise NetnsError("os.unshare is unavailable (needs Python >= 3.12 on Linux)")
    if os.geteuid() == 0:
        try:
            os.unshare(os.CLONE_NEWNET)
            return "root: new network namespace"
        except OSError as exc:
            root_error: OSError | None = exc
    else:
        root_error = None
    uid, gid = os.getuid(), os.getgid()
    try:
        os.unshare(os.CLONE_NEWUSER | os.CLONE_NEWNET)
    except OSError as exc:
        detail = f"unshare(CLONE_NEWUSER|CLONE_NEWNET): {exc}"
        if root_error is not None:
            detail = f"unshare(CLONE_NEWNET) as root: {root_error}; {detail}"
        raise NetnsError(detail) from exc
    _map_ids(f"0 {uid} 1", f"0 {gid} 1")
    if uid != 0:
        _state["unprivileged"] = f"{uid}:{gid}"
    return f"user namespace (uid {uid}) + new network namespace"


def _be_the_user_again() -> None:
    """Back to the caller's own uid, with no capability over the test namespace.

    The first user namespace maps the caller to uid 0 only so the namespace can be configured;
    a test process that stayed uid 0 there would run egressd as "root" (every sandbox and capture
    path of an ordinary user untested). A nested user namespace maps the caller's uid back: its
    processes hold no capability in the namespace that owns the test network, exactly as a user's
    egressd holds none on the host.
    """
    uid, _, gid = _state["unprivileged"].partition(":")
    os.unshare(os.CLONE_NEWUSER)
    _map_ids(f"{uid} 0 1", f"{gid} 0 1")


def _ip() -> str:
    ip = shutil.which("ip") or next(
        (p for p in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip") if os.path.exists(p)), None
    )
    if ip is None:
        raise NetnsError("the `ip` command (iproute2) is not installed")
    return ip


def _ip_batch(commands: list[str]) -> None:
    ip = _ip()
    proc = subprocess.run(
        [ip, "-batch", "-"], input="\n".join(commands) + "\n", capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise NetnsError(f"ip -batch failed ({proc.returncode}): {proc.stderr.strip()}")


def _configure_addresses() -> None:
    """Bring lo up and add the documentation-range addresses used as upstream hosts."""
    ipv6_off = Path("/proc/sys/net/ipv6/conf/lo/disable_ipv6")
    if ipv6_off.exists() and ipv6_off.read_text().strip() != "0":
        try:
            ipv6_off.write_text("0")
        except OSError as exc:
            raise NetnsError(f"cannot enable IPv6 on lo: {exc}") from exc
    if "unprivileged" in _state:
        # the user's own servers (sshd on 22) bind low ports in this namespace, as root's would
        Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").write_text("0")
    Path("/proc/sys/net/ipv6/ip_nonlocal_bind").write_text("1")  # PUBLIC_V6: no interface has them
    cmds = ["link set lo up"]
    for address in INTERFACE_V4:
        cmds.append(f"addr add {address}/24 dev lo")
    for addr in UPSTREAM_V6:
        cmds.append(f"addr add {addr}/128 dev lo nodad")
    cmds.append(f"route add local {PUBLIC_V6_NET} dev lo")
    _ip_batch(cmds)


@contextlib.contextmanager
def local_address(address: str) -> Iterator[str]:
    """One more address on ``lo`` of the test namespace while the block runs (a /32 or a /128,
    nodad): an upstream at a private address (10.x, a ULA) of a network that only exists here."""
    if not in_test_netns():
        raise NetnsError("local_address is for the isolated test namespace only")
    prefix = "/128 dev lo nodad" if ":" in address else "/32 dev lo"
    _ip_batch([f"addr add {address}{prefix}"])
    try:
        yield address
    finally:
        _ip_batch([f"addr del {address}{prefix.removesuffix(' nodad')}"])


def in_test_netns() -> bool:
    """True once this process has entered (and configured) the isolated namespace."""
    return "description" in _state


def enter_test_netns() -> str:
    """Enter and configure the isolated namespace once per process; return a description.

    Must run before any other thread starts: a network namespace is per thread, and unsharing only
    moves the calling thread (and threads it starts later); a user namespace refuses multithreaded
    callers outright.
    """
    with _lock:
        if "description" in _state:
            return _state["description"]
        others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
        if others:
            raise NetnsError(f"other threads are already running ({', '.join(others)})")
        how = _unshare()
        _configure_addresses()
        if "unprivileged" in _state:
            _be_the_user_again()
        os.environ[ENV_FLAG] = "1"
        desc = (
            f"{how}; lo up with {', '.join(LOCAL_V4_NETWORKS)}, "
            f"{UPSTREAM_V6[0]}..{UPSTREAM_V6[-1]} and ::1 (pid {os.getpid()})"
        )
        _state["description"] = desc
        return desc


def in_a_namespace_of_its_own(addresses: Sequence[str], argv: Sequence[str]) -> list[str]:
    """`argv` run in a new network namespace whose interface `eg0` has `addresses` (CIDR), as the
    test's own user (root stays root): a host with addresses of its own (a LAN address, a Docker
    bridge's) where nothing leads to any real network. eg0 is one end of a veth pair whose other
    end stays in the namespace too (kernels without the dummy driver have veth).

    An ordinary user configures it as root of a user namespace of its own, then maps itself back
    to its uid (as the session's namespace does), so `argv` holds no capability there.
    """
    ip = shlex.quote(_ip())
    steps = ["link set lo up", "link add eg0 type veth peer name eg1", "link set eg1 up", "link set eg0 up"]
    steps += [f"addr add {shlex.quote(a)} dev eg0" + (" nodad" if ":" in a else "") for a in addresses]
    script = " && ".join(f"{ip} {step}" for step in steps)
    if "unprivileged" not in _state:
        return ["unshare", "--net", "--", "sh", "-c", f'{script} && exec "$@"', "sh", *argv]
    back = f'exec unshare --user --map-user={os.getuid()} --map-group={os.getgid()} -- "$@"'
    unshare = ["unshare", "--user", "--map-root-user", "--net", "--"]
    return [*unshare, "sh", "-c", f"{script} && {back}", "sh", *argv]


def real_root() -> bool:
    """Root of the initial user namespace (named network namespaces, mounts, useradd, docker need
    it), not a uid 0 mapped in a user namespace."""
    try:
        first = Path("/proc/self/uid_map").read_text().split()
    except OSError:
        return False
    return os.geteuid() == 0 and first[:2] == ["0", "0"]


def links() -> list[str]:
    """Names of the network interfaces of the current namespace (not /sys, which shows the mounter's)."""
    return sorted(name for _index, name in socket.if_nameindex())
