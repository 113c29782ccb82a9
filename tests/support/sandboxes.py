"""Helpers that several test modules use (so none imports another), from the tests of: `egressd
sandbox` with real bubblewrap, real curl and Python inside, real servers outside."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from tests.support.egressd_cli import EGRESSD

BWRAP = "/usr/bin/bwrap"


PY = sys.executable


def egressd_sandbox(
    options: Sequence[str],
    command: Sequence[str],
    *,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float = 60,
    input: bytes | None = None,  # noqa: A002 - mirrors subprocess.run
) -> subprocess.CompletedProcess[bytes]:
    """`egressd sandbox OPTIONS -- COMMAND` run from `cwd` (the sandbox's writable directory)."""
    return subprocess.run(
        [*EGRESSD, "sandbox", *options, "--", *command],
        cwd=cwd,
        env=env if env is not None else sandbox_env(cwd),
        input=input,
        capture_output=True,
        timeout=timeout,
    )


def sandbox_env(tmp: Path) -> dict[str, str]:
    """The test's environment with a private TMPDIR: the relay's socket directory goes there.

    Kept short: a Unix socket path must fit in 107 bytes (a longer TMPDIR falls back to /tmp).
    """
    env = dict(os.environ)
    env["TMPDIR"] = str(tmp / ".t")
    (tmp / ".t").mkdir(exist_ok=True)
    return env


def python_inside(code: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(code)]


