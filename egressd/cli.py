"""The `egressd` command line: thin click commands that parse, call the library and print.

stdout is sacred in `exec` (it belongs to the child); every egressd message goes to stderr with
an `egressd:` prefix. Exit codes: `exec` exits like its child; egressd's own set-up failures
(bad policy, bad option, proxy cannot start) exit 2 without running anything.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import ipaddress
import os
import re
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NoReturn

import click

from egressd import __version__, process
from egressd.policy import (
    Client,
    Decision,
    Policy,
    PolicyError,
    TargetError,
    builtin_policy_path,
    decide,
    filter_addresses,
    load_policy,
    parse_target,
    resolution_refusal,
)
from egressd.policy.dump import policy_to_data
from egressd.policy.model import MODES
from egressd.session import Overrides, ProxySession, SessionError, SessionOptions, base_policy
from egressd.ssh_env import with_git_ssh

if TYPE_CHECKING:
    from egressd.engine import EgressProxy

EXIT_USAGE = 2
DRAIN_TIMEOUT = 10.0
_PRESET_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")
_CONTEXT: dict[str, Any] = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _mitmproxy_version() -> str:
    try:
        return importlib.metadata.version("mitmproxy")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """`--version`: the package metadata is read only when asked (it costs ~40 ms at start)."""
    if not value or ctx.resilient_parsing:
        return
    click.echo(f"egressd {__version__} (mitmproxy {_mitmproxy_version()})")
    ctx.exit()


def _say(message: str) -> None:
    """One line to stderr, prefixed: the only place egressd talks while a child runs."""
    click.echo(f"egressd: {message}", err=True)


def _fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    _say(message)
    sys.exit(code)


# -- policy loading shared by exec / run / check / policy show ---------------------------------
def effective_policy(policy_file: str | None, overrides: Overrides) -> Policy:
    try:
        return overrides.apply(base_policy(policy_file))
    except PolicyError as exc:
        _fail(str(exc))


def _with_options(func: Callable[..., Any], options: Sequence[Callable[..., Any]]) -> Callable[..., Any]:
    for option in reversed(options):
        func = option(func)
    return func


def policy_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--policy/--allow/--deny/--mode/--nameserver, identical on every command that decides."""
    options = [
        click.option(
            "--policy",
            "policy_file",
            metavar="FILE",
            help="Policy file (YAML/JSON) or a built-in preset name (default, npm, pypi, github). "
            "Default: the built-in default policy (loopback only).",
        ),
        click.option("--allow", multiple=True, metavar="RULE", help="Add an allow rule (repeatable)."),
        click.option("--deny", multiple=True, metavar="RULE", help="Add a deny rule (repeatable)."),
        click.option(
            "--mode", type=click.Choice(MODES), help="Override the mode (beats the file and EGRESSD_MODE)."
        ),
        click.option(
            "--nameserver",
            "nameservers",
            multiple=True,
            metavar="IP[:PORT]",
            help="Resolve names with this DNS server instead of the system's (repeatable).",
        ),
    ]
    return _with_options(func, options)


def proxy_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--profile/--audit/--trace/--listen, identical on every command that runs the proxy."""
    options = [
        click.option("--profile", metavar="NAME", help="Issue the child's credentials for this profile."),
        click.option(
            "--audit", "audit_path", metavar="FILE", help="Append one JSON line per decision to FILE."
        ),
        click.option("--trace", is_flag=True, help="One human line per decision on stderr."),
        click.option(
            "--listen",
            default="127.0.0.1:0",
            show_default=True,
            metavar="HOST:PORT",
            help="Loopback listen address.",
        ),
    ]
    return _with_options(func, options)


def inspection_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--no-inspect/--upstream-ca: TLS inspection for the hosts whose rules need it."""
    options = [
        click.option(
            "--no-inspect",
            is_flag=True,
            help="Never intercept TLS: hosts admitted only for some paths are refused (needs_inspection).",
        ),
        click.option(
            "--upstream-ca",
            multiple=True,
            metavar="FILE",
            type=click.Path(exists=True, dir_okay=False),
            help="Also trust this CA (PEM) for upstream certificates of intercepted hosts (repeatable).",
        ),
    ]
    return _with_options(func, options)


