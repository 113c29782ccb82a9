"""Repositories the run made where the sandbox could not protect them: their code taken out of git's way.

The sandbox write-protects the git directories it finds when it starts (hooks.py). A repository
the child makes during the run (`git init sub`, `git clone`, `git init --bare x.git`, a `.git`
file or symlink naming a directory of its own, a `commondir` leading to one) cannot be: bubblewrap
covers only paths that exist when it starts, and any directory can be a git directory. Yet your
git runs its hooks and configuration as soon as you use git there, and your prompt's `git status`
in the project does when the project's index records it as a submodule.

So after the run, every git directory under the writable paths that the exit summary's walks
(exit_summary.py) show as made during the run, or whose hooks or configuration the run created or
changed, and that was not write-protected, is neutralised before the person gets the prompt back:

- its configuration (`config`, `config.worktree`) keeps only the keys on SAFE_KEYS, which name
  the repository's layout, remotes and branches and run nothing; everything else (core.fsmonitor,
  core.hooksPath, include.path, includeIf, filter and diff drivers, aliases, pager, editor, ...) is
  dropped. An allowlist: git grows new keys that run programs, and those stay dropped;
- its `hooks` directory, unless it holds only git's `*.sample` files (which git never runs), and
  `info/attributes` (which picks the drivers of your configuration) are moved aside.

The walk is bounded and cannot list a directory the child made unreadable, but git reaches a
submodule the project's index records by name: those are looked at wherever they are (recorded).
A file the project's configuration includes (include.path, includeIf) that was missing at start
has no placeholder (one would show in `git add -A`), nor has the directory a relative
core.hooksPath of the user's own configuration names in each work tree: made during the run,
they are renamed where they are (set_aside).

The originals are moved, not copied or edited, into a new `egressd-quarantine` directory in the
same git directory, for the person to read: a hook that is a hard link to another file leaves
that file as it is, a symlink is moved as a symlink, and nothing is written through either. No
path is followed through a symlink the child made (every step is relative to a directory opened
with O_NOFOLLOW), so a planted link cannot steer egressd into another repository; a directory
whose permissions the child took away gets its owner's back first, and what still cannot be
taken is named as not taken. Every process
of the run has ended by then (on Linux its PID namespace is gone; on macOS leftovers.py ended what
the run's profile confines), so nothing the child runs races it.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from egressd.sandbox import hooks
from egressd.sandbox.exit_summary import (
    CLOCK_SLACK_NS,
    GIT_CONFIGURATION,
    GIT_HOOK,
    NESTED_GIT,
    Change,
    Walk,
    printable,
)
from egressd.sandbox.mounts import within

QUARANTINE = "egressd-quarantine"
CONFIG_MAX = 1 << 20
HOOKS_LISTED = 4096  # entries of a hooks directory looked at; beyond, it is moved unread
GITLINKS_LIMIT = 4096  # submodules of the index looked at beyond what the walk saw
GIT_TIMEOUT = 10.0
# What a configuration keeps: the repository's layout, its remotes and branches, the identity.
# Keys as `git config --list` prints them (section and name lowercased, any subsection). Not a
# partial clone's promisor remote: git fetches from it by itself (on `git diff`, a checkout), so
# a URL of the child's choosing would carry what it learnt past the proxy. Compiled on first use
# (safe_key), by the runs that find a configuration to look at.
SAFE_KEYS = r"""(
      core\.(repositoryformatversion|bare|worktree|filemode|logallrefupdates|ignorecase
             |precomposeunicode|symlinks|autocrlf|eol|safecrlf|sparsecheckout|sparsecheckoutcone)
    | extensions\.(?!partialclone$)[^.]+
    | remote\..+\.(url|pushurl|fetch|push|tagopt|mirror|prune)
    | branch\..+\.(remote|pushremote|merge)
    | submodule\..+\.(url|active)
    | user\.(name|email)
    | init\.defaultbranch
    | lfs\.repositoryformatversion
    )"""
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def safe_key(key: str) -> bool:
    """Whether a configuration keeps `key` (SAFE_KEYS)."""
    return re.fullmatch(SAFE_KEYS, key, re.VERBOSE) is not None


@dataclass(frozen=True)
class Taken:
    """One thing moved out of git's way: `path` (what git would have read or run), `kept` (where
    the original is now), and for a configuration the keys dropped (none: it was not a file git
    could read as one, and it is gone)."""

    path: str
    kept: str
    dropped: tuple[str, ...] = ()
    hooks: tuple[str, ...] = ()  # for a hooks directory: what git would have run
    failed: str = ""  # why it could not be taken (then it is where it was)


def after_run(
    before: Walk,
    after: Walk,
    found: Sequence[Change],
    *,
    writable: Sequence[str],
    protected: Sequence[str],
    later: Iterable[str],
) -> list[Taken]:
    """Everything taken out of git's way once the run ended: the repositories it made (`found`: the
    exit summary's changes between the two walks), the files `later` names that it made (what
    the configuration includes), and the hooks directory your relative core.hooksPath names in
    the work trees it made."""
    git = hooks.system_git()
    taken = set_aside(later, before.roots)  # first: git reads the project's configuration below
    gitdirs = touched(before, after, found)
    # what the walk did not reach (it stopped, or a directory was made unreadable): the submodules
    # your git status enters
    gitdirs += [g for g in recorded(before, git) if g not in after.gitdirs and g not in gitdirs]
    taken += quarantine(gitdirs, writable=writable, protected=protected, git=git)
    made = work_trees(gitdirs, found)
    # git is asked only when the run made a work tree: most runs make none, and git starts slowly
    if made and (relative := user_hooks_path(git)) is not None:
        trees = [os.path.normpath(os.path.join(t, relative)) for t in made]
        taken += set_aside([p for p in trees if p not in protected], before.roots)
    return taken


def touched(before: Walk, after: Walk, found: Iterable[Change]) -> list[str]:
    """The git directories (canonical) the run made, or whose hooks or configuration it created or
    changed, or that a `.git` file or symlink it made names."""
    gitdirs: dict[str, None] = {}
    for path, inode in after.gitdirs.items():
        if before.gitdirs.get(path) != inode:
            gitdirs[path] = None
    for change in found:
        if change.why in (GIT_HOOK, GIT_CONFIGURATION):
            owner = _owner(change.path, after.gitdirs)
            if owner is not None:
                gitdirs[owner] = None
        elif change.why == NESTED_GIT:
            named = _named(change.path)
            if named is not None:
                gitdirs[named] = None
    return list(gitdirs)


def recorded(before: Walk, git: str | None) -> list[str]:
    """The git directories of the submodules the index of each root's repository records (git
    status enters each), among the first GITLINKS_LIMIT, that were made or changed since the run
    started (ctime, which the child cannot set back)."""
    found = []
    for root in before.roots:
        for path in _gitlinks(root, git)[:GITLINKS_LIMIT]:
            dot_git = os.path.join(root, path, ".git")
            gitdir = _named(dot_git)
            if gitdir is None:
                continue
            common = hooks.common_dir(gitdir)
            looked = [dot_git, gitdir, *(os.path.join(common, n) for n in ("config", "hooks", "info"))]
            looked.append(os.path.join(gitdir, "config.worktree"))
            if any(_ctime(p) >= before.started_ns - CLOCK_SLACK_NS for p in looked):
                found.append(gitdir)
    return found


def _ctime(path: str) -> int:
    try:
        return os.lstat(path).st_ctime_ns
    except OSError:
        return 0


def _gitlinks(root: str, git: str | None) -> list[str]:
    """The paths the index of the repository at `root` records as submodules (mode 160000)."""
    dot_git = os.path.join(root, ".git")
    linked = os.path.islink(dot_git)
    gitdir = dot_git if os.path.isdir(dot_git) and not linked else hooks.read_gitfile(dot_git)
    if git is None or gitdir is None or not os.path.isfile(os.path.join(gitdir, "HEAD")):
        return []
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env |= {"GIT_DIR": gitdir, "GIT_WORK_TREE": root}
    try:
        result = subprocess.run(
            [git, "-c", "core.fsmonitor=false", "ls-files", "--stage", "-z"],
            capture_output=True,
            timeout=GIT_TIMEOUT,
            env=env,
            cwd=root,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    paths = []
    for item in result.stdout.split(b"\0"):
        meta, tab, path = item.partition(b"\t")
        if tab and meta.startswith(b"160000 "):
            paths.append(os.fsdecode(path))
    return paths


def work_trees(gitdirs: Iterable[str], found: Iterable[Change]) -> list[str]:
    """The work trees of the repositories made: the directory of each `.git` the run made."""
    trees = [os.path.dirname(g) for g in gitdirs if os.path.basename(g) == ".git"]
    trees += [os.path.dirname(c.path) for c in found if c.why == NESTED_GIT]
    return list(dict.fromkeys(trees))


def user_hooks_path(git: str | None) -> str | None:
    """core.hooksPath of your own configuration (system, global) when it is relative: git then runs
    the hooks of every repository from that directory of its work tree, one the child wrote in a
    repository it made too."""
    if git is None:
        return None
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_") or k.startswith("GIT_CONFIG")}
    try:
        result = subprocess.run(
            [git, "config", "--get", "core.hooksPath"],
            capture_output=True,
            timeout=GIT_TIMEOUT,
            env=env,
            cwd="/",
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    value = os.fsdecode(result.stdout).strip()
    if result.returncode != 0 or not value or os.path.isabs(value) or value.startswith("~"):
        return None
    return value


def _owner(path: str, gitdirs: dict[str, int]) -> str | None:
    current = os.path.dirname(path)
    while current != os.path.dirname(current):
        if current in gitdirs:
            return current
        current = os.path.dirname(current)
    return None


def _named(dot_git: str) -> str | None:
    """The directory a `.git` entry leads git to: itself, a symlink's target, a file's gitdir."""
    try:
        info = os.lstat(dot_git)
    except OSError:
        return None
    named = hooks.read_gitfile(dot_git) if stat.S_ISREG(info.st_mode) else os.path.realpath(dot_git)
    return named if named is not None and os.path.isdir(named) else None


def quarantine(
    gitdirs: Iterable[str],
    *,
    writable: Sequence[str],
    protected: Iterable[str],
    git: str | None,
) -> list[Taken]:
    """Neutralise each git directory of `gitdirs` (and the common directory it reads its
    configuration and hooks from) where it lies in `writable` and is not in `protected` (the
    paths the sandbox kept read-only)."""
    kept = set(protected)
    taken: list[Taken] = []
    done: set[str] = set()
    boxes: dict[str, _Box] = {}  # one quarantine directory per git directory
    try:
        for gitdir in gitdirs:
            common = hooks.common_dir(gitdir)
            wanted = [(common, "config"), (common, "hooks"), (common, "info"), (gitdir, "config.worktree")]
            for directory, name in wanted:
                path = os.path.join(directory, name)
                target = path if name != "info" else os.path.join(path, "attributes")
                if target in done or target in kept or not any(within(path, w) for w in writable):
                    continue
                done.add(target)
                try:
                    if directory not in boxes:
                        boxes[directory] = _Box(directory, _open_dir(directory))
                    taken += _neutralise(boxes[directory], name, git)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    taken.append(Taken(path, "", failed=exc.strerror or str(exc)))
    finally:
        for box in boxes.values():
            box.close()
    return taken


def set_aside(paths: Iterable[str], roots: Sequence[str]) -> list[Taken]:
    """Rename each of `paths` (what git would read or run that the sandbox could not protect: a
    file your configuration includes, missing at start; the hooks directory of a repository made)
    that exists now, next to where it is (`NAME.egressd-quarantine`): git then finds nothing
    there. A directory on the way that is a symlink now is what is renamed: it is not followed."""
    taken = []
    for path in paths:
        root = next((r for r in roots if within(path, r) and path != r), None)
        if root is not None:
            try:
                taken += _set_aside(root, os.path.relpath(path, root).split("/"))
            except OSError as exc:
                taken.append(Taken(path, "", failed=exc.strerror or str(exc)))
    return taken


def _set_aside(root: str, parts: Sequence[str]) -> list[Taken]:
    fd = _open_dir(root)
    directory = root
    try:
        for number, name in enumerate(parts):
            try:
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return []
            if number == len(parts) - 1 or not stat.S_ISDIR(info.st_mode):
                kept = _aside(name, fd)
                return [Taken(os.path.join(directory, name), os.path.join(directory, kept))]
            inner = _open_dir(name, fd)
            os.close(fd)
            fd, directory = inner, os.path.join(directory, name)
    finally:
        os.close(fd)
    return []


def _aside(name: str, dir_fd: int) -> str:
    """Rename `name` to a new name beside it (never over an existing entry); the new name."""
    for attempt in range(100):
        kept = f"{name}.{QUARANTINE}" + (f"-{attempt}" if attempt else "")
        try:
            os.stat(kept, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            os.rename(name, kept, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            return kept
    raise FileExistsError(name)


def _neutralise(box: _Box, name: str, git: str | None) -> list[Taken]:
    if name == "hooks":
        return _hooks(box)
    if name == "info":
        return _attributes(box)
    return _config(box, name, git)


def _open_dir(path: str, dir_fd: int | None = None) -> int:
    """The directory at `path`, never through a symlink, readable and writable by its owner: the
    child may have taken those permissions away (`chmod 100 hooks`: git still runs what is
    inside, which it reaches by name) to keep egressd from listing or moving what it holds."""
    try:
        fd = os.open(path, _O_DIR, dir_fd=dir_fd)
    except PermissionError:
        info = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISDIR(info.st_mode):
            raise
        os.chmod(path, stat.S_IMODE(info.st_mode) | 0o700, dir_fd=dir_fd)  # no process races it
        fd = os.open(path, _O_DIR, dir_fd=dir_fd)
    try:
        if (mode := stat.S_IMODE(os.fstat(fd).st_mode)) & 0o700 != 0o700:
            os.fchmod(fd, mode | 0o700)
    except OSError:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _opened(path: str, dir_fd: int) -> Iterator[int | None]:
    """`_open_dir`, None when it is not a directory or cannot be opened."""
    try:
        fd = _open_dir(path, dir_fd)
    except OSError:
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


class _Box:
    """The quarantine directory of one git directory, made on first use, always a new one."""

    def __init__(self, directory: str, fd: int) -> None:
        self.directory = directory
        self.fd = fd
        self.name: str | None = None
        self.box: int | None = None

    def keep(self, name: str, dir_fd: int | None = None) -> str:
        """Move the entry `name` (of `dir_fd`, by default the git directory) into the box; where it is."""
        if self.box is None:
            self.name, self.box = self._make()
        os.rename(name, name, src_dir_fd=self.fd if dir_fd is None else dir_fd, dst_dir_fd=self.box)
        return os.path.join(self.directory, str(self.name), name)

    def _make(self) -> tuple[str, int]:
        for attempt in range(100):
            name = QUARANTINE if attempt == 0 else f"{QUARANTINE}-{attempt}"
            try:
                os.mkdir(name, 0o700, dir_fd=self.fd)  # never one the child made: it may be a link
            except FileExistsError:
                continue
            return name, os.open(name, _O_DIR, dir_fd=self.fd)
        raise FileExistsError(os.path.join(self.directory, QUARANTINE))

    def close(self) -> None:
        os.close(self.fd)
        if self.box is not None:
            os.close(self.box)


def _hooks(box: _Box) -> list[Taken]:
    try:
        info = os.stat("hooks", dir_fd=box.fd, follow_symlinks=False)
    except FileNotFoundError:
        return []
    names = ["(not a directory)"]
    if stat.S_ISDIR(info.st_mode):
        with _opened("hooks", box.fd) as fd:
            names = ["(unreadable)"] if fd is None else _hook_names(fd)
        if not names:
            return []  # what git init and git clone put there: git runs none of it
    path = os.path.join(box.directory, "hooks")
    return [Taken(path, box.keep("hooks"), hooks=tuple(sorted(names)))]


def _hook_names(fd: int) -> list[str]:
    """What git could run in the hooks directory `fd`: all but git's `*.sample` files."""
    names = []
    with os.scandir(fd) as entries:
        for count, entry in enumerate(entries):
            if count >= HOOKS_LISTED:
                return [*names, "..."]
            if not (entry.name.endswith(".sample") and entry.is_file(follow_symlinks=False)):
                names.append(entry.name)
    return names


