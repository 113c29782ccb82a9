"""The first egressd process in the child's network namespace: the proxy's listeners, then the child.

It runs inside bubblewrap (`egressd sandbox`), or on its own with `--unshare` (`exec`, `mcp run`,
`acp`): then it makes the child's user and network namespaces itself, and nothing else of the
child is confined. bubblewrap neither forwards signals nor reports how its child died (a signal
becomes 128+N), and the sandbox is a new session, so the terminal's signals do not reach the child
either. The launcher fills those gaps, and hands egressd the proxy's listeners, over what it
inherits:

- handover (a Unix socket to egressd): first of all, the launcher binds the proxy's listening
  sockets on the namespace's loopback (127.0.0.1:3128 HTTP, :1080 SOCKS5, :3130 HTTP that needs no
  credentials, since only the child can reach it) and sends them to egressd (SCM_RIGHTS) with a
  sock_diag socket of the namespace (egressd finds which program holds a connection there with
  it); egressd accepts the child's connections on them itself: no relay in between. They are
  bound before the child starts, so its first connection already finds them.
- control (egressd -> launcher): one byte per signal to deliver to the child. EOF means egressd
  is gone: the child is stopped (SIGTERM, then SIGKILL), since it has no way out any more.
- status (launcher -> egressd): `started`, then `exit N` (a subprocess-style code, -N for a
  signal), or `error MESSAGE` when the namespace could not be set up (`unavailable MESSAGE` when
  the kernel refused the user or network namespace itself).
- setup (egressd -> launcher, optional): one line, then EOF, written once egressd has set up
  the namespace's network from outside (capture.py): `capture` or `no-capture`. The child
  starts only after it, so nothing it sends escapes the capture.
- names and captures (optional, with capture): the capture asks egressd for the names of the
  child's DNS over the first, and hands it every captured connection over the second
  (intercept.py).

Under bubblewrap the launcher is the sandbox's PID 1 (--as-pid-1): it reaps what the child leaves
behind, and when it exits the kernel ends the PID namespace, and with it the capture's bridge and
anything the child left running. Before anything else it makes itself not dumpable and (in the
sandbox) joins a new session keyring (the user's stays outside).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence

from egressd.platform.exits import FORWARDED_SIGNALS, exec_failure
from egressd.sandbox import BRIDGE_HOST, SETUP_CAPTURE, SETUP_NO_CAPTURE, bridge, seccomp

TYPE_CHECKING = False  # typing itself is not imported: it would be a good part of the start
# nor contextlib: try/except and try/finally do here what its helpers would
if TYPE_CHECKING:
    from typing import NoReturn

STOP_GRACE = 5.0
PR_SET_DUMPABLE = 4
NETLINK_SOCK_DIAG = 4
PROXY_BACKLOG = 4096  # as egressd's own ports: a burst of the child's connections waits, not fails
# Dispositions the child must start with (the launcher ignores these, Python ignores SIGPIPE).
_CHILD_DEFAULTS = tuple({*FORWARDED_SIGNALS, signal.SIGPIPE, getattr(signal, "SIGXFSZ", signal.SIGPIPE)})


def _report(fd: int, line: str) -> None:
    try:
        os.write(fd, (line + "\n").encode())
    except OSError:
        pass


def _parse_listen(text: str) -> tuple[tuple[str, int], str]:
    address, sep, kind = text.partition("=")
    if not sep or kind not in ("http", "socks", "open"):
        raise ValueError(f"{text!r}: expected HOST:PORT=http|socks|open")
    return bridge.parse_hostport(address), kind


def _hand_over(fd: int, listens: Sequence[str]) -> None:
    """Bind the proxy's listeners here, in the child's network namespace, and send them to egressd
    with this namespace itself (egressd installs the capture's rules in it: the launcher is not
    dumpable, so its /proc entry is not egressd's to open) and a sock_diag socket of it (which
    program holds a connection is asked there): one message, the kinds comma-separated, the
    descriptors in the same order."""
    held: list[socket.socket] = []
    network = -1
    with socket.socket(fileno=fd) as channel:
        try:
            handed = []
            for address, kind in map(_parse_listen, listens):
                held.append(bridge.listen(address, PROXY_BACKLOG))
                handed.append((held[-1].fileno(), kind))
            network = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            handed.append((network, "netns"))
            try:
                held.append(socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG))
                handed.append((held[-1].fileno(), "diag"))
            except OSError:  # a kernel without sock_diag: no program is named
                pass
            kinds = ",".join(kind for _, kind in handed).encode()
            socket.send_fds(channel, [kinds], [fd for fd, _ in handed])  # egressd holds them now
        finally:
            for sock in held:
                sock.close()
            if network >= 0:
                os.close(network)


def _parse_capture(text: str) -> tuple[int, int]:
    tcp, comma, dns = text.partition(",")
    if not comma or not tcp.isdigit() or not dns.isdigit():
        raise ValueError(f"{text!r}: expected TCP_PORT,DNS_PORT")
    return int(tcp), int(dns)


def _read_setup(fd: int) -> str | None:
    """egressd's one setup line (SETUP_CAPTURE or SETUP_NO_CAPTURE); None when egressd went away
    before sending it."""
    data = b""
    try:
        while b"\n" not in data and (chunk := os.read(fd, 4096)):
            data += chunk
    except OSError:
        pass
    os.close(fd)
    line, newline, _ = data.partition(b"\n")
    said = line.decode("ascii", "replace")
    return said if newline and said in (SETUP_CAPTURE, SETUP_NO_CAPTURE) else None


def _bind_capture(
    spec: str, names_fd: int | None, captures_fd: int
) -> tuple[Callable[[], Awaitable[None]], tuple[socket.socket, ...]]:
    """Bind the capture's listeners now (before the child starts); return what serves them once
    the bridge's thread runs, and the listeners whose first client starts it. `names_fd`: where
    egressd answers the names the child's DNS asks for (front/names.py); `captures_fd`: where the
    captured connections go (front/captured.py)."""
    tcp_port, dns_port = _parse_capture(spec)
    tcp = bridge.listen((BRIDGE_HOST, tcp_port), PROXY_BACKLOG)
    dns_udp = bridge.bind_udp((BRIDGE_HOST, dns_port))
    dns_tcp = bridge.listen((BRIDGE_HOST, dns_port))

    def serve() -> Awaitable[None]:
        from egressd.sandbox import intercept

        names = socket.socket(fileno=names_fd) if names_fd is not None else None
        handover = socket.socket(fileno=captures_fd)
        return intercept.Capture(tcp_port, handover, names).serve(tcp, dns_udp, dns_tcp)

    return serve, (tcp, dns_udp, dns_tcp)


def _signaller(pid: int) -> Callable[[int], None]:
    """Signal the child by pidfd where possible: never a recycled PID after the child was reaped."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return lambda signo: os.kill(pid, signo)
    return lambda signo: signal.pidfd_send_signal(pidfd, signo)


