"""The bubblewrap command line (pure: golden-tested on any platform).

Layout inside the sandbox, in mount order (later mounts cover earlier ones):
- `/` read-only; fresh `/dev` and `/proc`; private, empty `/tmp` and `/run` (tmpfs). Hiding `/run`
  also hides the host's daemon sockets (D-Bus, systemd-resolved, docker, ssh-agent): a Unix socket
  is connectable even on a read-only mount, and some of those would be a way out;
- the working directory and `--rw` paths writable, `--ro` paths read-only, with the covers of
  shields.py (the home masked: empty but for what is shown in it; egressd's own code, presets,
  policy and audit read-only; credentials, secrets' sources and egressd's home hidden), all
  parents first;
- paths egressd itself needs when they live under a hidden tree (its Python, the CA bundle);
- the masked home remounted read-only, once everything inside it is mounted.
Namespaces: user (all capabilities dropped), PID, network (only `lo`, which bubblewrap brings
up), IPC, UTS, cgroup; a new session (no controlling terminal: no TIOCSTI injection into the
user's shell); the seccomp filter of seccomp.py. The command is the launcher (see launcher.py),
the PID namespace's first process, which runs the child.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from egressd.sandbox.mounts import Mount, depth, order, within
from egressd.sandbox.shields import Cover, inside_view, ordered_with

NAMESPACES: tuple[str, ...] = (
    "--unshare-user",
    "--unshare-pid",
    "--unshare-net",
    "--unshare-ipc",
    "--unshare-uts",
    "--unshare-cgroup-try",
)
BASE_MOUNTS: tuple[str, ...] = (
    "--ro-bind", "/", "/",
    "--dev", "/dev",
    "--proc", "/proc",
    "--tmpfs", "/tmp",
    "--tmpfs", "/run",
)  # fmt: skip


@dataclass(frozen=True)
class BwrapSpec:
    """Everything the command line depends on; built by run.py from the options and the session."""

    bwrap: str
    workdir: str
    mounts: tuple[Mount, ...]
    command: tuple[str, ...]  # the launcher and its arguments
    needed: tuple[str, ...] = ()  # read-only paths egressd needs inside (python, CA bundle)
    covers: tuple[Cover, ...] = ()  # shields.plan_covers: what the child must not change or read
    disable_userns: bool = True  # bubblewrap >= 0.8: the child cannot make user namespaces
    info_fd: int | None = None  # bubblewrap writes the sandbox's PID there (egressd sets up capture)
    binds: tuple[Bind, ...] = ()  # files shown read-only at a path in place of the host's there
    seccomp_fd: int | None = None  # the seccomp filter bubblewrap loads (seccomp.py)
    # (directory, view): the directory made private and writable (a tmpfs), the host's read-only
    # at `view` (in the private /tmp); the launcher fills the directory with links into the view
    private_views: tuple[tuple[str, str], ...] = ()


PRIVATE_EMPTY = ("/tmp", "/run")


def privately_empty(path: str, mounts: Sequence[Mount]) -> bool:
    """Inside, `path` lies in the sandbox's own empty /tmp or /run (no mount shows the host's)."""
    return any(within(path, top) for top in PRIVATE_EMPTY) and inside_view(path, mounts, ()) == "hidden"


@dataclass(frozen=True)
class Bind:
    """A file of egressd's shown read-only at `path` (which exists on the host) inside."""

    source: str
    path: str


def _hides(cover: Cover) -> bool:
    return cover.kind in ("tmpfs", "empty", "mask")


def _mount_args(item: Mount | Cover | Bind) -> list[str]:
    if isinstance(item, Bind):
        return ["--ro-bind", item.source, item.path]
    if isinstance(item, Mount):
        return ["--bind" if item.writable else "--ro-bind", item.path, item.path]
    if item.kind in ("tmpfs", "mask"):
        return ["--tmpfs", item.path]
    if item.kind == "empty":
        return ["--ro-bind", "/dev/null", item.path]
    return ["--bind" if item.kind == "pin" else "--ro-bind", item.path, item.path]


def security_options(disable_userns: bool) -> list[str]:
    options = list(NAMESPACES)
    if disable_userns:
        options.append("--disable-userns")
    # --as-pid-1: the launcher, not dumpable, is the sandbox's first process; no bubblewrap init
    # (dumpable, the child's uid) stays inside for the child to ptrace or write through /proc/1/mem
    options += ["--cap-drop", "ALL", "--die-with-parent", "--new-session", "--as-pid-1"]
    return options


