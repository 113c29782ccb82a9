"""`egressd exec`: run a child with all its traffic going through egressd."""

from __future__ import annotations

import dataclasses

import click

from egressd import process
from egressd.cli.options import dashboard_option, fail, open_session, session_options
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
  egressd exec --policy agent.yaml --audit audit.jsonl -- my-mcp-server --stdio""",
)
@session_options
@dashboard_option
@click.option(
    "--attach",
    is_flag=True,
    help="Run CMD under an egressd already running (`egressd run`) instead of starting one: fresh "
    "credentials from its control API, revoked when CMD exits. Takes --pid and --profile only.",
)
@click.option(
    "--pid", type=int, metavar="PID", help="With --attach: the egressd to attach to (when several run)."
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- CMD [ARGS]...")
def exec_command(options: SessionOptions, attach: bool, pid: int | None, command: tuple[str, ...]) -> None:
    """Run CMD with all its traffic going through egressd.

    The child's stdin, stdout, stderr, exit status and signals pass through untouched; egressd
    writes nothing to stdout. With --policy FILE, edits to FILE apply to the running child.
    """
    if attach or pid is not None:
        _attach(options, attach, pid, command)
    # Before any thread starts: the proxy thread must inherit the blocked signal mask.
    catcher = process.child_signal_catcher().install()
    returncode = EXIT_CANNOT_RUN
    with open_session(options, announce_reloads=options.trace, command=command) as session:
        creds = session.credentials()
        session.record_child(creds, command)
        env = with_git_ssh(session.child_env(creds=creds), session.policy)
        returncode = process.run_child(command, env, catcher=catcher)
    process.exit_like(returncode, fast=True)


def _attach(options: SessionOptions, attach: bool, pid: int | None, command: tuple[str, ...]) -> None:
    """--attach: the running instance's policy, listener and audit apply; options that would set up
    a proxy of this command's own are refused rather than silently ignored."""
    from egressd import attach as attaching

    if not attach:
        fail("--pid needs --attach")
    profile = options.overrides.profile
    alone = dataclasses.replace(options, overrides=dataclasses.replace(options.overrides, profile=None))
    if alone.dashboard or alone != SessionOptions(report=alone.report):
        fail("--attach takes only --pid and --profile: the running egressd's policy and options apply")
    attaching.attach(pid, profile, command)
