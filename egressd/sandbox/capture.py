"""Capture, in the sandbox's network namespace, what a child sends without using the proxy.

Why: many clients ignore the proxy variables (node's fetch, Java's HttpClient, aiohttp's default
session, urllib3, Go with its own transport). Without capture, in the sandbox they get nothing at all.
egressd (host side, owner of the sandbox's user namespace) installs, before the child starts:

- a route that makes every IPv4 address local to the sandbox's `lo` (so a connect() to any
  address, the synthetic ones the bridge's DNS responder hands out included, is not "unreachable"),
- nftables rules that redirect every TCP connection leaving the sandbox's own loopback to the
  bridge's transparent listener, every UDP and TCP port-53 packet to its DNS responder, and drop
  every other packet that is not loopback (UDP, ICMP, IPv6).

The bridge then asks the proxy with a CONNECT for the name the address stands for: the decision
stays in the proxy. This module decides nothing either; it only sets the plumbing: `nft` and `ip`
run through util-linux's `nsenter`, in the sandbox's network namespace and the user namespace that
owns it (joining a user namespace needs a single-threaded process, which egressd is not; nsenter
starts in milliseconds).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from egressd.sandbox import BRIDGE_SOURCE

# Addresses the bridge's DNS responder hands out, one per name (RFC 2544 benchmarking range: never
# a real destination). Inside the sandbox every IPv4 address is local, these included.
SYNTHETIC_NET = "198.18.0.0/15"
TOOL_DIRS = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")
INSTALL_TIMEOUT = 30.0
HINT = "apt-get install nftables iproute2 util-linux"
NS_GET_USERNS = 0xB701  # linux/nsfs.h: _IO(0xb7, 0x1)


def ruleset(
    tcp_port: int,
    dns_port: int,
    host_ports: Sequence[int] = (),
    *,
    all_loopback: bool = False,
    own_ports: Sequence[int] = (),
) -> str:
    """The nftables rules for the child's network namespace (pure: tested as text).

    nat/output runs before the route is final: DNS first (a resolv.conf naming 127.0.0.53 is
    captured too), then the loopback ports the policy names for the host (`host_ports`: a client
    that never uses a proxy for 127.0.0.1, node's fetch or Go's, still reaches the host's service
    there, through the proxy, unless a server in the namespace listens on it: the bridge tries that
    first, from BRIDGE_SOURCE) — or, with `all_loopback` (a child that is not sandboxed), every
    loopback port but egressd's own there (`own_ports`) — then the namespace's own loopback stays
    untouched, then every other TCP connection goes to the transparent listener. filter/output
    drops whatever is left that is not loopback: UDP other than DNS, ICMP, every other protocol,
    and all IPv6 but ::1.
    """
    host = ""
    # not the bridge's own connections (from BRIDGE_SOURCE): it tries the namespace's loopback first
    if all_loopback:
        own = ", ".join(str(port) for port in sorted({*own_ports, tcp_port, dns_port}))
        host = (
            f"        ip saddr != {BRIDGE_SOURCE} ip daddr 127.0.0.0/8 tcp dport != {{ {own} }} "
            f"redirect to :{tcp_port}\n"
        )
    elif host_ports:
        ports = ", ".join(str(port) for port in sorted(set(host_ports)))
        host = (
            f"        ip saddr != {BRIDGE_SOURCE} ip daddr 127.0.0.0/8 tcp dport {{ {ports} }} "
            f"redirect to :{tcp_port}\n"
        )
    return f"""\
table inet egressd_capture {{
    chain nat_out {{
        type nat hook output priority -100; policy accept;
        meta nfproto ipv4 udp dport 53 redirect to :{dns_port}
        meta nfproto ipv4 tcp dport 53 redirect to :{dns_port}
{host}        ip daddr 127.0.0.0/8 accept
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
    """$EGRESSD_IP / $EGRESSD_NFT / $EGRESSD_NSENTER, else the system directories only: these run
    outside the sandbox, and PATH often leads into the project (an activated .venv/bin,
    node_modules/.bin), where an earlier child could have put its own `nft`."""
    environ = os.environ if environ is None else environ
    chosen = environ.get(f"EGRESSD_{name.upper()}")
    if chosen:
        return chosen if os.path.isfile(chosen) and os.access(chosen, os.X_OK) else None
    return shutil.which(name, path=os.pathsep.join(TOOL_DIRS))


def _namespace_fds(network: int) -> tuple[int, ...]:
    """The child's network namespace (a copy of the descriptor `network`) and, for an ordinary
    user, the user namespace that owns it.

    An ordinary user holds CAP_NET_ADMIN in the child's network only from inside the user
    namespace that owns it (root holds it in every one below its own). That is not the namespace
    of the child's processes: bubblewrap's --disable-userns (and the launcher's own --unshare)
    move them one user namespace deeper, where the network belongs to the parent. The kernel
    names the owner (NS_GET_USERNS).
    """
    net = fcntl.fcntl(network, fcntl.F_DUPFD_CLOEXEC, 3)
    if os.geteuid() == 0:
        return (net,)
    try:
        owner = fcntl.ioctl(net, NS_GET_USERNS)
    except OSError:
        os.close(net)
        raise
    return (net, owner)


def install(network: int, rules: str) -> str | None:
    """Install the capture (`rules`: ruleset's) in the network namespace `network` (a descriptor of
    it, from the launcher inside); None when done, else why not."""
    tools = {name: find_tool(name) for name in ("nft", "ip", "nsenter")}
    missing = [name for name, found in tools.items() if found is None]
    if missing:
        return f"{' and '.join(missing)} not found; {HINT}"
    try:
        fds = _namespace_fds(network)
    except OSError as exc:
        return f"cannot open the child's network namespace: {exc}"
    try:
        return _run_steps(tools, fds, rules)
    finally:
        for fd in fds:
            os.close(fd)


def _run_steps(tools: Mapping[str, str | None], fds: tuple[int, ...], rules: str) -> str | None:
    # the descriptors, not /proc/PID: the namespaces stay the child's whatever that PID becomes
    enter = [str(tools["nsenter"]), f"--net=/proc/self/fd/{fds[0]}"]
    if len(fds) > 1:
        enter += [f"--user=/proc/self/fd/{fds[1]}", "--preserve-credentials"]
    env = {"PATH": os.pathsep.join(TOOL_DIRS), "LC_ALL": "C"}
    # the rules first: a route without them would deliver every address to the sandbox's own
    # loopback instead of "network unreachable"; then every IPv4 address is local, so no
    # "network unreachable" comes before the redirect sees the packet
    steps = (
        ([str(tools["nft"]), "-f", "-"], rules),
        ([str(tools["ip"]), "route", "add", "local", "0.0.0.0/0", "dev", "lo", "table", "local"], ""),
    )
    for argv, stdin in steps:
        try:
            result = subprocess.run(
                [*enter, "--", *argv],
                input=stdin,
                env=env,
                capture_output=True,
                text=True,
                timeout=INSTALL_TIMEOUT,
                pass_fds=fds,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"cannot run {argv[0]} in the sandbox: {exc}"
        if result.returncode != 0:
            said = " ".join((result.stderr or result.stdout).split())
            return f"`{' '.join(argv[:4])}` failed: {said or result.returncode}"
    return None
