"""egressd's side of one launcher (launcher.py): the pipes and sockets between them, the proxy's
listeners it hands over, the capture set up from outside, the signals, how the child ended.

The launcher runs as the first process of the child's network namespace: under bubblewrap for
`egressd sandbox`, or on its own (`--unshare`, its own user and network namespaces) for `exec`,
`mcp run` and `acp`, whose child is not confined otherwise. Both are driven from here, the same way.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import sys
import sysconfig
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import egressd
from egressd.child.env import CHILD_PROXY_VAR, NO_PROXY_VARS, child_environment, java_environment
from egressd.child.ssh_env import with_git_ssh
from egressd.front.handed import Handed
from egressd.inspect.ca import java_truststore_path
from egressd.platform.diag import Diag
from egressd.platform.exits import EXIT_CANNOT_RUN
from egressd.sandbox import (
    BRIDGE_CAPTURE_PORT,
    BRIDGE_DNS_PORT,
    BRIDGE_HOST,
    BRIDGE_HTTP_PORT,
    BRIDGE_OPEN_PORT,
    BRIDGE_SOCKS_PORT,
    SETUP_CAPTURE,
    SETUP_NO_CAPTURE,
    capture,
)
from egressd.sandbox.bwrap import launcher_command
from egressd.session.proxy import EngineError

if TYPE_CHECKING:
    from egressd.admission.credentials import ProxyCredentials
    from egressd.child.process import SignalCatcher
    from egressd.session import ProxySession

HANDOVER_TIMEOUT = 30.0  # the launcher binds a few sockets; a loaded machine may take a while to start it
# the launcher could not make the child's namespaces (user namespaces refused): its status line
UNAVAILABLE = "unavailable "


@dataclass(frozen=True)
class Outcome:
    """How the child ended (subprocess-style code), or why it never started; `unavailable`: the
    kernel refused the namespaces (the child was not run)."""

    returncode: int
    started: bool = True
    error: str | None = None
    unavailable: bool = False


def package_root() -> str:
    """The directory egressd's own package is imported from (the launcher imports it from there)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(egressd.__file__)))


def launcher_import_path() -> str:
    """Where the launcher (started without site) imports from: egressd's package and the
    site-packages that hold what the capture uses (dnspython)."""
    paths = [package_root(), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    return os.pathsep.join(dict.fromkeys(paths))


def read_status(fd: int) -> list[str]:
    data = b""
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(fd, 4096):
            data += chunk
    return data.decode("utf-8", "replace").splitlines()


def outcome(lines: Sequence[str], code: int, runner: str = "bubblewrap") -> Outcome:
    """Read the launcher's report: an `error` counts only before `started`, then the first `exit`.

    The child cannot reach the pipe (the launcher is not dumpable), and even a line it forged after
    `started` could not turn a run into "the sandbox did not start".
    """
    started = "started" in lines
    before = lines[: lines.index("started")] if started else lines
    for line in before:
        if line.startswith("error "):
            return Outcome(EXIT_CANNOT_RUN, started=False, error=line[6:])
        if line.startswith(UNAVAILABLE):
            return Outcome(EXIT_CANNOT_RUN, started=False, error=line[len(UNAVAILABLE) :], unavailable=True)
    for line in lines:
        if line.startswith("exit "):
            with contextlib.suppress(ValueError):
                return Outcome(int(line[5:]), started=started)
    if started:  # the launcher died without a word: its runner's status is all there is
        return Outcome(code)
    return Outcome(code, started=False, error=f"{runner} exited with status {code}")


def receive_listeners(channel: socket.socket) -> list[tuple[int, str]]:
    """The descriptors the launcher made inside (the proxy's listeners, the network namespace, its
    sock_diag) with their kinds, or [] when it died first (its status says why)."""
    channel.settimeout(HANDOVER_TIMEOUT)
    try:
        message, fds, _flags, _addr = socket.recv_fds(channel, 1024, 8, socket.MSG_CMSG_CLOEXEC)
    except OSError:
        return []
    kinds = message.decode("ascii", "replace").split(",") if message else []
    if len(kinds) != len(fds):
        for fd in fds:
            os.close(fd)
        return []
    return list(zip(fds, kinds, strict=True))


def keep_only_inherited(keep: Sequence[int]) -> None:
    """Nothing but stdio and the launcher's pipes crosses into the child's namespaces.

    A descriptor the caller left open (a directory, a socket, a file) would otherwise reach the
    child, which could write through it (or `/proc/self/fd/N`) where the sandbox allows nothing.
    """
    listing = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    for name in os.listdir(listing):
        fd = int(name)
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):
                os.set_inheritable(fd, False)


