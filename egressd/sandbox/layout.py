"""The sandbox's file system, planned from the options and this process before anything starts.

Gathers what shields.py protects — the user's home (masked: empty but for what is shown), egressd's
code, presets and interpreter (every directory it imports from), the policy it reloads, the audit
it writes, its home (the CA key, whenever it is created), the user's credentials, the sources of
the policy's secrets and authority sockets — and checks the user's mounts against them, so a bad
combination stops with the fix before the proxy or the child runs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import egressd
from egressd.inspect import ca
from egressd.policy import PolicyError, builtin_policy_path
from egressd.policy.loader import preset_dirs
from egressd.sandbox import exit_summary, hooks
from egressd.sandbox.exit_summary import Walk
from egressd.sandbox.hooks import Placeholder
from egressd.sandbox.mounts import Mount, MountError, plan_mounts, within
from egressd.sandbox.shields import (
    HARMLESS,
    PRIVATE,
    Cover,
    absent_credentials,
    apply_show,
    credential_paths,
    existing,
    inside_view,
    plan_covers,
)
from egressd.session import SessionOptions, resolve_policy_path


@dataclass(frozen=True)
class Layout:
    """The sandbox's file system: what is mounted, covered, hidden and shown."""

    mounts: tuple[Mount, ...]
    covers: tuple[Cover, ...]
    hidden: tuple[str, ...]  # every hidden path (the environment drops variables pointing there)
    shown: tuple[str, ...]  # --show paths (a warning names each)
    cache: str | None = None  # --cache DIR (writable), or None: a private cache in the sandbox's /tmp
    # what egressd reads, runs or writes while the child runs, wherever it is: Seatbelt shares the
    # host's /tmp, so it protects each one itself (bubblewrap needs only the covers)
    guarded: tuple[str, ...] = ()
    masked: tuple[str, ...] = ()  # the home: empty inside but for what is shown in it
    revealed: tuple[str, ...] = ()  # shown read-only inside the masked home or a hidden path
    harmless: tuple[str, ...] = ()  # of those, the configuration shown by default
    withheld: tuple[tuple[str, str], ...] = ()  # harmless-listed files not shown, and why
    notes: tuple[tuple[str, str], ...] = ()  # (path, what it is) for --explain
    private: tuple[str, ...] = PRIVATE  # what the sandbox makes private whatever the covers say
    absent: tuple[str, ...] = ()  # listed credentials that do not exist at start (Seatbelt hides them)
    # the project's hooks (hooks.py) write-protected: (path, why); none with --allow-project-hooks
    hooks: tuple[tuple[str, str], ...] = ()
    # of those, the missing ones bubblewrap mounts a placeholder on (egressd makes it, then removes it)
    placeholders: tuple[Placeholder, ...] = ()
    # the candidates for the exit summary, as the run found them (exit_summary.py)
    before: Walk | None = None
    own_home: str | None = None  # egressd's home: where it records the placeholders it made
    # after the run, neutralise the repositories made where nothing protected them (quarantine.py)
    quarantine: bool = False
    # what git reads that was missing at start and could not be protected: set aside if made
    later: tuple[str, ...] = ()

    def hides(self, path: str) -> bool:
        """The child sees nothing of the host's at the canonical `path`."""
        return inside_view(path, self.mounts, self.covers, self.private) == "hidden"


