"""The project's own hooks: a sandboxed child must not leave code that runs outside the sandbox.

Every test runs `egressd sandbox` as a user who is not root (tests/support/unprivileged.py) in a
real git repository in that user's home. The child tries each way to make git, direnv or an
editor run its code later: hooks, `git config` (core.fsmonitor, core.hooksPath, a filter driver)
and the config file itself, a new `.git` in place of the old, a symlinked `.git`, `commondir`, a
linked worktree's `.git` file and directory, a submodule's and a nested repository's git
directories, `.envrc`, `.vscode/tasks.json`. After the run, the user does what users do next —
`git status`, `git diff`, `git add`, `git commit`, `git checkout` — outside the sandbox, and every
payload would touch a marker file: none may appear. The same attack with
`--allow-project-hooks` (the sandbox without this protection) does leave a marker: the attack is
real and the test is not vacuous.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.egressd_cli import EGRESSD
from tests.support.unprivileged import User, unprivileged_user

GIT_ENV = {
    "GIT_AUTHOR_NAME": "T",
    "GIT_AUTHOR_EMAIL": "t@example.test",
    "GIT_COMMITTER_NAME": "T",
    "GIT_COMMITTER_EMAIL": "t@example.test",
    "GIT_CONFIG_NOSYSTEM": "1",
}


@pytest.fixture(scope="module")
def user() -> Iterator[User]:
    with unprivileged_user() as created:
        created.mkdir("marks")
        yield created


def sh(user: User, script: str, cwd: Path) -> subprocess.CompletedProcess[bytes]:
    """`script` run by the user outside any sandbox; fails the test when it fails."""
    result = user.run(["sh", "-ec", script], cwd=cwd, env=GIT_ENV)
    assert result.returncode == 0, (script, result.stderr.decode())
    return result


def sandboxed(user: User, cwd: Path, script: str, *options: str) -> subprocess.CompletedProcess[bytes]:
    env = {**GIT_ENV, "TMPDIR": "/tmp"}
    argv = [*EGRESSD, "sandbox", "--no-capture", *options, "--", "sh", "-c", f"{script}\ntrue"]
    return user.run(argv, cwd=cwd, env=env)


def marks(user: User) -> set[str]:
    return set(os.listdir(user.home / "marks"))


def payload(user: User, name: str) -> str:
    """A command that leaves the marker `name` (inside the sandbox the home is read-only)."""
    return f"touch {user.home}/marks/{name}"


def hook(user: User, name: str) -> str:
    """A hook script's text."""
    return f"#!/bin/sh\n{payload(user, name)}\n"


@dataclass
class Case:
    setup: str  # run by the user outside, in the project, before the sandbox
    attack: str  # run by the child inside the sandbox, in the project
    marks: set[str]  # what the attack leaves once the user runs git, without the protection
    repos: tuple[str, ...] = (".",)  # where the user runs git afterwards
    options: tuple[str, ...] = ()
    project: str = ""  # the project, relative to the case's directory
    unchanged: tuple[str, ...] = ()  # files that must be exactly as before


REPO = "git init -q && git commit -q --allow-empty -m first"
SUBMODULE = (
    "mkdir subsrc && (cd subsrc && git init -q && git commit -q --allow-empty -m s) && "
    f"mkdir proj && cd proj && {REPO} && "
    "git -c protocol.file.allow=always submodule add -q ../subsrc sub && git commit -q -m sub"
)


def submodule(attack: str, left: set[str], unchanged: str) -> Case:
    """A case in a project with a submodule, whose git directory is the project's .git/modules/sub."""
    return Case(SUBMODULE, attack, left, repos=(".", "sub"), project="proj", unchanged=(unchanged,))


def in_writable_parent(attack: str, left: set[str], repos: tuple[str, ...] = (".",)) -> Case:
    """A case whose project, no repository, lies in a directory the child may write too (--rw ..)."""
    return Case("mkdir proj", attack, left, repos=repos, options=("--rw", ".."), project="proj")