# the launcher's own listeners: never sent to the host, whatever the policy names
OWN_PORTS = frozenset(
    {BRIDGE_HTTP_PORT, BRIDGE_SOCKS_PORT, BRIDGE_OPEN_PORT, BRIDGE_CAPTURE_PORT, BRIDGE_DNS_PORT}
)


def host_ports(session: ProxySession) -> tuple[int, ...]:
    """The host's loopback ports the policy names at start (loopback.ports, --allow-loopback-port):
    captured to the proxy even when the client never uses a proxy for 127.0.0.1."""
    return tuple(p for p in session.policy.loopback.ports if p not in OWN_PORTS)


def listens(session: ProxySession, *, open_port: bool = True) -> list[tuple[str, str]]:
    """The proxy's listeners the launcher binds on the namespace's loopback: HTTP, HTTP without
    credentials (`open_port`: only the child reaches it), and SOCKS5 when the proxy serves it."""
    assert session.proxy is not None
    out = [(f"{BRIDGE_HOST}:{BRIDGE_HTTP_PORT}", "http")]
    if open_port:
        out.append((f"{BRIDGE_HOST}:{BRIDGE_OPEN_PORT}", "open"))
    if session.proxy.socks_address:
        out.append((f"{BRIDGE_HOST}:{BRIDGE_SOCKS_PORT}", "socks"))
    return out


def proxied_env(
    session: ProxySession,
    creds: ProxyCredentials,
    http: tuple[str, int],
    socks: tuple[str, int] | None,
    base: Mapping[str, str],
    open_port: tuple[str, int] | None = None,
) -> dict[str, str]:
    """`base` with the proxy variables naming the listeners the child reaches (`http`, `socks`),
    the CA bundle when inspecting, and the JVM's proxy and trust store; `open_port`: the
    credential-free listener only the child reaches (the JVM sends no credentials on a CONNECT),
    also in EGRESSD_CHILD_PROXY."""
    socks_url = creds.proxy_url(*socks, scheme="socks5h") if socks else None
    env = child_environment(
        base,
        creds.proxy_url(*http),
        socks_url,
        ca_bundle=session.ca_bundle,
        placeholders=session.placeholders(),
        hidden=session.hidden_variables(),
    )
    if open_port is not None:
        env[CHILD_PROXY_VAR] = f"http://{open_port[0]}:{open_port[1]}"
    store = java_truststore_path(session.ca_bundle) if session.ca_bundle else None
    env = java_environment(
        env, proxy=open_port, truststore=str(store) if store is not None and store.is_file() else None
    )
    return with_git_ssh(env, session.policy)


# Loopback skips the proxy in a network namespace of the child's own that is not a sandbox: a
# server the child starts is then reached where it listens, and the capture takes a connection
# that finds none to the host's loopback through the proxy (decided by the loopback rules).
OWN_LOOPBACK = "localhost,127.0.0.1,::1"


def with_own_loopback(env: dict[str, str]) -> dict[str, str]:
    for name in NO_PROXY_VARS:
        env[name] = OWN_LOOPBACK
    return env


