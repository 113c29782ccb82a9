"""What the run left that runs code later: the exit summary of `egressd sandbox`.

The sandbox write-protects the project's hooks (hooks.py), but the project is the child's to
write, and much in it runs code later: an executable, the scripts `npm install` runs, a Makefile,
a `.envrc` in a subdirectory, a repository the child made. Before the child starts, egressd walks
the writable roots once and keeps the stat of the files that matter (the candidates); after it
ended, it walks again and names every candidate created or changed meanwhile, so the person sees
what the agent left before running any of it.

Cheap for a big project: one `lstat` per entry, the content of nothing but the `package.json` at
each root; inside a git directory only its hooks and configuration are looked at (never
`objects`, `refs`, `logs`); nothing below a symlink or on another file system. Bounded: at most
WALK_LIMIT entries per walk, nearest the top first (breadth first); the summary says when the
walk stopped. Changed means another inode, size, mtime, ctime or mode; ctime cannot be set back
by the child, so restoring a file's mtime does not hide a change.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import stat
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from egressd.sandbox import hooks
from egressd.sandbox.mounts import within

WALK_LIMIT = 200_000
SUMMARY_LINES = 20
# ctime is kept in coarse clock ticks: a file changed just after the start may look older
CLOCK_SLACK_NS = 2_000_000_000
PACKAGE_JSON_MAX = 1 << 20
# What `npm install` runs in the project without being asked: its lifecycle scripts.
LIFECYCLE = ("preinstall", "install", "postinstall", "prepublish", "preprepare", "prepare", "postprepare")
GIT_SKIPPED = frozenset({"objects", "refs", "logs", "lfs", "rr-cache", "subtree-cache"})
GIT_CONFIG = frozenset({"config", "config.worktree", "commondir"})
# Read on entering a directory, at any depth (the hooks list protects them at the roots).
_READ_ON_CD = (".envrc", ".tool-versions", ".mise.toml", "mise.toml", ".mise.local.toml", "mise.local.toml")
ANY_DEPTH = {e.path: e.why for e in hooks.IN_PROJECT if e.path in _READ_ON_CD}
# Not protected (the child must be able to write them), but run by a tool without naming them.
AT_ROOT = {
    "Makefile": "make runs it",
    "makefile": "make runs it",
    "GNUmakefile": "make runs it",
    ".npmrc": "npm reads it on every command (script-shell, node-options, git)",
    ".yarnrc.yml": "yarn runs the yarnPath it names",
    ".pnpmfile.cjs": "pnpm runs it on install",
}
_ROOT_ENTRIES = {e.path: e.why for e in hooks.IN_PROJECT}


@dataclass(frozen=True)
class Seen:
    """What identifies a version of a file (a directory: its inode only)."""

    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    mode: int

    @classmethod
    def of(cls, info: os.stat_result) -> Seen:
        if stat.S_ISDIR(info.st_mode):
            return cls(info.st_ino, 0, 0, info.st_ctime_ns, stat.S_IFDIR)
        return cls(info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_mode)

    def same(self, other: Seen) -> bool:
        if stat.S_ISDIR(self.mode) and stat.S_ISDIR(other.mode):
            return self.ino == other.ino
        return self == other


class Walk:
    """What one walk of the roots found. A plain class: filled by walk() and read, never compared
    nor copied, so a dataclass would only add start-up time (the walk before the child is on its
    path)."""

    __slots__ = (
        "roots",
        "started_ns",
        "files",
        "gits",
        "gitdirs",
        "lifecycle",
        "unreadable",
        "seen",
        "complete",
    )

    def __init__(self, roots: tuple[str, ...], started_ns: int) -> None:
        self.roots = roots
        self.started_ns = started_ns
        self.files: dict[str, tuple[Seen, str]] = {}  # candidate: (stat, why)
        self.gits: list[str] = []  # `.git` entries below the roots (not theirs)
        self.gitdirs: dict[str, int] = {}  # every git directory seen: its inode
        self.lifecycle: dict[str, dict[str, str]] = {}  # package.json: its scripts
        self.unreadable: list[str] = []  # directories whose permissions kept it out
        self.seen = 0
        self.complete = True


GIT_HOOK = "a git hook"
GIT_CONFIGURATION = "git configuration"
ROOT_GIT = "the project's git directory"
NESTED_GIT = "a git repository: git runs its hooks and configuration there"
EXECUTABLE = "executable"
_TOPS = {e.path.split("/", 1)[0] for e in hooks.IN_PROJECT}


def _why(relative: str, name: str, info: os.stat_result, in_git: bool) -> str | None:
    """Why the entry at `relative` (to its root) matters, or None."""
    if in_git:
        if ("/" + relative).endswith("/hooks/" + name) and not name.endswith(".sample"):
            return GIT_HOOK
        if name in GIT_CONFIG or ("/" + relative).endswith("/info/attributes"):
            return GIT_CONFIGURATION
        return None
    if name == ".git":
        return ROOT_GIT if relative == ".git" else NESTED_GIT
    if relative.split("/", 1)[0] in _TOPS:
        for entry, why in _ROOT_ENTRIES.items():
            if relative == entry or relative.startswith(entry + "/"):
                return why
    if relative in AT_ROOT:
        return AT_ROOT[relative]
    if name in ANY_DEPTH:
        return ANY_DEPTH[name]
    if stat.S_ISREG(info.st_mode) and info.st_mode & 0o111:
        return EXECUTABLE
    return None


def walk(roots: Sequence[str], limit: int = WALK_LIMIT, started_ns: int | None = None) -> Walk:
    """The candidates under `roots` (canonical directories), breadth first, at most `limit` entries."""
    found = Walk(tuple(roots), time.time_ns() if started_ns is None else started_ns)
    queue: deque[tuple[str, str, bool, int]] = deque()
    for root in roots:
        try:
            queue.append((root, root, False, os.stat(root).st_dev))
        except OSError:
            continue
        _lifecycle(found, root)
    while queue:
        directory, root, in_git, device = queue.popleft()
        try:
            entries = list(os.scandir(directory))
        except PermissionError:
            found.unreadable.append(directory)  # git may still reach what it holds, by name
            continue
        except OSError:
            continue
        if hooks.git_directory({e.name for e in entries}):
            with contextlib.suppress(OSError):
                found.gitdirs[directory] = os.lstat(directory).st_ino
            in_git = True  # a bare repository, a submodule's: git reads its hooks and configuration
        for entry in entries:
            if found.seen >= limit:
                found.complete = False
                return found
            found.seen += 1
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            path = entry.path
            why = _why(path[len(root) + 1 :], entry.name, info, in_git)
            if why is not None:
                found.files[path] = (Seen.of(info), why)
            if entry.name == ".git" and not in_git and directory != root:
                found.gits.append(path)
            if not stat.S_ISDIR(info.st_mode) or info.st_dev != device:
                continue  # a symlink, a file, or another file system
            if in_git and entry.name in GIT_SKIPPED:
                continue
            queue.append((path, root, in_git or entry.name == ".git", device))
    return found


def lifecycle_scripts(package_json: str) -> dict[str, str] | None:
    """The lifecycle scripts of a package.json (None when there is none or it does not parse)."""
    text = hooks.read_small(package_json, PACKAGE_JSON_MAX)
    if text is None:
        return None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # the child's file: nested deeper than the parser goes
        return None
    scripts = data.get("scripts") if isinstance(data, dict) else None
    if not isinstance(scripts, dict):
        return {}
    return {k: v for k, v in scripts.items() if k in LIFECYCLE and isinstance(v, str)}


def script_files(root: str, command: str) -> list[str]:
    """The files under `root` a script names (`node scripts/x.js`, `./install.sh`), canonical."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    files = []
    for word in words:
        if not word or word.startswith("-") or ("=" in word and os.sep not in word):
            continue  # an option, or a variable set for the command
        path = os.path.realpath(os.path.join(root, word))
        if within(path, root) and path != root and os.path.isfile(path):
            files.append(path)
    return files


