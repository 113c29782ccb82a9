"""`egressd sandbox`: `exec`, but the proxy is the only way out (bubblewrap / Seatbelt).

Thin: parse, check the platform, call egressd.sandbox, exit like the child.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import click

from egressd.admission.state import ProxyCredentials
from egressd.child import client_fixes, process
from egressd.cli.options import (
    capture_option,
    dashboard_option,
    fail,
    open_session,
    say,
    secret_options,
    session_options,
)
from egressd.cli.passthrough import passthrough_option, run_unwrapped
from egressd.platform.exits import EXIT_CANNOT_RUN
from egressd.policy import PolicyError
from egressd.sandbox import exit_summary, hooks, narrow, preflight
from egressd.sandbox.layout import Layout, hide_more, option_links, pinned_options, plan_layout
from egressd.sandbox.mounts import MountError, within
from egressd.sandbox.runner import Outcome, needed_paths, run_bwrap, run_seatbelt
from egressd.sandbox.shields import PRIVATE
from egressd.sandbox.sources import SourceError, SourceGuard, source_files
from egressd.session import ProxySession, SessionOptions, base_policy

SERVE_HELP = (
    "macOS: let the child listen on this port of the loopback (repeatable); by default it listens "
    "on none (a page in your browser could reach it). Linux: the child's loopback is its own."
)
# What --env-clear keeps: what a program needs to find itself and print text.
KEPT_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "LANG", "TZ")


def child_base_env(environ: Mapping[str, str], passed: Sequence[str]) -> dict[str, str]:
    """--env-clear: the kept variables, LC_*, and the --pass-env names that are set."""
    return {
        name: value
        for name, value in environ.items()
        if name in KEPT_ENV or name.startswith("LC_") or name in passed
    }


@click.command(
    "sandbox",
    context_settings={"allow_interspersed_args": False},
    short_help="Run CMD in a sandbox whose only way out is egressd's proxy.",
    epilog="""\b
Example:
  egressd sandbox --policy npm -- npm ci
  egressd sandbox --policy agent.yaml --only api.example.com --cache ~/.cache/agent -- python agent.py
  egressd sandbox --allow github.com:22 -- git clone ssh://git@github.com/org/repo

