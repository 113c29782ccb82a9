"""`egressd check`: decide a target without connecting."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import replace

import click

from egressd.cli.options import cli_overrides, effective_policy, fail, first_policy, policy_options
from egressd.policy import (
    Client,
    Decision,
    Policy,
    Program,
    TargetError,
    decide,
    filter_addresses,
    parse_target,
    resolution_refusal,
)


@click.command(
    "check",
    short_help="Decide a URL or HOST[:PORT] against the policy, without connecting.",
    epilog="""\b
Example:
  egressd check https://registry.npmjs.org/react
  egressd check --policy policy.yaml api.github.com:443
  egressd check --allow up.test --resolve up.test

\b
Exit status: 0 allowed, 1 refused, 2 bad input.""",
)
@policy_options
@click.option("--profile", metavar="NAME", help="Decide as a child running under this profile.")
@click.option("--method", metavar="METHOD", help="HTTP method for path rules (default GET).")
@click.option("--resolve", is_flag=True, help="Also resolve a name and apply the address rules (uses DNS).")
@click.option(
    "--exe",
    metavar="PROGRAM",
    help="Decide as if this program (a name, or a path: its symlinks are followed) opened the "
    "connection, for allow rules scoped by exe.",
)
@click.argument("target")
def check_command(
    policy_file: tuple[str, ...],
    allow: tuple[str, ...],
    deny: tuple[str, ...],
    mode: str | None,
    nameservers: tuple[str, ...],
    profile: str | None,
    method: str | None,
    resolve: bool,
    exe: str | None,
    target: str,
) -> None:
    """Decide TARGET (a URL or HOST[:PORT], port 443 by default) without connecting.

    Prints allow/deny, the reason code, the rule and the detail. Without --resolve no network
    request at all is made: a name the policy allows is reported as needing resolution.
    """
    overrides = cli_overrides(allow, deny, mode, nameservers, profile, policy_file)
    policy = effective_policy(first_policy(policy_file), overrides)
    try:
        parsed = parse_target(target, default_port=443)
    except (TargetError, ValueError) as exc:
        fail(f"bad target: {exc}")
    if method:
        parsed = replace(parsed, method=method.upper())
    decision = decide(parsed, Client(profile, _program(exe)), policy)
    notes: list[str] = []
    if exe is None and policy.needs_program:
        notes.append(
            "note: egressd check runs no program: rules scoped by exe admit nothing here; "
            "--exe PROGRAM decides as that program"
        )
    if decision.allowed and decision.needs_resolution:
        if resolve:
            decision = _check_resolution(decision, policy, notes)
        else:
            notes.append(
                f"note: {parsed.host.text} is a name: egressd resolves it when connecting and drops "
                "always-refused, private and loopback addresses; --resolve checks that now (uses DNS)"
            )
    if decision.ask:
        notes.append("note: mode ask: an approver would be asked; without one this is refused")
    _print_decision(decision, parsed.authority() + (parsed.path or ""), notes)
    sys.exit(0 if decision.allowed else 1)


def _program(exe: str | None) -> Program | None:
    """--exe: a name as given; a path with its symlinks followed, like the running program's exe."""
    if exe is None:
        return None
    if "/" not in exe:
        return Program(exe)
    from egressd.platform.peer import aliases

    real = os.path.realpath(exe)
    return Program(real, aliases(real) | {exe})


def _check_resolution(decision: Decision, policy: Policy, notes: list[str]) -> Decision:
    from egressd.cli.resolve import ResolveError, resolve_sync

    assert decision.target is not None
    name = decision.target.host.text
    try:
        addresses = resolve_sync(
            name, nameservers=policy.resolver.nameservers, timeout=policy.limits.dns_timeout
        )
    except ResolveError as exc:
        return replace(decision, allowed=False, reason=exc.reason, detail=str(exc), needs_resolution=False)
    kept, verdicts = filter_addresses(decision, addresses, policy)
    for verdict in verdicts:
        state = "kept" if verdict.kept else "dropped"
        notes.append(f"resolved: {verdict.address} ({verdict.klass.value}) {state}: {verdict.why}")
    if not kept:
        return resolution_refusal(decision, verdicts)
    return replace(decision, addresses=tuple(kept), needs_resolution=False)


def _print_decision(decision: Decision, target: str, notes: Sequence[str]) -> None:
    click.echo("allow" if decision.allowed else "deny")
    click.echo(f"target: {target}")
    click.echo(f"reason: {decision.reason}")
    click.echo(f"rule: {decision.rule or '-'}")
    if decision.detail:
        click.echo(f"detail: {decision.detail}")
    for note in notes:
        click.echo(note)
