"""Capture, in the sandbox's network namespace, what a child sends without using the proxy.

Why: many clients ignore the proxy variables (node's fetch, Java's HttpClient, aiohttp's default
session, urllib3, Go with its own transport). In the sandbox they used to get nothing at all.
egressd (host side, owner of the sandbox's user namespace) installs, before the child starts:

- a route that makes every IPv4 address local to the sandbox's `lo` (so a connect() to any
  address, the synthetic ones the bridge's DNS responder hands out included, is not "unreachable"),
- nftables rules that redirect every TCP connection leaving the sandbox's own loopback to the
  bridge's transparent listener, every UDP and TCP port-53 packet to its DNS responder, and drop
  every other packet that is not loopback (UDP, ICMP, IPv6).

The bridge then asks the proxy with a CONNECT for the name the address stands for: the decision
stays in the proxy. This module decides nothing either; it only sets the plumbing. Run as
`python -I -m egressd.sandbox.capture PID TCP_PORT DNS_PORT IP NFT`, it enters PID's network
namespace (and the user namespace that owns it, found with NS_GET_USERNS) and runs `ip` and `nft`
there. A separate process because joining a user namespace needs a single-threaded caller.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

# Addresses the bridge's DNS responder hands out, one per name (RFC 2544 benchmarking range: never
# a real destination). Inside the sandbox every IPv4 address is local, these included.
SYNTHETIC_NET = "198.18.0.0/15"
NS_GET_USERNS = 0xB701  # _IO(0xb7, 0x1): the user namespace owning a namespace
TOOL_DIRS = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")
INSTALL_TIMEOUT = 30.0
HINT = "apt-get install nftables iproute2"


def ruleset(tcp_port: int, dns_port: int) -> str:
    """The nftables rules for the sandbox (pure: tested as text).

    nat/output runs before the route is final: DNS first (a resolv.conf naming 127.0.0.53 is
    captured too), then the sandbox's own loopback stays untouched, then every other TCP connection
    goes to the transparent listener. filter/output drops whatever is left that is not loopback:
    UDP other than DNS, ICMP, every other protocol, and all IPv6 but ::1.
    """
    return f"""\
table inet egressd_capture {{
    chain nat_out {{
        type nat hook output priority -100; policy accept;
        meta nfproto ipv4 udp dport 53 redirect to :{dns_port}
        meta nfproto ipv4 tcp dport 53 redirect to :{dns_port}
        ip daddr 127.0.0.0/8 accept
        meta nfproto ipv4 meta l4proto tcp redirect to :{tcp_port}
    }}
    chain filter_out {{
        type filter hook output priority 0; policy drop;
        ct state established,related accept
        ip daddr 127.0.0.0/8 accept
        ip6 daddr ::1 accept
    }}
}}
"""


def find_tool(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """$EGRESSD_IP / $EGRESSD_NFT, else PATH and the sbin directories (`ip` and `nft` live in
    /usr/sbin, which an ordinary user's PATH often lacks)."""
    environ = os.environ if environ is None else environ
    chosen = environ.get(f"EGRESSD_{name.upper()}")
    if chosen:
        return chosen if os.path.isfile(chosen) and os.access(chosen, os.X_OK) else None
    return shutil.which(name, path=os.pathsep.join([environ.get("PATH", ""), *TOOL_DIRS]))


def install(pid: int, tcp_port: int, dns_port: int, python: str | None = None) -> str | None:
    """Install the capture in the network namespace of `pid`; None when done, else why not."""
    tools = {name: find_tool(name) for name in ("ip", "nft")}
    missing = [name for name, found in tools.items() if found is None]
    if missing:
        return f"{' and '.join(missing)} not found; {HINT}"
    argv = [
        python or sys.executable,
        "-I",
        "-m",
        "egressd.sandbox.capture",
        str(pid),
        str(tcp_port),
        str(dns_port),
        str(tools["ip"]),
        str(tools["nft"]),
    ]
    env = {"PATH": os.pathsep.join(TOOL_DIRS), "LC_ALL": "C"}
    try:
        result = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run the capture helper: {exc}"
    if result.returncode != 0:
        said = " ".join((result.stderr or result.stdout).split()) or f"status {result.returncode}"
        return said
    return None


def enter_network_of(pid: int) -> None:
    """Join the network namespace of `pid`, after the user namespace that owns it (so this process
    holds CAP_NET_ADMIN there, and only there). The caller must be single-threaded."""
    net = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        owner = fcntl.ioctl(net, NS_GET_USERNS)
        try:
            if os.stat(f"/proc/self/fd/{owner}").st_ino != os.stat("/proc/self/ns/user").st_ino:
                os.setns(owner, os.CLONE_NEWUSER)
        finally:
            os.close(owner)
        os.setns(net, os.CLONE_NEWNET)
    finally:
        os.close(net)


def _run(argv: Sequence[str], stdin: str | None = None) -> None:
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    if result.returncode != 0:
        said = " ".join((result.stderr or result.stdout).split())
        raise RuntimeError(f"`{' '.join(argv[:4])}` failed: {said or result.returncode}")


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 5 or not all(a.isdigit() for a in args[:3]):
        sys.exit("usage: python -m egressd.sandbox.capture PID TCP_PORT DNS_PORT IP NFT")
    pid, tcp_port, dns_port = map(int, args[:3])
    ip, nft = args[3:]
    try:
        enter_network_of(pid)
    except OSError as exc:
        sys.exit(f"cannot enter the sandbox's network namespace: {exc}")
    try:
        # the rules first: a route without them would deliver every address to the sandbox's own
        # loopback instead of "network unreachable"
        _run([nft, "-f", "-"], ruleset(tcp_port, dns_port))
        # every IPv4 address is local: no "network unreachable" before the redirect sees the packet
        _run([ip, "route", "add", "local", "0.0.0.0/0", "dev", "lo", "table", "local"])
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        sys.exit(str(exc))


if __name__ == "__main__":
    main()