def _overrides(
    allow: Sequence[str],
    deny: Sequence[str],
    mode: str | None,
    nameservers: Sequence[str],
    profile: str | None,
) -> Overrides:
    return Overrides(tuple(allow), tuple(deny), mode, tuple(nameservers), profile)


def _pop_session_options(params: dict[str, Any]) -> SessionOptions:
    """Take what the three option groups parsed out of a command's parameters, as one value."""
    names = ("allow", "deny", "mode", "nameservers", "profile")
    overrides = _overrides(*(params.pop(name) for name in names))
    return SessionOptions(
        policy_file=params.pop("policy_file"),
        overrides=overrides,
        listen=parse_listen(params.pop("listen")),
        audit_path=params.pop("audit_path"),
        trace=params.pop("trace"),
        inspect=not params.pop("no_inspect"),
        upstream_ca=tuple(params.pop("upstream_ca")),
    )


def session_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """@policy_options, @proxy_options and @inspection_options, handed to the command as one
    SessionOptions argument named `options` (every command that runs a proxy for a child)."""

    @functools.wraps(func)
    def with_options(*args: Any, **kwargs: Any) -> Any:
        return func(*args, options=_pop_session_options(kwargs), **kwargs)

    return policy_options(proxy_options(inspection_options(with_options)))


@contextlib.contextmanager
def _session(options: SessionOptions, **kwargs: Any) -> Iterator[ProxySession]:
    """A started ProxySession; any set-up failure exits 2 with the reason on stderr."""
    try:
        session = ProxySession(options, say=_say, **kwargs)
        session.start()
    except SessionError as exc:
        _fail(str(exc))
    try:
        yield session
    finally:
        session.close()


def parse_listen(text: str) -> tuple[str, int]:
    """`HOST:PORT`, `[::1]:PORT` or `PORT`; the host must be loopback (children are local)."""
    host, port_text = "127.0.0.1", text
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or text[end + 1 : end + 2] != ":":
            raise click.BadParameter(f"{text!r}: expected [IPv6]:PORT", param_hint="--listen")
        host, port_text = text[1:end], text[end + 2 :]
    elif ":" in text:
        host, _, port_text = text.rpartition(":")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise click.BadParameter(f"{text!r}: port must be 0-65535", param_hint="--listen")
    if host == "localhost":
        host = "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise click.BadParameter(f"{text!r}: host must be an IP address", param_hint="--listen") from None
    if not address.is_loopback:
        raise click.BadParameter(
            f"{text!r}: egressd listens on loopback only (127.0.0.0/8 or ::1). Its proxy is for "
            "processes on this machine; a listener on another interface would let any host on the "
            "network use your allowlist.",
            param_hint="--listen",
        )
    return str(address), int(port_text)


# -- commands ------------------------------------------------------------------------------------
@click.group(
    context_settings=_CONTEXT,
    epilog="""\b
Example:
  egressd exec --allow registry.npmjs.org -- npm install
  egressd check https://evil.test/
  egressd policy validate policy.yaml""",
)
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the version and exit.",
)
def cli() -> None:
    """egressd: an egress-filtering forward proxy for child processes.

    Every connection the child makes through egressd is decided against one policy: the
    allowlist, the loopback allowance and the built-in allowances. Refusals say why.
    """


@cli.command(
    "exec",
    context_settings={"allow_interspersed_args": False},
    epilog="""\b
Example:
  egressd exec --allow registry.npmjs.org -- npm install
  egressd exec --policy npm --trace -- npm ci
  egressd exec --policy agent.yaml --audit audit.jsonl -- my-mcp-server --stdio""",
)
@session_options
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- CMD [ARGS]...")
def exec_command(options: SessionOptions, command: tuple[str, ...]) -> None:
    """Run CMD with all its traffic going through egressd.

    The child's stdin, stdout, stderr, exit status and signals pass through untouched; egressd
    writes nothing to stdout. With --policy FILE, edits to FILE apply to the running child.
    """
    # Before any thread starts: the proxy thread must inherit the blocked signal mask.
    catcher = process.child_signal_catcher().install()
    returncode = process.EXIT_CANNOT_RUN
    with _session(options, announce_reloads=options.trace) as session:
        env = with_git_ssh(session.child_env(), session.policy)
        returncode = process.run_child(command, env, catcher=catcher)
    process.exit_like(returncode, fast=True)


