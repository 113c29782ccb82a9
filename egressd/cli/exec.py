"""`egressd exec`: run a child with all its traffic going through egressd."""

from __future__ import annotations

import dataclasses

import click

from egressd import process
from egressd.admission import identity
from egressd.cli.options import dashboard_option, open_session, secret_options, session_options
from egressd.exits import EXIT_CANNOT_RUN
from egressd.session import SessionOptions
from egressd.ssh_env import with_git_ssh


@click.command(
    "exec",
    context_settings={"allow_interspersed_args": False},
    epilog="""\b
Example:
  egressd exec --allow registry.npmjs.org -- npm install
  egressd exec --policy npm --trace -- npm ci
  egressd exec --policy agent.yaml --audit audit.jsonl -- my-mcp-server --stdio
  egressd exec --allow api.example.com --secret api=API_KEY \\
      --secret-host api=api.example.com -- my-agent""",
)
@session_options
@dashboard_option
@secret_options
@click.option(
    "--no-credentials-listener",
    "credentials_listener",
    flag_value=False,
    default=True,
    help="No credential-free listener for the child's own processes (EGRESSD_CHILD_PROXY, the "
    "JVM's JAVA_TOOL_OPTIONS): Chromium and Java then get 407. See docs/security.md.",
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- CMD [ARGS]...")
def exec_command(options: SessionOptions, credentials_listener: bool, command: tuple[str, ...]) -> None:
    """Run CMD with all its traffic going through egressd.

    The child's stdin, stdout, stderr, exit status and signals pass through untouched; egressd
    writes nothing to stdout. With --policy FILE, edits to FILE apply to the running child.
    """
    if options.identify is None:  # ~0.3 ms a connection through the child's tree: where it is kept
        recorded = bool(options.audit_path or options.trace or options.dashboard)
        options = dataclasses.replace(options, identify=identity.SUPPORTED and recorded)
    # Before any thread starts: the proxy thread must inherit the blocked signal mask.
    catcher = process.child_signal_catcher().install()
    returncode = EXIT_CANNOT_RUN
    with open_session(options, announce_reloads=options.trace, command=command) as session:
        creds = session.credentials()
        session.record_child(creds, command)
        env = with_git_ssh(session.child_env(creds=creds), session.policy)
        env = session.child_only(env, creds, listener=credentials_listener and identity.SUPPORTED)
        returncode = process.run_child(
            command, env, catcher=catcher, started=lambda pid: session.child_started(creds, pid)
        )
    process.exit_like(returncode, fast=True)
