"""`egressd exec`: run a child with its traffic going through egressd: by the proxy variables, and
(Linux, where user namespaces exist) by capture in a network namespace of its own."""

from __future__ import annotations

import dataclasses
import os

import click

from egressd.child import client_fixes, process
from egressd.child.ssh_env import with_git_ssh
from egressd.cli.options import (
    capture_option,
    dashboard_option,
    fail,
    open_session,
    secret_options,
    session_options,
)
from egressd.cli.passthrough import passthrough_option, run_unwrapped
from egressd.platform import diag
from egressd.platform.exits import EXIT_CANNOT_RUN
from egressd.sandbox import netns
from egressd.session import SessionOptions


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
@passthrough_option
@secret_options
@click.option(
    "--no-credentials-listener",
    "credentials_listener",
    flag_value=False,
    default=True,
    help="No credential-free listener for the child's own processes (EGRESSD_CHILD_PROXY, the "
    "JVM's JAVA_TOOL_OPTIONS): Chromium and Java then get 407. See docs/security.md.",
)
@capture_option
@click.option(
    "--attach",
    is_flag=True,
    help="Run CMD under an egressd already running (`egressd run`) instead of starting one: fresh "
    "credentials from its control API, revoked when CMD exits. Takes --pid, --profile and "
    "--no-capture only. CMD is not captured (egressd says so unless --no-capture).",
)
@click.option(
    "--pid", type=int, metavar="PID", help="With --attach: the egressd to attach to (when several run)."
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- CMD [ARGS]...")
def exec_command(
    options: SessionOptions,
    credentials_listener: bool,
    capture_direct: bool,
    attach: bool,
    pid: int | None,
    command: tuple[str, ...],
) -> None:
    """Run CMD with its connections decided by egressd.

    Programs that use the proxy variables go through egressd's proxy. On Linux CMD also runs in a
    network namespace of its own, where connections of programs that ignore them are captured
    and decided like any other. Where that cannot be (user namespaces turned off, --no-capture,
    not Linux) egressd says so on stderr: such connections then go out unseen, as they do from a
    child started with --attach (docs/exec.md).

    The child's stdin, stdout, stderr, exit status and signals pass through untouched; egressd
    writes nothing to stdout. With --policy FILE, edits to FILE apply to the running child.
    """
    if attach or pid is not None:  # never captured: said unless --no-capture
        _attach(options, attach, pid, command, listener=credentials_listener, capture=capture_direct)
    if options.identify is None:  # a lookup per connection: only where it is kept
        recorded = bool(options.audit_path or options.trace or options.dashboard)
        options = dataclasses.replace(options, identify=diag.SUPPORTED and recorded)
    # Before any thread starts: the proxy thread must inherit the blocked signal mask.
    catcher = process.child_signal_catcher().install()
    if options.passthrough:
        run_unwrapped(options, command, catcher)
    client_fixes.ask_node_version(os.environ)
    returncode = EXIT_CANNOT_RUN
    with open_session(options, announce_reloads=options.trace, command=command, load_later=True) as session:
        creds = session.credentials()
        session.record_child(creds, command)
        captured = netns.run_captured(
            session, creds, command, catcher, capture=capture_direct, listener=credentials_listener
        )
        if captured is not None and captured.error:
            fail(f"{command[0]} was not run: {captured.error}")
        if captured is not None:
            returncode = captured.returncode
        else:
            env = with_git_ssh(session.child_env(creds=creds), session.policy)
            env = session.child_only(env, creds, listener=credentials_listener and diag.SUPPORTED)

            def started(pid: int) -> None:
                session.child_started(creds, pid)
                session.load()  # the proxy, while the child starts: it waits for nothing of it

            returncode = process.run_child(command, env, catcher=catcher, started=started)
    process.exit_like(returncode, fast=True)


def _attach(
    options: SessionOptions,
    attach: bool,
    pid: int | None,
    command: tuple[str, ...],
    *,
    listener: bool,
    capture: bool,
) -> None:
    """--attach: the running instance's policy, listener and audit apply; options that would set up
    a proxy of this command's own are refused rather than silently ignored."""
    from egressd.child import attach as attaching

    if not attach:
        fail("--pid needs --attach")
    profile = options.overrides.profile
    overrides = dataclasses.replace(options.overrides, profile=None)
    # passthrough (EGRESSD_PASSTHROUGH=1) is not an attach's: it runs CMD under the running egressd
    alone = dataclasses.replace(options, overrides=overrides, passthrough=False)
    if not listener or alone.dashboard or alone != SessionOptions(report=alone.report):
        fail(
            "--attach takes only --pid, --profile and --no-capture: the running egressd's policy "
            "and options apply"
        )
    attaching.attach(pid, profile, command, no_capture=not capture)