def _relay_signals(control_fd: int, send: Callable[[int], None]) -> None:
    while True:
        try:
            data = os.read(control_fd, 64)
        except OSError:
            data = b""
        if not data:  # egressd is gone: stop the child, it has no way out any more
            for signo, pause in ((signal.SIGTERM, STOP_GRACE), (signal.SIGKILL, 0.0)):
                try:
                    send(signo)
                except OSError:
                    pass
                time.sleep(pause)
            return
        for signo in data:
            try:
                send(signo)
            except (OSError, ValueError):
                pass


class Arguments:
    """The launcher's command line, as launcher_command (bwrap.py) writes it: each option followed
    by its value, `--unshare` alone, then `--` and the child's command. Parsed by hand: argparse
    (and the regular expressions it imports) would be most of the launcher's start-up."""

    NAMED = (
        "--control-fd",
        "--status-fd",
        "--handover-fd",
        "--setup-fd",
        "--names-fd",
        "--captures-fd",
        "--capture",
        "--listen",
        "--link-view",
    )
    REPEATED = ("--listen", "--link-view")

    def __init__(self, argv: Sequence[str]) -> None:
        values: dict[str, list[str]] = {}
        self.unshare = False
        position = 0
        while position < len(argv) and argv[position] != "--":
            name = argv[position]
            if name == "--unshare":
                self.unshare = True
                position += 1
                continue
            if name not in self.NAMED or position + 1 >= len(argv):
                raise ValueError(f"unexpected {name!r}")
            if name not in self.REPEATED and name in values:
                raise ValueError(f"{name} given twice")
            values.setdefault(name, []).append(argv[position + 1])
            position += 2
        self.command = list(argv[position + 1 :])
        if not self.command:
            raise ValueError("no command")
        self.control_fd = _required_fd(values, "--control-fd")
        self.status_fd = _required_fd(values, "--status-fd")
        self.handover_fd = _required_fd(values, "--handover-fd")
        self.setup_fd = _fd(values, "--setup-fd")
        self.names_fd = _fd(values, "--names-fd")
        self.captures_fd = _fd(values, "--captures-fd")
        self.listen = values.get("--listen", [])
        self.link_view = values.get("--link-view", [])
        self.capture = values["--capture"][0] if "--capture" in values else None


