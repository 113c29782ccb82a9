"""What the control commands share: finding the running egressd to talk to (`--pid`).

`pending`, `watch`, `approve` and `deny` need no selector: they read every instance (an ask ID
names its own). `grant` and `dashboard` talk to one: with one instance running no selector is
needed; with several, `--pid` picks one and the error lists them. Stale sockets (their egressd is
gone) are removed while looking.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import click

from egressd.cli.options import fail
from egressd.control.client import ControlClient, ControlError, find_instances

if TYPE_CHECKING:
    from egressd.control.follow import Item


def pid_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--pid", type=int, metavar="PID", help="The egressd to talk to (default: see the command's help)."
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


def instances(pid: int | None) -> list[ControlClient]:
    """Every running instance (or --pid's); exits 2 when there is none."""
    try:
        directory, found = find_instances()
    except ControlError as exc:
        fail(str(exc))
    chosen = [ControlClient(f.path) for f in found if pid is None or f.pid == pid]
    if not chosen:
        fail(
            f"no egressd with pid {pid} is running (sockets in {directory})"
            if pid is not None
            else f"no egressd is running (no control socket in {directory})"
        )
    return chosen


def say_follow(items: Iterable[Item], pid: int | None) -> Iterator[Item]:
    """The lines of a follow (egressd.control.follow), saying on stderr which instance is followed
    from when to when, and that it waits while none (or not --pid's) runs."""
    try:
        _directory, found = find_instances()
    except ControlError as exc:
        fail(str(exc))
    if pid is not None and pid not in {f.pid for f in found}:
        click.echo(f"egressd: waiting for the egressd with pid {pid} to start (Ctrl-C stops)", err=True)
    elif not found:
        click.echo("egressd: no egressd is running yet; waiting for one to start (Ctrl-C stops)", err=True)
    for item in items:
        if item.kind == "started":
            command = shlex.join(item.data.get("command") or [])
            click.echo(f"egressd: following egressd {item.pid}{'  ' + command if command else ''}", err=True)
        elif item.kind == "ended":
            click.echo(f"egressd: egressd {item.pid} ended", err=True)
        else:
            yield item