UNREAD_PACKAGE_JSON = (
    "npm install runs its lifecycle scripts, and egressd could not read them (larger than 1 MiB, "
    "or not JSON): look at them"
)


def _lifecycle(found: Walk, root: str) -> None:
    package_json = os.path.join(root, "package.json")
    scripts = lifecycle_scripts(package_json)
    if scripts is None:
        with contextlib.suppress(OSError):  # padded past what is read: any change of it is named
            found.files[package_json] = (Seen.of(os.lstat(package_json)), UNREAD_PACKAGE_JSON)
        return
    found.lifecycle[package_json] = scripts
    for key, command in scripts.items():
        for path in script_files(root, command):
            try:
                info = os.lstat(path)
            except OSError:
                continue
            found.files.setdefault(path, (Seen.of(info), f"npm install runs it (package.json's {key})"))


class Change:
    """One candidate created or changed during the run, and why it matters. A plain class: made by
    changes() and read, never compared nor copied (a dataclass would only add start-up time: this
    module loads before the child)."""

    __slots__ = ("path", "what", "why")

    def __init__(self, path: str, what: str, why: str) -> None:
        self.path = path
        self.what = what  # created or changed
        self.why = why


def changes(before: Walk, after: Walk, ignore: Iterable[str] = ()) -> list[Change]:
    """Every candidate created or changed between the two walks (`ignore`: egressd's own
    placeholders, if one could not be removed), the most telling first."""
    ignored = set(ignore)
    found = []
    for path, (now, why) in after.files.items():
        if path in ignored:
            continue
        old = before.files.get(path)
        if old is None:
            if now.ctime_ns < before.started_ns - CLOCK_SLACK_NS:
                continue  # there before and untouched: the first walk stopped short of it
            found.append(Change(path, "changed" if path in before.lifecycle else "created", why))
        elif not old[0].same(now):
            found.append(Change(path, "changed", why))
    for package_json, scripts in after.lifecycle.items():
        old = before.lifecycle.get(package_json, {})
        keys = sorted(k for k in set(old) | set(scripts) if old.get(k) != scripts.get(k))
        if keys:
            found.append(Change(package_json, "changed", f"npm install runs its {', '.join(keys)} script"))
    return sorted(found, key=lambda c: (_rank(c.why), c.path))