def _fd(values: dict[str, list[str]], name: str) -> int | None:
    given = values.get(name)
    if given is None:
        return None
    if not given[0].isdigit():
        raise ValueError(f"{name} {given[0]!r}: expected a descriptor")
    return int(given[0])


def _required_fd(values: dict[str, list[str]], name: str) -> int:
    fd = _fd(values, name)
    if fd is None:
        raise ValueError(f"{name} is required")
    return fd


def _arguments(argv: Sequence[str] | None) -> Arguments:
    try:
        return Arguments(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        print(f"python -m egressd.sandbox.launcher: {exc}", file=sys.stderr, flush=True)
        os._exit(2)


def _not_dumpable() -> None:
    """No process of the same user (the child) may open /proc/<launcher>/fd or ptrace the launcher.

    Its status pipe leads to egressd and its bridge holds the child's credentials: both stay its own.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def _own_session_keyring() -> None:
    """Replace the session keyring inherited from the user with a new, empty one.

    The user's session keyring may hold Kerberos, AFS or CIFS credentials, and the kernel searches
    it on the child's behalf (a network file system's look-ups); the child's own keyring calls are
    refused by the seccomp filter, which lets exactly this one through. A kernel without keyrings
    has nothing to hide.
    """
    arch = seccomp.native_arch()
    if arch is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    keyctl = ctypes.c_long(arch.calls["keyctl"])
    join = ctypes.c_long(seccomp.KEYCTL_JOIN_SESSION_KEYRING)
    if libc.syscall(keyctl, join, ctypes.c_void_p(None)) < 0:
        code = ctypes.get_errno()
        if code != errno.ENOSYS:
            raise OSError(code, os.strerror(code))


def _link_views(pairs: Sequence[str]) -> None:
    """Fill each private, writable directory with links to the entries of the host's read-only
    view of it: the child sees what the host has, and whatever it writes there stays its own."""
    for pair in pairs:
        directory, _, view = pair.partition("=")
        for name in os.listdir(view):
            try:
                os.symlink(os.path.join(view, name), os.path.join(directory, name))
            except FileExistsError:
                pass


SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
_IFREQ = struct.Struct("16sH")


def _map_ids(uid: tuple[int, int], gid: tuple[int, int]) -> None:
    """This user namespace's one uid and one gid: (inside, outside) each. An unprivileged process
    maps only its own ids, and a gid only once setgroups is denied (a child namespace inherits it)."""
    try:
        with open("/proc/self/setgroups", "w") as handle:
            handle.write("deny")
    except OSError:
        pass
    for name, (inside, outside) in (("uid_map", uid), ("gid_map", gid)):
        with open(f"/proc/self/{name}", "w") as handle:
            handle.write(f"{inside} {outside} 1")


def _loopback_up() -> None:
    """A new network namespace has `lo`, down: up, as bubblewrap does for the sandbox."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        _, flags = _IFREQ.unpack(fcntl.ioctl(sock, SIOCGIFFLAGS, _IFREQ.pack(b"lo", 0)))
        fcntl.ioctl(sock, SIOCSIFFLAGS, _IFREQ.pack(b"lo", flags | IFF_UP))


