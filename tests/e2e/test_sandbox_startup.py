"""What `egressd sandbox` does before its child starts: one bubblewrap, and only the modules that
confining the child and its proxy need.

The child waits for all of egressd's start-up, so what only later steps use waits for them: what
serving a connection needs (the pipeline, the front, the event loop, the resolver: dnspython, and
importlib.metadata that its feature checks read) loads while the child starts, the proxy's
listeners bound before; the exit summary's quarantine and the hints once it ended, Seatbelt's
modules only on macOS, and the launcher's own modules only inside the sandbox; besides, everything
`egressd exec` leaves for later (test_exec_startup.py).

"Before the child starts" is exact: the listing is cut where egressd lets the launcher start the
child (the setup pipe's end, marked on stderr by a wrapper around the real command, which runs
unchanged: tests/support/startup.py); `python -X importtime` lists every module the process
imports, on any thread, on stderr in the order they finish.

Needs bubblewrap, as every sandbox test; runs as root and as a user who is not.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from egressd.platform.exits import EXIT_CANNOT_RUN
from egressd.sandbox.bwrap import LAUNCHER_BOOT
from egressd.sandbox.launch import launcher_import_path
from tests.e2e.test_exec_startup import LATER
from tests.support.egressd_cli import write_policy
from tests.support.sandboxes import egressd_sandbox, python_inside, sandbox_env
from tests.support.startup import (
    MARKED,
    SERVING,
    among,
    broken_h11,
    first_on_path,
    immediate_client,
    loaded_before_the_child,
)
from tests.support.upstreams import EchoHTTPServer

# loaded after the child started, or never (a subpackage listed here stands for all of it)
SANDBOX_LATER = (
    *(name for name in LATER if name != "egressd.cli.sandbox"),
    "dns",  # the resolver: while the child starts
    "egressd.net.dns",
    "importlib.metadata",  # read by dnspython's feature checks only
    "egressd.sandbox.quarantine",  # once the child ended
    "egressd.sandbox.explain",
    "egressd.sandbox.seatbelt",  # macOS
    "egressd.sandbox.sbpl",
    "egressd.sandbox.leftovers",
    "egressd.sandbox.launcher",  # inside the sandbox, in the launcher's own interpreter
    "egressd.sandbox.bridge",
    "egressd.sandbox.intercept",
    "encodings.idna",  # a host that is not plain ASCII; the resolver
    *SERVING,  # what serving needs: while the child starts
)


def test_sandbox_true_loads_nothing_before_the_child_that_only_later_steps_use(
    tmp_path: Path, work: Path
) -> None:
    policy = write_policy(tmp_path)
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", MARKED, "sandbox", "--policy", str(policy), "--", "true"],
        cwd=work,
        env=sandbox_env(work),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    names = loaded_before_the_child(result)
    assert among(names, SANDBOX_LATER) == []
    # what the sandbox needs is there: its command line, the proxy, the capture's rules, the filter
    assert {"egressd.sandbox.runner", "egressd.sandbox.capture", "egressd.sandbox.seccomp"} <= names


def test_a_child_that_connects_at_once_is_served_by_the_pipeline(tmp_path: Path, work: Path) -> None:
    """A client in the sandbox that connects the instant it starts, before the proxy may be loaded,
    waits in the listener's backlog and is admitted as any other: the allowed target answers, the
    other is refused and never reached."""
    with EchoHTTPServer() as allowed, EchoHTTPServer() as refused:
        policy = write_policy(tmp_path, f"version: 1\nloopback: {{allow: true, ports: [{allowed.port}]}}\n")
        child = python_inside(immediate_client(allowed.port, refused.port))
        result = egressd_sandbox(["--policy", str(policy)], child, cwd=work)
        assert result.returncode == 0, result.stderr.decode()[-3000:]
        assert result.stdout.decode().splitlines() == ["200", "403 loopback_port"], result.stderr.decode()
        assert refused.connections == 0


def test_a_proxy_that_cannot_load_stops_the_sandbox_and_says_why(tmp_path: Path, work: Path) -> None:
    """What serving needs loads once the child started: when it cannot (here h11, which the
    pipeline imports, fails to import), the sandboxed child is stopped, never left running without
    its proxy, and egressd says why and fails: that is the only explanation (the child was killed,
    not failing for a file the sandbox hides)."""
    env = sandbox_env(work)
    env = first_on_path(broken_h11(tmp_path), env)
    options = ["--policy", str(write_policy(tmp_path))]
    result = egressd_sandbox(options, ["sh", "-c", "sleep 30; echo survived"], cwd=work, env=env)
    stderr = result.stderr.decode()
    assert result.returncode == EXIT_CANNOT_RUN, stderr[-3000:]
    assert b"survived" not in result.stdout
    assert "the proxy could not start" in stderr and "h11" in stderr, stderr[-3000:]
    assert "--show" not in stderr and "exited with status" not in stderr, stderr[-3000:]


def test_one_bubblewrap_per_run(tmp_path: Path, work: Path) -> None:
    """No empty sandbox is started beside the real one to check that sandboxes work here: the real
    one's failure is explained (test_sandbox_integration.py's refusals)."""
    log = tmp_path / "bwrap.log"
    wrapper = tmp_path / "bin" / "bwrap"
    wrapper.parent.mkdir()
    real = shutil.which("bwrap")
    assert real is not None
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    options = ["--policy", str(write_policy(tmp_path)), "--bwrap", str(wrapper)]
    result = egressd_sandbox(options, ["sh", "-c", "echo inside"], cwd=work)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"inside\n"
    runs = [line for line in log.read_text().splitlines() if line != "--help"]
    assert len(runs) == 1, runs


def test_the_launcher_loads_no_typing_nor_regular_expressions() -> None:
    """The launcher starts between bubblewrap and the child, on every run: it imports the standard
    library's few modules it uses and egressd's small ones, never typing (nor the regular
    expressions, dataclasses and inspect that would come with it), nor contextlib."""
    boot = [sys.executable, "-X", "importtime", "-I", "-S", "-c", LAUNCHER_BOOT, launcher_import_path()]
    result = subprocess.run(boot, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "no command" in result.stderr, result.stderr[-2000:]
    names = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.count("|") == 2}
    assert "egressd.sandbox.launcher" in names
    assert not {"typing", "re", "dataclasses", "inspect", "contextlib"} & names