def egressd_code() -> dict[str, str]:
    """Every directory egressd's own process runs code from: a module it imports late (an addon on
    the first SOCKS5 connection) must not be one the child wrote."""
    code: dict[str, str] = {}

    def add(paths: Sequence[str | None], what: str) -> None:
        for path in existing(p for p in paths if p):
            code.setdefault(path, what)

    add([os.path.dirname(egressd.__file__)], "egressd's own package")
    spec = importlib.util.find_spec("egressd.addons")
    add(list(spec.submodule_search_locations or []) if spec else [], "egressd's mitmproxy addons")
    add([sys.prefix, sys.exec_prefix], "egressd's Python environment")
    add(
        [sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.realpath(sys.executable))],
        "egressd's Python",
    )
    add([p for p in sys.path if p and os.path.isdir(p)], "a directory egressd imports from")
    add([str(p) for p in preset_dirs()], "egressd's presets")
    if sys.pycache_prefix:
        # PYTHONPYCACHEPREFIX: the bytecode of every module egressd imports late is looked for
        # there before the (read-only) source is compiled. Made now if missing, so the child
        # can never be the one to create it.
        with contextlib.suppress(OSError):
            os.makedirs(sys.pycache_prefix, exist_ok=True)
        add([sys.pycache_prefix], "egressd's bytecode cache (PYTHONPYCACHEPREFIX)")
    return code


def followed_links(path: str, *, _depth: int = 0) -> tuple[str, ...]:
    """Every symlink resolving `path` goes through (the links' own paths, in order)."""
    links: list[str] = []
    resolved = "/"
    for part in os.path.abspath(os.path.expanduser(path)).split("/"):
        if not part:
            continue
        candidate = os.path.join(resolved, part)
        if os.path.islink(candidate) and _depth < 40:
            links.append(candidate)
            target = os.path.join(resolved, os.readlink(candidate))
            links += followed_links(target, _depth=_depth + 1)
            resolved = os.path.realpath(target)
        else:
            resolved = candidate
    return tuple(links)


def option_links(options: SessionOptions) -> tuple[tuple[str, str, str], ...]:
    """(option, as given, symlink) for the symlinks the policy and audit paths go through: taken
    before pinned_options resolves them, for plan_layout to check against the writable mounts."""
    found = []
    for policy in _policy_values(options):
        given = str(resolve_policy_path(policy))
        found += [("--policy", given, link) for link in followed_links(given)]
    if options.audit_path is not None:
        found += [("--audit", options.audit_path, link) for link in followed_links(options.audit_path)]
    return tuple(found)


def _unshadowed_preset(value: str) -> None:
    """`--policy npm` means the preset, but a file `npm` in the working directory wins, and an
    earlier sandboxed command (a postinstall script) can write that file: both existing is
    refused, and `./npm` names the file."""
    if not os.path.exists(value) or os.sep in value:
        return
    try:
        builtin_policy_path(value)
    except PolicyError:
        return  # no preset of that name: the file is all it can mean
    raise PolicyError(
        "--policy",
        None,
        value,
        f"names both the built-in preset and the file ./{value} (which a sandboxed command may "
        f"have written); remove ./{value} for the preset, or write --policy ./{value} for the file",
    )


def _policy_values(options: SessionOptions) -> list[str]:
    """Every --policy given: the first (watched, edited) and the ones merged with it."""
    first = [options.policy_file] if options.policy_file is not None else []
    return first + list(options.overrides.policies)


def _pinned_policy(value: str) -> str:
    _unshadowed_preset(value)
    return os.path.realpath(resolve_policy_path(value))


def pinned_options(options: SessionOptions) -> SessionOptions:
    """The policy and audit paths resolved once: egressd reads and writes exactly the files the
    sandbox protects, never through a symlink the child could point elsewhere."""
    policy = options.policy_file
    if policy is not None:
        policy = _pinned_policy(policy)
    overrides = replace(
        options.overrides, policies=tuple(_pinned_policy(p) for p in options.overrides.policies)
    )
    audit = options.audit_path
    if audit is not None:
        audit = os.path.realpath(audit)
    return replace(options, policy_file=policy, audit_path=audit, overrides=overrides)


def egressd_home(options: SessionOptions) -> str:
    """egressd's home, created (0700) now so it can be hidden even if the CA appears only later."""
    home = Path(options.config_dir) if options.config_dir else ca.config_dir()
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    return os.path.realpath(home)