def cases(user: User) -> dict[str, Case]:
    p = lambda name: shlex.quote(payload(user, name))  # noqa: E731
    write_hook = lambda path, name: (  # noqa: E731
        f"printf %s {shlex.quote(hook(user, name))} > {path}; chmod +x {path}"
    )
    evil_git = (
        "mkdir -p evil && git -C evil init -q && git -C evil commit -q --allow-empty -m e && "
        f"git -C evil config core.fsmonitor {p('evil-fsmonitor')}"
    )
    new_repo = lambda path: f"git init -q {path} && git -C {path} commit -q --allow-empty -m n"  # noqa: E731
    return {
        "hooks": Case(
            REPO,
            "; ".join(
                [write_hook(".git/hooks/pre-commit", "pre-commit")]
                + [f"cp .git/hooks/pre-commit .git/hooks/{h}" for h in ("post-checkout", "post-commit")]
                + ["ln -s pre-commit .git/hooks/pre-push"]
            ),
            {"pre-commit"},
        ),
        "hooks-missing": Case(
            f"{REPO} && rm -rf .git/hooks",
            f"mkdir -p .git/hooks; {write_hook('.git/hooks/pre-commit', 'pre-commit')}",
            {"pre-commit"},
        ),
        "git-config": Case(
            REPO,
            "; ".join(
                [
                    f"git config core.fsmonitor {p('fsmonitor')}",
                    f"git config filter.x.clean {p('clean-filter')}",
                    f"git config filter.x.smudge {p('smudge-filter')}",
                    "echo '* filter=x' > .gitattributes",
                    f"git config diff.external {p('diff-external')}",
                    "mkdir -p .githooks",
                    write_hook(".githooks/pre-commit", "hooks-path"),
                    "git config core.hooksPath .githooks",
                ]
            ),
            {"fsmonitor", "clean-filter", "hooks-path"},
            unchanged=(".git/config",),
        ),
        "config-edit": Case(
            REPO,
            "; ".join(
                [
                    f"printf '[core]\\n\\tfsmonitor = %s\\n' {p('appended')} >> .git/config",
                    f"printf '[core]\\n\\tfsmonitor = %s\\n' {p('replaced')} > config.new",
                    "mv config.new .git/config",
                ]
            ),
            {"replaced"},
            unchanged=(".git/config",),
        ),
        "replace-git": Case(
            REPO,
            f"mv .git .git2 || rm -rf .git; git init -q; git config core.fsmonitor {p('new-git')}",
            {"new-git"},
        ),
        "symlink-git": Case(
            REPO,
            f"{evil_git}; rm -rf .git; ln -s evil/.git .git",
            {"evil-fsmonitor"},
        ),
        "commondir": Case(
            REPO,
            f"mkdir -p evil && cp -r .git/. evil/ && git --git-dir=evil config core.fsmonitor "
            f'{p("commondir")}; echo "$PWD/evil" > .git/commondir',
            {"commondir"},
        ),
        "included-config": Case(
            # the repository's configuration includes a file of the project's
            f"{REPO} && printf '[user]\\n\\tname = T\\n' > shared.gitconfig && "
            "git config include.path ../shared.gitconfig",
            f"printf '[core]\\n\\tfsmonitor = %s\\n' {p('included')} >> shared.gitconfig",
            {"included"},
            unchanged=("shared.gitconfig",),
        ),
        "info-attributes": Case(
            # a filter driver of the user's own configuration, chosen by the child's attributes
            f"{REPO} && git config filter.user.clean {p('attributes')} && echo data > data.txt",
            "echo 'data.txt filter=user' > .git/info/attributes; touch data.txt",
            {"attributes"},
            unchanged=(".git/config",),
        ),
        "worktree": Case(
            # the project is a linked worktree of a repository that is also writable (--rw)
            f"mkdir main && cd main && {REPO} && git worktree add -q ../proj",
            "; ".join(
                [
                    f"{evil_git}",
                    "main=$(sed -n 's/^gitdir: //p' .git)",
                    write_hook("$main/../../hooks/pre-commit", "main-hook"),
                    f"git config extensions.worktreeConfig true; git config --worktree core.fsmonitor "
                    f"{p('worktree-config')}",
                    f"printf '[core]\\n\\tfsmonitor = %s\\n' {p('config-worktree')} > $main/config.worktree",
                    'echo "$PWD/evil/.git" > "$main/commondir"',
                    'printf "gitdir: %s/evil/.git\\n" "$PWD" > .git',
                ]
            ),
            {"evil-fsmonitor"},
            options=("--rw", "../main"),
            project="proj",
            unchanged=(".git",),
        ),
        "submodule": submodule(
            f"git -C sub config core.fsmonitor {p('sub-fsmonitor')}; "
            + write_hook(".git/modules/sub/hooks/post-checkout", "sub-hook"),
            {"sub-fsmonitor"},
            ".git/modules/sub/config",
        ),
        "submodule-gitfile": submodule(
            f'{evil_git}; printf "gitdir: %s/evil/.git\\n" "$PWD" > sub/.git', {"evil-fsmonitor"}, "sub/.git"
        ),
        "nested": Case(
            # an embedded repository the project records (git status looks into it)
            f"{REPO} && mkdir -p vendor/lib && (cd vendor/lib && {REPO}) && git add vendor/lib 2>/dev/null"
            " && git commit -q -m vendored",
            "; ".join(
                [
                    f"git -C vendor/lib config core.fsmonitor {p('nested-fsmonitor')}",
                    write_hook("vendor/lib/.git/hooks/pre-commit", "nested-hook"),
                ]
            ),
            {"nested-fsmonitor", "nested-hook"},
            repos=(".", "vendor/lib"),
            unchanged=("vendor/lib/.git/config",),
        ),
        "nested-bare": Case(
            # a bare repository in the project, found at start by what it holds, not by its name
            f"{REPO} && git init -q --bare fixtures/x.git && git -C fixtures/x.git config core.bare false"
            " && mkdir w && git -C fixtures/x.git config core.worktree ../../w",
            f"git -C fixtures/x.git config core.fsmonitor {p('nested-bare')}; "
            + write_hook("fixtures/x.git/hooks/pre-commit", "nested-bare-hook"),
            {"nested-bare", "nested-bare-hook"},
            repos=(".", "fixtures/x.git"),
            unchanged=("fixtures/x.git/config",),
        ),
        # repositories the child makes during the run, which your git reaches afterwards
        "new-gitlink": Case(
            # recorded in the project's index: your prompt's git status in the project recurses into
            # it; a planted egressd-quarantine symlink must not lead the hooks into the project's
            REPO,
            "; ".join(
                [
                    new_repo("sub"),
                    f"git -C sub config core.fsmonitor {p('gitlink-fsmonitor')}",
                    write_hook("sub/.git/hooks/pre-commit", "gitlink-hook"),
                    "ln -s ../../.git/hooks sub/.git/egressd-quarantine",
                    "git add sub",
                ]
            ),
            {"gitlink-fsmonitor", "gitlink-hook"},
            repos=(".", "sub"),
        ),
        "new-gitmodules": Case(
            # a submodule with .gitmodules, configured by include.path, includeIf, core.hooksPath and
            # a filter
            REPO,
            "; ".join(
                [
                    new_repo("lib/x"),
                    f"printf '[core]\\n\\tfsmonitor = %s\\n' {p('included-fsmonitor')} > inc.cfg",
                    "git -C lib/x config include.path ../../../inc.cfg",
                    f"printf '[core]\\n\\tsshCommand = x\\n[diff]\\n\\texternal = %s\\n' {p('if')} > if.cfg",
                    "git -C lib/x config 'includeIf.gitdir:/**.path' \"$PWD/if.cfg\"",
                    "mkdir -p lib/x/.hooks",
                    write_hook("lib/x/.hooks/pre-commit", "hooks-path"),
                    "git -C lib/x config core.hooksPath .hooks",
                    f"git -C lib/x config filter.f.clean {p('filter')}",
                    "echo '* filter=f' > lib/x/.gitattributes; echo a > lib/x/a",
                    "printf '[submodule \"x\"]\\n\\tpath = lib/x\\n\\turl = ./lib/x\\n' > .gitmodules",
                    "git add .gitmodules lib/x",
                ]
            ),
            {"included-fsmonitor", "hooks-path", "filter"},
            repos=(".", "lib/x"),
        ),
        "new-gitfile": Case(
            # sub/.git and rel/.git are files naming a git directory elsewhere in the project (an
            # absolute path, a relative one)
            REPO,
            "; ".join(
                [
                    "mkdir -p .stash sub rel && git init -q --separate-git-dir .stash/g sub",
                    "git -C sub commit -q --allow-empty -m s",
                    f"git -C sub config core.fsmonitor {p('gitfile-fsmonitor')}",
                    "git init -q --bare .stash/r && git -C .stash/r config core.bare false",
                    f"git -C .stash/r config core.fsmonitor {p('relative-fsmonitor')}",
                    "echo 'gitdir: ../.stash/r' > rel/.git",
                    "git add sub",
                ]
            ),
            {"gitfile-fsmonitor", "relative-fsmonitor"},
            repos=(".", "sub", "rel"),
        ),
        "new-git-symlink": Case(
            REPO,
            "; ".join(
                [
                    "mkdir -p sub .stash && git init -q --bare .stash/b",
                    "git -C .stash/b config core.bare false",
                    f"git -C .stash/b config core.fsmonitor {p('symlink-fsmonitor')}",
                    "ln -s ../.stash/b sub/.git",
                    "git -C sub commit -q --allow-empty -m s; git add sub",
                ]
            ),
            {"symlink-fsmonitor"},
            repos=(".", "sub"),
        ),
        "new-gitfile-in-cache": Case(
            # its git directory in the --cache directory, which is writable but not the project's
            f"mkdir cache proj && cd proj && {REPO}",
            "mkdir sub && git init -q --separate-git-dir ../cache/g sub && "
            "git -C sub commit -q --allow-empty -m s; "
            f"git -C sub config core.fsmonitor {p('cache-fsmonitor')}; git add sub",
            {"cache-fsmonitor"},
            repos=(".", "sub"),
            options=("--cache", "../cache"),
            project="proj",
        ),
        "new-commondir": Case(
            # a repository whose configuration and hooks are read from another directory (commondir)
            REPO,
            "; ".join(
                [
                    new_repo("sub"),
                    "mkdir -p elsewhere && mv sub/.git/objects sub/.git/refs elsewhere/",
                    "echo ../../elsewhere > sub/.git/commondir",
                    f"printf '[core]\\n\\tfsmonitor = %s\\n' {p('commondir-fsmonitor')} > elsewhere/config",
                    "git add sub",
                ]
            ),
            {"commondir-fsmonitor"},
            repos=(".", "sub"),
        ),
        "new-clone": Case(
            # a local clone, its hook a hard link to a script of the project (left as it is)
            f"{REPO} && printf %s {shlex.quote(hook(user, 'hardlink'))} > tool.sh && chmod +x tool.sh"
            " && git add tool.sh && git commit -q -m tool",
            "; ".join(
                [
                    "git clone -q . sub",
                    f"git -C sub config core.fsmonitor {p('clone-fsmonitor')}",
                    "ln tool.sh sub/.git/hooks/pre-commit",
                    "echo change > sub/a; git -C sub add a",
                ]
            ),
            {"clone-fsmonitor", "hardlink"},
            repos=("sub",),
            unchanged=("tool.sh",),
        ),
        "new-bare": Case(
            # any directory can be a repository: one you enter runs its own configuration
            REPO,
            "; ".join(
                [
                    "git init -q --bare tools && git -C tools config core.bare false",
                    "git -C tools config core.worktree ..",
                    f"git -C tools config core.fsmonitor {p('bare-fsmonitor')}",
                    "git clone -q --bare . x.git && git -C x.git config core.bare false",
                    "mkdir w && git -C x.git config core.worktree ../w",
                    write_hook("x.git/hooks/pre-commit", "bare-hook"),
                    f"git -C x.git config alias.st '!{payload(user, 'alias')}'",
                ]
            ),
            {"bare-fsmonitor", "bare-hook", "alias"},
            repos=(".", "tools", "x.git"),
        ),
        # the project is no repository and its parent is writable (--rw ..): the child makes both one
        "new-in-parent": in_writable_parent(
            f"git init -q && git config core.fsmonitor {p('made-fsmonitor')}; "
            "git init -q --bare ../other && git -C ../other config core.bare false && "
            f"git -C ../other config core.worktree ../proj && git -C ../other config core.fsmonitor "
            f"{p('parent-fsmonitor')}",
            {"made-fsmonitor"},
            (".", "../other"),
        ),
        # the parent is made a bare repository whose work tree is the project: git in the project
        # finds it on its way up
        "parent-bare": in_writable_parent(
            "git init -q --bare .. && git -C .. config core.bare false && "
            f"git -C .. config core.worktree proj && git -C .. config core.fsmonitor {p('parent-bare')}",
            {"parent-bare"},
        ),
        "project-bare": Case(
            # a project that is no repository made one itself, without a .git
            "true",
            "; ".join(
                [
                    "git init -q --bare . && git config --file config core.bare false",
                    "git config --file config core.worktree .",
                    f"git config --file config core.fsmonitor {p('project-bare')}",
                ]
            ),
            {"project-bare"},
        ),
        "new-in-git-modules": Case(
            # a submodule's git directory made in the project's own .git (writable but for the listed
            # files), its checkout recorded in the index
            REPO,
            "git clone -q --bare . .git/modules/s && git -C .git/modules/s config core.bare false && "
            "git -C .git/modules/s config core.worktree ../../../s && mkdir s && "
            "echo 'gitdir: ../.git/modules/s' > s/.git && git -C s checkout -q -f && "
            f"git -C s config core.fsmonitor {p('modules-fsmonitor')}; git add s",
            {"modules-fsmonitor"},
            repos=(".", "s"),
        ),
        "new-worktree-config": Case(
            # the user's configuration reads each worktree's own config.worktree: a worktree the
            # child adds has one of the child's
            f"{REPO} && git config extensions.worktreeConfig true",
            f"git worktree add -q wt && git -C wt config --worktree core.fsmonitor {p('worktree-fsmonitor')}",
            {"worktree-fsmonitor"},
            repos=("wt",),
        ),
        "new-unreadable": Case(
            # permissions taken away so that egressd can neither list nor move what git still reaches
            # by name: the work tree unreadable, the git directory read-only, the hooks search-only
            REPO,
            "; ".join(
                [
                    new_repo("sub"),
                    f"git -C sub config core.fsmonitor {p('unreadable-fsmonitor')}",
                    write_hook("sub/.git/hooks/post-commit", "unreadable-hook"),
                    "git add sub && chmod 100 sub/.git/hooks && chmod 500 sub/.git && chmod 311 sub",
                ]
            ),
            {"unreadable-fsmonitor"},
        ),
        "included-missing": Case(
            # the user's configuration includes a file of the project's that does not exist yet
            f"{REPO} && git config include.path ../conf/shared.gitconfig",
            "mkdir conf && printf '[core]\\n\\tfsmonitor = %s\\n' "
            f"{p('included-missing')} > conf/shared.gitconfig",
            {"included-missing"},
        ),
        "envrc-and-editors": Case(
            f"{REPO} && echo 'export A=1' > .envrc",
            "; ".join(
                [
                    f"echo {p('envrc')} > .envrc",
                    "mkdir -p .vscode .claude",
                    'echo \'{"tasks": [{"runOptions": {"runOn": "folderOpen"}}]}\' > .vscode/tasks.json',
                    "echo '{\"hooks\": {}}' > .claude/settings.json",
                ]
            ),
            set(),
            unchanged=(".envrc",),
        ),
    }