def _attributes(box: _Box) -> list[Taken]:
    try:
        info = os.stat("info", dir_fd=box.fd, follow_symlinks=False)
    except FileNotFoundError:
        return []
    path = os.path.join(box.directory, "info")
    if not stat.S_ISDIR(info.st_mode):
        return [Taken(path, box.keep("info"))]  # a symlink git would follow
    with _opened("info", box.fd) as fd:
        if fd is None:
            return [Taken(path, box.keep("info"))]  # git may still reach what it holds
        try:
            os.stat("attributes", dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return []
        kept = box.keep("attributes", fd)
    return [Taken(os.path.join(path, "attributes"), kept)]


def _config(box: _Box, name: str, git: str | None) -> list[Taken]:
    try:
        info = os.stat(name, dir_fd=box.fd, follow_symlinks=False)
    except FileNotFoundError:
        return []
    path = os.path.join(box.directory, name)
    text = _read(name, box.fd) if stat.S_ISREG(info.st_mode) else None
    entries = None if text is None else parse(text, git)
    if entries is None:  # not a file git reads as it is: moved, with nothing in its place
        return [Taken(path, box.keep(name))]
    safe = [(key, value) for key, value in entries if safe_key(key)]
    dropped = tuple(dict.fromkeys(key for key, _ in entries if not safe_key(key)))
    if not dropped:
        return []
    temporary = f".{name}.egressd-{secrets.token_hex(8)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temporary, flags, 0o644, dir_fd=box.fd)
    with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(render(safe))
    try:
        kept = box.keep(name)
        os.rename(temporary, name, src_dir_fd=box.fd, dst_dir_fd=box.fd)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=box.fd)
        raise
    return [Taken(path, kept, dropped)]


