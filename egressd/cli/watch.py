"""`egressd watch`: the decisions of a running egressd as they happen."""

from __future__ import annotations

import json

import click

from egressd.admission.events import Told
from egressd.cli.instances import pid_option, say_follow
from egressd.cli.options import fail
from egressd.control.client import ControlError
from egressd.policy.reasons import is_network_failure


def _line(item: dict, told: Told) -> str | None:
    event = item.get("event")
    if event == "decision":
        if not told.first(item.get("conn"), str(item.get("stage")), bool(item.get("allowed"))):
            return None  # the decision line said it already
        verdict = "allow" if item.get("allowed") else "DENY "
        if not item.get("allowed") and is_network_failure(str(item.get("reason") or "")):
            verdict = "FAIL "  # the network or the upstream failed: nothing was refused
        where = f"{item.get('host')}:{item.get('port')}"
        request = f" {item['method']} {item['path']}" if item.get("path") else ""
        rule = item.get("rule") or "-"
        line = f"{verdict} {item.get('stage'):<10} {where}{request}  {item.get('reason')}  ({rule})"
        if item.get("pid") or item.get("exe"):
            line += f"  [{item.get('exe') or '?'} pid {item.get('pid') or '?'}]"
        if item.get("captured"):
            line += "  captured (the program ignored the proxy variables)"
        return line
    if event == "ask":
        ask_id = item.get("id")
        return f"ASK   {ask_id} {item.get('host')}:{item.get('port')}  (egressd approve {ask_id})"
    if event == "dropped":
        return f"... {item.get('count')} events dropped (this reader was too slow)"
    return None


@click.command(
    "watch",
    epilog="""\b
Example:
  egressd watch
  egressd watch --json --pid 4242""",
    short_help="Show the decisions of every running egressd live.",
)
@pid_option
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Every event as one JSON object per line (with egressd_pid: the egressd that sent it).",
)
def watch_command(pid: int | None, as_json: bool) -> None:
    """Show every decision (and ask) of every egressd running now or started later, as it
    happens, until interrupted; each line starts with the pid of the egressd that made it. With
    --pid, only that one: watch waits for it to start and ends when it does."""
    from egressd.control.follow import Follow
    from egressd.control.prompt import printable

    told = Told()
    try:
        for item in say_follow(Follow("/v1/events", pid), pid):
            if as_json:
                click.echo(json.dumps({**item.data, "egressd_pid": item.pid}))
                continue
            line = _line(item.data, told)
            if line is not None:  # an executable's name is the child's to choose: no escapes
                click.echo(f"{item.pid:>7}  {printable(line)}")
    except ControlError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        pass