def control_run_dir() -> str | None:
    """The control API's run directory ($XDG_RUNTIME_DIR/egressd when egressd's home does not
    hold it), created (0700) now so it is hidden before egressd's socket appears in it: a child that
    reached the socket could approve its own asks and grant itself targets."""
    from egressd.control import paths

    try:
        return os.path.realpath(paths.ensure_run_dir(paths.run_dir()))
    except paths.RunDirError:
        return None  # egressd will not serve there either


def plan_layout(
    options: SessionOptions,
    *,
    workdir: str | None,
    rw: Sequence[str],
    ro: Sequence[str],
    hide: Sequence[str] = (),
    show: Sequence[str] = (),
    rw_home: bool = False,
    cache: str | None = None,
    environ: Mapping[str, str] | None = None,
    links: Sequence[tuple[str, str, str]] = (),
    private: Sequence[str] = PRIVATE,
    project_hooks: bool = True,
) -> Layout:
    """Mounts and covers for `options` (already pinned_options; `links` from option_links before
    that); MountError names the fix. `private`: what the sandbox itself makes private (bubblewrap's
    /tmp, /run, /dev, /proc; nothing under Seatbelt). `project_hooks`: write-protect the project's
    hooks (hooks.py); False is --allow-project-hooks. `workdir` None: no working directory mount
    (see plan_mounts)."""
    environ = os.environ if environ is None else environ
    home = os.path.realpath(os.path.expanduser("~"))
    given = [("--rw", p) for p in rw] + [("--ro", p) for p in ro] + ([("--cache", cache)] if cache else [])
    given += [("--show", p) for p in show]
    links = [*links, *_home_links(options)]
    links += [(option, path, link) for option, path in given for link in followed_links(path)]
    cache_dir = _checked("--cache", [cache])[0] if cache else None
    rw = [*rw, cache_dir] if cache_dir else rw
    mounts = plan_mounts(workdir, rw, ro, home=home, rw_home=rw_home)
    cwd = [os.path.realpath(workdir)] if workdir is not None else []
    _check_links([*cwd, *(m.path for m in mounts if m.writable)], links)
    _check_single_links(mounts, options)
    guarded = egressd_code()
    for policy in _policy_values(options):
        guarded.setdefault(policy, "the policy egressd reads")
    if options.audit_path is not None:
        guarded.setdefault(options.audit_path, "the audit log egressd writes")
    own = [egressd_home(options)]
    run_dir = control_run_dir()
    if run_dir is not None and not any(within(run_dir, top) for top in own):
        own.append(run_dir)
    credentials = [*credential_paths(home, environ), *_checked("--hide", hide)]
    shown = _checked("--show", show)
    for path in shown:
        for top in own:
            if _same_or_inside(path, top):
                raise MountError(
                    f"--show {path}: egressd's own home and sockets ({top}) are never shown to the child"
                )
    # the home is masked unless the user names the home itself (--rw-home, --ro ~, --show ~);
    # then the credentials below are all that stays hidden in it
    masked = () if home == "/" or home in shown or any(m.path == home for m in mounts) else (home,)
    credentials, inside = apply_show(tuple(dict.fromkeys(credentials)), shown, masked)
    harmless, withheld = harmless_files(home) if masked else ((), ())
    revealed = (*inside, *harmless)
    hidden = (*own, *credentials)
    roots = writable_roots(mounts, cache_dir)
    before = exit_summary.walk(roots)
    # every nested repository found, a bare one (`x.git`, any directory git takes for one) too
    bare = [d for d in before.gitdirs if os.path.basename(d) != ".git" and "/.git/" not in d]
    nested = [*before.gits, *bare]
    found = hooks.Found()
    if project_hooks:
        registry = hooks.registry_of(own[0])
        with hooks.registry_lock(registry):  # other sandboxes' stand-ins neither appear nor vanish
            found = hooks.find(roots, nested, git=hooks.system_git(), registry=registry)
    project = {p: why for p, why in found.protected.items() if not any(within(p, h) for h in hidden)}
    covers = plan_covers(
        mounts, {**guarded, **project}, hidden, masked=masked, shown=revealed, private=private
    )
    notes = [*guarded.items(), *((p, "egressd's own home or sockets") for p in own)]
    notes += [(p, "a credential, or a path --hide names") for p in credentials]
    return Layout(
        mounts,
        covers,
        hidden,
        shown,
        cache_dir,
        tuple(guarded),
        masked=masked,
        revealed=revealed,
        harmless=harmless,
        withheld=withheld,
        notes=tuple(notes),
        private=tuple(private),
        absent=absent_credentials(home, environ),
        hooks=tuple(project.items()),
        placeholders=_placeholders(found.placeholders, covers),
        before=before,
        own_home=own[0],
        quarantine=project_hooks,
        later=tuple(p for p in found.later if not any(within(p, h) for h in hidden)),
    )