def _read(name: str, dir_fd: int) -> str | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(CONFIG_MAX + 1)
    return None if len(data) > CONFIG_MAX else data.decode("utf-8", "surrogateescape")


def parse(text: str, git: str | None) -> list[tuple[str, str | None]] | None:
    """The entries of a configuration file as git reads them ((key, value); None: a key without
    `=`), by git itself, includes not followed; None when git cannot read it (git then refuses to
    run in the repository, so it is moved aside) or there is no git."""
    if git is None:
        return None
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["GIT_CONFIG_NOSYSTEM"] = "1"
    try:
        result = subprocess.run(
            [git, "config", "--file", "-", "--no-includes", "--list", "-z"],
            input=text.encode("utf-8", "surrogateescape"),
            capture_output=True,
            timeout=GIT_TIMEOUT,
            env=env,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    entries: list[tuple[str, str | None]] = []
    for item in result.stdout.split(b"\0")[:-1]:
        key, newline, value = os.fsdecode(item).partition("\n")
        entries.append((key, value if newline else None))
    return entries


def render(entries: Sequence[tuple[str, str | None]]) -> str:
    """A configuration file git reads as exactly `entries` (keys as `git config --list` prints them)."""
    lines: list[str] = []
    section: tuple[str, str | None] | None = None
    for key, value in entries:
        first, _, rest = key.partition(".")
        subsection, _, name = rest.rpartition(".") if "." in rest else (None, "", rest)
        if subsection is not None and ("\0" in subsection or "\n" in subsection):
            continue
        if (first, subsection) != section:
            section = (first, subsection)
            quoted = "" if subsection is None else ' "' + _escape(subsection, value=False) + '"'
            lines.append(f"[{first}{quoted}]")
        lines.append(f"\t{name}" if value is None else f'\t{name} = "{_escape(value, value=True)}"')
    return "".join(f"{line}\n" for line in lines)


def _escape(text: str, *, value: bool) -> str:
    text = text.replace("\\", "\\\\").replace('"', '\\"')
    if value:
        text = text.replace("\n", "\\n").replace("\t", "\\t").replace("\b", "\\b")
    return text


def summary(taken: Sequence[Taken], cwd: str) -> list[str]:
    """The lines egressd prints on stderr about what it moved out of git's way."""
    shown = lambda path: printable(os.path.relpath(path, cwd) if within(path, cwd) else path)  # noqa: E731
    if not taken:
        return []
    lines = [
        "the sandboxed command left git hooks or configuration the sandbox could not protect (in "
        "repositories it made, or files your configuration includes that it made), which would run "
        "code when you use git; egressd took them out of git's way and kept the originals:"
    ]
    for item in taken:
        if item.failed:
            why = f"NOT taken out of git's way ({printable(item.failed)}): look before you use git there"
            lines.append(f"  {shown(item.path)}: {why}")
            continue
        if item.hooks:
            what = f"hooks ({_listed(item.hooks)}) moved"
        elif item.dropped:
            what = f"{_listed(item.dropped)} removed"
        else:
            what = "moved"
        lines.append(f"  {shown(item.path)}: {what}, the original is {shown(item.kept)}")
    return lines


def _listed(names: Sequence[str], limit: int = 8) -> str:
    return printable(", ".join(names[:limit]) + (", ..." if len(names) > limit else ""))
