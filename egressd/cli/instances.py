"""What the control commands share: finding the running egressd to talk to (`--pid`).

With one instance running no selector is needed; with several, `--pid` picks one and the error
lists them. Stale sockets (their egressd is gone) are removed while looking.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import Any

import click

from egressd.cli.options import fail
from egressd.control.client import ControlClient, ControlError, find_instances


def pid_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--pid", type=int, metavar="PID", help="The egressd to talk to (needed when several run)."
    )(func)


def describe(client: ControlClient) -> str:
    """`PID  COMMAND` of one instance, for lists in errors."""
    try:
        info = client.call("GET", "/v1/info")
    except ControlError:
        return f"{client.path.stem}  (not answering)"
    return f"{info.get('pid')}  {shlex.join(info.get('command') or [])}"


def select(pid: int | None) -> ControlClient:
    """The client of the one instance meant; exits 2 with the reason otherwise."""
    try:
        directory, found = find_instances()
    except ControlError as exc:
        fail(str(exc))
    if pid is not None:
        for instance in found:
            if instance.pid == pid:
                return ControlClient(instance.path)
        fail(f"no egressd with pid {pid} is running (sockets in {directory})")
    if not found:
        fail(f"no egressd is running (no control socket in {directory})")
    if len(found) > 1:
        listing = "\n".join(f"  {describe(ControlClient(f.path))}" for f in found)
        fail(f"{len(found)} egressd instances are running; choose one with --pid:\n{listing}")
    return ControlClient(found[0].path)


def call(client: ControlClient, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
    try:
        return client.call(method, url, body)
    except ControlError as exc:
        fail(str(exc), code=1)
