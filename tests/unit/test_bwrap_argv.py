"""The bubblewrap command line, golden: what the sandbox is made of, flag by flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from egressd.sandbox.bwrap import LAUNCHER_BOOT, BwrapSpec, bwrap_argv, launcher_command, probe_argv
from egressd.sandbox.launcher import Arguments
from egressd.sandbox.mounts import Mount, MountError, order, plan_mounts
from egressd.sandbox.shields import Cover

SECURITY = [
    "--unshare-user",
    "--unshare-pid",
    "--unshare-net",
    "--unshare-ipc",
    "--unshare-uts",
    "--unshare-cgroup-try",
    "--disable-userns",
    "--cap-drop", "ALL",
    "--die-with-parent",
    "--new-session",
    "--as-pid-1",
]  # fmt: skip
BASE = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--tmpfs", "/run"]


def test_golden_argv() -> None:
    spec = BwrapSpec(
        bwrap="/usr/bin/bwrap",
        workdir="/home/u/project",
        mounts=(
            Mount("/home/u/project", True),
            Mount("/home/u/.cache/pip", True),
            Mount("/home/u/project/.git", False),
        ),
        command=("/venv/bin/python", "-I", "-m", "egressd.sandbox.launcher", "--", "curl", "x"),
        needed=("/opt/venv", "/tmp/venv", "/home/u/.config/egressd/public/ca-bundle.pem"),
        covers=(
            Cover("/home/u/project/conf/agent.yaml", "ro"),
            Cover("/home/u/project/conf", "pin"),
            Cover("/home/u/.config/egressd", "tmpfs"),
            Cover("/home/u/.npmrc", "empty"),
        ),
    )
    assert bwrap_argv(spec) == [
        "/usr/bin/bwrap",
        *SECURITY,
        *BASE,
        # the user's mounts, the covers and the needed paths egressd shows (under /tmp, or under a
        # hidden directory), parents first
        "--ro-bind", "/tmp/venv", "/tmp/venv",
        "--bind", "/home/u/project", "/home/u/project",
        "--ro-bind", "/dev/null", "/home/u/.npmrc",
        "--bind", "/home/u/.cache/pip", "/home/u/.cache/pip",
        "--ro-bind", "/home/u/project/.git", "/home/u/project/.git",
        "--bind", "/home/u/project/conf", "/home/u/project/conf",
        "--tmpfs", "/home/u/.config/egressd",
        "--ro-bind", "/home/u/project/conf/agent.yaml", "/home/u/project/conf/agent.yaml",
        "--ro-bind", "/home/u/.config/egressd/public/ca-bundle.pem",
        "/home/u/.config/egressd/public/ca-bundle.pem",
        "--chdir", "/home/u/project",
        "--", "/venv/bin/python", "-I", "-m", "egressd.sandbox.launcher", "--", "curl", "x",
    ]  # fmt: skip


def test_needed_path_under_tmp_never_covers_a_deeper_working_directory() -> None:
    # egressd installed (editable) in /tmp/repo, run from /tmp/repo/work: the checkout stays
    # readable, the working directory inside it stays writable
    spec = BwrapSpec(
        "bwrap",
        "/tmp/repo/work",
        (Mount("/tmp/repo/work", True),),
        ("true",),
        needed=("/tmp/repo", "/tmp/repo/.venv"),
    )
    argv = bwrap_argv(spec)
    binds = [argv[i : i + 2] for i, word in enumerate(argv) if word in ("--bind", "--ro-bind")]
    binds = [bind for bind in binds if bind[1].startswith("/tmp/repo")]
    assert binds == [
        ["--ro-bind", "/tmp/repo"],
        ["--bind", "/tmp/repo/work"],
        ["--ro-bind", "/tmp/repo/.venv"],
    ]


def test_probe_shows_the_interpreter_when_it_lives_under_tmp() -> None:
    argv = probe_argv("bwrap", "/usr/bin/true", True, ("/tmp/x/.venv", "/usr"))
    assert argv[argv.index("/tmp/x/.venv") - 1] == "--ro-bind"
    assert "/usr" not in argv  # already visible through the read-only /


def test_old_bubblewrap_without_disable_userns() -> None:
    spec = BwrapSpec("bwrap", "/w", (Mount("/w", True),), ("true",), disable_userns=False)
    argv = bwrap_argv(spec)
    assert "--disable-userns" not in argv
    assert argv[1:7] == SECURITY[:6] and "--cap-drop" in argv


def test_network_namespace_and_no_capabilities_always() -> None:
    argv = bwrap_argv(BwrapSpec("bwrap", "/w", (), ("true",)))
    assert "--unshare-net" in argv and "--share-net" not in argv
    assert argv[argv.index("--cap-drop") + 1] == "ALL"
    assert "--cap-add" not in argv


def test_probe_argv() -> None:
    assert probe_argv("/usr/bin/bwrap", "/usr/bin/true", True) == [
        "/usr/bin/bwrap", *SECURITY, *BASE, "--", "/usr/bin/true",
    ]  # fmt: skip


def test_launcher_command() -> None:
    assert launcher_command(
        "/py",
        "/venv/lib/site-packages",
        5,
        7,
        9,
        [("127.0.0.1:3128", "http"), ("127.0.0.1:1080", "socks")],
        ["git", "clone", "--", "x"],
    ) == (
        "/py", "-I", "-S", "-c", LAUNCHER_BOOT, "/venv/lib/site-packages",
        "--control-fd", "5", "--status-fd", "7",
        "--handover-fd", "9", "--listen", "127.0.0.1:3128=http", "--listen", "127.0.0.1:1080=socks",
        "--", "git", "clone", "--", "x",
    )  # fmt: skip


# -- mounts ---------------------------------------------------------------------------------------
def test_plan_mounts_orders_parents_first(tmp_path: Path) -> None:
    (tmp_path / "proj" / ".git").mkdir(parents=True)
    cache = tmp_path / "cache"
    cache.mkdir()
    mounts = plan_mounts(str(tmp_path / "proj"), rw=[str(cache)], ro=[str(tmp_path / "proj" / ".git")])
    assert mounts == (
        Mount(str(cache), True),
        Mount(str(tmp_path / "proj"), True),
        Mount(str(tmp_path / "proj" / ".git"), False),
    )


def test_plan_mounts_resolves_symlinks_and_relative_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    monkeypatch.chdir(tmp_path)
    mounts = plan_mounts(str(tmp_path), rw=["link"], ro=[])
    assert Mount(str(real), True) in mounts


def test_plan_mounts_ro_working_directory_wins(tmp_path: Path) -> None:
    assert plan_mounts(str(tmp_path), rw=[], ro=[str(tmp_path)]) == (Mount(str(tmp_path), False),)


@pytest.mark.parametrize(
    ("rw", "ro", "message"),
    [
        (["/nonexistent/egressd-test"], [], "--rw /nonexistent/egressd-test: no such file or directory"),
        ([], ["/nonexistent/x"], "--ro /nonexistent/x: no such file or directory"),
        (["/"], [], "--rw /: the whole file system"),
    ],
)
def test_plan_mounts_errors(tmp_path: Path, rw: list[str], ro: list[str], message: str) -> None:
    with pytest.raises(MountError, match="^" + message.replace("/", "/")):
        plan_mounts(str(tmp_path), rw=rw, ro=ro)


def test_plan_mounts_same_path_rw_and_ro(tmp_path: Path) -> None:
    with pytest.raises(MountError, match="both as --rw and --ro"):
        plan_mounts(str(tmp_path), rw=[str(tmp_path)], ro=[str(tmp_path)])


def test_working_directory_root_refused() -> None:
    with pytest.raises(MountError, match="working directory is /"):
        plan_mounts("/", rw=[], ro=[])


def test_order_is_stable_within_a_depth() -> None:
    mounts = [Mount("/a/b", False), Mount("/z", True), Mount("/a", True), Mount("/y", False)]
    assert order(mounts) == (Mount("/z", True), Mount("/a", True), Mount("/y", False), Mount("/a/b", False))


def test_pyenv_shims_get_a_private_view() -> None:
    spec = BwrapSpec(
        "bwrap",
        "/w",
        (Mount("/w", True),),
        ("true",),
        private_views=(("/home/u/.pyenv/shims", "/tmp/.egressd-pyenv-shims"),),
    )
    argv = bwrap_argv(spec)
    view = argv.index("/tmp/.egressd-pyenv-shims")
    assert argv[view - 2 : view + 1] == ["--ro-bind", "/home/u/.pyenv/shims", "/tmp/.egressd-pyenv-shims"]
    tmpfs = len(argv) - 1 - argv[::-1].index("--tmpfs")
    assert argv[tmpfs + 1] == "/home/u/.pyenv/shims" and tmpfs > view  # over everything else
    command = launcher_command("/py", "/r", 5, 7, 8, [], ["x"], views=spec.private_views)
    assert "--link-view" in command
    assert command[command.index("--link-view") + 1] == "/home/u/.pyenv/shims=/tmp/.egressd-pyenv-shims"


def test_the_launcher_reads_every_option_launcher_command_writes() -> None:
    argv = launcher_command(
        "/py",
        "/r",
        5,
        7,
        8,
        [("127.0.0.1:3128", "http"), ("127.0.0.1:1080", "socks")],
        ["sh", "-c", "x", "--", "--listen", "--unshare"],
        setup_fd=9,
        capture=(3129, 1053),
        views=[("/a", "/tmp/v/a"), ("/b", "/tmp/v/b")],
        names_fd=10,
        captures_fd=12,
        unshare=True,
    )
    args = Arguments(argv[argv.index("/r") + 1 :])
    assert (args.control_fd, args.status_fd, args.handover_fd) == (5, 7, 8)
    assert (args.setup_fd, args.names_fd, args.captures_fd) == (9, 10, 12)
    assert args.listen == ["127.0.0.1:3128=http", "127.0.0.1:1080=socks"]
    assert args.capture == "3129,1053"
    assert args.link_view == ["/a=/tmp/v/a", "/b=/tmp/v/b"]
    assert args.unshare
    # everything after the first `--` is the child's, options and `--` alike
    assert args.command == ["sh", "-c", "x", "--", "--listen", "--unshare"]
    bare = Arguments(["--control-fd", "1", "--status-fd", "2", "--handover-fd", "3", "--", "true"])
    assert (bare.setup_fd, bare.names_fd, bare.captures_fd, bare.capture) == (None, None, None, None)
    assert (bare.listen, bare.link_view, bare.unshare, bare.command) == ([], [], False, ["true"])


REQUIRED = ["--control-fd", "1", "--status-fd", "2", "--handover-fd", "3"]


@pytest.mark.parametrize(
    "argv",
    [
        [*REQUIRED, "--"],  # no command
        [*REQUIRED, "true"],  # no `--`
        ["--control-fd", "1", "--status-fd", "2", "--", "true"],  # a required descriptor missing
        [*REQUIRED, "--setup-fd", "x", "--", "true"],  # not a descriptor
        [*REQUIRED, "--setup-fd", "-1", "--", "true"],
        [*REQUIRED, "--status-fd", "4", "--", "true"],  # given twice
        [*REQUIRED, "--setup-fd=4", "--", "true"],  # only the form launcher_command writes
        [*REQUIRED, "--bogus", "1", "--", "true"],
        [*REQUIRED, "--capture"],  # an option's value missing
    ],
)
def test_the_launcher_refuses_a_command_line_launcher_command_never_writes(argv: list[str]) -> None:
    with pytest.raises(ValueError):
        Arguments(argv)
