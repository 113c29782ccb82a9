"""Workload 7, second half: `egressd exec --attach -- true` beside `egressd exec -- true`.

An attached child asks a running `egressd run` for its credentials over the control API and execs
the command: no proxy, no policy, no engine start-up of its own. Measured against the same `true`
run directly; the report prints the ratio to `exec -- true` (workload 7's main row).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from bench import system
from bench.model import Metric
from bench.peers import DIRECT, EGRESSD, EGRESSD_EXTRA_ENV, VENV_BIN

WORKLOAD = "7. egressd exec -- true"


@contextlib.contextmanager
def running_egressd(env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """`egressd run` in the background until its control socket answers."""
    run_dir = Path(env["EGRESSD_HOME"]) / "run"
    proc = subprocess.Popen(
        [str(VENV_BIN / "egressd"), "run", "--quiet"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        deadline = time.monotonic() + 30
        sock = run_dir / f"{proc.pid}.sock"
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"egressd run did not start (exit {proc.poll()})")
            time.sleep(0.05)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def exec_attach(work: Path, cpu: int | None, repeats: int, runs: int) -> list[Metric]:
    """The metrics; `cpu`: the core egressd's commands are pinned to (None: not pinned)."""
    main = Metric(
        "w7.attach",
        WORKLOAD,
        "`egressd exec --attach -- true` wall time, an `egressd run` already running (direct: `true`)",
        "s",
        "lower",
        ratio_to_direct=False,
    )
    imports = Metric(
        "w7.import_attach", WORKLOAD, "`python -c 'import egressd.child.attach'`", "s", "lower", main=False
    )
    env = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY")}
    env.update(EGRESSD_EXTRA_ENV)
    home = work / "attach-home"
    home.mkdir(parents=True, exist_ok=True)
    env["EGRESSD_HOME"] = str(home)  # its own run directory: exactly one instance to attach to
    attach = system.pinned([str(VENV_BIN / "egressd"), "exec", "--attach", "--", "true"], cpu)
    true = system.which("true") or "/bin/true"
    py = str(VENV_BIN / "python")
    try:
        with running_egressd(env):
            with contextlib.suppress(subprocess.CalledProcessError):
                system.wall(attach, env)  # the first attach also waits for the control API's import
            for run in range(repeats):
                try:
                    for _ in range(runs):
                        main.add(EGRESSD, system.wall(attach, env))
                        main.add(DIRECT, system.wall([true]))
                    argv = system.pinned([py, "-c", "import egressd.child.attach"], cpu)
                    imports.add(EGRESSD, statistics.median(system.wall(argv, env) for _ in range(3)))
                except subprocess.CalledProcessError as e:
                    main.note(f"run {run + 1} failed: {e}")
                    main.unavailable(EGRESSD, f"error: {e}")
    except RuntimeError as e:
        main.unavailable(EGRESSD, f"error: {e}")
    attached, alone = main.median(EGRESSD), main.median(DIRECT)
    if attached is not None and alone is not None:
        main.extra["overhead_s"] = round(attached - alone, 4)
    return [main, imports]
