"""The project's hooks, unit by unit: what the list finds, the covers and placeholders it gives
both sandboxes, and what the exit summary names. The end-to-end attacks are in
tests/e2e/test_sandbox_hooks.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.sandbox import exit_summary, hooks, quarantine
from egressd.sandbox.bwrap import BwrapSpec, bwrap_argv
from egressd.sandbox.hooks import HookError, Placeholder
from egressd.sandbox.layout import plan_layout
from egressd.sandbox.seatbelt import seatbelt_profile, spellings
from egressd.sandbox.shields import Cover
from egressd.session import SessionOptions
from tests.support.seatbelt_model import Model

DOCS = Path(__file__).resolve().parents[2] / "docs" / "sandbox.md"


def git(*args: str, cwd: Path) -> None:
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "t", "GIT_COMMITTER_NAME": "t"}
    env |= {"GIT_AUTHOR_EMAIL": "t@example.test", "GIT_COMMITTER_EMAIL": "t@example.test"}
    subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    project = tmp_path / "p"
    project.mkdir()
    git("init", "-q", cwd=project)
    git("commit", "-q", "--allow-empty", "-m", "i", cwd=project)
    return Path(os.path.realpath(project))


def found(root: Path, nested: tuple[str, ...] = ()) -> hooks.Found:
    return hooks.find([str(root)], nested, git=hooks.system_git())


def test_a_repository_gets_its_git_files_and_the_missing_ones_placeholders(repo: Path) -> None:
    result = found(repo)
    g = f"{repo}/.git"
    assert {f"{g}/hooks", f"{g}/config"} <= set(result.protected)
    assert f"{g}" not in result.protected  # git writes in .git: never read-only as a whole
    assert result.placeholders[f"{g}/commondir"] == Placeholder(f"{g}/commondir", False, ".")
    assert result.placeholders[f"{g}/config.worktree"] == Placeholder(f"{g}/config.worktree", False)
    assert result.placeholders[f"{repo}/.vscode"] == Placeholder(f"{repo}/.vscode", True)
    assert f"{repo}/.claude" in result.placeholders
    # a file at the top of the project: protected when it exists, its creation left to the summary
    assert f"{repo}/.envrc" not in result.protected and f"{repo}/.mcp.json" not in result.protected
    (repo / ".envrc").write_text("export A=1\n")
    assert f"{repo}/.envrc" in found(repo).protected


def test_a_project_without_git_cannot_become_one(tmp_path: Path) -> None:
    result = found(tmp_path)
    assert result.placeholders[f"{tmp_path}/.git"] == Placeholder(f"{tmp_path}/.git", True)
    assert not any(p.startswith(f"{tmp_path}/.git/") for p in result.protected)


def test_a_linked_worktree_protects_its_file_its_directory_and_the_common_one(tmp_path: Path) -> None:
    main = tmp_path / "main"
    main.mkdir()
    git("init", "-q", cwd=main)
    git("commit", "-q", "--allow-empty", "-m", "i", cwd=main)
    git("worktree", "add", "-q", str(tmp_path / "wt"), cwd=main)
    result = found(tmp_path / "wt")
    admin = f"{main}/.git/worktrees/wt"
    assert f"{tmp_path}/wt/.git" in result.protected  # the gitdir: file itself
    assert {f"{admin}/commondir", f"{admin}/config.worktree"} <= set(result.protected)
    assert {f"{main}/.git/hooks", f"{main}/.git/config"} <= set(result.protected)
    assert f"{admin}/hooks" not in result.protected  # a worktree's hooks are the common directory's


def test_submodules_nested_repositories_and_hooks_path(repo: Path) -> None:
    for name in ("modules/lib", "modules/a/b", "modules/lib/modules/inner"):
        directory = repo / ".git" / name
        directory.mkdir(parents=True)
        (directory / "HEAD").write_text("ref: refs/heads/main\n")
    nested = repo / "vendor" / "x"
    nested.mkdir(parents=True)
    git("init", "-q", cwd=nested)
    git("config", "core.hooksPath", ".githooks", cwd=repo)
    result = found(repo, (str(nested / ".git"),))
    for gitdir in ("modules/lib", "modules/a/b", "modules/lib/modules/inner"):
        assert f"{repo}/.git/{gitdir}/hooks" in result.protected, gitdir
        assert f"{repo}/.git/{gitdir}/config" in result.placeholders, gitdir
    assert f"{nested}/.git/hooks" in result.protected and f"{nested}/.git/config" in result.protected
    assert result.placeholders[f"{repo}/.githooks"] == Placeholder(f"{repo}/.githooks", True)


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda r: _relink(r / ".git", r / "elsewhere"), "is a symlink"),
        (lambda r: _relink(r / ".git" / "hooks", r / "hookdir"), "is a symlink"),
        (lambda r: (r / "real-vscode").mkdir() or (r / ".vscode").symlink_to("real-vscode"), "is a symlink"),
        (lambda r: os.link(r / ".git" / "config", r / "config-copy"), "hard links"),
        (
            lambda r: (r / ".claude").mkdir() or _linked(r / ".claude" / "settings.json", r / "s"),
            "hard links",
        ),
    ],
    ids=["git", "hooks", "vscode", "config-hard-link", "hard-link-inside"],
)
def test_what_a_mount_cannot_protect_is_refused(repo: Path, make, said: str) -> None:
    make(repo)
    with pytest.raises(HookError, match=said) as error:
        found(repo)
    assert hooks.ALLOW_FLAG in str(error.value)


def _relink(path: Path, target: Path) -> None:
    os.rename(path, target)
    path.symlink_to(target.name)


def _linked(path: Path, other: Path) -> None:
    path.write_text("{}")
    os.link(path, other)


def test_a_nested_symlinked_git_is_left_to_the_summary(repo: Path) -> None:
    (repo / "deep").mkdir()
    (repo / "deep" / ".git").symlink_to("/nonexistent")
    assert f"{repo}/deep/.git" not in found(repo, (f"{repo}/deep/.git",)).protected


# -- the layout both sandboxes get -------------------------------------------------------------------
def _layout(repo: Path, monkeypatch, **kwargs):
    monkeypatch.setenv("HOME", str(repo.parent))
    options = SessionOptions(config_dir=repo.parent / "egressd-home")
    kwargs.setdefault("rw", [])
    return plan_layout(options, workdir=str(repo), environ={}, **kwargs)


def test_the_layout_covers_them_and_pins_the_git_directory(repo: Path, monkeypatch) -> None:
    layout = _layout(repo, monkeypatch, ro=[])
    covers = set(layout.covers)
    assert Cover(f"{repo}/.git/hooks", "ro") in covers and Cover(f"{repo}/.git/config", "ro") in covers
    assert Cover(f"{repo}/.git", "pin") in covers  # cannot be renamed away (mv .git .git2)
    assert Cover(f"{repo}/.git/info", "pin") not in covers or (repo / ".git" / "info").is_dir()
    assert {p.path for p in layout.placeholders} >= {f"{repo}/.vscode", f"{repo}/.git/commondir"}
    argv = bwrap_argv(BwrapSpec("bwrap", str(repo), layout.mounts, ("true",), covers=layout.covers))
    text = " ".join(argv)
    assert f"--bind {repo}/.git {repo}/.git" in text
    assert text.index(f"--bind {repo}/.git {repo}/.git") < text.index(f"--ro-bind {repo}/.git/hooks ")


def test_a_read_only_git_needs_no_cover_and_no_placeholder_inside(repo: Path, monkeypatch) -> None:
    layout = _layout(repo, monkeypatch, ro=[str(repo / ".git")])
    assert not any(c.path.startswith(f"{repo}/.git/") for c in layout.covers)
    assert not any(p.path.startswith(f"{repo}/.git/") for p in layout.placeholders)
    assert f"{repo}/.vscode" in {p.path for p in layout.placeholders}


def test_allow_project_hooks_protects_none_but_still_looks(repo: Path, monkeypatch) -> None:
    layout = _layout(repo, monkeypatch, ro=[], project_hooks=False)
    assert layout.hooks == () and layout.placeholders == ()
    assert not any(c.path.startswith(f"{repo}/.") for c in layout.covers)
    assert layout.before is not None and layout.before.roots == (str(repo),)


def test_a_writable_file_is_no_root(repo: Path, tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "notes.txt").write_text("x")
    layout = _layout(repo, monkeypatch, ro=[], rw=[str(tmp_path / "notes.txt")])
    assert layout.before is not None and layout.before.roots == (str(repo),)
    assert not any(p.path.startswith(f"{tmp_path}/notes.txt/") for p in layout.placeholders)


def test_seatbelt_denies_writing_and_creating_them(repo: Path, monkeypatch) -> None:
    (repo / ".git" / "hooks").rename(repo / "hooks-gone")
    layout = _layout(repo, monkeypatch, ro=[], private=())
    profile = seatbelt_profile(layout, [3128], temp=[], home=str(repo.parent))
    g = f"{repo}/.git"
    expected = [
        ("file-write-create", f"{g}/hooks", "deny"),  # missing: creating it is denied too
        ("file-write-create", f"{g}/hooks/pre-commit", "deny"),
        ("file-write-data", f"{g}/config", "deny"),
        ("file-write-unlink", f"{g}/config", "deny"),
        ("file-write-create", f"{g}/commondir", "deny"),
        ("file-write-create", f"{g}/info/attributes", "deny"),
        ("file-write-create", f"{repo}/.vscode", "deny"),
        ("file-write-create", f"{repo}/.claude/settings.json", "deny"),
        ("file-write-unlink", g, "deny"),  # mv .git .git2
        ("file-write-create", f"{g}/objects/ab/cdef", "allow"),
        ("file-write-create", f"{g}/index.lock", "allow"),
        ("file-write-create", f"{g}/config.lock", "allow"),
        ("file-write-data", f"{repo}/main.py", "allow"),
        ("file-write-create", f"{repo}/.envrc", "allow"),  # left to the summary
    ]
    for semantics in ("seatbelt", "last-match"):  # operation-specific rules first, or the last match
        model = Model.of(profile, semantics)
        for operation, path, want in expected:
            for spelled in spellings(path):
                assert model.decide(operation, path=spelled) == want, (semantics, operation, spelled)
    allowed = _layout(repo, monkeypatch, ro=[], private=(), project_hooks=False)
    profile = seatbelt_profile(allowed, [3128], temp=[], home=str(repo.parent))
    assert Model.of(profile).decide("file-write-create", path=f"{g}/hooks/pre-commit") == "allow"


# -- placeholders ---------------------------------------------------------------------------------
def test_placeholders_are_made_then_removed(tmp_path: Path) -> None:
    wanted = [
        Placeholder(str(tmp_path / "a" / "b" / "commondir"), False, "."),
        Placeholder(str(tmp_path / ".vscode"), True),
    ]
    registry = str(tmp_path / "registry")
    with hooks.placeholders(wanted, registry=registry) as standing:
        assert sorted(standing) == sorted(p.path for p in wanted)
        assert (tmp_path / "a" / "b" / "commondir").read_text() == "."
        assert (tmp_path / ".vscode").is_dir()
        assert len(os.listdir(registry)) == 4  # and the directories made on the way
    assert sorted(os.listdir(tmp_path)) == ["registry", "registry.lock"]  # both in egressd's home
    assert os.listdir(registry) == []


def test_a_placeholder_someone_changed_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / ".vscode"
    with hooks.placeholders([Placeholder(str(path), True)]):
        (path / "settings.json").write_text("{}")  # the user, outside the sandbox
    assert (path / "settings.json").read_text() == "{}"


def test_a_placeholder_another_sandbox_holds_stays_until_it_is_done(tmp_path: Path) -> None:
    path = str(tmp_path / ".claude")
    registry = str(tmp_path / "registry")
    first = hooks.placeholders([Placeholder(path, True)], registry=registry)
    first.__enter__()
    second = hooks.placeholders([Placeholder(path, True)], [path], registry=registry)
    assert second.__enter__() == [path]  # the first one's, recognised by the record
    first.__exit__(None, None, None)
    assert os.path.isdir(path)  # the second one holds it
    second.__exit__(None, None, None)
    assert not os.path.exists(path)


def test_another_sandboxs_stand_ins_are_planned_as_missing(tmp_path: Path) -> None:
    """A sandbox starting while another one's empty `.git` stands in the project plans the same
    stand-ins (none inside that `.git`: it is no repository); a directory of the user's is kept."""
    project = Path(os.path.realpath(tmp_path / "p"))
    project.mkdir()
    registry = str(tmp_path / "registry")
    alone = hooks.find([str(project)], registry=registry)
    with hooks.placeholders(alone.placeholders.values(), registry=registry):
        assert (project / ".git").is_dir()
        meanwhile = hooks.find([str(project)], registry=registry)
    assert meanwhile.placeholders == alone.placeholders
    assert not any("/.git/" in p for p in meanwhile.protected)
    (project / ".git").mkdir()  # the user's own (not a stand-in, even where one stood before)
    assert f"{project}/.git/hooks" in hooks.find([str(project)], registry=registry).placeholders


