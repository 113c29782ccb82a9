"""What the child must not change or read: the covers, table by table, with the nasty cases."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from egressd.sandbox.bwrap import BwrapSpec, mount_plan
from egressd.sandbox.mounts import Mount, MountError, plan_mounts, within
from egressd.sandbox.shields import Cover, apply_show, inside_view, plan_covers

W = Mount("/w", True)


@pytest.mark.parametrize(
    ("mounts", "guarded", "covers"),
    [
        # outside every writable mount: the read-only root already protects it
        ((W,), {"/opt/venv": "code"}, ()),
        # directly in the writable mount: a read-only bind, nothing to pin
        ((W,), {"/w/agent.yaml": "policy"}, (Cover("/w/agent.yaml", "ro"),)),
        # deeper: every plain directory on the way is pinned (cannot be renamed away)
        (
            (W,),
            {"/w/a/b/agent.yaml": "policy"},
            (Cover("/w/a/b/agent.yaml", "ro"), Cover("/w/a/b", "pin"), Cover("/w/a", "pin")),
        ),
        # a user mount on the way is a mount point already; its parents still get pinned
        (
            (W, Mount("/w/a/b", True)),
            {"/w/a/b/c/x": "code"},
            (Cover("/w/a/b/c/x", "ro"), Cover("/w/a/b/c", "pin"), Cover("/w/a", "pin")),
        ),
        # inside a --ro mount: read-only already, and that mount point cannot be renamed
        ((W, Mount("/w/ro", False)), {"/w/ro/x": "code"}, ()),
        # a --ro mount deeper in: it would move with its renamed parent, which is pinned
        ((W, Mount("/w/a/ro", False)), {"/w/a/ro/x": "policy"}, (Cover("/w/a", "pin"),)),
        # a writable mount inside a read-only one inside a writable one
        (
            (W, Mount("/w/a", False), Mount("/w/a/b/c", True)),
            {"/w/a/b/c/d/p": "policy"},
            (Cover("/w/a/b/c/d/p", "ro"), Cover("/w/a/b/c/d", "pin")),
        ),
    ],
)
def test_guarded_covers(
    mounts: tuple[Mount, ...], guarded: dict[str, str], covers: tuple[Cover, ...]
) -> None:
    assert plan_covers(mounts, guarded, ()) == covers


@pytest.mark.parametrize(
    ("mounts", "guarded"),
    [
        ((Mount("/w", True),), {"/w": "egressd's own package"}),  # the working directory IS the code
        ((Mount("/w/venv/lib", True),), {"/w/venv": "egressd's Python environment"}),  # inside it
        ((Mount("/w/agent.yaml", True),), {"/w/agent.yaml": "the policy"}),  # --rw of the file itself
    ],
)
def test_writable_guarded_paths_are_refused(mounts: tuple[Mount, ...], guarded: dict[str, str]) -> None:
    with pytest.raises(MountError, match="must never change"):
        plan_covers(mounts, guarded, ())


def test_a_read_only_mount_inside_guarded_code_is_fine() -> None:
    assert plan_covers((Mount("/w", True), Mount("/w/venv/x", False)), {"/w/venv": "code"}, ()) == (
        Cover("/w/venv", "ro"),
    )


def test_hidden_directories_get_a_tmpfs_and_files_an_empty_file() -> None:
    covers = plan_covers((W,), {}, ("/home/u/.ssh", "/home/u/.npmrc"), is_dir=lambda p: p.endswith(".ssh"))
    assert covers == (Cover("/home/u/.ssh", "tmpfs"), Cover("/home/u/.npmrc", "empty"))


def test_directories_on_the_way_to_a_hidden_path_are_pinned() -> None:
    # renamed, `a` would take the tmpfs along and leave the host path to a directory of the child's
    covers = plan_covers((W,), {}, ("/w/a/b/.egressd",), is_dir=lambda p: True)
    assert covers == (Cover("/w/a/b/.egressd", "tmpfs"), Cover("/w/a/b", "pin"), Cover("/w/a", "pin"))


def test_directories_on_the_way_to_a_nested_user_mount_are_pinned() -> None:
    mounts = (W, Mount("/w/sub/.git", False), Mount("/w/x", True), Mount("/opt/ro/a/b", False))
    assert plan_covers(mounts, {}, ()) == (Cover("/w/sub", "pin"),)


def test_no_pin_reopens_a_hidden_directory() -> None:
    # /w/h/x is hidden inside the hidden /w/h: a pin of /w/h/x's parent would show the host's /w/h
    # (and x needs no cover of its own: nothing of the host's is visible there)
    covers = plan_covers((W,), {}, ("/w/h", "/w/h/y/x"), is_dir=lambda p: True)
    assert covers == (Cover("/w/h", "tmpfs"),)


@pytest.mark.parametrize("mount", [Mount("/home/u/.ssh", False), Mount("/home/u/.ssh/keys", True)])
def test_a_user_mount_in_a_hidden_path_needs_show(mount: Mount) -> None:
    with pytest.raises(MountError, match="--show /home/u/.ssh"):
        plan_covers((W, mount), {}, ("/home/u/.ssh",))


def test_show_drops_a_hidden_path_or_shows_inside_one() -> None:
    hidden = ("/h/.ssh", "/h/.npmrc")
    assert apply_show(hidden, ["/h/.npmrc"]) == (("/h/.ssh",), ())
    assert apply_show(hidden, ["/h/.ssh/known_hosts"]) == (hidden, ("/h/.ssh/known_hosts",))
    with pytest.raises(MountError, match="does not hide it"):
        apply_show(hidden, ["/h/.bashrc"])


@given(st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=5))
def test_every_directory_between_a_writable_mount_and_a_guarded_path_is_pinned(parts: list[str]) -> None:
    path = "/w/" + "/".join(parts) + "/f"
    covers = plan_covers((W,), {path: "policy"}, ())
    pinned = {c.path for c in covers if c.kind == "pin"}
    expected = {"/w/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)}
    assert pinned == expected and Cover(path, "ro") in covers


# -- what may be writable ------------------------------------------------------------------------
@pytest.mark.parametrize("rw", ["/etc", "/usr", "/usr/share", "/var", "/etc/ssh"])
def test_system_directories_are_never_writable(rw: str, tmp_path: object) -> None:
    with pytest.raises(MountError, match="system directory|holds code and configuration"):
        plan_mounts(str(tmp_path), rw=[rw], ro=[])


def test_home_and_its_ancestors_need_rw_home(tmp_path: object) -> None:
    from pathlib import Path

    home = Path(str(tmp_path)) / "home" / "u"
    (home / "project").mkdir(parents=True)
    for workdir in (home, home.parent):
        with pytest.raises(MountError, match="--rw-home"):
            plan_mounts(str(workdir), rw=[], ro=[], home=str(home))
        assert plan_mounts(str(workdir), rw=[], ro=[], home=str(home), rw_home=True)
    assert plan_mounts(str(home / "project"), rw=[], ro=[], home=str(home))  # below it is fine


def test_no_working_directory_mounts_only_what_is_named(tmp_path: Path) -> None:
    """A remote sandbox's working directory is the login's home: it is not mounted (it stays
    masked); only --rw and --ro paths are."""
    (tmp_path / "rw").mkdir()
    (tmp_path / "ro").mkdir()
    rw, ro = str(tmp_path / "rw"), str(tmp_path / "ro")
    mounts = plan_mounts(None, rw=[rw], ro=[ro], home=str(tmp_path))
    assert {(m.path, m.writable) for m in mounts} == {(rw, True), (ro, False)}
    assert plan_mounts(None, rw=[], ro=[]) == ()


def test_followed_links_names_every_symlink_on_the_way(tmp_path: Path) -> None:
    from egressd.sandbox.layout import followed_links

    (tmp_path / "real" / "d").mkdir(parents=True)
    (tmp_path / "real" / "d" / "f").write_text("x")
    (tmp_path / "hop").symlink_to("real")
    (tmp_path / "real" / "link").symlink_to(tmp_path / "hop" / "d" / "f")
    assert followed_links(str(tmp_path / "real" / "d" / "f")) == ()
    assert followed_links(str(tmp_path / "hop" / "link")) == (
        str(tmp_path / "hop"),
        str(tmp_path / "real" / "link"),
        str(tmp_path / "hop"),
    )


# -- what the child gets at a path ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "view"),
    [
        ("/usr/bin/env", "ro"),  # the read-only root
        ("/tmp/x", "hidden"),  # private
        ("/w/src/a.py", "rw"),
        ("/w/.git/config", "ro"),  # --ro inside the writable mount
        ("/w/.venv/lib", "ro"),  # a read-only cover
        ("/w/.venv/lib/x/y", "ro"),
        ("/w/conf", "rw"),  # a pin: writable, but a mount point
        ("/home/u", "hidden"),  # the mask
        ("/home/u/.bash_history", "hidden"),
        ("/home/u/.gitconfig", "ro"),  # shown inside the mask
        ("/home/u/.config/egressd", "hidden"),
        ("/home/u/.config/egressd/public/ca.pem", "ro"),
        ("/w", "rw"),
        ("/wx", "ro"),  # not inside /w: by path component, not by prefix
    ],
)
def test_inside_view(path: str, view: str) -> None:
    mounts = (W, Mount("/w/.git", False))
    covers = (
        Cover("/w/.venv", "ro"),
        Cover("/w/conf", "pin"),
        Cover("/home/u", "mask"),
        Cover("/home/u/.gitconfig", "ro"),
        Cover("/home/u/.config/egressd", "tmpfs"),
        Cover("/home/u/.config/egressd/public/ca.pem", "ro"),
    )
    assert inside_view(path, mounts, covers) == view


def test_a_cover_at_a_user_mount_s_own_path_wins() -> None:
    # bubblewrap lays covers after the user's mounts at one depth: --ro . with the policy at .
    assert inside_view("/w", (W,), (Cover("/w", "ro"),)) == "ro"
    assert inside_view("/w", (Mount("/w", False),), (Cover("/w", "pin"),)) == "rw"


# -- every install layout: what egressd reads stays read-only ----------------------------------------
HOME = "/home/u"
PROJECT = Mount("/home/u/proj", True)
SITE = "lib/python3.12/site-packages"


def _install(prefix: str, package_root: str, presets: str, *, base: str = "/usr") -> dict[str, object]:
    """What egressd_code() and needed_paths() give for egressd installed like this, run with
    `--policy npm` (the preset pinned read-only). A checkout (presets in its `policies/`) is
    installed editable: its root is not on sys.path, its addons live in `addons/`."""
    package = f"{package_root}/egressd"
    checkout = presets == f"{package_root}/policies"
    guarded = {
        prefix: "egressd's Python environment",
        package: "egressd's own package",
        f"{package_root}/addons" if checkout else f"{package}/addons": "egressd's mitmproxy addons",
        presets: "egressd's presets",
        f"{presets}/npm.yaml": "the policy egressd reads",
    }
    if not checkout:
        guarded[package_root] = "a directory egressd imports from"
    return {"guarded": guarded, "needed": (prefix, base, package_root)}


CHECKOUT = "/home/u/proj/vendor/egressd"
LAYOUTS = {
    "project .venv": _install(
        "/home/u/proj/.venv", f"/home/u/proj/.venv/{SITE}", f"/home/u/proj/.venv/{SITE}/egressd/data/policies"
    ),
    "pipx": _install(
        "/home/u/.local/pipx/venvs/egressd",
        f"/home/u/.local/pipx/venvs/egressd/{SITE}",
        f"/home/u/.local/pipx/venvs/egressd/{SITE}/egressd/data/policies",
    ),
    "user site": _install("/usr", f"/home/u/.local/{SITE}", f"/home/u/.local/{SITE}/egressd/data/policies"),
    "checkout in the project": _install(f"{CHECKOUT}/.venv", CHECKOUT, f"{CHECKOUT}/policies"),
    "checkout in the home": _install(
        "/home/u/src/egressd/.venv", "/home/u/src/egressd", "/home/u/src/egressd/policies"
    ),
    "system": _install(
        "/usr", "/usr/lib/python3/dist-packages", "/usr/lib/python3/dist-packages/egressd/data/policies"
    ),
    "pyenv in the home": _install(
        "/home/u/proj/.venv",
        f"/home/u/proj/.venv/{SITE}",
        f"/home/u/proj/.venv/{SITE}/egressd/data/policies",
        base="/home/u/.pyenv/versions/3.12.1",
    ),
}
CASES = [(name, PROJECT) for name in LAYOUTS] + [("checkout in the project", Mount(CHECKOUT, True))]


def _between(top: str, path: str) -> list[str]:
    """`path` and every directory from it up to `top`."""
    found = []
    while within(path, top):
        found.append(path)
        if path == top:
            break
        path = os.path.dirname(path)
    return found


@pytest.mark.parametrize(("name", "workdir"), CASES, ids=[f"{n}, from {w.path}" for n, w in CASES])
def test_every_install_layout_keeps_egressd_read_only(name: str, workdir: Mount) -> None:
    layout = LAYOUTS[name]
    guarded: dict[str, str] = layout["guarded"]  # type: ignore[assignment]
    needed: tuple[str, ...] = layout["needed"]  # type: ignore[assignment]
    covers = plan_covers(
        (workdir,),
        guarded,
        (f"{HOME}/.config/egressd",),
        masked=(HOME,),
        shown=(f"{HOME}/.gitconfig",),
        is_dir=lambda p: not p.endswith((".yaml", ".gitconfig")),
    )
    spec = BwrapSpec("bwrap", workdir.path, (workdir,), ("true",), needed=needed, covers=covers)
    plan = mount_plan(spec)
    mounts = [m for m in plan if isinstance(m, Mount)]
    laid = [c for c in plan if isinstance(c, Cover)]
    # every mount laid inside what egressd reads, and every directory on the way to it
    probes = {g for g in guarded}
    for item in plan:
        for top in guarded:
            if within(item.path, top):
                probes.update(_between(top, item.path))
    probes.update(f"{g}/lib/python3.12" for g in guarded)
    writable = sorted(p for p in probes if inside_view(p, mounts, laid) == "rw")
    assert writable == [], f"{name}: writable inside the sandbox: {writable}"
    for path in needed:  # egressd's launcher can run and import
        assert inside_view(path, mounts, laid) != "hidden", path
    assert inside_view(workdir.path, mounts, laid) == "rw"
    assert inside_view(f"{HOME}/.bash_history", mounts, laid) == "hidden"
    assert inside_view(f"{HOME}/.gitconfig", mounts, laid) == "ro"
    assert inside_view(f"{HOME}/.config/egressd/ca/key.pem", mounts, laid) == "hidden"


def test_a_pin_inside_a_read_only_cover_is_never_laid() -> None:
    """`--policy npm` from a project .venv: the preset's directories must not be bound writable
    over the read-only cover of the .venv (the child would rewrite github.yaml)."""
    venv = "/w/.venv"
    preset = f"{venv}/{SITE}/egressd/data/policies/npm.yaml"
    covers = plan_covers((W,), {venv: "egressd's Python environment", preset: "the policy"}, ())
    assert covers == (Cover(venv, "ro"),)
