"""The first egressd process inside the bubblewrap sandbox: the proxy's listeners, then the child.

bubblewrap neither forwards signals nor reports how its child died (a signal becomes 128+N), and
the sandbox is a new session, so the terminal's signals do not reach the child either. The
launcher fills those gaps, and hands egressd the proxy's listeners, over what it inherits:

- handover (a Unix socket to egressd): first of all, the launcher binds the proxy's listening
  sockets on the sandbox's loopback (127.0.0.1:3128 HTTP, :1080 SOCKS5, :3130 HTTP that needs no
  credentials, since only the child can reach it) and sends them to egressd
  (SCM_RIGHTS), which accepts the child's connections on them itself: no relay in between. They
  are bound before the child starts, so its first connection already finds them.
- control (egressd -> launcher): one byte per signal to deliver to the child. EOF means egressd
  is gone: the child is stopped (SIGTERM, then SIGKILL), since it has no way out any more.
- status (launcher -> egressd): `started`, then `exit N` (a subprocess-style code, -N for a
  signal), or `error MESSAGE` when the sandbox could not be set up.
- setup (egressd -> launcher, optional): one JSON line, then EOF, written once egressd has set up
  the sandbox's network from outside (capture.py): whether connections are captured and the
  child's proxy credentials, which the capture's CONNECTs carry. The child starts only after it,
  so nothing it sends escapes the capture, and the credentials never pass through argv or the
  environment, which the child could read.

The launcher is the sandbox's PID 1 (bubblewrap's --as-pid-1): it reaps what the child leaves
behind, and when it exits the kernel ends the PID namespace, and with it the capture's bridge and
anything the child left running. Before anything else it makes itself not dumpable and joins a new
session keyring (the user's stays outside).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import functools
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import NoReturn

from egressd.exits import FORWARDED_SIGNALS, exec_failure
from egressd.sandbox import BRIDGE_HOST, bridge, seccomp

STOP_GRACE = 5.0
PR_SET_DUMPABLE = 4
PROXY_BACKLOG = 4096  # as egressd's own ports: a burst of the child's connections waits, not fails
# Dispositions the child must start with (the launcher ignores these, Python ignores SIGPIPE).
_CHILD_DEFAULTS = tuple({*FORWARDED_SIGNALS, signal.SIGPIPE, getattr(signal, "SIGXFSZ", signal.SIGPIPE)})


def _report(fd: int, line: str) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, (line + "\n").encode())


def _parse_listen(text: str) -> tuple[tuple[str, int], str]:
    address, sep, kind = text.partition("=")
    if not sep or kind not in ("http", "socks", "open"):
        raise ValueError(f"{text!r}: expected HOST:PORT=http|socks|open")
    return bridge.parse_hostport(address), kind


def _hand_over(fd: int, listens: Sequence[str]) -> None:
    """Bind the proxy's listeners here, in the sandbox's network namespace, and send them to
    egressd: one message, the kinds comma-separated, the descriptors in the same order."""
    with socket.socket(fileno=fd) as channel:
        sockets = [
            (bridge.listen(address, PROXY_BACKLOG), kind) for address, kind in map(_parse_listen, listens)
        ]
        try:
            kinds = ",".join(kind for _, kind in sockets).encode()
            socket.send_fds(channel, [kinds], [sock.fileno() for sock, _ in sockets])
        finally:
            for sock, _ in sockets:
                sock.close()  # egressd holds them now


def _parse_capture(text: str) -> tuple[int, int, tuple[str, int]]:
    ports, sep, proxy = text.partition("=")
    tcp, comma, dns = ports.partition(",")
    if not sep or not proxy or not comma or not tcp.isdigit() or not dns.isdigit():
        raise ValueError(f"{text!r}: expected TCP_PORT,DNS_PORT=PROXY_HOST:PORT")
    return int(tcp), int(dns), bridge.parse_hostport(proxy)


def _read_setup(fd: int) -> dict[str, object]:
    """egressd's one setup line; an empty dict when egressd went away before sending it."""
    data = b""
    with contextlib.suppress(OSError):
        while b"\n" not in data and (chunk := os.read(fd, 4096)):
            data += chunk
    os.close(fd)
    try:
        setup = json.loads(data.partition(b"\n")[0] or b"{}")
    except ValueError:
        return {}
    return setup if isinstance(setup, dict) else {}


