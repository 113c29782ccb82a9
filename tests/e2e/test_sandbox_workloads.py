"""Everyday set-ups that used to break inside `egressd sandbox`: a $TMPDIR under /tmp, a virtual
environment under /tmp, pyenv's shims. Each through the real command, as the user who runs the
tests (CI runs them as an ordinary user too).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.egressd_cli import EGRESSD
from tests.support.sandboxes import egressd_sandbox, sandbox_env


@pytest.fixture
def in_tmp() -> Iterator[Path]:
    """A directory of the host's /tmp (the sandbox has a /tmp of its own)."""
    path = Path("/tmp") / f"egressd-test-{uuid.uuid4().hex[:12]}"
    path.mkdir(mode=0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_tmpdir_under_tmp_works_inside(in_tmp: Path, work: Path) -> None:
    """A $TMPDIR the host has under /tmp (pam_tmpdir's, a CI runner's) does not exist in the
    sandbox's own /tmp: inside, the temporary directory is that private /tmp, and mktemp works."""
    env = sandbox_env(work)
    env["TMPDIR"] = str(in_tmp / "user-tmp")
    (in_tmp / "user-tmp").mkdir()
    script = 'f=$(mktemp) && echo "$f" && ls -ld "$TMPDIR"'
    result = egressd_sandbox([], ["sh", "-c", script], cwd=work, env=env)
    assert result.returncode == 0, result.stderr
    made, _listing = result.stdout.decode().splitlines()
    assert made.startswith("/tmp/tmp.")
    assert list((in_tmp / "user-tmp").iterdir()) == []  # nothing reached the host's


def test_a_venv_under_tmp_is_the_python_the_command_runs(in_tmp: Path, work: Path) -> None:
    venv = in_tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    env = sandbox_env(work)
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv}/bin:{env['PATH']}"
    script = "import sys; print(sys.prefix); open(sys.prefix + '/planted', 'w')"
    result = egressd_sandbox([], ["python", "-c", script], cwd=work, env=env)
    assert result.stdout.decode().splitlines()[:1] == [str(venv)], result.stderr
    assert b"Read-only file system" in result.stderr  # shown, not writable
    assert not (venv / "planted").exists()


def test_a_program_under_tmp_is_named_with_the_way_to_show_it(in_tmp: Path, work: Path) -> None:
    tool = in_tmp / "bin" / "tool"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\necho ran\n")
    tool.chmod(0o755)
    env = sandbox_env(work)
    env["PATH"] = f"{tool.parent}:{env['PATH']}"
    result = egressd_sandbox([], ["tool"], cwd=work, env=env)
    assert result.returncode == 127
    assert f"tool is {tool}, in the sandbox's own empty /tmp or /run".encode() in result.stderr
    assert f"--ro {tool.parent} shows it".encode() in result.stderr
    shown = egressd_sandbox(["--ro", str(tool.parent)], ["tool"], cwd=work, env=env)
    assert shown.returncode == 0 and shown.stdout == b"ran\n", shown.stderr


def _pyenv() -> Path | None:
    """The pyenv installation egressd's own Python may come from (pyenv's code, read-only)."""
    for root in (Path(sys.base_prefix).parents[1], Path.home() / ".pyenv"):
        if (root / "libexec" / "pyenv").is_file():
            return root
    return None


@pytest.mark.skipif(_pyenv() is None, reason="pyenv is not installed")
def test_pyenv_rehash_works_inside_and_never_writes_the_users_shims(shared_tmpdir: Path, work: Path) -> None:
    """A pyenv of the test's own (pyenv's code, one version: egressd's Python), outside /tmp so
    the sandbox shows it read-only as it shows a user's ~/.pyenv."""
    real = _pyenv()
    assert real is not None
    root = shared_tmpdir / "pyenv"
    for part in ("libexec", "pyenv.d", "bin"):
        shutil.copytree(real / part, root / part, symlinks=True)
    (root / "versions").mkdir()
    version = Path(sys.base_prefix).name
    (root / "versions" / version).symlink_to(sys.base_prefix)
    env = sandbox_env(work)
    env.update(PYENV_ROOT=str(root), PYENV_VERSION=version)
    subprocess.run([str(root / "bin" / "pyenv"), "rehash"], env=env, check=True, timeout=60)
    before = sorted(p.name for p in (root / "shims").iterdir())
    assert "python" in before
    env["PATH"] = f"{root}/shims:{root}/bin:{env['PATH']}"
    script = (
        'pyenv rehash && python -c "import sys; print(sys.base_prefix)" && touch "$PYENV_ROOT/shims/planted"'
    )
    result = subprocess.run(
        [*EGRESSD, "sandbox", "--", "sh", "-c", script], cwd=work, env=env, capture_output=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert b"cannot rehash" not in result.stderr
    assert result.stdout.decode().strip() == str(root / "versions" / version)  # through the shim
    assert sorted(p.name for p in (root / "shims").iterdir()) == before  # the user's shims: untouched