@cli.command(
    "run",
    short_help="Run the proxy in the foreground; print the proxy settings for children.",
    epilog="""\b
Example:
  egressd run --policy policy.yaml > egressd.env &
  . ./egressd.env && npm install
  kill -HUP %1     # reload policy.yaml now (edits are also picked up by themselves)
  kill %1          # drain: in-flight connections get 10 s, then egressd exits""",
)
@session_options
def run_command(options: SessionOptions) -> None:
    """Run the proxy until SIGTERM/SIGINT; print the `export` lines a child needs.

    stdout gets only the export lines (then is closed, so `$(...)` and pipes see EOF); status
    goes to stderr. The policy file is reloaded when it changes and on SIGHUP; a file that fails
    to load is reported and the last good policy stays in force.
    """
    stops = (signal.SIGINT, signal.SIGTERM)
    catcher = process.SignalCatcher((*stops, signal.SIGHUP)).install()
    with _session(options, announce_reloads=True) as session:
        for key, value in session.exports().items():
            click.echo(f"export {key}={shlex.quote(value)}")
        _close_stdout()
        assert session.proxy is not None
        host, port = session.proxy.http_address
        where = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        socks_note = (
            f", SOCKS5 on port {session.proxy.socks_address[1]}" if session.proxy.socks_address else ""
        )
        profile = options.overrides.profile
        profile_note = f"; profile: {profile}" if profile else ""
        policy = session.policy
        click.echo(
            f"# egressd listening on {where}{socks_note}; policy: {policy.source} (mode: {policy.mode})"
            f"{profile_note}. SIGHUP reloads; SIGTERM or Ctrl-C drains and exits.",
            err=True,
        )
        _serve(catcher, session, stops)
        _say(f"draining (up to {DRAIN_TIMEOUT:g}s for open connections)")
        _drain(session.proxy, catcher, stops)
    _say("stopped")
    sys.exit(0)


def _close_stdout() -> None:
    """After the exports, stdout is done: point fd 1 at /dev/null so readers see EOF."""
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _serve(catcher: process.SignalCatcher, session: ProxySession, stops: Sequence[int]) -> None:
    while True:
        got = catcher.wait(1.0)
        if got is None:
            continue
        if got.signo in stops:
            return
        if not session.reload_now():
            _say("SIGHUP: no --policy file to reload")


def _drain(proxy: EgressProxy, catcher: process.SignalCatcher, stops: Sequence[int]) -> None:
    """drain() in a thread so a second SIGTERM/Ctrl-C can still cut it short."""
    worker = threading.Thread(target=proxy.drain, args=(DRAIN_TIMEOUT,), name="egressd-drain", daemon=True)
    worker.start()
    while worker.is_alive():
        got = catcher.wait(0.2)
        if got is not None and got.signo in stops:
            _say("second signal: stopping now")
            proxy.stop()
            return


