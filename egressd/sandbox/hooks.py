"""The project's own hooks: what a project runs on the user's behalf later, outside the sandbox.

The working directory is writable (it must be). But a shell prompt runs `git status` there on
every prompt (and git runs `core.fsmonitor`), git runs `.git/hooks/*` on commit, direnv runs
`.envrc` on `cd`, editors and coding agents start what the project's settings name when they open
it. A child that writes those runs code outside the sandbox as soon as the user gets the prompt
back. This module is the one list of them, used by bubblewrap, Seatbelt and `--explain`:

- `IN_PROJECT`, relative to every writable root (the working directory, each `--rw` path);
- `IN_GIT_DIR`, relative to every git directory found at start: the project's `.git`, the
  directory a `.git` file names (a linked worktree, a submodule's checkout), a worktree's common
  directory, the submodules' git directories under `modules/`, those of the nested repositories
  the start-up walk finds (exit_summary.py; a bare one too, whatever its name), `core.hooksPath`
  where it leads into the project, and the files the configuration includes (include.path,
  includeIf) that lie in the project.

An entry marked `create` is protected whether or not it exists: Seatbelt's rule on the path
covers its creation, and on Linux a missing one gets an empty read-only placeholder (a directory,
or inside a git directory a file) for the run, which egressd makes before bubblewrap starts and
removes after. Those are the ones whose mere creation makes code run without anyone being asked
(git reads its directory on every prompt; an editor or agent opening the project reads its
settings directory), and a placeholder there is invisible to git. The other files are protected
when they exist: a placeholder file at the top of the project would be picked up by `git add -A`,
and the tools that read them ask before running a new one (direnv, mise, Claude Code's MCP
servers) or run only when asked (`git submodule update`, a hook manager whose git hook is itself
protected). The exit summary names every one created during the run.

What cannot be covered: a repository the child creates during the run (any directory can be a
git directory, and bubblewrap only covers paths known when it starts); quarantine.py takes its
hooks and configuration out of git's way when the run ends, and the summary names it.
A listed path that is a symlink, goes through one in a writable directory, or is a file with a
second hard link is refused: a mount covers a path, so the child could re-point the link or
write through the other name.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from egressd.inspect import ca
from egressd.platform.files import replace_atomically
from egressd.sandbox.mounts import MountError, within

ALLOW_FLAG = "--allow-project-hooks"


@dataclass(frozen=True)
class Entry:
    """One protected path of a project: where, why, and whether it is protected while missing."""

    path: str  # relative to a writable root or to a git directory
    why: str
    directory: bool = False
    create: bool = False  # protected even while missing (a placeholder on Linux)
    content: str = ""  # what a placeholder file holds


GIT = Entry(
    ".git",
    "git reads its configuration and runs its hooks from here; a .git the child made would be "
    "one of its own, run by your next git status",
    directory=True,
    create=True,
)
_MISE = "mise: [env] and [hooks] run commands when you enter the directory"
_LEFTHOOK = "lefthook (installed as the git hook) runs its commands"
_DEV_CONTAINER = "initializeCommand runs on your machine when the dev container is opened"
# Editors' and coding agents' settings: protected even while missing (opening the project reads them).
SETTINGS_DIRS: dict[str, str] = {
    ".vscode": "VS Code: tasks run when the folder opens, settings naming the programs it starts "
    "(interpreters, linters, formatters), launch configurations",
    ".idea": "JetBrains IDEs: run configurations and their before-launch tasks, the project's "
    "interpreter (started to index the project)",
    ".zed": "Zed: language-server binaries and tasks",
    ".claude": "Claude Code: hooks (commands it runs on its events, without asking once the folder "
    "is trusted), settings, commands and agents",
    ".gemini": "Gemini CLI: the MCP servers it starts, settings",
    ".cursor": "Cursor: the MCP servers it starts, rules",
}
# Protected when they exist (see the module's docstring for why not while missing).
EXISTING_DIRS: dict[str, str] = {
    ".direnv": "direnv's cache: nix-direnv loads the environment saved there",
    ".mise": "mise's configuration directory",
    ".config/mise": "mise's configuration directory",
    ".devcontainer": _DEV_CONTAINER,
    ".husky": "husky: the hooks git runs (core.hooksPath leads into it)",
}
EXISTING_FILES: dict[str, str] = {
    ".gitmodules": "the submodules' URLs and paths: git submodule update clones from them into the project",
    ".envrc": "direnv runs it when you enter the directory",
    ".tool-versions": "asdf and mise: a tool's version may be a path whose programs then run",
    ".mise.toml": _MISE,
    "mise.toml": _MISE,
    ".mise.local.toml": _MISE,
    "mise.local.toml": _MISE,
    ".mcp.json": "Claude Code starts the MCP servers it names",
    ".aider.conf.yml": "aider: the lint and test commands it runs after each edit",
    ".devcontainer.json": _DEV_CONTAINER,
    ".pre-commit-config.yaml": "pre-commit (installed as the git hook) runs its commands on commit",
    "lefthook.yml": _LEFTHOOK,
    ".lefthook.yml": _LEFTHOOK,
    "lefthook-local.yml": _LEFTHOOK,
    ".lefthook-local.yml": _LEFTHOOK,
}
IN_PROJECT: tuple[Entry, ...] = (
    GIT,
    *(Entry(path, why, directory=True, create=True) for path, why in SETTINGS_DIRS.items()),
    *(Entry(path, why, directory=True) for path, why in EXISTING_DIRS.items()),
    *(Entry(path, why) for path, why in EXISTING_FILES.items()),
)
IN_GIT_DIR: tuple[Entry, ...] = (
    Entry("hooks", "git hooks: run on commit, merge, checkout, push, rebase", directory=True, create=True),
    Entry(
        "config",
        "git configuration: core.fsmonitor (run by every git status, a shell prompt's too), "
        "core.hooksPath, filter and diff drivers, pager, editor, aliases, credential helpers",
        create=True,
    ),
    Entry(
        "config.worktree", "git configuration of one worktree (with extensions.worktreeConfig)", create=True
    ),
    # "." names the directory itself: an empty commondir makes git stop ("failed to read")
    Entry("commondir", "where git reads its configuration and hooks from", create=True, content="."),
    Entry("info/attributes", "selects the filter and diff drivers git runs on files", create=True),
)
HOOKS_PATH = Entry("core.hooksPath", "the hooks git runs (core.hooksPath)", directory=True, create=True)
# Protected when it exists: a placeholder file in the project would be picked up by `git add -A`.
INCLUDED = Entry("include.path", "a file git reads as configuration (include.path, includeIf)")
# A linked worktree's own directory (<common>/worktrees/NAME): its configuration and hooks are
# the common directory's, but these two are its own.
IN_WORKTREE_DIR: tuple[Entry, ...] = tuple(
    e for e in IN_GIT_DIR if e.path in ("config.worktree", "commondir")
)

GIT_DIRS_LIMIT = 256  # submodules' and linked worktrees' git directories looked at per repository
TREE_LIMIT = 4096  # files checked for hard links inside each protected directory
HOOKS_PATH_TIMEOUT = 10.0
SYSTEM_PATH = "/usr/bin:/bin:/usr/local/bin:/opt/homebrew/bin"


class HookError(MountError):
    """A project hook the sandbox cannot protect as it is (a symlink, a second hard link)."""


class PlaceholderError(OSError):
    """A placeholder could not be made: the sandbox does not start without it."""


@dataclass(frozen=True)
class Placeholder:
    """What stands in for a missing protected path on Linux while the sandbox runs."""

    path: str
    directory: bool
    content: str = ""


class Found:
    """The project hooks found under the writable roots: {path: why}, and the placeholders for the
    missing ones that `create` protects. A plain class: filled and read, never compared nor
    copied, so a dataclass would only add start-up time (find() runs before the child)."""

    __slots__ = ("protected", "placeholders", "later", "stand_in")

    def __init__(self, stand_in: Callable[[str], bool] | None = None) -> None:
        self.protected: dict[str, str] = {}
        self.placeholders: dict[str, Placeholder] = {}
        # what git would read that is missing and has no placeholder (an included file): set aside
        # after the run if it was made meanwhile (quarantine.py)
        self.later: dict[str, str] = {}
        # whether a path is a stand-in another sandbox made (stands): missing as far as the
        # project goes
        self.stand_in: Callable[[str], bool] = stand_in or _never

    def exists(self, path: str) -> bool:
        return os.path.lexists(path) and not self.stand_in(path)

    def add(self, path: str, entry: Entry) -> None:
        if path in self.protected:
            return
        if self.exists(path):
            self.protected[path] = entry.why
        elif entry.create:
            self.protected[path] = entry.why
            self.placeholders[path] = Placeholder(path, entry.directory, entry.content)


def _never(path: str) -> bool:
    return False


SMALL_FILE = 1 << 16


def git_directory(names: Collection[str]) -> bool:
    """Whether git takes a directory holding these entries for a git directory, whatever its name
    (a `.git`, a bare repository, a submodule's under `modules/`): HEAD, and objects and refs or
    a `commondir` naming where they are. macOS's file systems ignore case, and so does git there."""
    if sys.platform == "darwin":
        names = {n.casefold() for n in names}
        return "head" in names and ("commondir" in names or ("objects" in names and "refs" in names))
    return "HEAD" in names and ("commondir" in names or ("objects" in names and "refs" in names))


def read_small(path: str, limit: int = SMALL_FILE) -> str | None:
    """The text of the regular file at `path`, if it holds at most `limit` bytes; else None. Never
    through a symlink, and a FIFO or a device is never read: an earlier child may have left one
    where egressd reads, to hang or flood it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks = []
        size = 0
        while size <= limit and (chunk := os.read(fd, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
        return None if size > limit else b"".join(chunks).decode("utf-8", "surrogateescape")
    except OSError:
        return None
    finally:
        os.close(fd)


def read_gitfile(path: str) -> str | None:
    """The git directory a `.git` file names (`gitdir: PATH`, relative to the file), canonical;
    None when it names none."""
    text = read_small(path)
    first = text.splitlines()[:1] if text else []
    if not first or not first[0].startswith("gitdir:"):
        return None
    named = first[0][len("gitdir:") :].strip()
    if not named:
        return None
    return os.path.realpath(os.path.join(os.path.dirname(path), named))


def common_dir(gitdir: str) -> str:
    """The directory git reads the configuration and hooks of `gitdir` from (its `commondir`)."""
    named = (read_small(os.path.join(gitdir, "commondir")) or "").strip()
    return os.path.realpath(os.path.join(gitdir, named)) if named else gitdir


def _git_dirs_inside(common: str) -> Iterator[tuple[str, tuple[Entry, ...]]]:
    """The submodules' git directories under `modules/` (at any depth: a submodule's name may hold
    slashes, and submodules have their own) and the linked worktrees' directories, bounded."""
    yielded = 0
    pending = [os.path.join(common, "modules")]
    while pending and yielded < GIT_DIRS_LIMIT:
        directory = pending.pop()
        for name in _listdir(directory):
            path = os.path.join(directory, name)
            if os.path.islink(path) or not os.path.isdir(path):
                continue
            if os.path.isfile(os.path.join(path, "HEAD")):
                yielded += 1
                yield path, IN_GIT_DIR
                pending.append(os.path.join(path, "modules"))
            else:
                pending.append(path)
    for name in _listdir(os.path.join(common, "worktrees"))[:GIT_DIRS_LIMIT]:
        path = os.path.join(common, "worktrees", name)
        if os.path.isdir(path) and not os.path.islink(path):
            yield path, IN_WORKTREE_DIR


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def system_git() -> str | None:
    """git from the system's directories only: PATH may lead into the project (an activated
    .venv/bin), where an earlier child may have left a `git`, and this one runs unconfined."""
    return shutil.which("git", path=SYSTEM_PATH)