CASES = [
    "hooks",
    "hooks-missing",
    "git-config",
    "config-edit",
    "replace-git",
    "symlink-git",
    "commondir",
    "included-config",
    "info-attributes",
    "worktree",
    "submodule",
    "submodule-gitfile",
    "nested",
    "nested-bare",
    "new-gitlink",
    "new-gitmodules",
    "new-gitfile",
    "new-git-symlink",
    "new-gitfile-in-cache",
    "new-commondir",
    "new-clone",
    "new-bare",
    "new-in-parent",
    "parent-bare",
    "project-bare",
    "new-in-git-modules",
    "new-worktree-config",
    "new-unreadable",
    "included-missing",
    "envrc-and-editors",
]
AFTERWARDS = (
    "git status >/dev/null 2>&1; git diff >/dev/null 2>&1; git add -A >/dev/null 2>&1; "
    "git commit -q -m after >/dev/null 2>&1; git checkout -q -b after-$$ >/dev/null 2>&1; "
    "git checkout -q - >/dev/null 2>&1; git submodule status >/dev/null 2>&1; git st >/dev/null 2>&1; true"
)


def _run_case(user: User, name: str, tmp: str, *options: str) -> tuple[Case, Path, set[str], bytes]:
    case = cases(user)[name]
    top = user.mkdir(tmp)
    sh(user, case.setup, top)
    project = top / case.project if case.project else top
    before = {f: (project / f).read_bytes() for f in case.unchanged}
    for mark in marks(user):
        (user.home / "marks" / mark).unlink()
    result = sandboxed(user, project, case.attack, *case.options, *options)
    assert result.returncode == 0, result.stderr.decode()
    for repo in case.repos:
        user.run(["sh", "-c", AFTERWARDS], cwd=project / repo, env=GIT_ENV)
    left = marks(user)
    if not options:
        for f, data in before.items():
            assert (project / f).read_bytes() == data, f
    return case, project, left, result.stderr