def test_the_directories_made_on_the_way_go_with_the_last_sandbox(repo: Path, tmp_path: Path) -> None:
    """`.git/info` made for the first sandbox's `info/attributes` stand-in is taken up, with the
    stand-in, by a second one that starts meanwhile, and goes when the last of them ends."""
    shutil.rmtree(repo / ".git" / "info")
    registry = str(tmp_path / "registry")
    wanted = [Placeholder(str(repo / ".git" / "info" / "attributes"), False)]
    first = hooks.placeholders(wanted, registry=registry)
    first.__enter__()
    second = hooks.placeholders(wanted, registry=registry)
    assert second.__enter__() == [wanted[0].path]
    first.__exit__(None, None, None)
    assert (repo / ".git" / "info" / "attributes").is_file()  # the second one holds it
    second.__exit__(None, None, None)
    assert not (repo / ".git" / "info").exists() and os.listdir(registry) == []


KILLED = """
import os, signal, sys
from egressd.sandbox import hooks
with hooks.placeholders([hooks.Placeholder(sys.argv[1], True)], registry=sys.argv[2]):
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_placeholder_left_behind_is_removed_by_the_next_run(tmp_path: Path) -> None:
    path = str(tmp_path / ".idea")
    registry = str(tmp_path / "registry")
    killed = subprocess.run([sys.executable, "-c", KILLED, path, registry], capture_output=True)
    assert killed.returncode == -signal.SIGKILL and os.path.isdir(path)
    with hooks.placeholders([], [path], registry=registry) as standing:
        assert standing == [path]
    assert not os.path.exists(path)
    os.mkdir(path)  # a directory of the user's own: kept
    with hooks.placeholders([], [path], registry=registry) as standing:
        assert standing == []
    assert os.path.isdir(path)


def test_git_inside_does_not_see_the_placeholders(repo: Path, tmp_path: Path) -> None:
    (repo / ".git" / "info" / "exclude").write_text("*.log")
    standing = [str(repo / ".vscode"), str(repo / ".git" / "commondir")]
    os.mkdir(standing[0])
    home = tmp_path / "egressd-home"
    with hooks.excludes(standing, [str(repo)], str(home)) as binds:
        [(source, path)] = binds
        assert path == str(repo / ".git" / "info" / "exclude")
        assert Path(source).read_text().splitlines() == ["*.log", hooks.EXCLUDE_NOTE, "/.vscode/"]
        assert Path(source).is_relative_to(home)  # egressd's hidden home, never $TMPDIR
    assert not os.path.exists(source)
    (repo / ".git" / "info" / "exclude").unlink()
    with hooks.excludes(standing, [str(repo)], str(home)) as binds:
        assert (repo / ".git" / "info" / "exclude").read_text() == ""  # made to be bound over
    assert not (repo / ".git" / "info" / "exclude").exists()
    os.mkfifo(repo / ".git" / "info" / "exclude")  # an earlier child's: never opened for reading
    with hooks.excludes(standing, [str(repo)], str(home)) as binds:
        assert binds == []


@pytest.mark.parametrize("kind", ["fifo", "symlink", "big"])
def test_what_egressd_reads_of_the_project_cannot_hang_or_flood_it(repo: Path, kind: str) -> None:
    """package.json, a .git file, commondir: a FIFO would block a read, a symlink to /dev/zero
    never end it."""
    path = repo / "package.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        path.symlink_to("/dev/zero")
    else:
        path.write_text("[" * 200_000 + "]" * 200_000)  # deeper than the JSON parser recurses
    assert exit_summary.lifecycle_scripts(str(path)) is None
    assert hooks.read_small(str(path)) is None


# -- the exit summary -----------------------------------------------------------------------------
def test_the_walk_looks_at_hooks_and_configuration_only_inside_git(repo: Path) -> None:
    (repo / ".git" / "hooks" / "pre-push").write_text("#!/bin/sh\n")
    (repo / "tool").write_text("#!/bin/sh\n")
    (repo / "tool").chmod(0o755)
    (repo / "data").write_text("x")
    walk = exit_summary.walk([str(repo)])
    names = {os.path.relpath(p, repo): why for p, (_, why) in walk.files.items()}
    assert names[".git/hooks/pre-push"] == exit_summary.GIT_HOOK
    assert names[".git/config"] == exit_summary.GIT_CONFIGURATION
    assert names["tool"] == exit_summary.EXECUTABLE and "data" not in names
    assert not any(n.startswith(".git/hooks/") and n.endswith(".sample") for n in names)
    assert not any(n.startswith((".git/objects", ".git/refs", ".git/logs")) for n in names)


def test_changes_name_what_was_created_or_changed(repo: Path) -> None:
    (repo / "package.json").write_text('{"scripts": {"postinstall": "node setup.js", "test": "t"}}')
    (repo / "setup.js").write_text("1")
    before = exit_summary.walk([str(repo)])
    time.sleep(0.01)
    (repo / "setup.js").write_text("2")
    (repo / "Makefile").write_text("all:\n")
    os.makedirs(repo / "sub" / ".git")
    (repo / "package.json").write_text('{"scripts": {"postinstall": "node setup.js", "prepare": "x"}}')
    after = exit_summary.walk([str(repo)])
    found = {(os.path.relpath(c.path, repo), c.what): c.why for c in exit_summary.changes(before, after)}
    assert found[("setup.js", "changed")] == "npm install runs it (package.json's postinstall)"
    assert found[("Makefile", "created")] == "make runs it"
    assert found[("sub/.git", "created")] == exit_summary.NESTED_GIT
    assert found[("package.json", "changed")] == "npm install runs its prepare script"
    assert after.gits == [str(repo / "sub" / ".git")]


def test_a_package_json_too_big_to_read_is_named_when_it_changes(repo: Path) -> None:
    (repo / "package.json").write_text('{"scripts": {"postinstall": "true"}}')
    before = exit_summary.walk([str(repo)])
    padding = " " * exit_summary.PACKAGE_JSON_MAX
    (repo / "package.json").write_text('{"scripts": {"postinstall": "node evil.js"}}' + padding)
    [change] = exit_summary.changes(before, exit_summary.walk([str(repo)]))
    assert (change.path, change.what, change.why) == (
        str(repo / "package.json"),
        "changed",
        exit_summary.UNREAD_PACKAGE_JSON,
    )


def test_the_summary_is_bounded_and_printable(tmp_path: Path) -> None:
    before = exit_summary.walk([str(tmp_path)])
    (tmp_path / "bin").mkdir()
    for n in range(25):
        path = tmp_path / "bin" / f"t{n:02}"
        path.write_text("")
        path.chmod(0o755)
    (tmp_path / "a-evil\x1b]0;owned\x07").write_text("")
    (tmp_path / "a-evil\x1b]0;owned\x07").chmod(0o755)
    after = exit_summary.walk([str(tmp_path)])
    lines = exit_summary.summary(exit_summary.changes(before, after), after, cwd=str(tmp_path))
    assert len(lines) == 1 + exit_summary.SUMMARY_LINES + 1
    assert lines[-1] == "  and 6 more (bin: 6)"
    assert all(line.isprintable() for line in lines)
    assert any("a-evil\\x1b]0;owned\\x07 (created): executable" in line for line in lines)


def test_a_walk_that_stops_says_so_and_what_it_did_not_see_is_not_new(tmp_path: Path) -> None:
    for n in range(10):
        (tmp_path / f"f{n}").write_text("")
        (tmp_path / f"f{n}").chmod(0o755)
    before = exit_summary.walk([str(tmp_path)], limit=3, started_ns=time.time_ns() + 10 * 10**9)
    after = exit_summary.walk([str(tmp_path)], limit=3)
    assert not after.complete
    assert exit_summary.changes(before, after) == []  # untouched since long before the start
    lines = exit_summary.summary([], after, cwd=str(tmp_path))
    assert lines == [
        "the look at what the command left stopped after 3 entries: files deeper in the project "
        "were not checked"
    ]


def test_every_entry_is_documented() -> None:
    text = DOCS.read_text()
    for name in [e.path for e in hooks.IN_PROJECT] + [f".git/{e.path}" for e in hooks.IN_GIT_DIR]:
        assert f"`{name}`" in text, name
    assert hooks.ALLOW_FLAG in text


# -- the quarantine of repositories made during the run ------------------------------------------
@pytest.mark.parametrize(
    ("key", "kept"),
    [
        ("core.repositoryformatversion", True),
        ("core.bare", True),
        ("core.worktree", True),
        ("extensions.objectformat", True),
        ("remote.origin.url", True),
        ("remote.a.b.c.fetch", True),
        ("branch.main.merge", True),
        ("submodule.x.url", True),
        ("core.fsmonitor", False),
        ("core.hookspath", False),
        ("core.pager", False),
        ("core.editor", False),
        ("core.sshcommand", False),
        ("core.askpass", False),
        ("include.path", False),
        ("includeif.gitdir:/**.path", False),
        ("filter.lfs.clean", False),
        ("filter.x.process", False),
        ("diff.x.textconv", False),
        ("diff.external", False),
        ("merge.x.driver", False),
        ("alias.st", False),
        ("credential.helper", False),
        ("gpg.program", False),
        ("sequence.editor", False),
        ("submodule.x.update", False),
        ("remote.origin.uploadpack", False),
        ("remote.origin.receivepack", False),
        ("remote.origin.vcs", False),
        ("url.ext::sh.insteadof", False),
        ("protocol.ext.allow", False),
        ("uploadpack.packobjectshook", False),
        ("extensions.partialclone", False),  # git fetches from it by itself
        ("remote.origin.promisor", False),
        ("core.bare.x", False),  # a subsection named core.bare: `[core "bare"] x`
        ("remote.url", False),  # no subsection
    ],
)
def test_a_configuration_keeps_only_what_runs_nothing(key: str, kept: bool) -> None:
    assert quarantine.safe_key(key) is kept


NASTY = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=30)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["core", "remote", "branch", "x"]),
            st.one_of(st.none(), NASTY.filter(lambda s: "\n" not in s)),
            st.from_regex(r"[a-z][a-z0-9-]{0,8}", fullmatch=True),
            st.one_of(st.none(), NASTY),
        ),
        max_size=6,
    )
)
def test_what_is_written_reads_back_exactly(entries: list[tuple[str, str | None, str, str | None]]) -> None:
    """The configuration written in place of the child's is read by git as exactly the entries
    kept, whatever their values hold (quotes, backslashes, new lines, `[`, `#`, `;`)."""
    wanted = [(".".join(p for p in (s, sub, n) if p is not None), v) for s, sub, n, v in entries]
    assert quarantine.parse(quarantine.render(wanted), hooks.system_git()) == wanted


def test_a_configuration_git_cannot_read_is_none() -> None:
    assert quarantine.parse("[core\n\tfsmonitor = x\n", hooks.system_git()) is None
    assert quarantine.parse("[core]\n\tbare = true\n", None) is None


def _quarantined(repo: Path, made: Path) -> list[quarantine.Taken]:
    writable = [str(repo)]
    protected = found(repo).protected
    return quarantine.quarantine([str(made)], writable=writable, protected=protected, git=hooks.system_git())


def test_a_new_repository_is_neutralised_and_nothing_outside_it_is_touched(
    repo: Path, tmp_path: Path
) -> None:
    """Planted links cannot steer the quarantine: an `egressd-quarantine` symlink into the
    project's hooks, a `hooks` symlink, a hook that is a hard link to a project file, an `info`
    symlink. Every original is moved as it is, and the files the links lead to stay untouched."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "attributes").write_text("* filter=x\n")
    sub = repo / "sub"
    git("init", "-q", "sub", cwd=repo)
    git("-C", "sub", "config", "core.fsmonitor", "evil", cwd=repo)
    git("-C", "sub", "config", "remote.origin.url", "https://example.test/x.git", cwd=repo)
    (repo / "tool.sh").write_text("#!/bin/sh\n")
    os.link(repo / "tool.sh", sub / ".git" / "hooks" / "pre-commit")
    (sub / ".git" / "egressd-quarantine").symlink_to(repo / ".git" / "hooks")
    os.rename(sub / ".git" / "info", sub / ".git" / "info.old")
    (sub / ".git" / "info").symlink_to(outside)
    hooks_before = sorted(os.listdir(repo / ".git" / "hooks"))

    taken = {os.path.relpath(t.path, sub): t for t in _quarantined(repo, sub / ".git")}

    assert set(taken) == {".git/config", ".git/hooks", ".git/info"}
    assert taken[".git/config"].dropped == ("core.fsmonitor",)
    assert taken[".git/hooks"].hooks == ("pre-commit",)
    box = sub / ".git" / "egressd-quarantine-1"
    assert taken[".git/hooks"].kept == str(box / "hooks")
    assert (box / "hooks" / "pre-commit").samefile(repo / "tool.sh")
    assert (repo / "tool.sh").read_text() == "#!/bin/sh\n"
    assert (box / "info").is_symlink() and (outside / "attributes").read_text() == "* filter=x\n"
    assert sorted(os.listdir(repo / ".git" / "hooks")) == hooks_before
    assert "fsmonitor" in (box / "config").read_text()
    config = subprocess.run(
        ["git", "config", "--file", str(sub / ".git" / "config"), "--list"], capture_output=True, text=True
    ).stdout
    assert "fsmonitor" not in config and "remote.origin.url=https://example.test/x.git" in config
    assert subprocess.run(["git", "-C", str(sub), "status"], capture_output=True).returncode == 0
    # a second time: nothing left to take
    assert _quarantined(repo, sub / ".git") == []


