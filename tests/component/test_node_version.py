"""The child's node is asked its version once per binary, though it is asked early (while the
proxy starts) and again when the child's environment is built: the second asker waits for the
first's answer instead of starting node a second time."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

from egressd.child.client_fixes import ask_node_version, node_version

SLOW_NODE = """#!/bin/sh
echo asked >> "{log}"
sleep 0.5
echo v20.11.1
"""


def _slow_node(tmp_path: Path) -> tuple[dict[str, str], Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "asked"
    node = bin_dir / "node"
    node.write_text(SLOW_NODE.format(log=log))
    node.chmod(node.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin"}, log


def test_asked_early_and_again_node_runs_once(tmp_path: Path) -> None:
    env, log = _slow_node(tmp_path)
    ask_node_version(env)
    assert node_version(env) == (20, 11, 1)
    assert node_version(env) == (20, 11, 1)
    assert log.read_text().splitlines() == ["asked"]


def test_askers_at_once_all_get_the_one_answer(tmp_path: Path) -> None:
    env, log = _slow_node(tmp_path)
    answers: list[object] = []
    threads = [threading.Thread(target=lambda: answers.append(node_version(env))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert answers == [(20, 11, 1)] * 4
    assert log.read_text().splitlines() == ["asked"]


def test_a_node_that_fails_is_asked_once_and_gives_none(tmp_path: Path) -> None:
    env, log = _slow_node(tmp_path)
    node = Path(env["PATH"].split(os.pathsep)[0]) / "node"
    node.write_text(f'#!/bin/sh\necho asked >> "{log}"\nexit 3\n')
    ask_node_version(env)
    assert node_version(env) is None
    assert log.read_text().splitlines() == ["asked"]
