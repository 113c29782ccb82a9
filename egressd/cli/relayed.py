"""What `egressd acp` and `egressd mcp run` share: run a child like `exec` (or `sandbox` with
--sandbox), with a JSON-RPC relay of egressd's in its stdio for the whole run. Like `exec`, the
child gets a network namespace of its own where it can (Linux): the code they run is chosen by a
model, and a program that ignores the proxy variables must not get out unseen."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import click

from egressd.admission.state import ProxyCredentials
from egressd.agents.wiring import Network
from egressd.child import process
from egressd.child.ssh_env import with_git_ssh
from egressd.cli.options import fail, open_session, say
from egressd.cli.passthrough import run_unwrapped
from egressd.cli.sandbox import run_sandboxed, sandbox_command
from egressd.platform.exits import EXIT_CANNOT_RUN
from egressd.sandbox import netns
from egressd.sandbox.launch import inside_env
from egressd.session import ProxySession, SessionOptions

# (session, the child's credentials, where it runs) -> the relay, entered while the child runs
RelayFactory = Callable[[ProxySession, ProxyCredentials, Network], contextlib.AbstractContextManager[object]]

SANDBOX_FLAG = click.option(
    "--sandbox",
    "sandboxed",
    is_flag=True,
    help="Run the child in egressd's sandbox (see `egressd sandbox`; its options apply).",
)


def with_sandbox_options(command: click.Command) -> click.Command:
    """Give `command` the options `egressd sandbox` has beyond `exec`'s, before its CMD argument."""
    names = {param.name for param in command.params}
    # --dashboard is a session option (exec's too), not one of the sandbox's own; --explain is
    # the sandbox command's alone
    skip = names | {"command", "dashboard", "explain"}
    extra = [p for p in sandbox_command.params if p.name not in skip]
    command.params[-1:-1] = extra
    return command


def run_relayed(
    options: SessionOptions,
    sandboxed: bool,
    command: tuple[str, ...],
    sandbox: dict[str, Any],
    relay: RelayFactory,
) -> NoReturn:
    """Run `command` under the session with `relay` in its stdio; exit like the child."""
    # Before any thread starts: the proxy thread must inherit the blocked signal mask.
    catcher = process.child_signal_catcher().install()
    if options.passthrough:
        run_unwrapped(options, command, catcher)
    if sandboxed:
        run_sandboxed(options, command, catcher, around=lambda s, c: relay(s, c, "sandbox"), **sandbox)
    ctx = click.get_current_context()
    used = [
        f"--{name.replace('_', '-')}"
        for name in sandbox
        if name != "capture_direct"  # exec's too: the child's own network namespace
        and ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)
    ]
    if used:
        fail(f"{', '.join(used)}: sandbox options need --sandbox")
    returncode = EXIT_CANNOT_RUN
    with open_session(options, announce_reloads=options.trace, command=command) as session:
        creds = session.credentials()
        session.record_child(creds, command)
        # the relay must know where the child's MCP servers reach the proxy before the child starts
        inside = netns.wanted(sandbox["capture_direct"], say) and _own_network_here()
        if inside:
            env = inside_env(session, creds, own_loopback=True)
        else:
            env = with_git_ssh(session.child_env(creds=creds), session.policy)
        with relay(session, creds, "own" if inside else "host"):
            if inside:
                outcome = netns.run_in_own_network(session, creds, command, env, catcher=catcher, warn=say)
                if outcome.error:
                    say(f"{command[0]} was not run: {outcome.error}")
                    sys.exit(EXIT_CANNOT_RUN)
                returncode = outcome.returncode
            else:
                returncode = process.run_child(command, env, catcher=catcher)
    process.exit_like(returncode, fast=True)


def _own_network_here() -> bool:
    """Whether the kernel gives the child a network namespace of its own (said once when not)."""
    why = netns.probe()
    if why is not None:
        say(netns.unavailable_message(why))
    return why is None