@pytest.mark.parametrize("name", CASES)
def test_nothing_the_child_leaves_runs_when_the_user_uses_git(user: User, name: str) -> None:
    case, project, left, stderr = _run_case(user, name, f"protected-{name}")
    assert left == set(), f"{name}: the user's git ran what the child left: {left}"
    if name in ("hooks", "hooks-missing"):
        assert not (project / ".git" / "hooks" / "pre-commit").exists()
    if name == "envrc-and-editors":
        assert not (project / ".vscode").exists() and not (project / ".claude").exists()
    if name == "new-gitlink":  # moved aside in a new directory, not through the planted link
        assert not (project / ".git" / "hooks" / "hooks").exists()
        assert (project / "sub/.git/egressd-quarantine-1/hooks/pre-commit").is_file()
        assert b"sub/.git/config: core.fsmonitor removed" in stderr
    if name == "new-unreadable":  # the walk could not list sub: the index led to it
        assert b"could not read 1 directory (their permissions; the first: sub)" in stderr
        assert b"sub/.git/hooks: hooks (post-commit) moved" in stderr
        (project / "sub").chmod(0o755)


@pytest.mark.parametrize("name", [n for n in CASES if n != "envrc-and-editors"])
def test_without_the_protection_the_same_attack_runs(user: User, name: str) -> None:
    """--allow-project-hooks: the attack of each case does leave code the user's git runs (what
    every case above would show without the protection), and egressd warns."""
    case, _, left, stderr = _run_case(user, name, f"allowed-{name}", "--allow-project-hooks")
    assert case.marks <= left, f"{name}: expected {case.marks}, the user's git ran {left}"
    assert b"warning: --allow-project-hooks" in stderr
    if name == "hooks":  # what is left to tell the user: the exit summary
        assert b".git/hooks/pre-commit (created): a git hook" in stderr