def _rank(why: str) -> int:
    """Hooks first, then git's own files, then the rest of the list, executables last."""
    return {GIT_HOOK: 0, GIT_CONFIGURATION: 1, ROOT_GIT: 1, NESTED_GIT: 1, EXECUTABLE: 3}.get(why, 2)


def printable(text: str) -> str:
    """A name the child chose, safe to print on a terminal (no escape sequences, no new lines)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def summary(found: Sequence[Change], after: Walk, *, cwd: str, limit: int = SUMMARY_LINES) -> list[str]:
    """The lines egressd prints on stderr after the run (none when nothing was left)."""
    lines = []
    if found:
        lines.append(
            "the sandboxed command created or changed files that run code when you or your tools use "
            "this project; look at them before you do:"
        )
        for change in found[:limit]:
            lines.append(f"  {printable(_shown(change.path, cwd))} ({change.what}): {change.why}")
        rest = found[limit:]
        if rest:
            tops = Counter(_top(c.path, after.roots, cwd) for c in rest)
            where = ", ".join(f"{printable(top)}: {n}" for top, n in tops.most_common(5))
            lines.append(f"  and {len(rest)} more ({where})")
    if after.unreadable:
        first = printable(_shown(after.unreadable[0], cwd))
        lines.append(
            f"the look at what the command left could not read {len(after.unreadable)} "
            f"director{'y' if len(after.unreadable) == 1 else 'ies'} (their permissions; the first: "
            f"{first}): nothing in them was checked"
        )
    if not after.complete:
        lines.append(
            f"the look at what the command left stopped after {after.seen} entries: files deeper in "
            "the project were not checked"
        )
    return lines


def _shown(path: str, cwd: str) -> str:
    return os.path.relpath(path, cwd) if within(path, cwd) else path


def _top(path: str, roots: Sequence[str], cwd: str) -> str:
    root = next((r for r in roots if within(path, r)), os.path.dirname(path))
    first = os.path.relpath(path, root).split("/", 1)[0]
    return _shown(os.path.join(root, first), cwd)