def writable_roots(mounts: Sequence[Mount], cache: str | None) -> tuple[str, ...]:
    """The outermost writable mounts but the --cache directory: where the project's hooks and
    what the run leaves are looked for."""
    writable = [m.path for m in mounts if m.writable and m.path != cache]
    outermost = [p for p in writable if not any(within(p, q) and p != q for q in writable)]
    return tuple(p for p in outermost if os.path.isdir(p))  # a --rw file holds no project


def _placeholders(wanted: Mapping[str, Placeholder], covers: Sequence[Cover]) -> tuple[Placeholder, ...]:
    """The placeholders a read-only cover lies on (elsewhere the path is read-only or hidden)."""
    covered = {c.path for c in covers if c.kind == "ro"}
    return tuple(p for path, p in wanted.items() if path in covered)


def hide_more(layout: Layout, paths: Mapping[str, str]) -> Layout:
    """`layout` with `paths` ({path: what it is}) hidden too, wherever they are: the sources of the
    policy's secrets, known once the policy is loaded. MountError when a user mount or --show
    would show one."""
    for path, what in paths.items():
        for shown in (*(m.path for m in layout.mounts), *layout.shown):
            if within(shown, path):
                raise MountError(
                    f"{shown}: it is {what}, which the sandbox never shows to the child; "
                    "drop that --rw, --ro or --show"
                )
    new = tuple(p for p in paths if p not in layout.hidden)
    if not new:
        return layout
    hidden = (*layout.hidden, *new)
    project = {p: why for p, why in layout.hooks if not any(within(p, h) for h in new)}
    covers = plan_covers(
        layout.mounts,
        {**dict.fromkeys(layout.guarded, "egressd's own"), **project},
        hidden,
        masked=layout.masked,
        shown=layout.revealed,
        private=layout.private,
    )
    notes = (*layout.notes, *((p, paths[p]) for p in new))
    placeholders = _placeholders({p.path: p for p in layout.placeholders}, covers)
    return replace(
        layout,
        covers=covers,
        hidden=hidden,
        notes=notes,
        hooks=tuple(project.items()),
        placeholders=placeholders,
    )


# A line of a configuration file that looks like it holds a credential: a key named like one, a
# URL with a password or a token as its user name, or a well-known token prefix.
_CREDENTIAL_LINE = re.compile(
    r"password|passwd|token|secret|api[_-]?key|authorization|bearer|extraheader|credential"
    r"|://[^\s/@:]+:[^\s/@]+@|https?://[^\s/@]+@"
    r"|\b(?:ghp_|gho_|ghs_|github_pat_|glpat-|xox[abpr]-|sk-|AKIA)",
    re.IGNORECASE,
)
HARMLESS_MAX = 1 << 16


def holds_credential(text: str) -> str | None:
    """Why a configuration file may hold a credential ("line N"), or None. Never the line itself."""
    for number, line in enumerate(text.splitlines(), 1):
        if _CREDENTIAL_LINE.search(line):
            return f"line {number} looks like it holds a credential"
    return None