def inside_env(
    session: ProxySession,
    creds: ProxyCredentials,
    base: Mapping[str, str] | None = None,
    *,
    open_port: bool = True,
    own_loopback: bool = False,
) -> dict[str, str]:
    """The environment of a child in a launcher's network namespace: the proxy's listeners on that
    namespace's loopback (the host's are not reachable from there); `open_port`: with the
    credential-free one; `own_loopback`: see OWN_LOOPBACK."""
    assert session.proxy is not None
    socks = (BRIDGE_HOST, BRIDGE_SOCKS_PORT) if session.proxy.socks_address else None
    base = dict(os.environ if base is None else base)
    port = (BRIDGE_HOST, BRIDGE_OPEN_PORT) if open_port else None
    env = proxied_env(session, creds, (BRIDGE_HOST, BRIDGE_HTTP_PORT), socks, base, port)
    return with_own_loopback(env) if own_loopback else env


def say(message: str) -> None:
    print(f"egressd: {message}", file=sys.stderr, flush=True)


class LauncherLink:
    """egressd's ends of everything it shares with one launcher: the control, status and setup
    pipes, the socket the proxy's listeners come over, and with capture the names service's socket
    and the one the captured connections come over."""

    def __init__(self, *, capture_direct: bool) -> None:
        self.capture_direct = capture_direct
        self.control_r, self.control_w = os.pipe()
        self.status_r, self.status_w = os.pipe()
        self.setup_r, self.setup_w = os.pipe()
        fcntl.fcntl(self.control_w, fcntl.F_SETFL, os.O_NONBLOCK)  # a signal never blocks egressd
        fcntl.fcntl(self.status_r, fcntl.F_SETFL, os.O_NONBLOCK)
        self.handover, self.handover_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.names: socket.socket | None = None
        self.names_child: socket.socket | None = None
        self.captures: socket.socket | None = None
        self.captures_child: socket.socket | None = None
        if capture_direct:
            # the capture's questions for the child's DNS (front/names.py), and the connections it
            # captured (front/captured.py): the launcher's ends only, never the child's
            self.names, self.names_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self.captures, self.captures_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.network = -1  # the child's network namespace, as the launcher hands it over
        self._sandbox_ends = [self.control_r, self.status_w, self.setup_r]
        for sock in (self.handover_child, self.names_child, self.captures_child):
            if sock is not None:
                self._sandbox_ends.append(sock.fileno())
        for fd in self._sandbox_ends:
            os.set_inheritable(fd, True)

    @property
    def inherited(self) -> tuple[int, ...]:
        """The launcher's ends: what crosses into its namespaces besides stdio."""
        return tuple(self._sandbox_ends)

    def command(
        self,
        child: Sequence[str],
        listening: Sequence[tuple[str, str]],
        *,
        views: Sequence[tuple[str, str]] = (),
        unshare: bool = False,
    ) -> tuple[str, ...]:
        """The launcher's command line (run by bubblewrap, or by egressd itself with `unshare`)."""
        names, captures = self.names_child, self.captures_child
        return launcher_command(
            sys.executable,
            launcher_import_path(),
            self.control_r,
            self.status_w,
            self.handover_child.fileno(),
            listening,
            child,
            setup_fd=self.setup_r,
            capture=(BRIDGE_CAPTURE_PORT, BRIDGE_DNS_PORT) if self.capture_direct else None,
            views=views,
            names_fd=names.fileno() if names is not None else None,
            captures_fd=captures.fileno() if captures is not None else None,
            unshare=unshare,
        )

    def spawned(self) -> None:
        """The launcher (or its runner) holds its ends now: egressd's copies go."""
        for fd in (self.control_r, self.status_w, self.setup_r):
            with contextlib.suppress(OSError):
                os.close(fd)
        for sock in (self.handover_child, self.names_child, self.captures_child):
            if sock is not None:
                sock.close()

    def serve(self, session: ProxySession, creds: ProxyCredentials) -> str | None:
        """Serve what the launcher hands over: the proxy's listeners (the credential-free one as
        the child's own), the names service and the captured connections; why not, or None ("":
        the launcher handed nothing over, its status says why)."""
        assert session.proxy is not None
        received = receive_listeners(self.handover)
        if not received:
            return ""
        self.network = next((fd for fd, kind in received if kind == "netns"), -1)
        sockets = [(socket.socket(fileno=fd), kind) for fd, kind in received if kind != "netns"]
        diag = next((Diag(sock) for sock, kind in sockets if kind == "diag"), None)
        try:
            for sock, kind in sockets:
                if kind == "diag":
                    continue
                # the proxy's loop owns it from now on; "open" needs no credentials: it is the
                # child's alone, in its own network namespace
                implicit = creds if kind == "open" else None
                listener = Handed(sock, "http" if kind == "open" else kind, implicit, diag)
                session.proxy.serve_socket(listener)
            if self.names is not None and self.captures is not None:
                session.proxy.serve_names(self.names, creds.profile)  # the proxy's loop owns them now
                session.proxy.serve_captures(self.captures, creds, diag=diag)
                self.names = self.captures = None
        except EngineError as exc:
            return str(exc)  # EOF on setup: the launcher stops without the child
        return None

    def set_up(
        self, host_loopback: Sequence[int], warn: Callable[[str], None], *, all_loopback: bool = False
    ) -> None:
        """Install the capture in the child's network namespace (the one the launcher handed
        over), then let the launcher start the child (EOF on setup once this returns, whatever
        happened). `host_loopback`: the host's loopback ports the capture sends to the proxy;
        `all_loopback`: every loopback port but egressd's own there (capture.ruleset).

        Without nft or ip, or when the kernel refuses, the child still runs in its namespace: it
        simply cannot connect except through the proxy (the warning says so)."""
        captured = False
        if self.capture_direct:
            rules = capture.ruleset(
                BRIDGE_CAPTURE_PORT,
                BRIDGE_DNS_PORT,
                host_loopback,
                all_loopback=all_loopback,
                own_ports=sorted(OWN_PORTS),
            )
            problem = (
                capture.install(self.network, rules)
                if self.network >= 0
                else "the launcher did not hand over its network namespace"
            )
            if problem is None:
                captured = True
            else:
                warn(
                    f"cannot capture connections that ignore the proxy variables ({problem}); "
                    "in the child's network namespace only the proxy leads out"
                )
        with contextlib.suppress(OSError):  # the launcher is gone: its status tells why
            os.write(self.setup_w, (SETUP_CAPTURE if captured else SETUP_NO_CAPTURE).encode() + b"\n")
        self.end_setup()

    def end_setup(self) -> None:
        if self.setup_w >= 0:
            os.close(self.setup_w)  # EOF: the launcher never waits for more
            self.setup_w = -1

    def wait(self, pid: int, catcher: SignalCatcher, *, forward_all: bool) -> int:
        """Wait for the launcher's runner (bubblewrap, or the launcher itself), forwarding the
        signals egressd catches over the control pipe. `forward_all`: also those the kernel sent
        to egressd's process group (the sandbox is a new session: they never reached the child);
        else only those sent to egressd itself (the child shares the group and got them)."""
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done == pid:
                return os.waitstatus_to_exitcode(status)
            got = catcher.wait(0.5)
            if got is None or got.signo == signal.SIGCHLD or (got.from_kernel and not forward_all):
                continue
            with contextlib.suppress(OSError):
                os.write(self.control_w, bytes([got.signo]))

    def outcome(self, code: int, problem: str | None, runner: str = "bubblewrap") -> Outcome:
        """How the run ended: the launcher's report; `problem`: why egressd did not let the child
        start (serve's answer), when the launcher had no words of its own for it."""
        if problem:
            return Outcome(EXIT_CANNOT_RUN, started=False, error=problem)
        return outcome(read_status(self.status_r), code, runner)

    def close(self) -> None:
        self.handover.close()
        if self.network >= 0:
            os.close(self.network)
            self.network = -1
        for sock in (self.names, self.captures):
            if sock is not None:
                sock.close()
        self.end_setup()
        for fd in (self.control_w, self.status_r):
            with contextlib.suppress(OSError):
                os.close(fd)
