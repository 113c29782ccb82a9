"""Options, messages and the session every command that runs a proxy shares.

stdout is sacred in `exec` (it belongs to the child); every egressd message goes to stderr with
an `egressd:` prefix. egressd's own set-up failures (bad policy, bad option, proxy cannot start)
exit 2 without running anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import ipaddress
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import click

from egressd.platform.exits import EXIT_CANNOT_RUN
from egressd.policy import (
    Policy,
    PolicyError,
)
from egressd.policy.model import MODES
from egressd.policy.ports import port_number
from egressd.policy.secrets import secrets_from_options
from egressd.session import (
    Overrides,
    ProxySession,
    SessionError,
    SessionOptions,
    base_policy,
)

if TYPE_CHECKING:
    from egressd.session.gateway_options import GatewayOptions, ListenerTLS


EXIT_USAGE = 2
DRAIN_TIMEOUT = 10.0
CONTEXT: dict[str, Any] = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def say(message: str) -> None:
    """One line to stderr, prefixed: the only place egressd talks while a child runs."""
    click.echo(f"egressd: {message}", err=True)


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    say(message)
    sys.exit(code)


# -- policy loading shared by exec / run / check / policy show ---------------------------------
def effective_policy(policy_file: str | None, overrides: Overrides) -> Policy:
    try:
        return overrides.apply(base_policy(policy_file))
    except PolicyError as exc:
        fail(str(exc))


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
            multiple=True,
            metavar="FILE",
            help="Policy file (YAML/JSON) or a built-in preset name (npm, github, anthropic, ...: "
            "`egressd provider list`). Repeatable: the policies are merged, deny wins "
            "(docs/providers.md). Default: the built-in default policy (loopback only).",
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
            "--quiet",
            "-q",
            is_flag=True,
            help="No line per refused host on stderr, and no summary of them when the child exits.",
        ),
        click.option(
            "--metrics",
            "metrics",
            metavar="HOST:PORT",
            help="Serve Prometheus metrics at http://HOST:PORT/metrics (loopback; port 0 = any free "
            "port, printed on stderr). See docs/metrics.md.",
        ),
        click.option(
            "--metrics-any",
            is_flag=True,
            help="Allow --metrics on a non-loopback address (other machines can then read them).",
        ),
        click.option(
            "--metrics-token-file",
            metavar="FILE",
            help="--metrics answers only requests with `Authorization: Bearer TOKEN`, TOKEN the "
            "content of FILE (read at start).",
        ),
        click.option(
            "--upstream-proxy",
            metavar="URL",
            help="Send admitted connections through this parent proxy (http://HOST:PORT, HTTP "
            "CONNECT); credentials 'user:password' from EGRESSD_UPSTREAM_PROXY_CREDENTIALS. "
            "See docs/upstream-proxy.md.",
        ),
        click.option(
            "--identify/--no-identify",
            default=None,
            help="Record each connection's program (pid, exe) in the audit, watch and dashboard "
            "(Linux; default: on for exec with --audit, --trace or --dashboard, else off). Rules "
            "scoped by exe look it up either way. See docs/audit.md.",
        ),
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


def approval_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--approve-all/--no-prompt: who answers the asks of `mode: ask`."""
    options = [
        click.option(
            "--approve-all",
            is_flag=True,
            help="Approve every ask at once, asking nobody (explicit only; egressd warns on stderr).",
        ),
        click.option(
            "--no-prompt",
            is_flag=True,
            help="Never ask on the terminal (/dev/tty); asks go to the control API only.",
        ),
    ]
    return _with_options(func, options)


def cli_overrides(
    allow: Sequence[str],
    deny: Sequence[str],
    mode: str | None,
    nameservers: Sequence[str],
    profile: str | None,
    policies: Sequence[str] = (),
) -> Overrides:
    """The command line's additions; `policies` are the --policy values after the first."""
    return Overrides(tuple(allow), tuple(deny), mode, tuple(nameservers), profile, tuple(policies[1:]))