def _bind_capture(spec: str, names_fd: int | None) -> Callable[[str], Awaitable[None]]:
    """Bind the capture's listeners now (before the child starts); return what serves them, given
    the child's credentials, once the bridge's thread runs. `names_fd`: where egressd answers the
    names the child's DNS asks for (front/names.py)."""
    tcp_port, dns_port, proxy = _parse_capture(spec)
    tcp = bridge.listen((BRIDGE_HOST, tcp_port))
    dns_udp = bridge.bind_udp((BRIDGE_HOST, dns_port))
    dns_tcp = bridge.listen((BRIDGE_HOST, dns_port))

    def serve(auth: str) -> Awaitable[None]:
        from egressd.sandbox import intercept

        names = socket.socket(fileno=names_fd) if names_fd is not None else None
        return intercept.Capture(proxy, auth, tcp_port, names).serve(tcp, dns_udp, dns_tcp)

    return serve


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
                with contextlib.suppress(OSError):
                    send(signo)
                time.sleep(pause)
            return
        for signo in data:
            with contextlib.suppress(OSError, ValueError):
                send(signo)


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m egressd.sandbox.launcher")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--status-fd", type=int, required=True)
    parser.add_argument("--handover-fd", type=int, required=True)
    parser.add_argument("--listen", action="append", default=[], metavar="HOST:PORT=http|socks|open")
    parser.add_argument("--setup-fd", type=int, default=None)
    parser.add_argument("--capture", default=None, metavar="TCP_PORT,DNS_PORT=PROXY_HOST:PORT")
    parser.add_argument("--link-view", action="append", default=[], metavar="DIRECTORY=VIEW")
    parser.add_argument("--names-fd", type=int, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command")
    return args


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
            with contextlib.suppress(FileExistsError):
                os.symlink(os.path.join(view, name), os.path.join(directory, name))


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
    optional = [fd for fd in (args.setup_fd, args.names_fd) if fd is not None]
    for fd in (control, status, args.handover_fd, *optional):
        os.set_inheritable(fd, False)  # the child gets none of the pipes
    try:
        _not_dumpable()
    except OSError as exc:
        _report(status, f"error cannot protect the launcher from the child: {exc}")
        os._exit(1)
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
        _report(status, f"error cannot listen on the sandbox's loopback: {exc}")
        os._exit(1)
    capture: Callable[[], Awaitable[None]] | None = None
    if args.setup_fd is not None:
        setup = _read_setup(args.setup_fd)
        if not setup:
            _report(status, "error egressd went away before the command started")
            os._exit(1)
        auth = setup.get("auth")
        if args.capture and setup.get("capture") and isinstance(auth, str):
            try:
                serve = _bind_capture(args.capture, args.names_fd)
            except (OSError, ValueError) as exc:
                _report(status, f"error cannot listen on the sandbox's loopback: {exc}")
                os._exit(1)
            capture = functools.partial(serve, auth)
    try:
        pid = os.posix_spawnp(args.command[0], args.command, os.environ, setsigdef=_CHILD_DEFAULTS)
    except OSError as exc:
        code = exec_failure(args.command[0], exc)
        _report(status, f"exit {code}")
        os._exit(code)
    if capture is not None:  # the listeners are bound: the child's first connections wait for it
        bridge.start_thread(capture)
    _report(status, "started")
    threading.Thread(target=_relay_signals, args=(control, _signaller(pid)), daemon=True).start()
    code = os.waitstatus_to_exitcode(_wait_reaping(pid))
    _report(status, f"exit {code}")
    sys.stderr.flush()
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