def hooks_path(worktree: str, git: str | None) -> str | None:
    """Where git looks for the hooks of the repository at `worktree` (core.hooksPath, from every
    configuration file git reads), canonical; None without git. `git rev-parse` runs no hook."""
    if git is None:
        return None
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    try:
        result = subprocess.run(
            [git, "-C", worktree, "rev-parse", "--git-path", "hooks"],
            capture_output=True,
            text=True,
            errors="surrogateescape",
            timeout=HOOKS_PATH_TIMEOUT,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = result.stdout.splitlines()
    if result.returncode != 0 or not lines or not lines[0]:
        return None
    return os.path.realpath(os.path.join(worktree, lines[0]))


def config_includes(config: str, git: str | None) -> list[str]:
    """The files git reads as configuration because `config` includes them (include.path,
    includeIf.*.path, at any depth), canonical; none without git. `git config` runs nothing."""
    if git is None or read_small(config) is None:
        return []
    argv = [git, "config", "--file", config, "--includes", "--show-origin", "-z"]
    argv += ["--get-regexp", r"^include(if\..*)?\.path$"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    try:
        result = subprocess.run(
            argv, capture_output=True, timeout=HOOKS_PATH_TIMEOUT, env=env, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.SubprocessError):
        return []
    fields = result.stdout.split(b"\0")
    found = []
    for origin, entry in zip(fields[0::2], fields[1::2], strict=False):
        where = os.fsdecode(origin.removeprefix(b"file:"))
        value = os.fsdecode(entry.partition(b"\n")[2])
        if value.startswith("~/"):
            value = os.path.expanduser(value)
        if value and os.path.isabs(where):
            found.append(os.path.realpath(os.path.join(os.path.dirname(where), value)))
    return found


def find(
    roots: Sequence[str],
    nested: Iterable[str] = (),
    *,
    git: str | None = None,
    registry: str | None = None,
) -> Found:
    """The project hooks under `roots` (canonical writable roots) and in the git directories their
    `.git` entries and the `nested` ones (`.git` entries below the roots, found at start) lead to;
    HookError when one cannot be protected. A stand-in another sandbox made (recorded in
    `registry`) counts as missing: its empty `.git` is no repository to protect the insides of,
    and every sandbox in the project then plans the same stand-ins, whichever starts first. The
    caller holds registry_lock meanwhile, so none is made or removed while this looks."""
    found = Found(stand_in=lambda path: stands(registry, path))
    for root in roots:
        for entry in IN_PROJECT:
            if entry is not GIT:  # a .git directory is never read-only as a whole: git writes in it
                found.add(os.path.join(root, entry.path), entry)
    for root in roots:
        _add_repository(found, os.path.join(root, ".git"), roots, git)
    # deep in the project: a symlink is left to the summary, and git is not asked about each one
    # (core.hooksPath and includes there are for the summary too)
    for dot_git in [n for n in nested if not os.path.islink(n)][:GIT_DIRS_LIMIT]:
        _add_repository(found, dot_git, roots, None)
    _check(found, roots)
    return found


def _add_repository(found: Found, dot_git: str, roots: Sequence[str], git: str | None) -> None:
    if os.path.islink(dot_git) or not found.exists(dot_git):
        found.add(dot_git, GIT)  # checked (refused) by _check, or a placeholder
        return
    if os.path.isdir(dot_git):
        gitdir = dot_git
    else:
        found.add(dot_git, Entry(".git", "the git directory this worktree uses (gitdir: ...)"))
        named = read_gitfile(dot_git)
        if named is None or not os.path.isdir(named):
            return
        gitdir = named
    common = common_dir(gitdir)
    if common != gitdir:
        for entry in IN_WORKTREE_DIR:
            found.add(os.path.join(gitdir, entry.path), entry)
    for entry in IN_GIT_DIR:
        found.add(os.path.join(common, entry.path), entry)
    for inside, entries in _git_dirs_inside(common):
        for entry in entries:
            found.add(os.path.join(inside, entry.path), entry)
    for config in (os.path.join(common, "config"), os.path.join(gitdir, "config.worktree")):
        for included in config_includes(config, git):
            if any(within(included, root) for root in roots):
                found.add(included, INCLUDED)
                if not found.exists(included):
                    found.later[included] = INCLUDED.why
    hooks = hooks_path(os.path.dirname(dot_git), git)
    if hooks is not None and any(within(hooks, root) for root in roots):
        found.add(hooks, HOOKS_PATH)


def _check(found: Found, roots: Sequence[str]) -> None:
    """Refuse what a mount cannot protect: a symlink among the listed paths or on the way to one
    inside a writable root, a file with a second hard link (in a protected directory too)."""
    for path in found.protected:
        root = next((r for r in roots if within(path, r)), None)
        if root is None:
            continue  # read-only or hidden in the sandbox already
        current = path
        while current != root and current != os.path.dirname(current):
            if os.path.islink(current):
                raise HookError(
                    f"{current} is a symlink (to {os.readlink(current)}) on the way to {path}, which "
                    "git or your tools run code from: the sandbox can protect a path but not keep the "
                    "child from re-pointing a symlink; replace it with what it points to (for .git, a "
                    f"file saying `gitdir: TARGET`), or give {ALLOW_FLAG}"
                )
            current = os.path.dirname(current)
        for name, info in _files(path):
            if info.st_nlink > 1:
                raise HookError(
                    f"{name} has {info.st_nlink} hard links, and {path} is one of the project's "
                    "hooks: the sandbox protects a path, not the file, so the child could change it "
                    f"through another name; make it a copy with a single link, or give {ALLOW_FLAG}"
                )


def _files(path: str) -> Iterator[tuple[str, os.stat_result]]:
    """Every file at or under `path` (bounded), with its lstat."""
    count = 0
    pending = [path]
    while pending and count < TREE_LIMIT:
        current = pending.pop()
        try:
            info = os.lstat(current)
        except OSError:
            continue
        count += 1
        if stat.S_ISDIR(info.st_mode):
            pending += [os.path.join(current, n) for n in _listdir(current)]
        elif stat.S_ISREG(info.st_mode):
            yield current, info


# What identifies a placeholder as made: (device, inode, size, mtime_ns).
Made = tuple[int, int, int, int]


def _identity(info: os.stat_result) -> Made:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


@contextlib.contextmanager
def placeholders(
    wanted: Iterable[Placeholder], existing: Iterable[str] = (), registry: str | None = None
) -> Iterator[list[str]]:
    """Make each missing protected path (an empty directory, or a file with its content) and the
    missing directories on the way, for bubblewrap to mount read-only; yield every path a stand-in
    holds while the sandbox runs; remove them afterwards where still exactly as made.

    Sandboxes started in the same project share the stand-ins: removing one on the host would drop
    the mount of every other sandbox using it (its child could then create the path). So every
    sandbox holds a shared lock on each protected path (`existing`) and stand-in it relies on, and
    a stand-in is removed only under an exclusive lock nobody else holds. `registry` (a directory
    of egressd's, hidden from the child) records each stand-in made, the directories on the way
    too, so the last sandbox to use one removes it, whoever made it, and one left by an egressd that
    was killed is removed by the next run. Making, recording, taking up and removing happen under
    registry_lock, so no sandbox sees a stand-in half made or half gone.
    """
    held: list[int] = []
    ours: dict[str, Made] = {}  # to remove at the end, if nobody else holds it
    standing: list[str] = []
    wanted = sorted(wanted, key=lambda p: p.path)
    try:
        with registry_lock(registry, exclusive=True):
            for path in sorted(set(existing) - {p.path for p in wanted}):
                if (fd := _hold(path)) is not None:
                    held.append(fd)
                    if _take_up(path, registry, ours):  # a stand-in after all (a killed egressd's)
                        standing.append(path)
            for placeholder in wanted:
                fd = _hold(placeholder.path)
                if fd is None:  # missing: ours to make (and to hold before anyone else can)
                    try:
                        _make(placeholder, registry, ours)
                    except OSError as exc:
                        raise PlaceholderError(
                            f"cannot make {placeholder.path} (an empty, read-only stand-in for a "
                            f"project hook while the sandbox runs): {exc.strerror or exc}"
                        ) from None
                    fd = _hold(placeholder.path)
                else:  # another sandbox's: the last one using it removes it, and its parents
                    _take_up(placeholder.path, registry, ours)
                if fd is not None:
                    held.append(fd)
                    standing.append(placeholder.path)
        yield standing
    finally:
        with registry_lock(registry, exclusive=True):
            for fd in held:
                os.close(fd)
            for path in sorted(ours, reverse=True):  # what a directory holds before the directory
                if _remove_if_unchanged(path, ours[path]):
                    _forget(registry, path)


def _take_up(path: str, registry: str | None, ours: dict[str, Made]) -> bool:
    """Add the stand-in at `path` to `ours` when egressd made it, with the recorded directories
    made on the way to it (another sandbox's, or one a killed egressd left); whether it did."""
    start = path
    while (made := _matching(registry, path)) is not None:
        ours.setdefault(path, made)
        path = os.path.dirname(path)
    return start in ours


def _hold(path: str) -> int | None:
    """A shared lock on the file or directory at `path` now, or None when there is none (or it
    changed meanwhile)."""
    try:
        if not stat.S_ISDIR(mode := os.lstat(path).st_mode) and not stat.S_ISREG(mode):
            return None  # a FIFO or a device: never opened
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if os.fstat(fd).st_ino == os.lstat(path).st_ino:
            return fd
    except OSError:
        pass
    os.close(fd)  # removed by the sandbox that made it while we waited: make our own
    return None


def _make(placeholder: Placeholder, registry: str | None, ours: dict[str, Made]) -> None:
    """Make `placeholder` and the directories on the way, each recorded and added to `ours` as it
    is made; nothing when something else made it first."""
    missing = []
    parent = os.path.dirname(placeholder.path)
    while not os.path.lexists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o755)
            _record(registry, directory, ours, _identity(os.lstat(directory)))
    try:
        if placeholder.directory:
            os.mkdir(placeholder.path, 0o755)
        else:
            fd = os.open(placeholder.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(placeholder.content)
    except FileExistsError:
        return
    _record(registry, placeholder.path, ours, _identity(os.lstat(placeholder.path)))


def _remove_if_unchanged(path: str, made: Made) -> bool:
    """Remove the placeholder at `path` if it is still as made (a directory: the same and empty),
    under an exclusive lock; False when another sandbox holds it or it changed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return not os.path.lexists(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by another sandbox: it stays
        now = os.fstat(fd)
        if now.st_ino != made[1] or os.lstat(path).st_ino != now.st_ino:
            return False
        if stat.S_ISDIR(now.st_mode):
            os.rmdir(path)  # only when empty
        elif _identity(now) == made:
            os.unlink(path)
        else:
            return False
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _registered(registry: str, path: str) -> str:
    name = hashlib.sha256(path.encode("utf-8", "surrogateescape")).hexdigest()
    return os.path.join(registry, name)


def registry_of(home: str | None) -> str | None:
    """Where egressd's `home` records the stand-ins it made (hidden from the child with the home)."""
    return os.path.join(home, "placeholders") if home else None


@contextlib.contextmanager
def registry_lock(registry: str | None, *, exclusive: bool = False) -> Iterator[None]:
    """The registry's lock: exclusive to make, take up or remove stand-ins, shared to look at the
    project knowing which of its paths are stand-ins (they neither appear nor vanish meanwhile).
    Without a registry (or when it cannot be made) nothing is locked."""
    fd = -1
    if registry is not None:
        with contextlib.suppress(OSError):
            os.makedirs(registry, mode=0o700, exist_ok=True)
            fd = os.open(registry + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    try:
        yield
    finally:
        if fd >= 0:
            os.close(fd)


def stands(registry: str | None, path: str) -> bool:
    """Whether `path` is a stand-in egressd made (recorded, and still the file or directory made)."""
    return _matching(registry, path) is not None


def _matching(registry: str | None, path: str) -> Made | None:
    """The record of the stand-in at `path`, when what lies there now is the one made (a
    directory: the same one, whatever was made in it since)."""
    made = _recorded(registry, path)
    if made is None:
        return None
    try:
        now = _identity(os.lstat(path))
    except OSError:
        return None
    same = now[:2] == made[:2] if os.path.isdir(path) and not os.path.islink(path) else now == made
    return made if same else None


def _record(registry: str | None, path: str, ours: dict[str, Made], made: Made) -> None:
    ours[path] = made
    if registry is None:
        return
    with contextlib.suppress(OSError):
        os.makedirs(registry, mode=0o700, exist_ok=True)
        # not fsynced: a record a crash of the machine loses leaves an empty placeholder behind
        replace_atomically(Path(_registered(registry, path)), " ".join(map(str, made)), durable=False)


def _recorded(registry: str | None, path: str) -> Made | None:
    if registry is None:
        return None
    try:
        with open(_registered(registry, path), encoding="ascii") as f:
            dev, ino, size, mtime = (int(n) for n in f.read(200).split())
    except (OSError, ValueError):
        return None
    return (dev, ino, size, mtime)


def _forget(registry: str | None, path: str) -> None:
    if registry is not None:
        with contextlib.suppress(OSError):
            os.unlink(_registered(registry, path))


EXCLUDE_MAX = 1 << 20
EXCLUDE_NOTE = "# egressd sandbox: its read-only stand-ins for missing project hooks"


def exclude_files(standing: Iterable[str], roots: Sequence[str]) -> dict[str, list[str]]:
    """{the `info/exclude` file of the repository at a root: a pattern for each placeholder
    standing at the top of that root}: git inside the sandbox must not see them as untracked
    directories (`git stash -u` and `git clean -d` would fail to remove them)."""
    files: dict[str, list[str]] = {}
    standing = list(standing)
    for root in roots:
        dot_git = os.path.join(root, ".git")
        if os.path.islink(dot_git) or not os.path.exists(dot_git) or dot_git in standing:
            continue  # no repository: a stand-in `.git` is an empty directory git does not read
        gitdir = dot_git if os.path.isdir(dot_git) else read_gitfile(dot_git)
        if gitdir is None or not os.path.isdir(gitdir):
            continue
        patterns = [
            "/" + os.path.basename(p) + ("/" if os.path.isdir(p) else "")
            for p in standing
            if os.path.dirname(p) == root
        ]
        if patterns:
            files.setdefault(os.path.join(common_dir(gitdir), "info", "exclude"), []).extend(patterns)
    return files


@contextlib.contextmanager
def excludes(
    standing: Iterable[str], roots: Sequence[str], home: str | None
) -> Iterator[list[tuple[str, str]]]:
    """(source, path) for bubblewrap to bind read-only: each repository's `info/exclude` as it is
    on the host plus the placeholders standing at the top of its worktree, written in a 0700
    directory of egressd's hidden `home` (ca.own_work_dir), removed afterwards. A missing exclude
    file is made (and removed) like a placeholder."""
    files = exclude_files(standing, roots)
    if not files or home is None:
        yield []
        return
    registry = registry_of(home)
    with registry_lock(registry):  # another sandbox's stand-in is shared like the others
        missing = [Placeholder(p, False) for p in files if not os.path.lexists(p) or stands(registry, p)]
    with placeholders(missing, registry=registry):
        private = ca.own_work_dir(Path(home))
        try:
            binds = []
            for number, (path, patterns) in enumerate(files.items()):
                text = read_small(path, EXCLUDE_MAX)
                if text is None:
                    continue  # not a plain file: git inside reads nothing of ours there
                source = private / str(number)
                lines = [*([text.rstrip("\n")] if text.strip() else []), EXCLUDE_NOTE, *patterns]
                source.write_text("".join(f"{line}\n" for line in lines), "utf-8", "surrogateescape")
                binds.append((str(source), path))
            yield binds
        finally:
            ca.remove_work_dir(private)