def test_what_git_init_and_clone_leave_is_left_alone(repo: Path) -> None:
    git("clone", "-q", ".", "sub", cwd=repo)
    git("init", "-q", "--bare", "x.git", cwd=repo)
    assert _quarantined(repo, repo / "sub" / ".git") == []
    assert _quarantined(repo, repo / "x.git") == []
    assert not (repo / "sub" / ".git" / "egressd-quarantine").exists()


def test_the_protected_repository_and_what_is_not_writable_are_left_alone(repo: Path, tmp_path: Path) -> None:
    git("config", "core.fsmonitor", "mine", cwd=repo)  # the user's own, protected while it ran
    elsewhere = tmp_path / "elsewhere"
    git("init", "-q", str(elsewhere), cwd=tmp_path)
    git("-C", str(elsewhere), "config", "core.fsmonitor", "theirs", cwd=tmp_path)
    assert _quarantined(repo, repo / ".git") == []
    assert _quarantined(repo, elsewhere / ".git") == []


def test_a_symlinked_config_is_moved_not_followed(repo: Path, tmp_path: Path) -> None:
    target = tmp_path / "real-config"
    target.write_text("[core]\n\tfsmonitor = evil\n")
    git("init", "-q", "sub", cwd=repo)
    (repo / "sub" / ".git" / "config").unlink()
    (repo / "sub" / ".git" / "config").symlink_to(target)
    [taken] = _quarantined(repo, repo / "sub" / ".git")
    assert taken.dropped == () and os.path.islink(taken.kept)
    assert not os.path.lexists(repo / "sub" / ".git" / "config")
    assert target.read_text() == "[core]\n\tfsmonitor = evil\n"


