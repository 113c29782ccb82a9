"""`egressd pending`: the asks waiting for an answer."""

from __future__ import annotations

import json

import click

from egressd.cli.instances import call, pid_option, select
from egressd.control.client import ControlError


def ask_line(ask: dict) -> str:
    what = f"{ask['host']}:{ask['port']}"
    if ask.get("method") and ask.get("path"):
        what += f"  {ask['method']} {ask['path']}"
    waiting = ask.get("waiting", 1)
    client = ask.get("client") or "-"
    return f"{ask['id']}  {what}  (client {client}, {waiting} waiting, {ask['expires_in']:g}s left)"


@click.command(
    "pending",
    epilog="""\b
Example:
  egressd pending
  egressd pending --follow --json   # a script that answers asks reads this""",
    short_help="List the asks waiting for an answer (mode: ask).",
)
@pid_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per ask, one per line.")
@click.option(
    "--follow", is_flag=True, help="Keep listing asks as they come (and how they end), until interrupted."
)
def pending_command(pid: int | None, as_json: bool, follow: bool) -> None:
    """List the asks of a running egressd (`mode: ask`) waiting for an answer; answer them with
    `egressd approve ID` or `egressd deny ID`. Listing them (or --follow) makes this client an
    approver: for a while, asks wait for an answer instead of being refused (no_approver)."""
    client = select(pid)
    if not follow:
        for ask in call(client, "GET", "/v1/asks")["asks"]:
            click.echo(json.dumps(ask) if as_json else ask_line(ask))
        return
    try:
        for item in client.stream("/v1/asks?follow=1"):
            if item.get("event") == "keepalive":
                continue
            if as_json:
                click.echo(json.dumps(item))
            elif item.get("event") == "ask":
                click.echo(ask_line(item))
            else:
                click.echo(
                    f"{item['id']}  {item['event']}{' ' + str(item['answer']) if 'answer' in item else ''}"
                )
    except ControlError as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        pass
