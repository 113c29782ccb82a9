"""What the child must never change or read, laid over the user's mounts (pure: tested on any OS).

Two kinds of host paths matter to a sandboxed child that has read the source:

- **guarded** — what egressd itself reads or runs after the child started: its own code and
  interpreter (a module imported late would run outside the sandbox), the policy it reloads, the
  audit it writes. Inside a writable mount each becomes a read-only bind. Renaming a directory on
  the way to it would let the child put another file at the same path on the host, so every plain
  directory between it and the writable mount is bound onto itself (still writable, but a mount
  point cannot be renamed or removed) — also when a `--ro` mount holds it, and on the way to
  every user mount nested in a writable one (a mount moves with its renamed parent). A writable
  mount that IS such a path, or lies inside one, is refused: the child could change it.
- **hidden** — what the child must not read: the user's credentials, egressd's home (the CA key,
  also when it is created or rotated during the run) and sockets that hand out authority (the
  ssh-agent, docker). A directory gets an empty tmpfs, a file or socket an empty file, and the
  plain directories on the way are pinned like a guarded path's (a tmpfs moves with a renamed
  parent, and the path would then lead to a directory of the child's). A user mount inside one
  needs `--show` first.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from egressd.sandbox.mounts import Mount, MountError, depth, within

# What the sandbox hides by default, relative to the user's home.
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
)
# Daemon sockets that hand out authority, outside the private /run and /tmp.
AUTHORITY_SOCKETS: tuple[str, ...] = ("/var/run/docker.sock", "/var/run/podman/podman.sock")


@dataclass(frozen=True)
class Cover:
    """One mount laid over the user's: `ro` a read-only bind of the path itself, `pin` a writable
    bind onto itself (the name can no longer be renamed), `tmpfs` an empty directory, `empty` an
    empty file."""

    path: str
    kind: Literal["ro", "pin", "tmpfs", "empty"]


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
    is_dir: Callable[[str], bool] = os.path.isdir,
) -> tuple[Cover, ...]:
    """The covers for `guarded` ({path: what it is}) and `hidden` paths; MountError when a user
    mount would make a guarded path writable or show a hidden one."""
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
    # a pin inside a hidden directory would bind the host's directory over its empty tmpfs
    hiding = [c.path for c in covers.values() if c.kind in ("tmpfs", "empty")]
    return tuple(
        c for c in covers.values() if c.kind != "pin" or not any(within(c.path, top) for top in hiding)
    )


def existing(paths: Iterable[str]) -> tuple[str, ...]:
    """Canonical, existing, distinct paths (a cover needs something to lie on)."""
    found = (os.path.realpath(p) for p in paths if p and os.path.lexists(p))
    return tuple(dict.fromkeys(p for p in found if os.path.exists(p)))


def credential_paths(home: str, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The user's credentials and authority sockets that exist now (the default hidden set)."""
    paths = [os.path.join(home, rel) for rel in CREDENTIALS]
    paths += AUTHORITY_SOCKETS
    if environ.get("SSH_AUTH_SOCK"):
        paths.append(environ["SSH_AUTH_SOCK"])
    docker_host = environ.get("DOCKER_HOST", "")
    if docker_host.startswith("unix://"):
        paths.append(docker_host[len("unix://") :])
    return existing(paths)


def apply_show(hidden: Sequence[str], shown: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(still hidden, shown inside a hidden directory): --show drops a hidden path, or shows one
    file or directory inside it read-only. Showing what is not hidden is an error."""
    keep = list(hidden)
    inside = []
    for path in shown:
        if path in keep:
            keep.remove(path)
        elif any(within(path, top) for top in keep):
            inside.append(path)
        else:
            raise MountError(f"--show {path}: the sandbox does not hide it (nothing to show)")
    return tuple(keep), tuple(inside)


def ordered_with(mounts: Sequence[Mount], covers: Sequence[Cover]) -> list[Mount | Cover]:
    """User mounts then covers, parents first (stable: a cover follows a user mount of equal depth)."""
    return sorted([*mounts, *covers], key=lambda m: depth(m.path))