def harmless_files(home: str) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(shown, withheld with why): the configuration of HARMLESS that exists in `home` and holds
    nothing that looks like a credential. A symlink (dotfiles) is shown at its own path, where
    tools look; its target is read for the check."""
    shown, withheld = [], []
    for rel in HARMLESS:
        path = os.path.join(home, rel)
        parent = os.path.realpath(os.path.dirname(path))
        if not within(parent, home):
            continue  # ~/.config a symlink out of the home: not the home's to show
        path = os.path.join(parent, os.path.basename(path))
        try:
            if not os.path.isfile(path):
                continue
            if os.path.getsize(path) > HARMLESS_MAX:
                withheld.append((path, f"larger than {HARMLESS_MAX} bytes: not checked"))
                continue
            with open(path, encoding="utf-8", errors="replace") as f:
                why = holds_credential(f.read())
        except OSError:
            continue
        if why is None:
            shown.append(path)
        else:
            withheld.append((path, why))
    return tuple(shown), tuple(withheld)


def _same_or_inside(path: str, top: str) -> bool:
    """`path` is `top` or lies in it, by file identity as well as by name: a case-insensitive file
    system or a second mount of one directory spells it another way."""
    if within(path, top):
        return True
    try:
        target = os.stat(top)
    except OSError:
        return False
    current = path
    while True:
        with contextlib.suppress(OSError):
            info = os.stat(current)
            if (info.st_dev, info.st_ino) == (target.st_dev, target.st_ino):
                return True
        parent = os.path.dirname(current)
        if parent == current:
            return False
        current = parent


def _home_links(options: SessionOptions) -> list[tuple[str, str, str]]:
    given = str(options.config_dir) if options.config_dir else str(ca.config_dir())
    return [("egressd's home (EGRESSD_HOME)", given, link) for link in followed_links(given)]


def _check_links(places: Sequence[str], links: Sequence[tuple[str, str, str]]) -> None:
    """A symlink in the working directory or a writable one may be the child's (left by an earlier
    run): following it, egressd would read its policy from, or append its audit (lines whose host
    and path the child chose) to, whatever file the child named, ~/.bashrc included, and a --rw
    would make that file's directory writable."""
    for option, given, link in links:
        if any(within(link, place) for place in places):
            raise MountError(
                f"{option} {given}: it goes through the symlink {link}, in a directory a sandboxed "
                f"command can write (an earlier one may have put it there; it leads to "
                f"{os.path.realpath(link)}); name the real path if you mean it, or remove the link"
            )


def _check_single_links(mounts: Sequence[Mount], options: SessionOptions) -> None:
    """The policy and audit must have no other hard link the child could write through: a
    read-only bind covers a path, not the inode, and an earlier child may have linked the file
    into a directory that is writable now."""
    writable_devices = set()
    for mount in mounts:
        if mount.writable:
            with contextlib.suppress(OSError):
                writable_devices.add(os.stat(mount.path).st_dev)
    code = egressd_code()
    checked = [("--policy", p) for p in _policy_values(options)] + [("--audit", options.audit_path)]
    for option, path in checked:
        if path is None or any(within(path, top) for top in code):
            continue  # a preset: egressd's package (installers such as uv hard-link it from a cache)
        try:
            info = os.stat(path)
        except OSError:
            continue  # an audit file egressd has yet to create
        if info.st_nlink > 1 and info.st_dev in writable_devices:
            raise MountError(
                f"{option} {path}: the file has {info.st_nlink} hard links, on a file system the "
                "sandbox makes writable: the child could change it through another one (an earlier "
                "sandboxed command may have made it); use a copy with a single link"
            )


def _checked(option: str, paths: Sequence[str]) -> tuple[str, ...]:
    found = []
    for path in paths:
        full = os.path.realpath(os.path.abspath(os.path.expanduser(path)))
        if not os.path.exists(full):
            raise MountError(f"{option} {path}: no such file or directory")
        found.append(full)
    return tuple(found)
