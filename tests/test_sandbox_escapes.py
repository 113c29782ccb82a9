"""A sandboxed child that has read the source tries to get out of `egressd sandbox`.

Each test is one way out that outside testers found or that the same class suggests: descriptors
it inherits, the launcher's pipes, egressd's own code, policy, audit and CA, the user's credentials,
start-up files, other sandboxes' sockets, the host's loopback. Every test goes through the real
command with real bubblewrap, and fails if the way out is open.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.support.egressd_cli import EGRESSD
from tests.test_sandbox_integration import egressd_sandbox, python_inside, sandbox_env

# -- what crosses into the sandbox ------------------------------------------------------------------
WRITE_THROUGH_FDS = """
    import json, os
    wrote = []
    for name in os.listdir("/proc/self/fd"):
        try:
            with open(f"/proc/self/fd/{name}/planted", "w") as f:
                f.write("x")
            wrote.append(name)
        except OSError:
            pass
    print(json.dumps(wrote))
"""


def test_an_inherited_directory_descriptor_does_not_reach_the_child(tmp_path: Path, work: Path) -> None:
    outside = tmp_path / "outside"  # read-only in the sandbox (not the working directory)
    outside.mkdir()
    fd = os.open(outside, os.O_RDONLY | os.O_DIRECTORY)
    try:
        result = subprocess.run(
            [*EGRESSD, "sandbox", "--", *python_inside(WRITE_THROUGH_FDS)],
            cwd=work,
            env=sandbox_env(work),
            capture_output=True,
            timeout=60,
            pass_fds=(fd,),
        )
    finally:
        os.close(fd)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
    assert not (outside / "planted").exists()


def test_a_directory_as_stdin_is_refused(tmp_path: Path, work: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    directory = os.open(outside, os.O_RDONLY | os.O_DIRECTORY)  # as a shell's `cmd < dir` does
    try:
        result = subprocess.run(
            [*EGRESSD, "sandbox", "--", "touch", "ran"],
            cwd=work,
            env=sandbox_env(work),
            stdin=directory,
            capture_output=True,
            timeout=60,
        )
    finally:
        os.close(directory)
    assert result.returncode != 0
    assert not (work / "ran").exists()


FORGE_STATUS = """
    import os
    reached = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            if int(fd) <= 2:  # stdio the child shares anyway (bubblewrap's init holds the same)
                continue
            try:
                with open(f"/proc/{pid}/fd/{fd}", "w") as pipe:
                    pipe.write("error forged by the child\\nexit 0\\n")
                reached.append(f"{pid}/{fd}")
            except OSError:
                pass
    print(reached)
    raise SystemExit(7)
"""


def test_the_child_cannot_forge_the_launchers_status(work: Path) -> None:
    result = egressd_sandbox([], python_inside(FORGE_STATUS), cwd=work)
    assert b"forged" not in result.stderr
    assert result.returncode == 7, result.stderr
    assert result.stdout.strip() == b"[]"
