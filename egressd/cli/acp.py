"""`egressd acp`: run an ACP agent for an editor, with egressd in the stdio between them."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import click

from egressd.admission.state import ProxyCredentials
from egressd.agents.stdio import StdioRelay
from egressd.agents.wiring import Network, acp_relay
from egressd.cli.options import say, secret_options, session_options
from egressd.cli.passthrough import passthrough_option
from egressd.cli.relayed import SANDBOX_FLAG, run_relayed, with_sandbox_options
from egressd.session import ProxySession, SessionOptions


@with_sandbox_options
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
@secret_options
@SANDBOX_FLAG
@passthrough_option
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- AGENT [ARGS]...")
def acp_command(options: SessionOptions, sandboxed: bool, command: tuple[str, ...], **sandbox: Any) -> None:
    """Run AGENT (an ACP agent on stdio) under egressd, for the editor that started egressd.

    Like `exec` (or `sandbox` with --sandbox): the agent's traffic goes through egressd's
    proxy, its stderr, exit status and signals pass through. Its stdin/stdout are relayed.
    """

    def relay(
        session: ProxySession, creds: ProxyCredentials, network: Network
    ) -> contextlib.AbstractContextManager[object]:
        return acp_relay(session, StdioRelay("acp", say), creds, network=network, warn=say)

    # the editor is where the user answers asks: egressd's own terminal prompt would write into
    # the editor's terminal (a terminal editor) and compete with it for the keyboard
    run_relayed(dataclasses.replace(options, prompt=False), sandboxed, command, sandbox, relay)