def _own_network() -> None:
    """`--unshare`: a network namespace of the child's own (only `lo`, egressd's listeners its way
    out), and nothing else of the child's changed. For a user who is not root, inside two user
    namespaces, as bubblewrap makes them: the outer one maps the user to root and owns the network,
    so egressd, joining it from outside, may install the capture's rules (capture.py); the inner
    one maps the user to itself, so the child is who it is and holds no capability over the network
    (it belongs to the outer namespace), not even through a program with file capabilities. Root
    needs no user namespace: it stays root. Must run while the process has one thread."""
    uid, gid = os.getuid(), os.getgid()
    if os.geteuid() == 0:
        os.unshare(os.CLONE_NEWNET)
        _loopback_up()
        return
    os.unshare(os.CLONE_NEWUSER)
    _map_ids((0, uid), (0, gid))
    os.unshare(os.CLONE_NEWNET)
    _loopback_up()
    os.unshare(os.CLONE_NEWUSER)
    _map_ids((uid, 0), (gid, 0))


def probe() -> NoReturn:
    """Can the child's namespaces be made here? Exit 0, or 1 with why on stdout."""
    try:
        _own_network()
    except OSError as exc:
        print(f"{exc.strerror or exc} ({type(exc).__name__})", flush=True)
        os._exit(1)
    os._exit(0)


def _wait_reaping(pid: int) -> int:
    """The child's wait status. The launcher is the PID namespace's first process: every process
    the child leaves behind becomes its child, and is reaped here (else a zombie for good)."""
    while True:
        done, wait_status = os.waitpid(-1, 0)
        if done == pid:
            return wait_status


def main(argv: Sequence[str] | None = None) -> NoReturn:
    args = _arguments(argv)
    control, status = args.control_fd, args.status_fd
    optional = [fd for fd in (args.setup_fd, args.names_fd, args.captures_fd) if fd is not None]
    for fd in (control, status, args.handover_fd, *optional):
        os.set_inheritable(fd, False)  # the child gets none of the pipes
    if args.unshare:
        try:
            _own_network()
        except OSError as exc:
            _report(status, f"unavailable {exc.strerror or exc} ({type(exc).__name__})")
            os._exit(1)
    try:
        _not_dumpable()
    except OSError as exc:
        _report(status, f"error cannot protect the launcher from the child: {exc}")
        os._exit(1)
    if not args.unshare:  # the sandbox's: an unconfined child keeps the user's keyring
        try:
            _own_session_keyring()
        except OSError as exc:
            _report(status, f"error cannot give the sandbox a session keyring of its own: {exc}")
            os._exit(1)
    try:
        _link_views(args.link_view)
    except OSError as exc:
        _report(status, f"error cannot make a private copy of {exc.filename}: {exc.strerror}")
        os._exit(1)
    for signo in FORWARDED_SIGNALS:
        signal.signal(signo, signal.SIG_IGN)  # only egressd's control pipe signals the launcher's child
    try:
        _hand_over(args.handover_fd, args.listen)
    except (OSError, ValueError) as exc:
        _report(status, f"error cannot listen on the child's loopback: {exc}")
        os._exit(1)
    capture: tuple[Callable[[], Awaitable[None]], tuple[socket.socket, ...]] | None = None
    if args.setup_fd is not None:
        setup = _read_setup(args.setup_fd)
        if setup is None:
            _report(status, "error egressd went away before the command started")
            os._exit(1)
        if args.capture and setup == SETUP_CAPTURE and args.captures_fd is not None:
            try:
                capture = _bind_capture(args.capture, args.names_fd, args.captures_fd)
            except (OSError, ValueError) as exc:
                _report(status, f"error cannot listen on the child's loopback: {exc}")
                os._exit(1)
    try:
        pid = os.posix_spawnp(args.command[0], args.command, os.environ, setsigdef=_CHILD_DEFAULTS)
    except OSError as exc:
        code = exec_failure(args.command[0], exc)
        _report(status, f"exit {code}")
        os._exit(code)
    if capture is not None:  # the listeners are bound: the child's first connections wait for it
        bridge.start_thread(*capture)
    _report(status, "started")
    threading.Thread(target=_relay_signals, args=(control, _signaller(pid)), daemon=True).start()
    code = os.waitstatus_to_exitcode(_wait_reaping(pid))
    _report(status, f"exit {code}")
    sys.stderr.flush()
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
