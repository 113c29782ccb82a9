"""`egressd exec --attach [--pid PID] [--profile P] [--no-capture] -- CMD`: run CMD under an
egressd already running.

For hosts that start many short children (an agent spawning tools), where starting a proxy per
child costs more than the child. This asks the running instance's control API for fresh
credentials (POST /v1/children), puts them in the environment like `exec` does, and replaces
itself with CMD (exec): the child's stdin, stdout, stderr, exit status and signals are its own,
no egressd process stays behind, and the instance revokes the token when this pid exits.

The start-up is the point, so this module imports the standard library, h11 (which reads the
control API's answer) and five small egressd modules only — no click, no policy, no asyncio, no
mitmproxy. `egressd/entry.py` sends a plain `exec --attach ...` command line here before the CLI is
even imported; the `exec` command of the CLI calls `attach` too, for the command lines the quick
parser leaves to click.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from egressd.child.env import stripped_variable
from egressd.child.ssh_env import add_git_ssh
from egressd.control.client import ControlClient, ControlError, find_instances


class AttachError(Exception):
    """Attaching failed; the message is for the user."""


def quick_parse(argv: Sequence[str]) -> tuple[int | None, str | None, list[str], bool] | None:
    """(pid, profile, command, whether --no-capture was given) of `exec --attach [--pid N]
    [--profile P] [--no-capture] -- CMD...`, or None for any other command line (the CLI then
    parses it, and says what is wrong with it)."""
    if len(argv) < 2 or argv[0] != "exec":
        return None
    args, pid, profile, attach, no_capture = list(argv[1:]), None, None, False, False
    while args:
        word = args.pop(0)
        if word == "--":
            break
        name, eq, value = word.partition("=")
        if name in ("--attach", "--no-capture") and not eq:
            attach = attach or name == "--attach"
            no_capture = no_capture or name == "--no-capture"
            continue
        if name not in ("--pid", "--profile"):
            return None
        if not eq:
            if not args:
                return None
            value = args.pop(0)
        if name == "--pid":
            if not value.isdigit():
                return None
            pid = int(value)
        else:
            profile = value
    else:
        return None  # no `--`: leave it to click
    if not attach or not args:
        return None
    return pid, profile, args, no_capture


def instance(pid: int | None) -> ControlClient:
    """The control client of the instance meant: the only one, or the one with this pid."""
    try:
        directory, found = find_instances()
    except ControlError as exc:
        raise AttachError(str(exc)) from None
    if pid is not None:
        for item in found:
            if item.pid == pid:
                return ControlClient(item.path)
        raise AttachError(f"no egressd with pid {pid} is running (control sockets in {directory})")
    if not found:
        raise AttachError(
            f"no egressd is running to attach to (no control socket in {directory}); "
            "start one with `egressd run`"
        )
    if len(found) > 1:
        pids = ", ".join(str(f.pid) for f in found)
        raise AttachError(f"{len(found)} egressd instances are running ({pids}); choose one with --pid")
    return ControlClient(found[0].path)


def child_env(answer: dict[str, object], base: dict[str, str]) -> dict[str, str]:
    """The environment `exec` would give the child: inherited proxy settings, EGRESSD_* variables
    and the variables the instance reads secret values from removed, the instance's variables
    (proxy URLs with this child's token, CA bundle, secrets' placeholders) set, GIT_SSH_COMMAND
    through egressd when its policy may allow SSH."""
    exports, hidden = answer.get("env"), answer.get("hidden", [])
    if not isinstance(exports, dict) or not isinstance(hidden, list):
        raise AttachError("the running egressd answered no environment")
    env = {key: value for key, value in base.items() if not stripped_variable(key) and key not in hidden}
    env.update({str(k): str(v) for k, v in exports.items()})
    return add_git_ssh(env) if answer.get("ssh") else env


def not_captured(program: str) -> str:
    """What an attach says once, unless --no-capture: its child has no network namespace of its
    own, so a user who expects exec's capture learns that it does not hold here."""
    return (
        f"egressd exec --attach: {program} is not captured: programs that ignore the proxy "
        "variables reach the network directly, neither decided nor recorded by egressd (plain "
        "`egressd exec` captures them; --no-capture says you know, and silences this)\n"
    )


def attach(pid: int | None, profile: str | None, command: Sequence[str], no_capture: bool) -> NoReturn:
    """Ask, then exec CMD; exits 126 (EXIT_CANNOT_RUN) with the reason when it cannot attach."""
    try:
        client = instance(pid)
        try:
            answer = client.call("POST", "/v1/children", {"command": list(command), "profile": profile})
        except ControlError as exc:
            raise AttachError(f"the egressd at {client.path} refused to attach: {exc}") from None
        env = child_env(answer, dict(os.environ))
    except AttachError as exc:
        from egressd.platform.exits import EXIT_CANNOT_RUN  # the failure paths only: it imports shutil

        sys.stderr.write(f"egressd exec --attach: {exc}\n")
        sys.stderr.flush()
        os._exit(EXIT_CANNOT_RUN)
    if not no_capture:
        sys.stderr.write(not_captured(os.path.basename(command[0])))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], list(command), env)
    except OSError as exc:
        from egressd.platform.exits import exec_failure

        os._exit(exec_failure(command[0], exc))


def main(argv: Sequence[str]) -> bool:
    """Attach when argv is a plain `exec --attach ...` (never returns then); False otherwise."""
    parsed = quick_parse(argv)
    if parsed is None:
        return False
    attach(*parsed)