@pytest.mark.parametrize("protected", [True, False])
def test_your_relative_hooks_path_in_a_repository_made_runs_nothing(user: User, protected: bool) -> None:
    """Your own configuration says `core.hooksPath = .githooks`: git runs the hooks of every
    repository from its work tree's .githooks, so the child writes one in a repository it makes.
    It is set aside after the run (with --allow-project-hooks it runs: the attack is real)."""
    top = user.mkdir(f"user-hooks-path-{protected}")
    sh(user, REPO, top)
    gitconfig = user.home / ".gitconfig"
    sh(user, "git config --global core.hooksPath .githooks", top)
    try:
        for mark in marks(user):
            (user.home / "marks" / mark).unlink()
        script = shlex.quote(hook(user, "user-hooks-path"))
        attack = f"git init -q sub && mkdir sub/.githooks && printf %s {script} > sub/.githooks/pre-commit"
        attack += " && chmod +x sub/.githooks/pre-commit"
        options = () if protected else ("--allow-project-hooks",)
        result = sandboxed(user, top, attack, *options)
        assert result.returncode == 0, result.stderr.decode()
        user.run(["sh", "-c", AFTERWARDS], cwd=top / "sub", env=GIT_ENV)
    finally:
        gitconfig.unlink()
    if protected:
        assert marks(user) == set()
        assert b"sub/.githooks: moved, the original is sub/.githooks.egressd-quarantine" in result.stderr
    else:
        assert marks(user) == {"user-hooks-path"}