def first_policy(policies: Sequence[str]) -> str | None:
    """The first --policy: the file egressd watches and edits (asks answered "always")."""
    return policies[0] if policies else None


def _pop_session_options(params: dict[str, Any]) -> SessionOptions:
    """Take what the three option groups parsed out of a command's parameters, as one value."""
    names = ("allow", "deny", "mode", "nameservers", "profile")
    policies = params.pop("policy_file")
    overrides = cli_overrides(*(params.pop(name) for name in names), policies)
    overrides = dataclasses.replace(overrides, upstream_proxy=params.pop("upstream_proxy"))
    metrics_text, metrics_any = params.pop("metrics"), params.pop("metrics_any")
    metrics = None
    if metrics_text is not None:
        metrics = parse_metrics_address(metrics_text, any_address=metrics_any)
    elif metrics_any:
        raise click.BadParameter("--metrics-any needs --metrics HOST:PORT", param_hint="--metrics-any")
    metrics_token = params.pop("metrics_token_file")
    if metrics_token is not None and metrics is None:
        raise click.BadParameter("needs --metrics HOST:PORT", param_hint="--metrics-token-file")
    gateway = _pop_gateway_options(params)
    if gateway is not None and overrides.profile is not None:
        raise click.UsageError(
            "--profile with --gateway: each client's profile is its token's "
            "(`egressd gateway token add NAME --profile P`)"
        )
    return SessionOptions(
        gateway=gateway,
        metrics=metrics,
        metrics_token_file=metrics_token,
        report=not params.pop("quiet"),
        policy_file=first_policy(policies),
        overrides=overrides,
        listen=parse_listen(params.pop("listen"), gateway=gateway is not None),
        audit_path=params.pop("audit_path"),
        trace=params.pop("trace"),
        inspect=not params.pop("no_inspect"),
        upstream_ca=tuple(params.pop("upstream_ca")),
        approve_all=params.pop("approve_all"),
        prompt=not params.pop("no_prompt"),
        identify=params.pop("identify"),
    )


def session_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """@policy_options, @proxy_options, @inspection_options and @approval_options, handed to the
    command as one SessionOptions argument named `options` (every command that runs a proxy)."""

    @functools.wraps(func)
    def with_options(*args: Any, **kwargs: Any) -> Any:
        return func(*args, options=_pop_session_options(kwargs), **kwargs)

    return policy_options(proxy_options(inspection_options(approval_options(with_options))))


@contextlib.contextmanager
def open_session(options: SessionOptions, **kwargs: Any) -> Iterator[ProxySession]:
    """A started ProxySession; any set-up failure exits 2 with the reason on stderr. Its refusals'
    hints name the command that runs it (`egressd acp`, not `egressd exec`)."""
    try:
        session = ProxySession(options, say=say, shown_as=command_name(), **kwargs)
        session.start()
    except SessionError as exc:
        fail(str(exc))
    try:
        yield session
    finally:
        session.close()
        if (failure := session.failure) is not None:  # loaded once the child was on its way
            fail(failure, EXIT_CANNOT_RUN)


def command_name() -> str:
    """The egressd command being run, as the user typed it: `exec`, `sandbox`, `mcp run`, ..."""
    ctx = click.get_current_context(silent=True)
    words = ctx.command_path.split()[1:] if ctx is not None else []
    return " ".join(words) or "exec"


