"""Run one child in the sandbox, with a started ProxySession, and return how it ended.

Linux: bubblewrap -> launcher, which binds the proxy's listeners on the sandbox's loopback and
hands them to egressd (the proxy accepts the child's connections on them itself, no relay in
between), then starts the child. egressd forwards every signal it catches to the launcher over the
control pipe: the sandbox is a new session, so even the terminal's Ctrl-C reaches the child only
this way, once. The exit status comes back on the status pipe (bubblewrap alone would turn "killed
by SIGTERM" into 143).
macOS: `sandbox-exec` with the generated profile runs the child, in a process group of its own
that has the terminal (as a shell runs a job), with a temporary directory of its own; when it
ends, its group is killed, so is every process its profile still confines (leftovers.py), and
the directory is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import select
import shutil
import signal
import socket
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import egressd
from egressd.ca import java_truststore_path
from egressd.child_env import child_environment, java_environment
from egressd.exits import EXIT_CANNOT_RUN, exec_failure
from egressd.process import SignalCatcher, run_child, spawn
from egressd.proxy import EngineError
from egressd.sandbox import (
    BRIDGE_CAPTURE_PORT,
    BRIDGE_DNS_PORT,
    BRIDGE_HOST,
    BRIDGE_HTTP_PORT,
    BRIDGE_OPEN_PORT,
    BRIDGE_SOCKS_PORT,
    capture,
    hooks,
    leftovers,
    preflight,
    seccomp,
    workloads,
)
from egressd.sandbox.bwrap import Bind, BwrapSpec, bwrap_argv, launcher_command
from egressd.sandbox.layout import Layout
from egressd.sandbox.mounts import within
from egressd.sandbox.sbpl import UnquotablePath
from egressd.sandbox.seatbelt import run_marker, seatbelt_argv, seatbelt_profile
from egressd.ssh_env import with_git_ssh

if TYPE_CHECKING:
    from egressd.admission.credentials import ProxyCredentials
    from egressd.session import ProxySession

SANDBOX_VAR = "EGRESSD_SANDBOX"
# The child's caches: a fresh directory in the sandbox's private /tmp, or --cache DIR. Never the
# user's own (~/.npm, ~/.cache): read-only inside, and a cache the child could poison if writable.
PRIVATE_CACHE = "/tmp/.egressd-cache"
CACHE_VARIABLES = {
    "npm_config_cache": "npm",
    "UV_CACHE_DIR": "uv",
    "PIP_CACHE_DIR": "pip",
    "XDG_CACHE_HOME": "xdg",
}
SOCKET_VARIABLES = ("SSH_AUTH_SOCK", "DOCKER_HOST")
TEMP_VARIABLES = ("TMPDIR", "TMP", "TEMP")


@dataclass(frozen=True)
class Outcome:
    """How the child ended (subprocess-style code), or why it never started."""

    returncode: int
    started: bool = True
    error: str | None = None


def sandbox_env(
    session: ProxySession,
    creds: ProxyCredentials,
    http: tuple[str, int],
    socks: tuple[str, int] | None,
    kind: str,
    base: Mapping[str, str] | None = None,
    hidden: Sequence[str] = (),
    cache: str | None = None,
    open_port: tuple[str, int] | None = None,
    temp: str = "/tmp",
) -> dict[str, str]:
    """The child environment with the proxy URLs the child can reach from inside the sandbox.

    Variables that lead to a hidden socket (SSH_AUTH_SOCK, a unix:// DOCKER_HOST) are dropped:
    the sandbox hides what they point at. TMPDIR, TMP and TEMP name `temp`, the run's own
    temporary directory (bubblewrap's private /tmp, or Seatbelt's per-run directory); the caches
    of npm, uv, pip and XDG programs are in it, or in `cache` (--cache DIR).
    """
    socks_url = creds.proxy_url(*socks, scheme="socks5h") if socks else None
    base = dict(os.environ if base is None else base)
    for name in SOCKET_VARIABLES:
        target = base.get(name, "").removeprefix("unix://")
        if target and any(within(os.path.realpath(target), top) for top in hidden):
            del base[name]
    env = child_environment(
        base,
        creds.proxy_url(*http),
        socks_url,
        ca_bundle=session.ca_bundle,
        placeholders=session.placeholders(),
        hidden=session.hidden_variables(),
    )
    store = java_truststore_path(session.ca_bundle) if session.ca_bundle else None
    # the JVM sends no Basic credentials on a CONNECT: the open port
    env = java_environment(
        env, proxy=open_port, truststore=str(store) if store is not None and store.is_file() else None
    )
    for name in TEMP_VARIABLES:
        env[name] = temp
    private_cache = PRIVATE_CACHE if temp == "/tmp" else os.path.join(temp, ".egressd-cache")
    for name, sub in CACHE_VARIABLES.items():
        env[name] = os.path.join(cache or private_cache, sub)
    env[SANDBOX_VAR] = kind
    return with_git_ssh(env, session.policy)


def package_root() -> str:
    """The directory egressd's own package is imported from (the launcher imports it from there)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(egressd.__file__)))


def launcher_import_path() -> str:
    """Where the launcher (started without site) imports from: egressd's package and the
    site-packages that hold what the capture uses (dnspython)."""
    paths = [package_root(), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    return os.pathsep.join(dict.fromkeys(paths))


def needed_paths(ca_bundle: str | None) -> tuple[str, ...]:
    """What egressd itself needs inside: its Python and every directory the launcher imports from
    (shown read-only where the home is masked), and the CA bundle when inspecting."""
    paths = [sys.prefix, sys.base_prefix, *launcher_import_path().split(os.pathsep)]
    if ca_bundle:
        paths.append(ca_bundle)
        if os.path.isfile(java_truststore_path(ca_bundle)):
            paths.append(str(java_truststore_path(ca_bundle)))
    return tuple(dict.fromkeys(os.path.realpath(p) for p in paths if os.path.exists(p)))


# -- Linux: bubblewrap ---------------------------------------------------------------------------
def _pipe_pair() -> tuple[int, int, int, int]:
    """(control read, control write, status read, status write); the sandbox ends are inheritable."""
    control_r, control_w = os.pipe()
    status_r, status_w = os.pipe()
    os.set_inheritable(control_r, True)
    os.set_inheritable(status_w, True)
    fcntl.fcntl(control_w, fcntl.F_SETFL, os.O_NONBLOCK)  # a signal never blocks egressd
    fcntl.fcntl(status_r, fcntl.F_SETFL, os.O_NONBLOCK)
    return control_r, control_w, status_r, status_w


def _read_status(fd: int) -> list[str]:
    data = b""
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(fd, 4096):
            data += chunk
    return data.decode("utf-8", "replace").splitlines()


def _outcome(lines: Sequence[str], bwrap_code: int) -> Outcome:
    """Read the launcher's report: an `error` counts only before `started`, then the first `exit`.

    The child cannot reach the pipe (the launcher is not dumpable), and even a line it forged after
    `started` could not turn a run into "the sandbox did not start".
    """
    started = "started" in lines
    before = lines[: lines.index("started")] if started else lines
    for line in before:
        if line.startswith("error "):
            return Outcome(EXIT_CANNOT_RUN, started=False, error=line[6:])
    for line in lines:
        if line.startswith("exit "):
            with contextlib.suppress(ValueError):
                return Outcome(int(line[5:]), started=started)
    if started:  # the launcher died without a word: bubblewrap's status is all there is
        return Outcome(bwrap_code)
    return Outcome(bwrap_code, started=False, error=f"bubblewrap exited with status {bwrap_code}")


HANDOVER_TIMEOUT = 30.0  # the launcher binds two sockets; a loaded machine may take a while to start it


def _receive_listeners(channel: socket.socket) -> list[tuple[socket.socket, str]]:
    """The proxy's listeners the launcher bound inside, or [] when it died first (its status says
    why)."""
    channel.settimeout(HANDOVER_TIMEOUT)
    try:
        message, fds, _flags, _addr = socket.recv_fds(channel, 1024, 8)
    except OSError:
        return []
    kinds = message.decode("ascii", "replace").split(",") if message else []
    if len(kinds) != len(fds):
        for fd in fds:
            os.close(fd)
        return []
    return [(socket.socket(fileno=fd), kind) for fd, kind in zip(fds, kinds, strict=True)]


def _keep_only_inherited(keep: Sequence[int]) -> None:
    """Nothing but stdio and the sandbox's pipes crosses into the sandbox.

    A descriptor the caller left open (a directory, a socket, a file) would otherwise reach the
    child, which could write through it (or `/proc/self/fd/N`) where the sandbox allows nothing.
    """
    listing = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    for name in os.listdir(listing):
        fd = int(name)
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):
                os.set_inheritable(fd, False)


INFO_TIMEOUT = 60.0  # bubblewrap reports the sandbox's PID once its namespaces exist


def _sandbox_pid(info_fd: int, timeout: float = INFO_TIMEOUT) -> int | None:
    """The sandbox's first process, from bubblewrap's --info-fd JSON; None if bubblewrap failed."""
    data = b""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([info_fd], [], [], left)
        if not ready:
            break
        try:
            chunk = os.read(info_fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        data += chunk
        with contextlib.suppress(ValueError):
            pid = json.loads(data).get("child-pid")
            return pid if isinstance(pid, int) and pid > 0 else None
    return None


def _set_up_network(
    info_r: int,
    setup_w: int,
    creds: ProxyCredentials,
    want_capture: bool,
    warn: Callable[[str], None],
    host_ports: Sequence[int] = (),
) -> None:
    """Install the capture in the sandbox's network namespace, then let the launcher start the child.

    Without nft or ip, or when the kernel refuses, the child still runs confined: it simply cannot
    connect except through the proxy (the warning says so)."""
    captured = False
    if want_capture:
        pid = _sandbox_pid(info_r)
        problem = (
            capture.install(pid, BRIDGE_CAPTURE_PORT, BRIDGE_DNS_PORT, host_ports)
            if pid is not None
            else "bubblewrap did not report the sandbox's PID"
        )
        if problem is None:
            captured = True
        else:
            warn(
                f"cannot capture connections that ignore the proxy variables ({problem}); "
                "inside the sandbox only the proxy leads out"
            )
    setup: dict[str, object] = {"capture": captured}
    if captured:  # the credentials go only where they are used
        setup["auth"] = f"{creds.username}:{creds.token}"
    with contextlib.suppress(OSError):  # the launcher is gone: its status tells why
        os.write(setup_w, json.dumps(setup).encode() + b"\n")


# the sandbox's own listeners: never sent to the host, whatever the policy names
SANDBOX_PORTS = frozenset(
    {BRIDGE_HTTP_PORT, BRIDGE_SOCKS_PORT, BRIDGE_OPEN_PORT, BRIDGE_CAPTURE_PORT, BRIDGE_DNS_PORT}
)


def _host_ports(session: ProxySession) -> tuple[int, ...]:
    """The host's loopback ports the policy names at start (loopback.ports, --allow-loopback-port):
    captured to the proxy even when the client never uses a proxy for 127.0.0.1."""
    return tuple(p for p in session.policy.loopback.ports if p not in SANDBOX_PORTS)


def _seccomp_filter(warn: Callable[[str], None]) -> int:
    """An inheritable descriptor bubblewrap reads the seccomp filter from; -1 (with a warning)
    on a machine egressd has no filter for."""
    data = seccomp.program()
    if data is None:
        warn(
            f"no seccomp filter for {os.uname().machine}: inside the sandbox every socket family "
            "and the keyring calls stay open"
        )
        return -1
    fd = seccomp.write_to(data)
    os.set_inheritable(fd, True)
    return fd


def _say(message: str) -> None:
    print(f"egressd: {message}", file=sys.stderr, flush=True)


def _wait_forwarding(pid: int, catcher: SignalCatcher, control_w: int) -> int:
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return os.waitstatus_to_exitcode(status)
        got = catcher.wait(0.5)
        if got is None or got.signo == signal.SIGCHLD:
            continue
        # forwarded even when the kernel sent it to our process group: the sandbox is a new session
        with contextlib.suppress(OSError):
            os.write(control_w, bytes([got.signo]))


def run_bwrap(
    session: ProxySession,
    creds: ProxyCredentials,
    command: Sequence[str],
    layout: Layout,
    *,
    env_base: Mapping[str, str] | None = None,
    bwrap: str,
    disable_userns: bool,
    catcher: SignalCatcher,
    capture_direct: bool = True,
    warn: Callable[[str], None] = _say,
) -> Outcome:
    """bubblewrap with the launcher inside; the proxy's listeners it hands over served by the
    proxy; capture installed; signals forwarded; status read. `capture_direct`: redirect
    connections that skip the proxy to it. The placeholders of the project's missing hooks exist
    while bubblewrap runs (it mounts them read-only), and are gone when this returns."""
    assert session.proxy is not None
    http = f"{BRIDGE_HOST}:{BRIDGE_HTTP_PORT}"
    listens = [(http, "http"), (f"{BRIDGE_HOST}:{BRIDGE_OPEN_PORT}", "open")]
    socks = None
    if session.proxy.socks_address:
        listens.append((f"{BRIDGE_HOST}:{BRIDGE_SOCKS_PORT}", "socks"))
        socks = (BRIDGE_HOST, BRIDGE_SOCKS_PORT)
    env = sandbox_env(
        session,
        creds,
        (BRIDGE_HOST, BRIDGE_HTTP_PORT),
        socks,
        "bubblewrap",
        env_base,
        (*layout.hidden, *layout.masked),
        layout.cache,
        (BRIDGE_HOST, BRIDGE_OPEN_PORT),
    )
    shown = workloads.command_paths(command, env, layout.mounts, warn)
    views = workloads.private_views(env)
    held = contextlib.ExitStack()
    try:
        roots = layout.before.roots if layout.before else ()
        existing = [path for path, _ in layout.hooks]
        registry = os.path.join(layout.own_home, "placeholders") if layout.own_home else None
        standing = held.enter_context(hooks.placeholders(layout.placeholders, existing, registry))
        excluded = held.enter_context(hooks.excludes(standing, roots, layout.own_home))
    except hooks.PlaceholderError as exc:
        held.close()
        return Outcome(EXIT_CANNOT_RUN, started=False, error=str(exc))
    control_r, control_w, status_r, status_w = _pipe_pair()
    info_r, info_w = os.pipe()
    setup_r, setup_w = os.pipe()
    handover, handover_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    # the capture's questions for the child's DNS (front/names.py): the launcher's end only
    names: socket.socket | None
    names, names_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    seccomp_r = _seccomp_filter(warn)
    os.set_inheritable(info_w, True)
    os.set_inheritable(setup_r, True)
    os.set_inheritable(handover_child.fileno(), True)
    os.set_inheritable(names_child.fileno(), True)
    inherited = (
        control_r,
        status_w,
        info_w,
        setup_r,
        handover_child.fileno(),
        names_child.fileno(),
        seccomp_r,
    )
    try:
        spec = BwrapSpec(
            bwrap=bwrap,
            workdir=os.getcwd(),
            mounts=layout.mounts,
            command=launcher_command(
                sys.executable,
                launcher_import_path(),
                control_r,
                status_w,
                handover_child.fileno(),
                listens,
                command,
                setup_fd=setup_r,
                capture=(BRIDGE_CAPTURE_PORT, BRIDGE_DNS_PORT, http) if capture_direct else None,
                views=views,
                names_fd=names_child.fileno() if capture_direct else None,
            ),
            needed=(*needed_paths(session.ca_bundle), *shown),
            covers=layout.covers,
            disable_userns=disable_userns,
            info_fd=info_w,
            binds=tuple(Bind(source, path) for source, path in excluded),
            seccomp_fd=seccomp_r if seccomp_r >= 0 else None,
            private_views=views,
        )
        _keep_only_inherited(inherited)
        try:
            # its own process group: the terminal's Ctrl-C must not kill bubblewrap's monitor
            pid = spawn(bwrap_argv(spec), env, catcher, new_process_group=True)
        except OSError as exc:
            return Outcome(exec_failure(bwrap, exc), started=False, error=f"cannot run {bwrap}")
        finally:
            for fd in (control_r, status_w, info_w, setup_r, seccomp_r):
                if fd >= 0:
                    os.close(fd)  # the sandbox holds these ends now
            handover_child.close()
            names_child.close()
        problem = None
        try:
            try:
                for sock, kind in _receive_listeners(handover):
                    # the proxy's loop owns it from now on; "open" needs no credentials: it is the
                    # child's alone, in its own network namespace
                    implicit = creds if kind == "open" else None
                    session.proxy.serve_socket(sock, "http" if kind == "open" else kind, implicit)
                if capture_direct:
                    session.proxy.serve_names(names, creds.profile)  # the proxy's loop owns it now
                    names = None
            except EngineError as exc:
                problem = str(exc)  # EOF on setup below: the launcher stops without the child
            else:
                _set_up_network(info_r, setup_w, creds, capture_direct, warn, _host_ports(session))
        finally:
            os.close(setup_w)  # EOF: the launcher never waits for more
            setup_w = -1
        bwrap_code = _wait_forwarding(pid, catcher, control_w)
        if problem is not None:
            return Outcome(EXIT_CANNOT_RUN, started=False, error=problem)
        return _outcome(_read_status(status_r), bwrap_code)
    finally:
        handover.close()
        if names is not None:
            names.close()
        for fd in (control_w, status_r, info_r, setup_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        held.close()  # the sandbox is gone: its placeholders go too


# -- macOS: Seatbelt -----------------------------------------------------------------------------
# Where macOS keeps temporary files: /tmp, and each user's $TMPDIR under /var/folders.
TEMP_ROOTS = ("/private/tmp", "/private/var/folders")


def temp_root(environ: Mapping[str, str]) -> str:
    """Where the run's own temporary directory goes: the user's $TMPDIR (canonical) when it lies
    under /var/folders or /tmp, else /tmp."""
    tmpdir = os.path.realpath(environ.get("TMPDIR") or "/tmp")
    if any(within(tmpdir, top) and tmpdir != top for top in TEMP_ROOTS) and os.path.isdir(tmpdir):
        return tmpdir
    return os.path.realpath("/tmp")


def make_run_dir(environ: Mapping[str, str]) -> str:
    """The run's own temporary directory (0700), canonical: the only place outside its mounts the
    child writes; never the host's /tmp or $TMPDIR, shared with builds outside the sandbox."""
    return os.path.realpath(tempfile.mkdtemp(prefix="egressd-run-", dir=temp_root(environ)))


def terminals() -> tuple[str, ...]:
    """The terminal devices the child inherits on stdin, stdout and stderr (the only ones it opens)."""
    names = []
    for fd in (0, 1, 2):
        with contextlib.suppress(OSError):
            if os.isatty(fd):
                names.append(os.path.realpath(os.ttyname(fd)))
    return tuple(dict.fromkeys(names))


def _set_terminal_group(pgid: int) -> int | None:
    """Give the terminal to process group `pgid` when egressd has it (as a shell does for the job
    it runs); the group that had it, or None."""
    try:
        if not os.isatty(0) or os.tcgetpgrp(0) != os.getpgrp():
            return None
        owner = os.tcgetpgrp(0)
        previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        try:
            os.tcsetpgrp(0, pgid)
        finally:
            signal.signal(signal.SIGTTOU, previous)
    except OSError:
        return None
    with contextlib.suppress(OSError):  # one that read the terminal before it was its own
        os.killpg(pgid, signal.SIGCONT)
    return owner


def _restore_terminal(owner: int | None) -> None:
    if owner is None:
        return
    with contextlib.suppress(OSError):
        previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        try:
            os.tcsetpgrp(0, owner)
        finally:
            signal.signal(signal.SIGTTOU, previous)


def end_run(pgid: int | None, marker: str, run_dir: str) -> None:
    """What the child left: its process group killed, then every process its profile confines
    (one that left the group), then its temporary directory removed."""
    if pgid is not None:
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)
    leftovers.end_leftovers(marker)
    shutil.rmtree(run_dir, ignore_errors=True)  # fd-based: a symlink the child left is not followed


def run_seatbelt(
    session: ProxySession,
    creds: ProxyCredentials,
    command: Sequence[str],
    layout: Layout,
    *,
    env_base: Mapping[str, str] | None = None,
    sandbox_exec: str,
    catcher: SignalCatcher,
    serve: Sequence[int] = (),
) -> Outcome:
    """The child talks to the proxy's own loopback port; Seatbelt allows nothing else out."""
    assert session.proxy is not None
    http = session.proxy.http_address
    socks = session.proxy.socks_address
    ports = [http[1]] + ([socks[1]] if socks else [])
    home = os.path.realpath(os.path.expanduser("~"))
    marker = run_marker(secrets.token_hex(16))
    run_dir = make_run_dir(os.environ)
    group: list[int] = []
    owner: list[int | None] = [None]
    try:
        try:
            profile = seatbelt_profile(
                layout,
                ports,
                temp=[run_dir],
                home=home,
                needed=needed_paths(session.ca_bundle),
                terminals=terminals(),
                serve=serve,
                marker=marker,
            )
        except UnquotablePath as exc:
            return Outcome(EXIT_CANNOT_RUN, started=False, error=str(exc))
        problem = preflight.check_profile(sandbox_exec, profile)
        if problem is not None:
            return Outcome(EXIT_CANNOT_RUN, started=False, error=problem)
        hidden = (*layout.hidden, *layout.masked)
        env = sandbox_env(
            session, creds, http, socks, "seatbelt", env_base, hidden, layout.cache, temp=run_dir
        )
        _keep_only_inherited(())

        def started(pid: int) -> None:
            group.append(pid)
            owner[0] = _set_terminal_group(pid)

        code = run_child(seatbelt_argv(profile, command, sandbox_exec), env, catcher=catcher, started=started,
                         new_process_group=True)  # fmt: skip
        return Outcome(code)
    finally:
        _restore_terminal(owner[0])
        end_run(group[0] if group else None, marker, run_dir)
