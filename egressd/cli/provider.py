"""`egressd provider`: list, show, add and remove provider presets in a policy file."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TextIO

import click

from egressd.cli.options import fail
from egressd.tools.providers import (
    Provider,
    ProviderError,
    acknowledge,
    acknowledged,
    provider,
    providers,
    user_file,
)


@click.group(
    "provider",
    epilog="""\b
Example:
  egressd provider list
  egressd provider show anthropic
  egressd provider add anthropic --policy agent.yaml
  egressd provider remove anthropic --policy agent.yaml""",
)
def provider_group() -> None:
    """Provider presets: the hosts a service uses, acknowledged into your policy file."""


@provider_group.command(
    "list",
    epilog="""\b
Example:
  egressd provider list
  egressd provider list --policy agent.yaml""",
)
@click.option(
    "--policy", "policy_file", metavar="FILE", help="Also mark the providers this file acknowledges."
)
def provider_list(policy_file: str | None) -> None:
    """One line per provider preset: name, version, what it is (and whether FILE acknowledges it)."""
    acks = {}
    if policy_file is not None:
        try:
            acks = {a.name: a for a in acknowledged(policy_file).providers}
        except ProviderError as exc:
            fail(str(exc))
    for item in providers():
        mark = ""
        if item.info.name in acks:
            ack = acks[item.info.name]
            mark = f"  [acknowledged {ack.acknowledged}, version {ack.version}]"
            if ack.version != item.info.version:
                mark += f" (preset is now version {item.info.version}: add it again to review)"
        click.echo(f"{item.info.name:<12} v{item.info.version}  {item.info.summary}{mark}")


def _describe(item: Provider) -> list[str]:
    lines = [f"{item.info.name} (preset version {item.info.version}): {item.info.summary}", "hosts:"]
    lines += [f"  {host}" for host in item.hosts]
    if item.policy.loopback.ports:
        lines.append(f"loopback ports: {', '.join(map(str, item.policy.loopback.ports))}")
    lines.append(f"what goes there: {item.info.sends}")
    lines.append(
        "egressd decides where the child may connect, not what it sends: anything the child can "
        "read may be sent to these hosts."
    )
    return lines


@provider_group.command(
    "show",
    epilog="""\b
Example:
  egressd provider show huggingface""",
)
@click.argument("name")
def provider_show(name: str) -> None:
    """The hosts of provider NAME, what data goes there, and where the preset lives."""
    try:
        item = provider(name)
    except ProviderError as exc:
        fail(str(exc))
    for line in _describe(item):
        click.echo(line)
    click.echo(f"preset: {item.path}")


@contextlib.contextmanager
def _terminal() -> Iterator[tuple[TextIO, TextIO] | None]:
    """(input, output) of the user's terminal: /dev/tty, else stdin/stderr when stdin is one."""
    try:
        tty = open("/dev/tty", "r+", encoding="utf-8")  # noqa: SIM115 - closed below
    except OSError:
        tty = None
    if tty is not None:
        with tty:
            yield tty, tty
        return
    if sys.stdin is not None and sys.stdin.isatty():
        yield sys.stdin, sys.stderr
        return
    yield None


def _confirm(question: str) -> bool:
    with _terminal() as terminal:
        if terminal is None:
            fail("no terminal to confirm on (neither /dev/tty nor stdin); read the above and pass --yes")
        given, shown = terminal
        shown.write(question + " [y/N] ")
        shown.flush()
        answer = given.readline().strip().lower()
    return answer in ("y", "yes")


@provider_group.command(
    "add",
    epilog="""\b
Example:
  egressd provider add anthropic --policy agent.yaml
  egressd provider add github --policy agent.yaml --yes""",
)
@click.argument("name")
@click.option(
    "--policy",
    "policy_file",
    required=True,
    metavar="FILE",
    help="The policy file to write (created from the default policy if missing).",
)
@click.option("--yes", is_flag=True, help="Acknowledge without asking (what goes where is still printed).")
def provider_add(name: str, policy_file: str, yes: bool) -> None:
    """Show provider NAME's hosts and what goes there, ask, then allow them in FILE and record the
    acknowledgement (provider, hosts, day, preset version). A running egressd reloads FILE."""
    try:
        item = provider(name)
        user_file(policy_file)  # before asking: a preset is never the file written
        acknowledged_now = _loads_or_missing(policy_file)
    except ProviderError as exc:
        fail(str(exc))
    for line in _describe(item):
        click.echo(f"egressd: {line}", err=True)
    if acknowledged_now is not None and acknowledged_now.get(name) == item.info.version:
        click.echo(
            f"egressd: {name} version {item.info.version} is already acknowledged in {policy_file}", err=True
        )
    if not yes and not _confirm(f"Allow these hosts in {policy_file}?"):
        fail("not acknowledged; nothing changed", 1)
    try:
        added = acknowledge(policy_file, item)
    except ProviderError as exc:
        fail(str(exc))
    kept = [h for h in item.hosts if h not in added]
    click.echo(
        f"egressd: {name} acknowledged in {policy_file}: added {', '.join(added) or 'nothing new'}", err=True
    )
    if kept:
        click.echo(f"egressd: already allowed there: {', '.join(kept)}", err=True)


def _loads_or_missing(policy_file: str) -> dict[str, int] | None:
    """The file's acknowledged providers (name -> version); None when the file does not exist yet."""
    if not os.path.exists(policy_file):
        return None
    return {a.name: a.version for a in acknowledged(policy_file).providers}


@provider_group.command(
    "remove",
    epilog="""\b
Example:
  egressd provider remove anthropic --policy agent.yaml""",
)
@click.argument("name")
@click.option("--policy", "policy_file", required=True, metavar="FILE", help="The policy file to edit.")
def provider_remove(name: str, policy_file: str) -> None:
    """Withdraw provider NAME from FILE: its acknowledgement, and the hosts its add wrote that no
    other acknowledged provider needs. Rules you wrote yourself stay."""
    from egressd.tools.providers import withdraw

    try:
        removed = withdraw(policy_file, name)
    except ProviderError as exc:
        fail(str(exc))
    click.echo(
        f"egressd: {name} removed from {policy_file}: {', '.join(removed) or 'no host removed'}", err=True
    )
