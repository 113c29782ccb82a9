"""The masked home's parts, table by table: the harmless list's credential check, --show inside
the home, the sources of secrets and the guard that keeps a reload from naming a visible one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from egressd.policy import PolicyError, parse_policy
from egressd.sandbox.explain import home_hint
from egressd.sandbox.layout import Layout, harmless_files, hide_more, holds_credential
from egressd.sandbox.mounts import Mount, MountError
from egressd.sandbox.shields import Cover, apply_show, plan_covers
from egressd.sandbox.sources import SourceGuard, source_files


@pytest.mark.parametrize(
    "text",
    [
        "[http]\n\textraHeader = Authorization: Bearer abc",
        '[url "https://x-access-token:ghp_abc@github.com/"]\n\tinsteadOf = https://github.com/',
        '[url "https://ghp_abcdef@github.com/"]',
        "[credential]\n\thelper = store",
        "set password=hunter2",
        "let g:api_key = 'x'",
        "export OPENAI_API_KEY=sk-abc",
        "token = glpat-abc",
        "aws = AKIAABCDEFGH",
        "[sendemail]\n\tsmtpPass = x\n\tsmtpUser = y\n\tsmtppassword = z",
    ],
)
def test_configuration_that_looks_like_it_holds_a_credential(text: str) -> None:
    why = holds_credential(text)
    assert why is not None and why.startswith("line ")
    assert "ghp_" not in why and "hunter2" not in why  # says where, never what


@pytest.mark.parametrize(
    "text",
    [
        "[user]\n\tname = A\n\temail = a@example.test",
        '[url "ssh://git@github.com/"]\n\tinsteadOf = https://github.com/',
        "[core]\n\teditor = vim\n\tautocrlf = input",
        "set number\nsyntax on",
        "",
    ],
)
def test_harmless_configuration(text: str) -> None:
    assert holds_credential(text) is None


def test_harmless_files_checks_each_and_keeps_a_symlinks_own_path(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".config" / "git").mkdir(parents=True)
    (tmp_path / "dotfiles").mkdir()
    (tmp_path / "dotfiles" / "gitconfig").write_text("[user]\n\tname = A\n")
    (home / ".gitconfig").symlink_to(tmp_path / "dotfiles" / "gitconfig")
    (home / ".config" / "git" / "config").write_text("[http]\n\textraheader = Authorization: x\n")
    (home / ".vimrc").write_text("x" * (1 << 17))
    (home / ".bashrc").write_text("alias ll='ls -l'\n")  # not on the list: shell rc files export tokens
    shown, withheld = harmless_files(str(home))
    assert shown == (str(home / ".gitconfig"),)
    assert dict(withheld) == {
        str(home / ".config" / "git" / "config"): "line 2 looks like it holds a credential",
        str(home / ".vimrc"): "larger than 65536 bytes: not checked",
    }


def test_show_inside_the_masked_home() -> None:
    hidden = ("/h/.ssh", "/h/.pgpass")
    assert apply_show(hidden, ["/h/notes"], ["/h"]) == (hidden, ("/h/notes",))
    # a credential in the masked home, named: no longer hidden, and shown
    assert apply_show(hidden, ["/h/.pgpass"], ["/h"]) == (("/h/.ssh",), ("/h/.pgpass",))
    with pytest.raises(MountError, match="does not hide it"):
        apply_show(hidden, ["/etc/hosts"], ["/h"])


def test_a_user_mount_inside_the_masked_home_is_shown_and_the_mask_stays_read_only() -> None:
    covers = plan_covers(
        (Mount("/h/proj", True),), {}, ("/h/.ssh", "/h/proj/.env"), masked=("/h",), shown=("/h/.gitconfig",),
        is_dir=lambda p: p.endswith(".ssh"),
    )  # fmt: skip
    # ~/.ssh needs no cover of its own (the mask hides it); the .env inside the project does
    assert covers == (Cover("/h", "mask"), Cover("/h/.gitconfig", "ro"), Cover("/h/proj/.env", "empty"))
    # the project IS the home: nothing masked, the credentials covered
    covers = plan_covers((Mount("/h", True),), {}, ("/h/.ssh",), masked=("/h",), is_dir=lambda p: True)
    assert covers == (Cover("/h/.ssh", "tmpfs"),)


def _policy(tmp_path: Path, secrets: str) -> object:
    text = f"version: 1\nallow: [api.test]\nsecrets:\n{secrets}"
    return parse_policy(yaml.safe_load(text), source=str(tmp_path / "p.yaml"))


def _secret(name: str, source: str) -> str:
    return f"  - name: {name}\n    from: {source}\n    hosts: [api.test]\n    env: {name.upper()}\n"


def test_source_files_of_files_and_commands(tmp_path: Path) -> None:
    key, gpg = tmp_path / "key", tmp_path / "key.gpg"
    key.write_text("k")
    gpg.write_text("g")
    policy = _policy(
        tmp_path,
        _secret("a", f"{{file: {key}}}")
        + _secret("b", f'{{command: [gpg, --quiet, "--output=-", "--decrypt", "{gpg}", "--batch"]}}')
        + _secret("c", f'{{command: [cat, "--file={key}", "{tmp_path / "missing"}"]}}')
        + _secret("d", "{env: D_VALUE}"),
    )
    assert source_files(policy.secrets) == {  # type: ignore[attr-defined]
        str(key): "the source of secret 'a'",
        str(gpg): "the source of secret 'b'",
    }


def test_the_guard_collects_then_refuses_a_visible_source(tmp_path: Path) -> None:
    hidden_dir, shown_dir = tmp_path / "home", tmp_path / "project"
    hidden_dir.mkdir()
    shown_dir.mkdir()
    for path in (hidden_dir / "a", hidden_dir / "b", shown_dir / "c"):
        path.write_text("x")
    guard = SourceGuard()
    first = _policy(tmp_path, _secret("a", f"{{file: {hidden_dir / 'a'}}}"))
    assert guard(first) is first  # type: ignore[arg-type]
    base = Layout((Mount(str(shown_dir), True),), (), (), (), masked=(str(hidden_dir),))
    seen = {}

    def hide(files: dict[str, str]) -> Layout:
        seen.update(files)
        return hide_more(base, files)

    layout = guard.fix(hide)  # type: ignore[arg-type]
    assert seen == {str(hidden_dir / "a"): "the source of secret 'a'"}
    assert layout.hides(str(hidden_dir / "a"))
    later = _policy(tmp_path, _secret("b", f"{{file: {hidden_dir / 'b'}}}"))
    assert guard(later) is later  # type: ignore[arg-type]  # hidden already: the masked home
    visible = _policy(tmp_path, _secret("c", f"{{file: {shown_dir / 'c'}}}"))
    with pytest.raises(PolicyError, match="shows to the child"):
        guard(visible)  # type: ignore[arg-type]
    # a source the child could create before egressd reads it
    missing = _policy(tmp_path, _secret("d", f"{{file: {shown_dir / 'later'}}}"))
    with pytest.raises(PolicyError, match="shows to the child"):
        guard(missing)  # type: ignore[arg-type]


def test_a_second_hard_link_is_refused_at_load(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("x")
    os.link(tmp_path / "key", tmp_path / "other")
    with pytest.raises(PolicyError, match="2 hard links"):
        SourceGuard()(_policy(tmp_path, _secret("a", f"{{file: {tmp_path / 'key'}}}")))  # type: ignore[arg-type]


def test_hide_more_refuses_what_a_user_mount_or_show_shows(tmp_path: Path) -> None:
    base = Layout((Mount("/p", True), Mount("/p/keys/k", False)), (), (), ("/h/k",), masked=("/h",))
    with pytest.raises(MountError, match="secret 'x'"):
        hide_more(base, {"/p/keys/k": "the source of secret 'x'"})  # --ro of the key itself
    with pytest.raises(MountError, match="never shows"):
        hide_more(base, {"/h/k": "the source of secret 'y'"})
    assert hide_more(base, {"/p/k": "the source of secret 'z'"}).hides("/p/k")
    assert hide_more(base, {"/p/keys/k2": "the source of secret 'z'"}).hides("/p/keys/k2")


def test_the_hint_names_show(tmp_path: Path) -> None:
    home = tmp_path / "h"
    (home / "bin").mkdir(parents=True)
    tool = home / "bin" / "tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    layout = Layout(
        (Mount(str(tmp_path / "p"), True),), (Cover(str(home), "mask"),), (), (), masked=(str(home),)
    )
    assert home_hint(layout, ["tool"], 0, str(home / "bin")) is None
    assert home_hint(layout, ["tool"], -15, str(home / "bin")) is None  # killed: nothing to explain
    assert f"--show {home / 'bin'} lets it run" in str(home_hint(layout, ["tool"], 127, str(home / "bin")))
    generic = str(home_hint(layout, ["sh"], 1, "/usr/bin:/bin"))
    assert "--show PATH" in generic and str(home) in generic
    assert home_hint(Layout((), (), (), ()), ["sh"], 1, "/bin") is None  # nothing masked


def test_the_docs_name_every_harmless_file_and_credential() -> None:
    from egressd.sandbox.shields import CREDENTIALS, HARMLESS

    text = (Path(__file__).resolve().parents[2] / "docs" / "sandbox.md").read_text()
    for rel in HARMLESS:
        assert f"`~/{rel}`" in text, rel
    for rel in CREDENTIALS:
        spelled = "`~/.cargo/credentials(.toml)`" if rel.startswith(".cargo/") else f"`~/{rel}`"
        assert spelled in text, rel


def test_a_project_holding_the_home_still_masks_it() -> None:
    """`--rw-home` from /home: the project holds the home, but only naming the home itself shows it."""
    covers = plan_covers((Mount("/home", True),), {}, (), masked=("/home/u",), is_dir=lambda p: True)
    assert covers == (Cover("/home/u", "mask"),)


def test_show_of_a_path_that_does_not_exist_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from egressd.sandbox.layout import plan_layout
    from egressd.session import SessionOptions

    home = tmp_path / "home"
    (home / "proj").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    options = SessionOptions(config_dir=home / ".config" / "egressd")
    with pytest.raises(MountError, match="no such file"):
        plan_layout(options, workdir=str(home / "proj"), rw=[], ro=[], show=["~/later"], environ={})
