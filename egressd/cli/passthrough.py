"""`--passthrough` / `EGRESSD_PASSTHROUGH=1`: run the child without egressd, loudly.

The off switch people expect from a wrapper ("proxy child processes: off") for a command line
they cannot easily change (an editor's agent command, an MCP client's config): the child runs as
if egressd were not there — no proxy, no relay, no sandbox, its environment as egressd got it
less egressd's own `EGRESSD_*` variables. Never silently: a warning on stderr every time, and an
audit record when --audit is given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import click

from egressd.child import process
from egressd.cli.options import fail, say
from egressd.session import SessionOptions

ENV = "EGRESSD_PASSTHROUGH"
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def from_environment(environ: Mapping[str, str]) -> bool:
    """EGRESSD_PASSTHROUGH: 1/true/yes/on turns egressd off; unset, empty, 0/false/no/off do not.
    Anything else is an error: a typo must not decide whether the child is filtered."""
    value = environ.get(ENV, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    fail(f"{ENV}={environ.get(ENV)!r}: expected 1 (run the child without egressd) or 0")


def passthrough_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """--passthrough on the commands that start a child; sets `options.passthrough`."""

    @functools.wraps(func)
    def with_passthrough(*args: Any, passthrough: bool, options: SessionOptions, **kwargs: Any) -> Any:
        on = passthrough or from_environment(os.environ)
        return func(*args, options=dataclasses.replace(options, passthrough=on), **kwargs)

    return click.option(
        "--passthrough",
        is_flag=True,
        help=f"Run CMD WITHOUT egressd (no proxy, no policy, no sandbox), with a warning on stderr "
        f"and an audit record; also {ENV}=1.",
    )(with_passthrough)


def _secret_variables(options: SessionOptions) -> set[str]:
    """The variables the secrets read their values from: the command line's, and the policy's when
    it loads (a policy that does not load hides the command line's only: passthrough needs none)."""
    from egressd.policy import PolicyError
    from egressd.session import base_policy

    specs = list(options.overrides.secrets)
    with contextlib.suppress(PolicyError, OSError):
        specs += list(options.overrides.apply(base_policy(options.policy_file)).secrets)
    return {spec.source.env for spec in specs if spec.source.kind == "env" and spec.source.env}


def run_unwrapped(
    options: SessionOptions, command: Sequence[str], catcher: process.SignalCatcher
) -> NoReturn:
    """Warn, record, run `command` as it is, and exit like it."""
    from egressd.observe.audit import AuditLog

    cause = "--passthrough" if os.environ.get(ENV, "").strip().lower() not in _ON else f"{ENV}=1"
    program = os.path.basename(command[0]) if command else ""
    say(
        f"WARNING: passthrough ({cause}): {program} runs WITHOUT egressd: no proxy, no policy, "
        "no sandbox; its connections are neither decided nor recorded"
    )
    try:
        with AuditLog(options.audit_path) as audit:
            audit.event("passthrough", program=program, cause=cause)
    except OSError as exc:
        fail(f"--audit {options.audit_path}: {exc.strerror or exc}")
    # as egressd got it, less egressd's own configuration and the variables holding the secrets'
    # values (a child meant to get placeholders never gets the real key, egressd or not)
    hidden = _secret_variables(options)
    if hidden:
        say(f"passthrough: the secrets' variables are not given to {program}: {', '.join(sorted(hidden))}")
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.upper().startswith("EGRESSD_") and key not in hidden
    }
    process.exit_like(process.run_child(list(command), env, catcher=catcher), fast=True)