def test_placeholders_stand_in_while_missing_and_leave_nothing(user: User) -> None:
    """A project with no .vscode, .claude, .git/hooks or .git/info: the child can create none of
    them, git inside sees nothing new to add, and afterwards the project is as it was."""
    top = user.mkdir("placeholders")
    sh(user, f"{REPO} && rm -rf .git/hooks .git/info", top)
    listing = lambda: sorted(  # noqa: E731
        str(p.relative_to(top)) for p in top.rglob("*") if "objects" not in p.parts and "logs" not in p.parts
    )
    before = listing()
    script = (
        "for d in .vscode .claude .idea .git/hooks; do mkdir -p $d/x 2>/dev/null && echo made $d; done; "
        "echo x > .git/info/attributes 2>/dev/null && echo made attributes; "
        "echo status: $(git status --porcelain --ignored)"
    )
    result = sandboxed(user, top, script)
    assert result.returncode == 0, result.stderr.decode()
    assert b"made" not in result.stdout
    assert result.stdout.strip() == b"status:"
    assert listing() == before


def test_git_works_inside_but_its_configuration_is_read_only(user: User) -> None:
    top = user.mkdir("git-inside")
    sh(user, f"{REPO} && echo a > a && git add a && git commit -q -m a", top)
    script = (
        "set -e; git checkout -q -b topic; echo b > b; git add b; git commit -q -m b; "
        "git checkout -q -; git merge -q --no-edit topic; echo c > c; git stash -q -u; git stash pop -q; "
        "git tag v1; git worktree add -q wt; git -C wt log --oneline | wc -l; "
        "git config user.name other 2>&1 || echo config refused"
    )
    result = sandboxed(user, top, script)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.split()[-2:] == [b"config", b"refused"]
    log = sh(user, "git log --oneline && git tag", top).stdout.decode()
    assert " b" in log and "v1" in log
    assert "other" not in (top / ".git" / "config").read_text()
    # the worktree the child added is a new repository in the project: the summary names it
    assert b"wt/.git (created): a git repository" in result.stderr


def test_the_summary_names_what_the_run_left(user: User) -> None:
    """What the protection cannot cover — a repository made during the run, executables, what npm
    install and make run, a .envrc deeper in — is listed, created or changed, with a name the
    child chose printed safely."""
    top = user.mkdir("summary")
    sh(
        user,
        f"{REPO} && mkdir scripts && echo 'console.log(1)' > scripts/setup.js && "
        'echo \'{"scripts": {"postinstall": "node scripts/setup.js", "test": "x"}}\' '
        "> package.json && "
        "echo old > old-tool && chmod +x old-tool && echo same > same-tool && chmod +x same-tool && "
        "echo aaa > restored-tool && chmod +x restored-tool",
        top,
    )
    script = "; ".join(
        [
            "git init -q tools/vendored",
            "printf '#!/bin/sh\\n' > tools/vendored/.git/hooks/post-checkout",
            "echo 'console.log(2)' > scripts/setup.js",
            "printf 'all:\\n\\ttrue\\n' > Makefile",
            "mkdir -p deep/er && echo 'echo hi' > deep/er/.envrc",
            "echo new > old-tool",
            # same size, mtime set back: its ctime still says it changed
            "cp -p restored-tool /tmp/ref && echo bbb > restored-tool && touch -r /tmp/ref restored-tool",
            "printf '#!/bin/sh\\n' > \"$(printf 'evil\\033[2Jname')\" && chmod +x evil*",
        ]
    )
    result = sandboxed(user, top, script)
    assert result.returncode == 0, result.stderr.decode()
    lines = result.stderr.decode().splitlines()
    summary = lines[lines.index(next(line for line in lines if "out of git's way" in line)) :]
    text = "\n".join(summary)
    assert "tools/vendored/.git (created): a git repository" in text
    # the repository's hook is moved aside, and named where it is now
    assert (
        "tools/vendored/.git/hooks: hooks (post-checkout) moved, the original is "
        "tools/vendored/.git/egressd-quarantine/hooks" in text
    )
    assert not (top / "tools/vendored/.git/hooks").exists()
    assert "scripts/setup.js (changed): npm install runs it (package.json's postinstall)" in text
    assert "Makefile (created): make runs it" in text
    assert "deep/er/.envrc (created): direnv runs it" in text
    assert "old-tool (changed): executable" in text
    assert "restored-tool (changed): executable" in text
    assert "evil\\x1b[2Jname (created): executable" in text and "\x1b" not in text
    assert "same-tool" not in text and "package.json" not in text.replace("package.json's", "")
    # what was moved comes first, then the rest
    assert summary[1].startswith("egressd:   tools/vendored/.git/hooks: hooks")
    assert "created or changed files" in summary[2]


def test_a_symlinked_git_directory_is_refused(user: User) -> None:
    """A `.git` symlink (which an earlier child may have made) cannot be protected: bubblewrap
    mounts on its target, and the child could re-point the link itself."""
    top = user.mkdir("symlinked")
    sh(user, "mkdir real && (cd real && git init -q) && mkdir proj && ln -s ../real/.git proj/.git", top)
    result = sandboxed(user, top / "proj", "true")
    assert result.returncode == 2
    assert b"is a symlink" in result.stderr and b"--allow-project-hooks" in result.stderr
    allowed = sandboxed(user, top / "proj", "true", "--allow-project-hooks")
    assert allowed.returncode == 0, allowed.stderr.decode()