@cli.command(
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
@click.argument("target")
def check_command(
    policy_file: str | None,
    allow: tuple[str, ...],
    deny: tuple[str, ...],
    mode: str | None,
    nameservers: tuple[str, ...],
    profile: str | None,
    method: str | None,
    resolve: bool,
    target: str,
) -> None:
    """Decide TARGET (a URL or HOST[:PORT], port 443 by default) without connecting.

    Prints allow/deny, the reason code, the rule and the detail. Without --resolve no network
    request at all is made: a name the policy allows is reported as needing resolution.
    """
    policy = effective_policy(policy_file, _overrides(allow, deny, mode, nameservers, profile))
    try:
        parsed = parse_target(target, default_port=443)
    except (TargetError, ValueError) as exc:
        _fail(f"bad target: {exc}")
    if method:
        parsed = replace(parsed, method=method.upper())
    decision = decide(parsed, Client(profile=profile), policy)
    notes: list[str] = []
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


def _check_resolution(decision: Decision, policy: Policy, notes: list[str]) -> Decision:
    from egressd.cli_resolve import ResolveError, resolve_sync

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


# -- egressd policy ...-------------------------------------------------------------------------
@cli.group(
    "policy",
    epilog="""\b
Example:
  egressd policy validate policy.yaml policies/*.yaml
  egressd policy show --allow api.github.com
  egressd policy path npm""",
)
def policy_group() -> None:
    """Validate, show and locate policies."""


@policy_group.command(
    "validate",
    epilog="""\b
Example:
  egressd policy validate policy.yaml
  egressd policy validate policies/*.yaml""",
)
@click.argument("files", nargs=-1, required=True, metavar="FILE...")
def policy_validate(files: tuple[str, ...]) -> None:
    """Check policy files: one line per file; exit 1 if any is bad."""
    bad = 0
    for name in files:
        try:
            policy = load_policy(name)
        except PolicyError as exc:
            bad += 1
            click.echo(" ".join(str(exc).split()))
            continue
        click.echo(
            f"{name}: ok (mode {policy.mode}, {len(policy.allow.rules)} allow, "
            f"{len(policy.deny.rules)} deny, {len(policy.profiles)} profiles)"
        )
    sys.exit(1 if bad else 0)


@policy_group.command(
    "show",
    epilog="""\b
Example:
  egressd policy show
  egressd policy show policy.yaml --allow example.com --mode ask""",
)
@click.argument("file", required=False)
@click.option("--allow", multiple=True, metavar="RULE", help="Add an allow rule (repeatable).")
@click.option("--deny", multiple=True, metavar="RULE", help="Add a deny rule (repeatable).")
@click.option("--mode", type=click.Choice(MODES), help="Override the mode.")
@click.option("--nameserver", "nameservers", multiple=True, metavar="IP[:PORT]", help="DNS server override.")
def policy_show(
    file: str | None,
    allow: tuple[str, ...],
    deny: tuple[str, ...],
    mode: str | None,
    nameservers: tuple[str, ...],
) -> None:
    """Print the effective policy (FILE or the built-in default, plus overrides) as YAML."""
    import yaml

    policy = effective_policy(file, _overrides(allow, deny, mode, nameservers, None))
    click.echo(f"# effective policy from {policy.source}")
    click.echo(yaml.safe_dump(policy_to_data(policy), sort_keys=False, allow_unicode=True), nl=False)


@policy_group.command(
    "path",
    epilog="""\b
Example:
  egressd policy path default
  cp "$(egressd policy path npm)" my-policy.yaml""",
)
@click.argument("name")
def policy_path(name: str) -> None:
    """Print the path of the built-in preset NAME."""
    try:
        click.echo(str(builtin_policy_path(name)))
    except PolicyError as exc:
        _fail(str(exc))


@cli.group(
    "ca",
    short_help="egressd's certificate authority for TLS inspection.",
    epilog="""\b
Example:
  egressd ca path            # the CA certificate to trust (created on first need)
  egressd ca rotate          # a new CA key and certificate""",
)
def ca_group() -> None:
    """The CA egressd signs intercepted connections with; its key never leaves EGRESSD_HOME/ca."""


@ca_group.command("path", epilog="\b\nExample:\n  curl --cacert \"$(egressd ca path)\" ...")
def ca_path() -> None:
    """Print the path of the CA certificate (no key), creating the CA when there is none yet."""
    from egressd import ca

    try:
        click.echo(str(ca.ensure_ca(ca.config_dir())))
    except ca.CAError as exc:
        _fail(str(exc))


@ca_group.command("rotate", epilog="\b\nExample:\n  egressd ca rotate && egressd ca path")
def ca_rotate() -> None:
    """Replace the CA; children started afterwards trust only the new certificate."""
    from egressd import ca

    try:
        path = ca.rotate_ca(ca.config_dir())
    except ca.CAError as exc:
        _fail(str(exc))
    _say(f"new CA certificate: {path}")


from egressd.cli_sandbox import sandbox_command  # noqa: E402  (it builds on the options above)

cli.add_command(sandbox_command)

from egressd.cli_ssh import register as _register_ssh  # noqa: E402  (it builds on the options above)

_register_ssh(cli)


def main() -> None:
    """Console-script entry point (`egressd`, `python -m egressd`)."""
    cli.main(prog_name="egressd")
