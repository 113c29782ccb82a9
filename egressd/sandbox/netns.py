"""`exec`, `mcp run` and `acp` on Linux: the child in a network namespace of its own, where the
only way out is egressd, and nothing else of it confined.

Programs that ignore the proxy variables (node's fetch, aiohttp, urllib3's PoolManager, Go with
its own transport, `curl -x ""`) would otherwise reach the network directly, unseen. egressd's
launcher (launcher.py, `--unshare`) makes the namespaces, binds the proxy's listeners on the
namespace's loopback and hands them over, egressd installs the sandbox's capture there from
outside (capture.py), and every connection that skips the proxy is handed to egressd and decided
like any other (front/captured.py). The child keeps the file system, its uid, its process group
and terminal, its signals, and every other descriptor it inherits; see docs/security.md for what
a user namespace changes for it.

Where the kernel refuses the namespaces (unprivileged user namespaces turned off), the launcher
says so before the child starts, and the caller runs the child without them (egressd says so).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from egressd.child.process import SignalCatcher, spawn
from egressd.platform.exits import exec_failure
from egressd.sandbox.bwrap import PROBE_BOOT
from egressd.sandbox.launch import (
    LauncherLink,
    Outcome,
    host_ports,
    inside_env,
    launcher_import_path,
    listens,
    say,
)
from egressd.sandbox.preflight import PROBE_TIMEOUT, USERNS_ENABLE

if TYPE_CHECKING:
    from egressd.admission.credentials import ProxyCredentials
    from egressd.session import ProxySession

RUNNER = "egressd's launcher"


def unavailable_message(why: str) -> str:
    """What egressd says, once, when the child cannot have a network namespace of its own."""
    return (
        f"cannot give the command a network namespace of its own ({why}): programs that ignore the "
        "proxy variables are NOT captured and reach the network directly, unseen by egressd. "
        f"{USERNS_ENABLE} (--no-capture runs without it and without this message.)"
    )


NO_CAPTURE_WARNING = (
    "WARNING: --no-capture: programs that ignore the proxy variables reach the network directly, "
    "neither decided nor recorded by egressd"
)


def wanted(capture: bool, warn: Callable[[str], None]) -> bool:
    """Whether to give the child a network namespace of its own: capture asked, on Linux. Else
    says, once, that programs ignoring the proxy variables are not captured."""
    if not capture:
        warn(NO_CAPTURE_WARNING)
        return False
    if not sys.platform.startswith("linux"):
        warn(
            f"programs that ignore the proxy variables are not captured on {sys.platform}: they reach "
            "the network directly; `egressd sandbox` leaves them no other way out"
        )
        return False
    return True


def run_captured(
    session: ProxySession,
    creds: ProxyCredentials,
    command: Sequence[str],
    catcher: SignalCatcher,
    *,
    capture: bool,
    listener: bool,
    warn: Callable[[str], None] = say,
) -> Outcome | None:
    """exec's child in a network namespace of its own, its connections captured; None when it is
    to run as it is (egressd said why). `listener`: with the credential-free proxy port."""
    if not wanted(capture, warn):
        return None
    env = inside_env(session, creds, open_port=listener, own_loopback=True)
    outcome = run_in_own_network(session, creds, command, env, catcher=catcher, warn=warn)
    if outcome.unavailable:
        warn(unavailable_message(outcome.error or "refused"))
        return None
    return outcome


def probe() -> str | None:
    """Why the child's namespaces cannot be made here, or None when they can: made once, empty,
    by the launcher's own code (for a relay that must know before the child starts)."""
    argv = [sys.executable, "-I", "-S", "-c", PROBE_BOOT, launcher_import_path()]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run {sys.executable}: {exc}"
    if result.returncode == 0:
        return None
    return " ".join((result.stdout or result.stderr).split()) or f"exit status {result.returncode}"


def run_in_own_network(
    session: ProxySession,
    creds: ProxyCredentials,
    command: Sequence[str],
    env: Mapping[str, str],
    *,
    catcher: SignalCatcher,
    warn: Callable[[str], None],
) -> Outcome:
    """Run `command` with `env` (naming the proxy's listeners inside: launch.inside_env) in a network
    namespace of its own, its connections captured; how it ended. `Outcome.unavailable`: the
    kernel refused the namespaces and the command did not run."""
    link = LauncherLink(capture_direct=True)
    try:
        argv = link.command(command, listens(session), unshare=True)
        try:
            # egressd's process group: the terminal's job, as `exec` runs its child
            pid = spawn(argv, env, catcher)
        except OSError as exc:
            return Outcome(exec_failure(argv[0], exc), started=False, error=f"cannot run {argv[0]}")
        finally:
            link.spawned()
        try:
            problem = link.serve(session, creds)
            if problem is None:
                session.child_started(creds, pid)  # its tree holds the connections: searched first
                link.set_up(host_ports(session), warn, all_loopback=True)
        finally:
            link.end_setup()
        session.load()  # the proxy, while the child starts: a client connecting meanwhile waits
        # the child shares egressd's process group: what the terminal sent reached it already
        return link.outcome(link.wait(pid, catcher, forward_all=False), problem, RUNNER)
    finally:
        link.close()