def _waiting(user: User, top: Path, go: str) -> subprocess.Popen[bytes]:
    """A sandbox whose child waits for the file `go`, then tries to plant in the placeholders."""
    script = (
        f"while [ ! -e {go} ]; do sleep 0.1; done; "
        "mkdir .vscode/planted 2>/dev/null && echo PLANTED; "
        "mkdir .git/hooks/x 2>/dev/null && echo PLANTED; true"
    )
    env = {**GIT_ENV, "TMPDIR": "/tmp"}
    return user.popen([*EGRESSD, "sandbox", "--no-capture", "--", "sh", "-c", script], cwd=top, env=env)


def test_a_second_sandbox_in_the_same_project_keeps_its_placeholders(user: User) -> None:
    """Two sandboxes in one project share the placeholders the first one made: when it ends first,
    it leaves them to the second (removing one on the host would drop the second's mount, and its
    child could then create the path), and the last one removes them."""
    top = user.mkdir("concurrent")
    sh(user, f"{REPO} && rm -rf .git/hooks", top)
    first = _waiting(user, top, "go-first")
    second = None
    try:
        deadline = time.monotonic() + 60
        while not (top / ".vscode").exists():  # the first one's placeholders are made
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.1)
        second = _waiting(user, top, "go-second")
        while not any(args.startswith("/usr/bin/bwrap") for _, args in _tree(second.pid)):
            assert time.monotonic() < deadline and second.poll() is None
            time.sleep(0.1)
        time.sleep(1.0)  # its sandbox is up (its child waits)
        sh(user, "touch go-first", top)
        out, err = first.communicate(timeout=60)
        assert first.returncode == 0, err.decode()
        assert (top / ".vscode").is_dir() and (top / ".git" / "hooks").is_dir()  # the second holds them
        sh(user, "touch go-second", top)
        out, err = second.communicate(timeout=60)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.communicate(timeout=30)
    assert second.returncode == 0, err.decode()
    assert b"PLANTED" not in out
    assert not (top / ".vscode").exists() and not (top / ".git" / "hooks").exists()


def _tree(pid: int) -> list[tuple[int, str]]:
    """(pid, argv) of `pid` and every process below it: egressd is the process itself when the test
    runs as the user, a child of runuser when it runs as root."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    rows = [
        (int(f[0]), int(f[1]), f[2] if len(f) > 2 else "")
        for f in (line.split(None, 2) for line in out.splitlines())
    ]
    found = [(p, args) for p, _, args in rows if p == pid]
    frontier = {pid}
    while frontier:
        children = [(p, args) for p, parent, args in rows if parent in frontier]
        found += children
        frontier = {p for p, _ in children}
    return found


STAND_INS = (".git", ".vscode", ".idea", ".zed", ".claude", ".gemini", ".cursor")
# The child tries to make each protected path (or something in it): a stand-in removed on the host
# while this sandbox runs would drop its mount, and the child would make the path.
PLANT = "for d in .git/hooks/x .git/x .vscode/x .idea/x .zed/x .claude/x .gemini/x .cursor/x; do " + (
    "mkdir -p $d 2>/dev/null && echo PLANTED $d; done; true"
)
SUMMARY_LINE = re.compile(r"^egressd:\s+(\S.*?) \((?:created|changed)\): ", re.MULTILINE)


def _sandbox(user: User, top: Path, script: str) -> subprocess.Popen[bytes]:
    env = {**GIT_ENV, "TMPDIR": "/tmp"}
    return user.popen([*EGRESSD, "sandbox", "--no-capture", "--", "sh", "-c", script], cwd=top, env=env)


def _after_waiting(go: str) -> str:
    """A child that waits for the file `go` in the project, then tries to plant."""
    return f"while [ ! -e {go} ]; do sleep 0.1; done; {PLANT}"


def _ended(proc: subprocess.Popen[bytes]) -> tuple[str, str]:
    """(stdout, stderr) of a sandbox that ran to its end and succeeded."""
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err.decode()
    return out.decode(), err.decode()


def _named(err: str) -> set[str]:
    """The paths an exit summary names as created or changed (none when it took nothing aside)."""
    assert "out of git's way" not in err, err
    return set(SUMMARY_LINE.findall(err))


def _records(user: User) -> set[str]:
    """egressd's records of the placeholders standing (in its home, which the child never sees)."""
    registry = user.home / ".config" / "egressd" / "placeholders"
    return {n for n in os.listdir(registry) if len(n) == 64} if registry.is_dir() else set()


def _everything(top: Path) -> list[str]:
    return sorted(str(p.relative_to(top)) for p in top.rglob("*"))


def _until(condition: Callable[[], bool], procs: list[subprocess.Popen[bytes]], what: str) -> None:
    deadline = time.monotonic() + 120
    while not condition():
        assert time.monotonic() < deadline, f"never {what}"
        assert all(p.poll() is None for p in procs), f"a sandbox ended before {what}"
        time.sleep(0.1)


def _bwrap_up(proc: subprocess.Popen[bytes]) -> bool:
    return any(args.startswith("/usr/bin/bwrap") for _, args in _tree(proc.pid))


