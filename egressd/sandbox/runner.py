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
import json
import os
import secrets
import select
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from egressd.child.env import CHILD_PROXY_VAR
from egressd.child.process import SignalCatcher, run_child, spawn
from egressd.inspect.ca import java_truststore_path
from egressd.platform.exits import EXIT_CANNOT_RUN, exec_failure
from egressd.sandbox import (
    BRIDGE_HOST,
    BRIDGE_HTTP_PORT,
    BRIDGE_OPEN_PORT,
    BRIDGE_SOCKS_PORT,
    hooks,
    preflight,
    seccomp,
    workloads,
)
from egressd.sandbox.bwrap import Bind, BwrapSpec, bwrap_argv
from egressd.sandbox.launch import (
    LauncherLink,
    Outcome,
    host_ports,
    keep_only_inherited,
    launcher_import_path,
    listens,
    proxied_env,
    say,
)
from egressd.sandbox.layout import Layout
from egressd.sandbox.mounts import within

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
    base = dict(os.environ if base is None else base)
    for name in SOCKET_VARIABLES:
        target = base.get(name, "").removeprefix("unix://")
        if target and any(within(os.path.realpath(target), top) for top in hidden):
            del base[name]
    env = proxied_env(session, creds, http, socks, base, open_port)
    env.pop(CHILD_PROXY_VAR, None)  # the sandbox's credential-free port is named by JAVA_TOOL_OPTIONS
    for name in TEMP_VARIABLES:
        env[name] = temp
    private_cache = PRIVATE_CACHE if temp == "/tmp" else os.path.join(temp, ".egressd-cache")
    for name, sub in CACHE_VARIABLES.items():
        env[name] = os.path.join(cache or private_cache, sub)
    env[SANDBOX_VAR] = kind
    return env


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


def _explained(outcome: Outcome, bwrap: str, disable_userns: bool) -> Outcome:
    """A sandbox that handed nothing over: when an empty one fails as well, bubblewrap cannot make
    a sandbox here, and the outcome says why with the fix (`unavailable`); else it is the run's own."""
    try:
        preflight.probe(bwrap, disable_userns)
    except preflight.SandboxUnavailable as exc:
        return Outcome(EXIT_CANNOT_RUN, started=False, error=str(exc), unavailable=True)
    return outcome


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
    warn: Callable[[str], None] = say,
    ended: Callable[[], object] | None = None,
) -> Outcome:
    """bubblewrap with the launcher inside; the proxy's listeners it hands over served by the
    proxy; capture installed; signals forwarded; status read. `capture_direct`: redirect
    connections that skip the proxy to it. The placeholders of the project's missing hooks exist
    while bubblewrap runs (it mounts them read-only), and are gone when this returns. `ended`:
    called once bubblewrap is gone (with it every process of the sandbox), before the placeholders
    are removed."""
    assert session.proxy is not None
    socks = (BRIDGE_HOST, BRIDGE_SOCKS_PORT) if session.proxy.socks_address else None
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
        registry = hooks.registry_of(layout.own_home)
        standing = held.enter_context(hooks.placeholders(layout.placeholders, existing, registry))
        excluded = held.enter_context(hooks.excludes(standing, roots, layout.own_home))
    except hooks.PlaceholderError as exc:
        held.close()
        return Outcome(EXIT_CANNOT_RUN, started=False, error=str(exc))
    link = LauncherLink(capture_direct=capture_direct)
    info_r, info_w = os.pipe()
    seccomp_r = _seccomp_filter(warn)
    os.set_inheritable(info_w, True)
    try:
        spec = BwrapSpec(
            bwrap=bwrap,
            workdir=os.getcwd(),
            mounts=layout.mounts,
            command=link.command(command, listens(session), views=views),
            needed=(*needed_paths(session.ca_bundle), *shown),
            covers=layout.covers,
            disable_userns=disable_userns,
            info_fd=info_w,
            binds=tuple(Bind(source, path) for source, path in excluded),
            seccomp_fd=seccomp_r if seccomp_r >= 0 else None,
            private_views=views,
        )
        keep_only_inherited((*link.inherited, info_w, seccomp_r))
        try:
            # its own process group: the terminal's Ctrl-C must not kill bubblewrap's monitor
            pid = spawn(bwrap_argv(spec), env, catcher, new_process_group=True)
        except OSError as exc:
            return Outcome(exec_failure(bwrap, exc), started=False, error=f"cannot run {bwrap}")
        finally:
            for fd in (info_w, seccomp_r):
                if fd >= 0:
                    os.close(fd)  # the sandbox holds these ends now
            link.spawned()
        try:
            problem = link.serve(session, creds)
            if problem is None:
                launcher = _sandbox_pid(info_r)
                if launcher is not None:  # its tree is searched first for a connection's program
                    session.child_started(creds, launcher)
                link.set_up(host_ports(session), warn)
        finally:
            link.end_setup()
        # the proxy (the resolver, the pipeline, the front), while the child starts: loaded
        # earlier, it would take the CPU bubblewrap and the launcher need, and the child would
        # start later; a client that connects meanwhile waits in the listener's backlog
        session.load()
        status = link.wait(pid, catcher, forward_all=True)
        if ended is not None:
            ended()
        done = link.outcome(status, problem)
        return _explained(done, bwrap, disable_userns) if problem == "" and not done.started else done
    finally:
        link.close()
        with contextlib.suppress(OSError):
            os.close(info_r)
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
    from egressd.sandbox import leftovers  # macOS's: Linux never loads Seatbelt's modules

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
    from egressd.sandbox.sbpl import UnquotablePath  # macOS's: Linux never loads Seatbelt's modules
    from egressd.sandbox.seatbelt import run_marker, seatbelt_argv, seatbelt_profile

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
        keep_only_inherited(())
        session.load()

        def started(pid: int) -> None:
            group.append(pid)
            owner[0] = _set_terminal_group(pid)

        code = run_child(seatbelt_argv(profile, command, sandbox_exec), env, catcher=catcher, started=started,
                         new_process_group=True)  # fmt: skip
        return Outcome(code)
    finally:
        _restore_terminal(owner[0])
        end_run(group[0] if group else None, marker, run_dir)