\b
Inside: / read-only, the working directory and --rw paths writable (never your home or a
system directory), private /tmp and /run, its own network with only loopback. Your home is
empty but for the working directory, --rw/--ro/--show paths and a few harmless configuration
files (--explain lists them). egressd's code, presets, policy and audit stay read-only; your
credentials, the secrets' source files and egressd's CA key are hidden. HTTP(S)_PROXY points
at a loopback port inside the sandbox that leads to egressd's proxy; TCP connections that
ignore it (and their DNS) are captured and decided by the same proxy; nothing else gets out.
127.0.0.1/localhost through the proxy is the HOST's loopback, on the ports the policy names
only. See docs/sandbox.md.""",
)
@session_options
@dashboard_option
@passthrough_option
@secret_options
@click.option("--rw", multiple=True, metavar="PATH", help="Also writable in the sandbox (repeatable).")
@click.option(
    "--ro",
    multiple=True,
    metavar="PATH",
    help="Read-only even inside a writable path, or shown although under the private /tmp or /run "
    "(repeatable).",
)
@click.option(
    "--hide",
    multiple=True,
    metavar="PATH",
    help="Also hidden from the child (empty inside), like the credentials hidden by default (repeatable).",
)
@click.option(
    "--show",
    multiple=True,
    metavar="PATH",
    help="Let the child read PATH in your home (hidden by default), or one of the credentials "
    "hidden even where the home is shown, read-only (repeatable; egressd warns).",
)
@click.option(
    "--explain",
    is_flag=True,
    help="Print what the child would see, read and write (shown, hidden, writable) and exit; nothing is run.",
)
@click.option(
    "--rw-home",
    is_flag=True,
    help="Allow the working directory or a --rw path to be your home directory or hold it.",
)
@click.option(
    hooks.ALLOW_FLAG,
    "allow_project_hooks",
    is_flag=True,
    help="Let the child write the project's hooks: .git/hooks, .git/config, .envrc, editor and agent "
    "settings (.vscode, .claude, ...), which run code outside the sandbox later (egressd warns).",
)
@click.option(
    "--env-clear",
    is_flag=True,
    help="Start the child's environment empty but for PATH, HOME, USER, LOGNAME, SHELL, TERM, LANG, "
    "LC_*, TZ and the --pass-env names (egressd's proxy variables are always set).",
)
@click.option(
    "--pass-env",
    multiple=True,
    metavar="NAME",
    help="With --env-clear: also pass this variable of egressd's environment (repeatable).",
)
@click.option(
    "--cache",
    metavar="DIR",
    help="Keep the child's npm, uv, pip and XDG caches in DIR (an existing directory, writable) to "
    "reuse them; by default each sandbox gets a fresh private cache.",
)
@click.option(
    "--allow-loopback-port",
    "loopback_ports",
    multiple=True,
    type=click.IntRange(1, 65535),
    metavar="PORT",
    help="Let the child reach this port of the host's loopback through the proxy (repeatable); "
    "inside the sandbox only these and the policy's loopback.ports are reachable.",
)
@click.option("--serve", multiple=True, type=click.IntRange(1, 65535), metavar="PORT", help=SERVE_HELP)
@click.option(
    "--only",
    multiple=True,
    metavar="RULE",
    help="Narrow the policy: the child reaches only hosts matching these rules, and only if the "
    "policy (and --profile) allows them too (repeatable).",
)
@capture_option
@click.option(
    "--bwrap",
    "bwrap_path",
    metavar="PATH",
    help="The bubblewrap binary (default: $EGRESSD_BWRAP, else bwrap on PATH). Linux only.",
)
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="-- CMD [ARGS]...")
def sandbox_command(options: SessionOptions, command: tuple[str, ...], explain: bool, **params: Any) -> None:
    """Run CMD confined: its only way out is egressd's proxy, decided by the policy.

    Same options, stdio, signals and exit status as `exec`. --only and --profile narrow the
    policy (a host must pass both); --allow and --deny edit the policy, as in `exec`. Without
    bubblewrap (Linux) or Seatbelt (macOS) it stops with what to install; it never runs CMD
    unconfined.
    """
    if explain:
        explain_sandbox(options, **params)
    if not command:
        fail("a command to run is required: egressd sandbox [OPTIONS] -- CMD [ARGS]...")
    # Before any thread starts: the proxy thread must inherit the blocked signal mask.
    catcher = process.child_signal_catcher().install()
    if options.passthrough:
        run_unwrapped(options, command, catcher)
    run_sandboxed(options, command, catcher, **params)


# What a command wrapping the sandboxed child (`egressd acp --sandbox`) does around it: entered with
# the started session and the child's credentials just before the child starts, left after it ended.
Around = Callable[[ProxySession, ProxyCredentials], contextlib.AbstractContextManager[object]]


def run_sandboxed(
    options: SessionOptions,
    command: tuple[str, ...],
    catcher: process.SignalCatcher,
    *,
    rw: tuple[str, ...],
    ro: tuple[str, ...],
    hide: tuple[str, ...],
    show: tuple[str, ...],
    rw_home: bool,
    allow_project_hooks: bool,
    env_clear: bool,
    pass_env: tuple[str, ...],
    cache: str | None,
    loopback_ports: tuple[int, ...],
    only: tuple[str, ...],
    capture_direct: bool,
    bwrap_path: str | None,
    serve: tuple[int, ...] = (),
    around: Around | None = None,
) -> NoReturn:
    """Everything `egressd sandbox` does after parsing; exits like the child."""
    if pass_env and not env_clear:
        fail("--pass-env works with --env-clear (without it the child gets egressd's whole environment)")
    planning = {"rw": rw, "ro": ro, "hide": hide, "show": show, "rw_home": rw_home, "cache": cache}
    options, layout = _planned(options, allow_project_hooks=allow_project_hooks, **planning)
    try:
        only_rules = narrow.parse_only(only)
    except PolicyError as exc:
        fail(str(exc))
    for path in layout.shown:
        say(f"warning: --show {path}: the sandboxed command can read it")
    if allow_project_hooks:
        say(
            f"warning: {hooks.ALLOW_FLAG}: the sandboxed command can write the project's git hooks and "
            "configuration, .envrc, editor and agent settings, which run code outside the sandbox later"
        )
    env_base = child_base_env(os.environ, pass_env) if env_clear else None
    client_fixes.ask_node_version(os.environ if env_base is None else env_base)
    bwrap, disable_userns, sandbox_exec = "", True, ""
    try:
        if sys.platform == "linux":
            writable = [os.path.realpath(os.getcwd()), *(m.path for m in layout.mounts if m.writable)]
            bwrap = preflight.locate_bwrap(bwrap_path, writable=writable)
            disable_userns = preflight.supports_disable_userns(bwrap)
        elif sys.platform == "darwin":
            sandbox_exec = preflight.locate_sandbox_exec()
        else:
            fail(f"egressd sandbox runs on Linux (bubblewrap) and macOS (Seatbelt), not {sys.platform}")
    except preflight.SandboxUnavailable as exc:
        fail(str(exc))
    if serve and not sandbox_exec:
        fail("--serve is for macOS: on Linux the sandbox's loopback is its own, unreachable from outside")
    narrowing = narrow.Narrowing(only_rules, options.overrides.profile) if only_rules else None
    outcome = Outcome(EXIT_CANNOT_RUN, started=False)
    # the secrets' source files are hidden once the policy that names them is loaded
    guard = SourceGuard(then=narrow.LoopbackConfinement(loopback_ports, then=narrowing))
    # the resolver loads as the child starts (run_bwrap, run_seatbelt)
    opened = open_session(
        options, announce_reloads=options.trace, transform=guard, command=command, load_later=True
    )
    with opened as session:
        try:
            layout = guard.fix(lambda files: hide_more(layout, files))
        except (MountError, SourceError) as exc:
            fail(str(exc))
        creds = session.credentials(narrowing.profile if narrowing else None)
        session.record_child(creds, command)
        with around(session, creds) if around is not None else contextlib.nullcontext():
            if bwrap:
                outcome = run_bwrap(
                    session,
                    creds,
                    command,
                    layout,
                    env_base=env_base,
                    bwrap=bwrap,
                    disable_userns=disable_userns,
                    catcher=catcher,
                    capture_direct=capture_direct,
                    warn=say,
                    # the sandbox gone, the proxy serves nobody: unless a wrapping command (`acp
                    # --sandbox`) still uses the session, its load is given up there
                    ended=session.give_up_load if around is None else None,
                )
            else:
                outcome = run_seatbelt(
                    session,
                    creds,
                    command,
                    layout,
                    env_base=env_base,
                    sandbox_exec=sandbox_exec,
                    catcher=catcher,
                    serve=serve,
                )
        if not outcome.error:
            # said before the session closes, so its summary of refusals stays the last line
            for line in left_behind(layout):
                say(line)
            from egressd.sandbox.explain import home_hint  # once the child ended

            # a child the proxy's failed load stopped has that failure as its only explanation
            # (open_session says it): the home it could not read is not why
            hint = home_hint(layout, command, outcome.returncode, os.environ.get("PATH"))
            if hint and options.report and session.failure is None:
                say(hint)
    if outcome.unavailable:  # no sandbox can run here: why, and the fix
        fail(outcome.error or "bubblewrap cannot create a sandbox here")
    if outcome.error:
        say(f"the sandbox did not start: {outcome.error}; {command[0]} was not run")
        sys.exit(2)
    process.exit_like(outcome.returncode, fast=True)  # the session is closed: audit flushed


def left_behind(layout: Layout) -> list[str]:
    """The exit summary: what the run created or changed that runs code later (exit_summary.py)."""
    if layout.before is None:
        return []
    from egressd.sandbox import quarantine  # once the child ended: nothing before needs it

    registry = hooks.registry_of(layout.own_home)
    # the stand-ins of sandboxes still running in the project (its own too, while they hold them)
    # are egressd's, not what the child left: none appears or vanishes while this looks
    with hooks.registry_lock(registry):
        after = exit_summary.walk(layout.before.roots)
        ignore = [p.path for p in layout.placeholders]
        found = exit_summary.changes(layout.before, after, ignore)
        found = [c for c in found if not hooks.stands(registry, c.path)]
    taken: list[quarantine.Taken] = []
    if layout.quarantine:
        taken = quarantine.after_run(
            layout.before,
            after,
            found,
            writable=[m.path for m in layout.mounts if m.writable],
            protected=[path for path, _ in layout.hooks],
            later=layout.later,
        )
        found = [c for c in found if not any(within(c.path, t.path) for t in taken)]
    cwd = os.getcwd()
    return quarantine.summary(taken, cwd) + exit_summary.summary(found, after, cwd=cwd)


def _planned(
    options: SessionOptions,
    *,
    rw: tuple[str, ...],
    ro: tuple[str, ...],
    hide: tuple[str, ...],
    show: tuple[str, ...],
    rw_home: bool,
    cache: str | None,
    allow_project_hooks: bool,
    **_others: object,
) -> tuple[SessionOptions, Layout]:
    """The options with the policy and audit paths pinned, and the sandbox's layout (exit 2 with
    the fix when the options cannot be honoured)."""
    try:
        links = option_links(options)  # before pinning: which symlinks the paths go through
        options = pinned_options(options)
    except PolicyError as exc:  # no such preset
        fail(str(exc))
    try:
        layout = plan_layout(
            options,
            workdir=os.getcwd(),
            rw=rw,
            ro=ro,
            hide=hide,
            show=show,
            rw_home=rw_home,
            cache=cache,
            links=links,
            private=PRIVATE if sys.platform != "darwin" else (),
            project_hooks=not allow_project_hooks,
        )
    except (MountError, PolicyError) as exc:
        fail(str(exc))
    return options, layout


def explain_sandbox(options: SessionOptions, **params: Any) -> NoReturn:
    """--explain: the layout the options give, with the secrets' sources the policy names, printed;
    nothing runs (no proxy, no secret read, no command)."""
    options, layout = _planned(options, **params)
    try:
        policy = options.overrides.apply(base_policy(options.policy_file))
        files = source_files(policy.secrets)
        layout = hide_more(layout, {p: what for p, what in files.items() if os.path.exists(p)})
    except (MountError, PolicyError) as exc:
        fail(str(exc))
    from egressd.sandbox.explain import explain

    kind = "seatbelt" if sys.platform == "darwin" else "bubblewrap"
    click.echo(explain(layout, needed_paths(None), workdir=os.getcwd(), kind=kind), nl=False)
    sys.exit(0)
