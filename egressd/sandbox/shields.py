"""What the child must never change or read, laid over the user's mounts (pure: tested on any OS).

Three kinds of host paths matter to a sandboxed child that has read the source:

- **masked** — the user's home: inside it is an empty directory, read-only once what is shown in
  it is mounted (the working directory, `--rw`/`--ro`/`--show` paths, the harmless configuration
  of HARMLESS, egressd's own Python). A home holds more secrets than any list names, so nothing
  in it is visible unless something names it.
- **guarded** — what egressd itself reads or runs after the child started: its own code and
  interpreter (a module imported late would run outside the sandbox), its presets, the policy it
  reloads, the audit it writes. Inside a writable mount each becomes a read-only bind. Renaming a
  directory on the way to it would let the child put another file at the same path on the host,
  so every plain directory between it and the writable mount is bound onto itself (a mount point
  cannot be renamed or removed) — also when a `--ro` mount holds it, and on the way to every user
  mount nested in a writable one (a mount moves with its renamed parent). Such a pin is a
  writable bind, so it is only ever laid where the directory is writable anyway: never inside a
  read-only cover. A writable mount that IS a guarded path, or lies inside one, is refused.
- **hidden** — what the child must not read even where it is shown: the credentials of
  CREDENTIALS (for a home the user shows), the sources of the policy's secrets, egressd's home
  (the CA key, also when it is created or rotated during the run) and sockets that hand out
  authority (the ssh-agent, docker). A directory gets an empty tmpfs, a file or socket an empty
  file, and the plain directories on the way are pinned like a guarded path's (a tmpfs moves with
  a renamed parent, and the path would then lead to a directory of the child's). A user mount
  inside one needs `--show` first.

`inside_view` says what the child gets at a path for a given set of mounts and covers; the
planner uses it to leave out every cover that changes nothing (each costs bubblewrap a mount).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from egressd.sandbox.mounts import Mount, MountError, depth, within

# Hidden even where the user shows the home (--rw-home, --ro ~, --show ~/.config), relative to it.
# The masked home hides these and everything else by default; this list is the second layer.
CREDENTIALS: tuple[str, ...] = (
    ".ssh",
    ".aws",
    ".npmrc",
    ".pypirc",
    ".netrc",
    ".git-credentials",
    ".config/gh",
    ".config/gcloud",
    ".config/op",
    ".1password",
    ".docker",
    ".kube",
    ".gnupg",
    ".azure",
    ".password-store",
    # registry, forge and infrastructure tokens of other tools
    ".cargo/credentials.toml",
    ".cargo/credentials",
    ".gem/credentials",
    ".vault-token",
    ".terraform.d/credentials.tfrc.json",
    ".config/hub",
    ".config/glab-cli",
    ".config/composer/auth.json",
    ".composer/auth.json",
    ".pulumi/credentials.json",
    ".config/containers/auth.json",
    ".m2/settings.xml",
    ".gradle/gradle.properties",
    ".pgpass",
    ".my.cnf",
    ".s3cfg",
    ".claude",
    ".claude.json",
    ".codex",
    ".local/share/keyrings",
    # what a shell or database client remembers: commands typed with tokens in them
    ".bash_history",
    ".zsh_history",
    ".python_history",
    ".psql_history",
    ".mysql_history",
    # container engines' sockets (Docker API access is root on the host) and browser profiles
    ".colima",
    ".rd",
    ".lima",
    ".local/share/containers",
    ".mozilla",
    ".config/google-chrome",
    ".config/chromium",
    # macOS: the keychains, browsers' profiles and cookies, apps' stored tokens, shell sessions
    ".zsh_sessions",
    ".bash_sessions",
    ".node_repl_history",
    "Library/Keychains",
    "Library/Cookies",
    "Library/Safari",
    "Library/Application Support/Google/Chrome",
    "Library/Application Support/Chromium",
    "Library/Application Support/BraveSoftware",
    "Library/Application Support/Microsoft Edge",
    "Library/Application Support/Arc",
    "Library/Application Support/Firefox",
    "Library/Application Support/1Password",
    "Library/Group Containers/2BUA8C4S2C.com.1password",
    "Library/Application Support/Slack",
    "Library/Application Support/discord",
    "Library/Application Support/Code/User/globalStorage",
    "Library/Application Support/Cursor/User/globalStorage",
    "Library/Application Support/gh",
    "Library/Containers/com.docker.docker",
)
# Shown read-only in the masked home because common tools read them, when they hold nothing that
# looks like a credential (holds_credential). Not the shell's rc files: they often export tokens.
HARMLESS: tuple[str, ...] = (
    ".gitconfig",
    ".config/git/config",
    ".config/git/ignore",
    ".config/git/attributes",
    ".editorconfig",
    ".inputrc",
    ".vimrc",
    ".nanorc",
    ".config/nvim/init.vim",
    ".config/nvim/init.lua",
)
# Daemon sockets that hand out authority, outside the private /run and /tmp.
AUTHORITY_SOCKETS: tuple[str, ...] = ("/var/run/docker.sock", "/var/run/podman/podman.sock")
# What bubblewrap's base layout makes private (fresh, empty) whatever the host holds there.
PRIVATE: tuple[str, ...] = ("/tmp", "/run", "/dev", "/proc")

CoverKind = Literal["ro", "pin", "tmpfs", "empty", "mask"]
View = Literal["rw", "ro", "hidden"]


@dataclass(frozen=True)
class Cover:
    """One mount laid over the user's: `ro` a read-only bind of the path itself, `pin` a writable
    bind onto itself (the name can no longer be renamed), `tmpfs` an empty directory, `empty` an
    empty file, `mask` an empty directory made read-only once everything inside it is mounted."""

    path: str
    kind: CoverKind


_VIEWS: dict[str, View] = {"ro": "ro", "pin": "rw", "tmpfs": "hidden", "empty": "hidden", "mask": "hidden"}


def inside_view(
    path: str, mounts: Sequence[Mount], covers: Iterable[Cover], private: Sequence[str] = PRIVATE
) -> View:
    """What the child gets at the canonical `path`: the host's file writable or read-only, or none
    of the host's (an empty stand-in, a private /tmp). The innermost mount decides; at one path a
    cover is laid after the user's mount (bubblewrap's order: parents first, covers last)."""
    best: tuple[int, int] = (0, -1)
    view: View = "ro"  # the read-only root
    candidates = [(p, 0, "hidden") for p in private]
    candidates += [(m.path, 1, "rw" if m.writable else "ro") for m in mounts]
    candidates += [(c.path, 2, _VIEWS[c.kind]) for c in covers]
    for top, rank, seen in candidates:
        if within(path, top) and (depth(top), rank) >= best:
            best, view = (depth(top), rank), seen  # type: ignore[assignment]
    return view


def _innermost(path: str, mounts: Sequence[Mount]) -> Mount | None:
    holding = [m for m in mounts if within(path, m.path)]
    return max(holding, key=lambda m: len(m.path)) if holding else None


def _pins(path: str, mounts: Sequence[Mount]) -> list[Cover]:
    """Plain directories on the way to `path` that the child could rename (in a writable mount)."""
    user_paths = {m.path for m in mounts}
    pins = []
    parent = os.path.dirname(path)
    while parent != "/":
        holder = _innermost(parent, mounts)
        if holder is None:
            break
        if holder.writable and parent not in user_paths:
            pins.append(Cover(parent, "pin"))
        parent = os.path.dirname(parent)
    return pins


def plan_covers(
    mounts: Sequence[Mount],
    guarded: Mapping[str, str],
    hidden: Iterable[str],
    *,
    masked: Iterable[str] = (),
    shown: Iterable[str] = (),
    is_dir: Callable[[str], bool] = os.path.isdir,
    private: Sequence[str] = PRIVATE,
) -> tuple[Cover, ...]:
    """The covers for `guarded` ({path: what it is}), `hidden` and `masked` paths, and the `shown`
    paths bound read-only inside those; MountError when a user mount would make a guarded path
    writable or show a hidden one. Covers that change nothing are left out (`private`: what the
    sandbox makes private whatever the covers say; none under Seatbelt)."""
    covers: dict[str, Cover] = {}
    for path, what in guarded.items():
        for mount in mounts:
            if mount.writable and within(mount.path, path):
                raise MountError(
                    f"{mount.path} would be writable in the sandbox, but it is or is inside {what} "
                    f"({path}), which the child must never change; run from (or --rw) a directory "
                    "outside it"
                )
        holder = _innermost(path, mounts)
        if holder is not None and holder.writable:  # else read-only already: the root, or a --ro mount
            covers[path] = Cover(path, "ro")
        # pinned also when a --ro mount holds it: that mount moves with a renamed parent, and the
        # child would put its own file at the path egressd reads
        for pin in _pins(path, mounts):
            covers.setdefault(pin.path, pin)
    for path in masked:
        if not any(m.path == path for m in mounts):
            covers[path] = Cover(path, "mask")
    for path in shown:
        covers.setdefault(path, Cover(path, "ro"))
    for path in hidden:
        for mount in mounts:
            if within(mount.path, path):
                raise MountError(
                    f"{mount.path} is inside {path}, which the sandbox hides (credentials or egressd's "
                    f"own files); add --show {path} to let the child see it"
                )
        covers[path] = Cover(path, "tmpfs" if is_dir(path) else "empty")
        # a mount moves with its parent: renamed away, the host path would lead to a directory
        # the child made, where whatever egressd or the user writes there later (a rotated CA)
        # is the child's to read
        for pin in _pins(path, mounts):
            covers.setdefault(pin.path, pin)
    for mount in mounts:  # the user's own --ro (and --rw) mounts keep their host paths too
        for pin in _pins(mount.path, mounts):
            covers.setdefault(pin.path, pin)
    return _needed_only(mounts, covers, private)


def _needed_only(
    mounts: Sequence[Mount], covers: Mapping[str, Cover], private: Sequence[str]
) -> tuple[Cover, ...]:
    """The covers that change what the child gets. A pin only where the directory is writable
    without it: inside a read-only cover it would make that part writable, inside a hidden one it
    would show the host's directory. A read-only or hiding cover only where the path would
    otherwise be something else."""
    settled = [c for c in covers.values() if c.kind != "pin"]
    kept = []
    for cover in covers.values():
        others = [c for c in settled if c is not cover]
        without = inside_view(cover.path, mounts, others, private)
        if cover.kind == "pin":
            needed = without == "rw"
        elif cover.kind == "mask":
            needed = without != "hidden"
        else:
            needed = without != _VIEWS[cover.kind]
        if needed:
            kept.append(cover)
    return tuple(kept)


def existing(paths: Iterable[str]) -> tuple[str, ...]:
    """Canonical, existing, distinct paths (a cover needs something to lie on)."""
    found = (os.path.realpath(p) for p in paths if p and os.path.lexists(p))
    return tuple(dict.fromkeys(p for p in found if os.path.exists(p)))


def credential_paths(home: str, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The user's credentials and authority sockets that exist now (hidden wherever shown)."""
    return existing(listed_credentials(home, environ))


