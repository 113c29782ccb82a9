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
  egressd ps --json | jq '.[].counts'""",
    short_help="List the running egressd instances: pid, mode, counts, policy, command.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON array, one object per instance.")
def ps_command(as_json: bool) -> None:
    """List the running egressd instances of this user: pid, command, policy (absolute paths),
    mode and counts (decisions allowed/refused, asks pending, grants, open connections)."""
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
        click.echo(json.dumps(rows))
        return
    if not rows:
        click.echo(f"no egressd running (control sockets in {directory})", err=True)
        return
    for line in table(rows):
        click.echo(line)


COLUMNS = ("PID", "MODE", "ALLOWED", "REFUSED", "PENDING", "POLICY", "COMMAND")
NUMERIC = frozenset({"PID", "ALLOWED", "REFUSED", "PENDING"})


def table(rows: list[dict]) -> list[str]:
    """The rows under their headings, every column as wide as its widest cell (numbers to the
    right); the last column runs free. An instance that did not answer says why instead."""
    cells = []
    for row in rows:
        if "error" in row:
            cells.append([str(row["pid"]), "?", "", "", "", "", row["error"]])
            continue
        counts = row.get("counts", {})
        cells.append(
            [
                str(row["pid"]),
                str(row.get("mode", "?")),
                *(str(counts.get(k, 0)) for k in ("allowed", "refused", "pending")),
                str(row.get("policy", "")),
                shlex.join(row.get("command") or []),
            ]
        )
    widths = [max(len(c[i]) for c in [list(COLUMNS), *cells]) for i in range(len(COLUMNS))]

    def line(values: list[str]) -> str:
        parts = [
            v.rjust(w) if name in NUMERIC else v.ljust(w)
            for name, v, w in zip(COLUMNS[:-1], values[:-1], widths[:-1], strict=True)
        ]
        return "  ".join([*parts, values[-1]]).rstrip()

    return [line(list(COLUMNS)), *(line(c) for c in cells)]
