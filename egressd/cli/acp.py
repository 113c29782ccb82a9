"""`egressd acp`: run an ACP agent for an editor, with egressd in the stdio between them."""

from __future__ import annotations

from typing import Any

import click

from egressd import process
from egressd.agents.stdio import StdioRelay
from egressd.agents.wiring import acp_relay
from egressd.cli.options import fail, open_session, say, session_options
from egressd.cli.sandbox import run_sandboxed, sandbox_command
from egressd.exits import EXIT_CANNOT_RUN
from egressd.session import ProxySession, SessionOptions
from egressd.ssh_env import with_git_ssh


@click.command(
    "acp",
    context_settings={"allow_interspersed_args": False},
    short_help="Run an ACP agent for an editor, its MCP servers and terminals under egressd.",
    epilog="""\b
Example (an editor's agent command):
  egressd acp --policy agent.yaml -- claude-code-acp
  egressd acp --sandbox --policy agent.yaml -- gemini --experimental-acp

\b
Between the editor (egressd's stdin/stdout) and the agent, JSON-RPC passes byte for byte,
except: stdio MCP servers in session/new and session/load get the proxy variables in their
env; http/sse MCP servers the policy refuses are removed (the editor is told why);
terminal/create gets the proxy variables; what egressd refuses is shown in the session.
See docs/acp.md.""",
)
@session_options
@click.option(
    "--sandbox",
    "sandboxed",
    is_flag=True,
    help="Run the agent in egressd's sandbox (see `egressd sandbox`; its options apply).",
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- AGENT [ARGS]...")
def acp_command(options: SessionOptions, sandboxed: bool, command: tuple[str, ...], **sandbox: Any) -> None:
    """Run AGENT (an ACP agent on stdio) under egressd, for the editor that started egressd.

    Like `exec` (or `sandbox` with --sandbox): the agent's traffic goes through egressd's
    proxy, its stderr, exit status and signals pass through. Its stdin/stdout are relayed.
    """
    # Before any thread starts: the proxy thread must inherit the blocked signal mask.
    catcher = process.child_signal_catcher().install()
    if not sandboxed:
        ctx = click.get_current_context()
        used = [
            f"--{name.replace('_', '-')}"
            for name in sandbox
            if ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)
        ]
        if used:
            fail(f"{', '.join(used)}: sandbox options need --sandbox")
        _run_exec(options, command, catcher)
    relay = StdioRelay("acp", say)

    def around(session: ProxySession, creds: Any) -> Any:
        return acp_relay(session, relay, creds, sandboxed=True, warn=say)

    run_sandboxed(options, command, catcher, around=around, **sandbox)


def _run_exec(options: SessionOptions, command: tuple[str, ...], catcher: process.SignalCatcher) -> None:
    returncode = EXIT_CANNOT_RUN
    with open_session(options, announce_reloads=options.trace) as session:
        creds = session.credentials()
        session.record_child(creds, command)
        env = with_git_ssh(session.child_env(creds=creds), session.policy)
        relay = StdioRelay("acp", say)
        with acp_relay(session, relay, creds, sandboxed=False, warn=say):
            returncode = process.run_child(command, env, catcher=catcher)
    process.exit_like(returncode, fast=True)


# `egressd sandbox`'s own options (beyond exec's), taken over unchanged
_EXEC_NAMES = {param.name for param in acp_command.params}
_SANDBOX_PARAMS = [p for p in sandbox_command.params if p.name not in _EXEC_NAMES and p.name != "command"]
acp_command.params[-1:-1] = _SANDBOX_PARAMS  # before the AGENT argument