def test_touched_names_the_repositories_made_and_those_a_git_entry_leads_to(repo: Path) -> None:
    before = exit_summary.walk([str(repo)])
    git("init", "-q", "--bare", "store/b", cwd=repo)
    (repo / "w").mkdir()
    (repo / "w" / ".git").write_text("gitdir: ../store/b\n")
    git("init", "-q", "made", cwd=repo)
    after = exit_summary.walk([str(repo)])
    made = quarantine.touched(before, after, exit_summary.changes(before, after))
    assert sorted(os.path.relpath(p, repo) for p in made) == ["made/.git", "store/b"]


def test_an_included_file_missing_at_start_is_set_aside_once_made(repo: Path, tmp_path: Path) -> None:
    """Your configuration includes `conf/shared.gitconfig` and `late.gitconfig`, missing at start:
    the run makes one, and a symlinked `conf` for the other; each is renamed where it is, and what
    the link leads to is left alone."""
    git("config", "include.path", "../late.gitconfig", cwd=repo)
    git("config", "includeIf.gitdir:/**.path", "../conf/shared.gitconfig", cwd=repo)
    later = found(repo).later
    assert set(later) == {str(repo / "late.gitconfig"), str(repo / "conf" / "shared.gitconfig")}
    (repo / "late.gitconfig").write_text("[core]\n\tfsmonitor = evil\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "shared.gitconfig").write_text("[user]\n\tname = mine\n")
    (repo / "conf").symlink_to(outside)
    taken = {t.path: t.kept for t in quarantine.set_aside(later, [str(repo)])}
    assert taken == {
        str(repo / "late.gitconfig"): str(repo / "late.gitconfig.egressd-quarantine"),
        str(repo / "conf"): str(repo / "conf.egressd-quarantine"),
    }
    assert (outside / "shared.gitconfig").read_text() == "[user]\n\tname = mine\n"
    assert (
        "evil"
        not in subprocess.run(
            ["git", "-C", str(repo), "config", "--list"], capture_output=True, text=True
        ).stdout
    )
    assert quarantine.set_aside(later, [str(repo)]) == []  # nothing made: nothing taken


def test_a_submodule_made_beyond_the_walk_is_still_neutralised(repo: Path) -> None:
    """The walk is bounded (a child can fill the project to stop it short), but your prompt's git
    status enters every submodule the index records: those made or changed since the start are
    looked at wherever they are."""
    before = exit_summary.walk([str(repo)], limit=5)
    git("init", "-q", "zz/sub", cwd=repo)
    git("-C", "zz/sub", "commit", "-q", "--allow-empty", "-m", "s", cwd=repo)
    git("-C", "zz/sub", "config", "core.fsmonitor", "evil", cwd=repo)
    git("add", "zz/sub", cwd=repo)
    after = exit_summary.walk([str(repo)], limit=5)
    assert not after.complete and str(repo / "zz" / "sub" / ".git") not in after.gitdirs
    changes = exit_summary.changes(before, after)
    protected = list(found(repo).protected)
    taken = quarantine.after_run(before, after, changes, writable=[str(repo)], protected=protected, later=())
    assert [(os.path.relpath(t.path, repo), t.dropped) for t in taken] == [
        ("zz/sub/.git/config", ("core.fsmonitor",))
    ]
