"""`egressd exec`: run a child with all its traffic going through egressd."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from egressd import process
from egressd.exits import EXIT_CANNOT_RUN
from egressd.session import SessionOptions
from egressd.ssh_env import with_git_ssh

if TYPE_CHECKING:
    pass
from egressd.cli.options import dashboard_option, open_session, session_options
from egressd.cli.passthrough import passthrough_option, run_unwrapped


@click.command(
    "exec",
    context_settings={"allow_interspersed_args": False},
    epilog="""\b
Example:
  egressd exec --allow registry.npmjs.org -- npm install
  egressd exec --policy npm --trace -- npm ci
  egressd exec --policy agent.yaml --audit audit.jsonl -- my-mcp-server --stdio""",
)
@session_options
@dashboard_option
@passthrough_option
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- CMD [ARGS]...")
def exec_command(options: SessionOptions, command: tuple[str, ...]) -> None:
    """Run CMD with all its traffic going through egressd.

    The child's stdin, stdout, stderr, exit status and signals pass through untouched; egressd
    writes nothing to stdout. With --policy FILE, edits to FILE apply to the running child.
    """
    # Before any thread starts: the proxy thread must inherit the blocked signal mask.
    catcher = process.child_signal_catcher().install()
    if options.passthrough:
        run_unwrapped(options, command, catcher)
    returncode = EXIT_CANNOT_RUN
    with open_session(options, announce_reloads=options.trace, command=command) as session:
        creds = session.credentials()
        session.record_child(creds, command)
        env = with_git_ssh(session.child_env(creds=creds), session.policy)
        returncode = process.run_child(command, env, catcher=catcher)
    process.exit_like(returncode, fast=True)
