"""`egressd pending`: the asks waiting for an answer, in every running egressd."""

from __future__ import annotations

import json
import shlex

import click

from egressd.admission.state import asker
from egressd.cli.instances import call, instances, pid_option, say_follow
from egressd.cli.options import fail
from egressd.control.client import ControlError
from egressd.control.prompt import printable


def ask_line(ask: dict) -> str:
    what = f"{ask['host']}:{ask['port']}"
    if ask.get("method") and ask.get("path"):
        what += f"  {ask['method']} {ask['path']}"
    waiting = ask.get("waiting", 1)
    who = ask.get("asker") or asker(ask.get("client"), ask.get("profile"))
    line = f"{ask['id']}  {what}  ({who}, {waiting} waiting, {ask['expires_in']:g}s left)"
    command = shlex.join(ask.get("command") or [])
    return printable(f"{line}  {command}" if command else line)


@click.command(
    "pending",
    epilog="""\b
Example:
  egressd pending
  egressd pending --interactive      # answer each ask here: o, r, a, d, D
  egressd pending --follow --json    # a script that answers asks reads this""",
    short_help="List the asks waiting for an answer (mode: ask); answer them with --interactive.",
)
@pid_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per ask, one per line.")
@click.option(
    "--follow",
    is_flag=True,
    help="Keep listing asks as they come (and how they end), of every egressd running now or "
    "started later (or of --pid's, waiting for it), until interrupted.",
)
@click.option(
    "-i",
    "--interactive",
    is_flag=True,
    help="Follow and answer each ask on this terminal, as egressd's own prompt does (o = once, "
    "r = this run, a = always, d = deny, D = deny always; then Enter).",
)
def pending_command(pid: int | None, as_json: bool, follow: bool, interactive: bool) -> None:
    """List the asks waiting for an answer (`mode: ask`) in every running egressd (or --pid's);
    answer them with `egressd approve ID` or `egressd deny ID` — an ID names its egressd — or here
    with --interactive. Listing them (or --follow) makes this client an approver: for a while (as
    long as it follows), asks wait for an answer instead of being refused (no_approver)."""
    if interactive:
        if as_json:
            fail("--interactive answers on the terminal; --json is for scripts (use --follow --json)")
        _interactive(pid)
        return
    if follow:
        _follow(pid, as_json)
        return
    for client in instances(pid):
        for ask in call(client, "GET", "/v1/asks")["asks"]:
            click.echo(json.dumps(ask) if as_json else ask_line(ask))


def _follow(pid: int | None, as_json: bool) -> None:
    from egressd.control.follow import Follow

    try:
        follow = Follow("/v1/asks?follow=1", pid)
        for item in say_follow(follow, pid):
            data = item.data
            if as_json:
                click.echo(json.dumps({**data, "egressd_pid": item.pid}))
            elif data.get("event") == "ask":
                click.echo(ask_line(data))
            elif data.get("event") == "waiting":
                click.echo(f"{data.get('id')}  {data.get('waiting')} waiting")
            else:
                answer = f" {data['answer']}" if "answer" in data else ""
                click.echo(f"{data.get('id')}  {data.get('event')}{answer}")
    except ControlError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        pass


def _interactive(pid: int | None) -> None:
    from egressd.control.follow import RemoteAsks
    from egressd.control.prompt import TtyPrompter

    asks = RemoteAsks(pid)
    prompter = TtyPrompter.open(asks, by="egressd pending --interactive")
    if prompter is None:
        fail("--interactive needs a terminal (/dev/tty): none here; use --follow --json and egressd approve")
    prompter.start()
    try:
        for _item in say_follow(asks.items(), pid):
            pass  # the prompter shows and answers them; the follow says who starts and ends
    except ControlError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        pass
    finally:
        prompter.stop()