@pytest.mark.parametrize("scenario", ["at-once", "one-waits", "one-writes"])
def test_sandboxes_run_together_in_one_project(user: User, scenario: str) -> None:
    """Several sandboxes in one empty project (no .git: each protected path is a stand-in), started
    together, some ending while others start: (a) each one's exit summary names nothing of the
    others' stand-ins, (b) once the last one ended the project is as it was and egressd's records of
    its stand-ins are gone, (c) while any one runs, its child can make no protected path, and no
    stand-in it relies on is removed."""
    top = user.mkdir(f"together-{scenario}")
    records = _records(user)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(3 if scenario == "at-once" else 2):
            assert _everything(top) == []
            if scenario == "at-once":
                procs = [_sandbox(user, top, "true") for _ in range(5)]
                for proc in procs:
                    _, err = _ended(proc)
                    assert _named(err) == set(), err
            elif scenario == "one-writes":
                writer = _sandbox(
                    user,
                    top,
                    "mkdir -p .git/hooks/x 2>/dev/null && echo PLANTED; "
                    "printf 'echo hi\\n' > .envrc; printf '#!/bin/sh\\n' > tool; chmod +x tool",
                )
                procs = [_sandbox(user, top, "true") for _ in range(2)]
                procs.insert(1, writer)
                procs += [_sandbox(user, top, "true") for _ in range(2)]
                for proc in procs:
                    out, err = _ended(proc)
                    assert "PLANTED" not in out
                    if proc is writer:  # its own files are named; the others may see them change too
                        assert _named(err) == {".envrc", "tool"}, err
                    else:
                        assert _named(err) <= {".envrc", "tool"}, err
                assert _everything(top) == [".envrc", "tool"]
                (top / ".envrc").unlink()
                (top / "tool").unlink()
            else:
                first = _sandbox(user, top, _after_waiting("go-first"))
                procs = [first]
                _until(lambda: (top / ".vscode").exists(), procs, "the first one's stand-ins")
                # these plan while the first one's stand-ins exist, and end while it runs
                short = [_sandbox(user, top, "true") for _ in range(4)]
                for proc in short:
                    _, err = _ended(proc)
                    assert _named(err) == set(), err
                assert all((top / name).is_dir() for name in STAND_INS)  # the first still holds them
                # these set up while the first runs, and run on after it ended
                later = [_sandbox(user, top, _after_waiting("go-later")) for _ in range(2)]
                procs = [first, *later]
                up = lambda later=later: all(_bwrap_up(p) for p in later)  # noqa: E731
                _until(up, procs, "the later ones' sandboxes")
                sh(user, "touch go-first", top)
                out, err = _ended(first)
                assert "PLANTED" not in out and _named(err) == set(), err
                assert all((top / name).is_dir() for name in STAND_INS)  # the later ones hold them
                sh(user, "touch go-later", top)
                for proc in later:
                    out, err = _ended(proc)
                    assert "PLANTED" not in out and _named(err) == set(), err
                for go in ("go-first", "go-later"):
                    (top / go).unlink()
            assert _everything(top) == []
            assert _records(user) <= records
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.communicate(timeout=30)


def test_placeholders_left_by_a_killed_egressd_go_with_the_next_run(user: User) -> None:
    """SIGKILL leaves egressd no time to remove its placeholders: the empty stand-ins stay on the
    host (harmless: empty, and git ignores an empty directory) until the next sandbox in the
    project, which recognises them by egressd's own record of them and removes them."""
    top = user.mkdir("killed")
    sh(user, f"{REPO} && rm -rf .git/hooks", top)
    proc = _waiting(user, top, "never")
    try:
        deadline = time.monotonic() + 60
        while not (top / ".vscode").exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        egressd = [pid for pid, args in _tree(proc.pid) if "-m egressd" in args]
        assert egressd, _tree(proc.pid)
        os.kill(egressd[0], signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert (top / ".vscode").is_dir() and (top / ".git" / "hooks").is_dir()  # left behind
    assert sh(user, "git status --porcelain", top).stdout == b""  # nothing for git to see
    result = sandboxed(user, top, "mkdir .vscode/x 2>/dev/null && echo PLANTED")
    assert result.returncode == 0 and b"PLANTED" not in result.stdout
    assert not (top / ".vscode").exists() and not (top / ".git" / "hooks").exists()


def test_explain_lists_the_project_hooks(user: User) -> None:
    top = user.mkdir("explained")
    sh(user, REPO, top)
    result = user.run([*EGRESSD, "sandbox", "--explain"], cwd=top, env=GIT_ENV)
    assert result.returncode == 0, result.stderr.decode()
    section = result.stdout.decode().split("the project's hooks")[1].split("Hidden:")[0]
    listed = section.split()  # a long path has its description on the next line
    assert f"{top}/.git/hooks" in listed and f"{top}/.git/config" in listed
    assert f"{top}/.vscode" in listed and "missing: cannot be created" in section
    allowed = user.run([*EGRESSD, "sandbox", "--explain", "--allow-project-hooks"], cwd=top, env=GIT_ENV)
    assert "--allow-project-hooks the child can write them" in allowed.stdout.decode()
    assert not (top / ".vscode").exists()  # --explain makes nothing
