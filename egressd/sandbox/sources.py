"""The files a policy's secrets are read from, which the sandboxed child must never read.

A secret's placeholder in the child's environment is worth nothing if the child can `cat` the file
egressd read the value from. Every `from: {file: ...}` path is hidden, and so is every argument of
a `from: {command: [...]}` that names an existing file (`gpg --decrypt ~/k.gpg`, `cat /etc/k`):
what egressd can tell the command reads. A file with more than one hard link is refused: a cover
hides a path, not the file, and the other link may be anywhere the child can read.

The sandbox's mounts are fixed when it starts, so a reload cannot hide a new file. SourceGuard is a
session transform: until the sandbox is planned it collects the sources of every policy loaded
(the sandbox then hides them all); after that, a policy naming a source the child can see inside
the running sandbox is refused like any bad reload (the last good policy stays), and one whose new
source is hidden already (anywhere in the masked home, a private /tmp) applies.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from egressd.policy import Policy, PolicyError
from egressd.policy.secrets import SecretSpec

if TYPE_CHECKING:
    from egressd.sandbox.layout import Layout


class SourceError(ValueError):
    """A secret's source that the sandbox cannot keep from the child; the message says why."""


def _candidate(argument: str) -> str:
    """The path in a command argument: `--key=PATH` or PATH."""
    if argument.startswith("-") and "=" in argument:
        return argument.partition("=")[2]
    return argument


def source_files(specs: Iterable[SecretSpec]) -> dict[str, str]:
    """{canonical path: what it is} for every file a secret is read from: each `file:` path (also
    one missing now, which someone may create before egressd reads it) and each argument of a
    `command:` that names an existing file."""
    found: dict[str, str] = {}
    for spec in specs:
        source = spec.source
        if source.kind == "file":
            paths = [os.path.expanduser(source.file)]
        elif source.kind == "command":
            arguments = [_candidate(a) for a in source.command[1:] if "=" in a or not a.startswith("-")]
            paths = [a for a in arguments if a and os.path.isfile(a)]
        else:
            continue
        for path in paths:
            found.setdefault(os.path.realpath(path), f"the source of secret {spec.name!r}")
    return found


def check_links(files: Mapping[str, str]) -> None:
    """SourceError when a source file has another hard link (which no cover can hide)."""
    for path, what in files.items():
        try:
            links = os.stat(path).st_nlink
        except OSError:
            continue
        if links > 1:
            raise SourceError(
                f"{path} ({what}) has {links} hard links: the sandbox hides a path, not the file, and "
                "the child could read it through another one; keep the secret in a file with a "
                "single link"
            )


class SourceGuard:
    """A ProxySession transform (see the module's docstring): `fix` takes the sources seen so far
    and the function that hides them, and from then on checks every policy against the result."""

    def __init__(self, then: Callable[[Policy], Policy] | None = None) -> None:
        self.then = then
        self._lock = threading.Lock()
        self._seen: dict[str, str] = {}
        self._layout: Layout | None = None

    def __call__(self, policy: Policy) -> Policy:
        policy = self.then(policy) if self.then else policy
        files = source_files(policy.secrets)
        try:
            check_links(files)
        except SourceError as exc:
            raise PolicyError(policy.source, "secrets", message=str(exc)) from None
        with self._lock:
            if self._layout is None:
                for path, what in files.items():
                    self._seen.setdefault(path, what)
                return policy
            for path, what in files.items():
                if not self._layout.hides(path):
                    raise PolicyError(
                        policy.source,
                        "secrets",
                        message=(
                            f"{what} is {path}, which the running sandbox shows to the child (its "
                            "mounts were fixed when it started); keep the file where the sandbox "
                            "hides it (your home outside the project and the paths you show) or "
                            "restart the sandbox"
                        ),
                    )
        return policy

    def fix(self, hide: Callable[[Mapping[str, str]], Layout]) -> Layout:
        """The sandbox's layout with every source seen so far hidden (`hide` plans it); every later
        policy is checked against it."""
        with self._lock:
            check_links(self._seen)
            # a cover needs something to lie on; one missing now failed the load that named it
            self._layout = hide({p: what for p, what in self._seen.items() if os.path.exists(p)})
            return self._layout
