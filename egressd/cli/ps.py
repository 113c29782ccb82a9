"""`egressd ps`: the running egressd instances of this user."""

from __future__ import annotations

import json
import shlex

import click

from egressd.cli.options import fail
from egressd.control.client import ControlClient, ControlError, find_instances


@click.command(
    "ps",
    epilog="""\b
Example:
  egressd ps
  egressd ps --json | jq .counts""",
    short_help="List the running egressd instances: pid, mode, counts, policy, command.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per instance, one per line.")
def ps_command(as_json: bool) -> None:
    """List the running egressd instances of this user: pid, command, policy, mode and counts
    (decisions allowed/refused, asks pending, grants, open connections)."""
    try:
        directory, found = find_instances()
    except ControlError as exc:
        fail(str(exc))
    rows = []
    for instance in found:
        try:
            rows.append(ControlClient(instance.path, timeout=5).call("GET", "/v1/info"))
        except ControlError as exc:
            rows.append({"pid": instance.pid, "error": str(exc)})
    if as_json:
        for row in rows:
            click.echo(json.dumps(row))
        return
    if not rows:
        click.echo(f"no egressd running (control sockets in {directory})", err=True)
        return
    click.echo(f"{'PID':>7}  {'MODE':7}  {'ALLOWED':>7}  {'REFUSED':>7}  {'PENDING':>7}  POLICY  COMMAND")
    for row in rows:
        if "error" in row:
            click.echo(f"{row['pid']:>7}  ?  {row['error']}")
            continue
        counts = row.get("counts", {})
        numbers = "  ".join(f"{counts.get(k, 0):>7}" for k in ("allowed", "refused", "pending"))
        command = shlex.join(row.get("command") or [])
        click.echo(f"{row['pid']:>7}  {row['mode']:7}  {numbers}  {row['policy']}  {command}")
