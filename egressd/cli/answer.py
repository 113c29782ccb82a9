"""`egressd approve ID` and `egressd deny ID`: answer a pending ask."""

from __future__ import annotations

import click

from egressd.cli.instances import call, pid_option
from egressd.cli.options import fail
from egressd.control.client import ControlError


def _answer(pid: int | None, ask_id: str, kind: str) -> None:
    """Answer the ask on the instance its ID names — never on whichever egressd happens to run."""
    from egressd.control.follow import client_for_ask

    try:
        client = client_for_ask(ask_id, pid)
    except ControlError as exc:
        fail(str(exc))
    reply = call(client, "POST", f"/v1/asks/{ask_id}", {"answer": kind, "by": "egressd CLI"})
    line = f"{reply['id']}: {reply['answer']} ({reply['released']} waiting released)"
    if reply.get("written"):
        line += f"; {reply['written']}"
    click.echo(line)


@click.command(
    "approve",
    epilog="""\b
Example:
  egressd approve 4242-9f3a-1             # once
  egressd approve 4242-9f3a-1 --always    # and add host:port to the policy file""",
    short_help="Approve a pending ask (once, for this run, or always).",
)
@pid_option
@click.argument("ask_id", metavar="ID")
@click.option(
    "--once", "kind", flag_value="once", default=True, help="This request/connection only (default)."
)
@click.option("--run", "kind", flag_value="run", help="This host:port until egressd exits (not written).")
@click.option("--always", "kind", flag_value="always", help="Add host:port to the policy file's allow list.")
def approve_command(pid: int | None, ask_id: str, kind: str) -> None:
    """Approve the pending ask ID (`egressd pending` lists them): every request waiting on it
    goes on. The ID names its egressd (PID-RANDOM-N): no --pid is needed."""
    _answer(pid, ask_id, kind)


@click.command(
    "deny",
    epilog="""\b
Example:
  egressd deny 4242-9f3a-1
  egressd deny 4242-9f3a-1 --always      # and add host:port to the deny list""",
    short_help="Deny a pending ask (once, or always).",
)
@pid_option
@click.argument("ask_id", metavar="ID")
@click.option(
    "--once", "kind", flag_value="deny", default=True, help="These waiting requests only (default)."
)
@click.option(
    "--always", "kind", flag_value="deny-always", help="Add host:port to the policy file's deny list."
)
def deny_command(pid: int | None, ask_id: str, kind: str) -> None:
    """Deny the pending ask ID: every request waiting on it is refused (ask_refused). The ID names
    its egressd: no --pid is needed."""
    _answer(pid, ask_id, kind)