def absent_credentials(home: str, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The listed credentials that do not exist now, canonical: Seatbelt denies a path whether or
    not anything lies there, so one created during the run is hidden too (a cover needs a file)."""
    found = (os.path.realpath(p) for p in listed_credentials(home, environ) if not os.path.lexists(p))
    return tuple(dict.fromkeys(found))


def listed_credentials(home: str, environ: Mapping[str, str]) -> list[str]:
    """Every credential and authority socket the lists name, existing or not."""
    paths = [os.path.join(home, rel) for rel in CREDENTIALS]
    paths += AUTHORITY_SOCKETS
    if environ.get("SSH_AUTH_SOCK"):
        paths.append(environ["SSH_AUTH_SOCK"])
    docker_host = environ.get("DOCKER_HOST", "")
    if docker_host.startswith("unix://"):
        paths.append(docker_host[len("unix://") :])
    return paths


def apply_show(
    hidden: Sequence[str], shown: Sequence[str], masked: Sequence[str] = ()
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(still hidden, shown inside a hidden or masked directory): --show drops a hidden path, or
    shows one file or directory inside it, or inside the masked home, read-only. Showing what is
    not hidden is an error."""
    keep = list(hidden)
    inside = []
    for path in shown:
        named = path in keep
        if named:
            keep.remove(path)
        if any(within(path, top) for top in [*keep, *masked]):
            inside.append(path)  # a credential in the masked home: no longer hidden, and shown
        elif not named:
            raise MountError(f"--show {path}: the sandbox does not hide it (nothing to show)")
    return tuple(keep), tuple(inside)


def ordered_with(mounts: Sequence[Mount], covers: Sequence[Cover]) -> list[Mount | Cover]:
    """User mounts then covers, parents first (stable: a cover follows a user mount of equal depth)."""
    return sorted([*mounts, *covers], key=lambda m: depth(m.path))