def mount_plan(spec: BwrapSpec) -> list[Mount | Cover | Bind]:
    """The user's mounts, the covers and egressd's own needed paths, in bubblewrap's order (parents
    first), after its base mounts."""
    # a cover that only hides is left out where the base layout's fresh /tmp or /run already hides
    # its path (no user mount shows it): bubblewrap would make an empty stand-in there for nothing
    covers = [c for c in spec.covers if not (_hides(c) and inside_view(c.path, spec.mounts, ()) == "hidden")]
    # egressd's own paths where nothing else shows them (under /tmp, the masked home, a hidden path)
    needed = [Cover(p, "ro") for p in spec.needed if inside_view(p, spec.mounts, covers) == "hidden"]
    return sorted(
        [*ordered_with(spec.mounts, [*covers, *needed]), *spec.binds],
        key=lambda m: depth(m.path),
    )


def bwrap_argv(spec: BwrapSpec) -> list[str]:
    argv = [spec.bwrap, *security_options(spec.disable_userns)]
    argv += BASE_MOUNTS
    for path, view in spec.private_views:
        argv += ["--ro-bind", path, view]
    plan = mount_plan(spec)
    for item in plan:
        argv += _mount_args(item)
    for path, _view in spec.private_views:
        argv += ["--tmpfs", path]
    # a masked directory (the home) turns read-only once everything shown in it is mounted: the
    # child can then neither plant files nor rename a directory on the way to a mount in it
    for item in plan:
        if isinstance(item, Cover) and item.kind == "mask":
            argv += ["--remount-ro", item.path]
    if spec.info_fd is not None:
        argv += ["--info-fd", str(spec.info_fd)]
    if spec.seccomp_fd is not None:
        argv += ["--seccomp", str(spec.seccomp_fd)]
    argv += ["--chdir", spec.workdir, "--", *spec.command]
    return argv


def probe_argv(bwrap: str, program: str, disable_userns: bool, needed: Sequence[str] = ()) -> list[str]:
    """The same namespaces and base mounts, with egressd's interpreter shown, running `program`
    (`true`: starting an interpreter would only add time): can a sandbox start here?"""
    argv = [bwrap, *security_options(disable_userns), *BASE_MOUNTS]
    for mount in order(Mount(path, False) for path in needed if inside_view(path, (), ()) == "hidden"):
        argv += ["--ro-bind", mount.path, mount.path]
    return [*argv, "--", program]


# The launcher runs from the package egressd itself runs from, and the capture needs dnspython from
# its site-packages: both appended to sys.path (os.pathsep-separated), after the standard library,
# even where the package's parent is a directory the child may write.
LAUNCHER_BOOT = (
    "import os, sys; sys.path += sys.argv.pop(1).split(os.pathsep); "
    "from egressd.sandbox.launcher import main; main()"
)
PROBE_BOOT = LAUNCHER_BOOT.replace("import main; main()", "import probe; probe()")


def launcher_command(
    python: str,
    import_path: str,
    control_fd: int,
    status_fd: int,
    handover_fd: int,
    listens: Sequence[tuple[str, str]],
    child: Sequence[str],
    *,
    setup_fd: int | None = None,
    capture: tuple[int, int] | None = None,
    views: Sequence[tuple[str, str]] = (),
    names_fd: int | None = None,
    captures_fd: int | None = None,
    unshare: bool = False,
) -> tuple[str, ...]:
    """`python -I -S -c LAUNCHER_BOOT IMPORT_PATH ... -- CHILD`; listens are (HOST:PORT, "http",
    "socks" or "open"), the proxy's listeners the launcher binds and hands over; capture is
    (transparent port, DNS port); `unshare`: the launcher makes the child's user and network
    namespaces itself (no bubblewrap: exec's capture)."""
    # -S: no site processing, .pth files or editable finders: the launcher imports the standard
    # library, egressd's own package and dnspython, from IMPORT_PATH
    argv = [python, "-I", "-S", "-c", LAUNCHER_BOOT, import_path]
    argv += [
        "--control-fd",
        str(control_fd),
        "--status-fd",
        str(status_fd),
        "--handover-fd",
        str(handover_fd),
    ]
    if setup_fd is not None:
        argv += ["--setup-fd", str(setup_fd)]
    for address, kind in listens:
        argv += ["--listen", f"{address}={kind}"]
    if capture is not None:
        argv += ["--capture", f"{capture[0]},{capture[1]}"]
    if names_fd is not None:
        argv += ["--names-fd", str(names_fd)]
    if captures_fd is not None:
        argv += ["--captures-fd", str(captures_fd)]
    if unshare:
        argv.append("--unshare")
    for path, view in views:
        argv += ["--link-view", f"{path}={view}"]
    return (*argv, "--", *child)