def _host_port(text: str, option: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """`HOST:PORT`, `[IPv6]:PORT` or `PORT` (127.0.0.1); HOST an IP address or `localhost`."""
    host, port_text = "127.0.0.1", text
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or text[end + 1 : end + 2] != ":":
            raise click.BadParameter(f"{text!r}: expected [IPv6]:PORT", param_hint=option)
        host, port_text = text[1:end], text[end + 2 :]
    elif ":" in text:
        host, _, port_text = text.rpartition(":")
    port = port_number(port_text, lowest=0)
    if port is None:
        raise click.BadParameter(f"{text!r}: port must be 0-65535", param_hint=option)
    if host == "localhost":
        host = "127.0.0.1"
    try:
        return ipaddress.ip_address(host), port
    except ValueError:
        raise click.BadParameter(f"{text!r}: host must be an IP address", param_hint=option) from None


def parse_metrics_address(text: str, *, any_address: bool = False) -> tuple[str, int]:
    """--metrics: loopback unless --metrics-any. Metrics name no host, but they show what a child
    does and when: other machines read them only when the user says so."""
    address, port = _host_port(text, "--metrics")
    if not address.is_loopback and not any_address:
        raise click.BadParameter(
            f"{text!r} is not a loopback address: egressd serves metrics on loopback only "
            "(127.0.0.0/8 or ::1) unless --metrics-any is given, so other machines cannot watch "
            "what the child does",
            param_hint="--metrics",
        )
    return str(address), port


def parse_listen(text: str, *, gateway: bool = False, option: str = "--listen") -> tuple[str, int]:
    """`HOST:PORT`, `[::1]:PORT` or `PORT`; the host must be loopback (children are local) unless
    this is a gateway, whose clients are other machines that each present their own token."""
    address, port = _host_port(text, option)
    if not address.is_loopback and not gateway:
        raise click.BadParameter(
            f"{text!r}: egressd listens on loopback only (127.0.0.0/8 or ::1). Its proxy is for "
            "processes on this machine; a listener on another interface would let any host on the "
            "network use your allowlist. To serve other machines (containers), run "
            "`egressd run --gateway`: each client then needs its own token (docs/gateway.md).",
            param_hint=option,
        )
    return str(address), port


def gateway_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--gateway/--tokens/--allow-from/--socks-listen (`egressd run`), parsed by session_options
    into `options.gateway`; put it above @session_options."""
    options = [
        click.option(
            "--gateway",
            is_flag=True,
            help="Serve other machines (containers): any --listen address, every client named by its "
            "own token (`egressd gateway token add`). See docs/gateway.md.",
        ),
        click.option(
            "--tokens",
            "tokens_file",
            metavar="FILE",
            help="The gateway's token file (default: $EGRESSD_HOME/gateway/tokens.json).",
        ),
        click.option(
            "--allow-from",
            multiple=True,
            metavar="CIDR",
            help="Gateway: accept clients from this network only (repeatable; others get 407).",
        ),
        click.option(
            "--socks-listen",
            metavar="HOST:PORT",
            help="Gateway: also serve SOCKS5 (user/password = name/token) on this address.",
        ),
        click.option(
            "--tls-cert",
            metavar="FILE",
            help="Gateway: the proxy port speaks TLS (https:// proxy URLs) with this certificate "
            "chain (PEM); needs --tls-key.",
        ),
        click.option("--tls-key", metavar="FILE", help="Gateway: the private key of --tls-cert (PEM)."),
        click.option(
            "--tls-name",
            "tls_names",
            multiple=True,
            metavar="NAME",
            help="Gateway: the proxy port speaks TLS with a certificate for NAME (repeatable: every "
            "name clients reach it by) from egressd's CA (`egressd ca path`).",
        ),
    ]
    return _with_options(func, options)


def _tls_options(cert: str | None, key: str | None, names: tuple[str, ...]) -> ListenerTLS | None:
    if (cert is None) != (key is None):
        raise click.UsageError("--tls-cert and --tls-key go together")
    if cert is not None and names:
        raise click.UsageError("--tls-name mints a certificate: not with --tls-cert")
    if cert is None and not names:
        return None
    from pathlib import Path

    from egressd.session.gateway_options import ListenerTLS

    return ListenerTLS(cert=Path(cert) if cert else None, key=Path(key) if key else None, names=tuple(names))


def _pop_gateway_options(params: dict[str, Any]) -> GatewayOptions | None:
    """The gateway's options when the command has them and --gateway is given; without --gateway
    they are refused rather than ignored."""
    if "gateway" not in params:
        return None
    gateway = params.pop("gateway")
    tokens, allow_from, socks = (
        params.pop("tokens_file"),
        params.pop("allow_from"),
        params.pop("socks_listen"),
    )
    tls = (params.pop("tls_cert"), params.pop("tls_key"), params.pop("tls_names"))
    if not gateway:
        pairs = (("--tokens", tokens), ("--allow-from", allow_from), ("--socks-listen", socks))
        pairs += (("--tls-cert", tls[0]), ("--tls-key", tls[1]), ("--tls-name", tls[2]))
        given = [name for name, value in pairs if value]
        if given:
            raise click.UsageError(f"{', '.join(given)} only with --gateway")
        return None
    from pathlib import Path

    from egressd.admission.tokens import TokenFileError, parse_network
    from egressd.session.gateway_options import GatewayOptions
    from egressd.session.token_file import default_tokens_path

    for text in allow_from:
        try:
            parse_network(text, "--allow-from")
        except TokenFileError as exc:
            raise click.BadParameter(str(exc), param_hint="--allow-from") from None
    return GatewayOptions(
        tokens=Path(tokens) if tokens else default_tokens_path(),
        allow_from=tuple(allow_from),
        socks_listen=parse_listen(socks, gateway=True, option="--socks-listen") if socks else None,
        tls=_tls_options(*tls),
    )


def dashboard_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """--dashboard (exec, run, sandbox): also serve the web dashboard; sets `options.dashboard`."""

    @functools.wraps(func)
    def with_dashboard(*args: Any, dashboard: bool, options: SessionOptions, **kwargs: Any) -> Any:
        return func(*args, options=dataclasses.replace(options, dashboard=dashboard), **kwargs)

    return click.option(
        "--dashboard",
        is_flag=True,
        help="Serve the live dashboard on a loopback port; its URL (with a secret token) goes to stderr.",
    )(with_dashboard)


def capture_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """--capture/--no-capture (exec, sandbox, and mcp run and acp through the sandbox's options)."""
    return click.option(
        "--capture/--no-capture",
        "capture_direct",
        default=True,
        show_default=True,
        help="Linux: CMD gets a network namespace of its own, where connections that ignore the proxy "
        "variables (and their DNS) are captured and decided like any other. --no-capture: outside "
        "the sandbox they reach the network directly, unseen (egressd warns); in the sandbox they "
        "get nothing. See docs/exec.md.",
    )(func)


def secret_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--secret NAME=ENV_VAR, --secret-host NAME=HOST, --secret-header, --secret-query (exec): a
    credential the child gets only as a placeholder (docs/secrets.md); sets `options.overrides`."""

    @functools.wraps(func)
    def with_secrets(
        *args: Any,
        secret: tuple[str, ...],
        secret_host: tuple[str, ...],
        secret_header: tuple[str, ...],
        secret_query: tuple[str, ...],
        options: SessionOptions,
        **kwargs: Any,
    ) -> Any:
        if secret or secret_host or secret_header or secret_query:
            try:
                specs = secrets_from_options(secret, secret_host, secret_header, secret_query)
            except PolicyError as exc:
                fail(str(exc))
            overrides = dataclasses.replace(options.overrides, secrets=specs)
            options = dataclasses.replace(options, overrides=overrides)
        return func(*args, options=options, **kwargs)

    options = [
        click.option(
            "--secret",
            multiple=True,
            metavar="NAME=ENV_VAR",
            help="Keep ENV_VAR's value with egressd: the child gets a placeholder in ENV_VAR, and egressd "
            "puts the value in requests to the --secret-host hosts (repeatable; docs/secrets.md).",
        ),
        click.option(
            "--secret-host",
            multiple=True,
            metavar="NAME=HOST",
            help="A host the secret NAME may go to; it must be allowed (repeatable).",
        ),
        click.option(
            "--secret-header",
            multiple=True,
            metavar="NAME='HEADER: ...{}'",
            help="How NAME is sent (default 'Authorization: Bearer {}'), e.g. 'x-api-key: {}'.",
        ),
        click.option(
            "--secret-query",
            multiple=True,
            metavar="NAME=PARAM",
            help="Send NAME in this query parameter instead of a header.",
        ),
    ]
    return _with_options(with_secrets, options)
