"""One proxy session: the policy (watched when it is a file), the audit, the running proxy.

`egressd exec`, `run`, `sandbox` and `ssh` all start the same session and differ only in how they
run the child; keeping it here means a reload, the audit or a credential works the same in each.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from egressd.child_env import child_environment, proxy_exports
from egressd.listeners import register
from egressd.observe.audit import AuditLog
from egressd.policy import (
    Policy,
    PolicyError,
    apply_env_mode,
    builtin_policy_path,
    default_policy,
    load_policy,
)
from egressd.refusal import HintContext
from egressd.secret_values import EnvVault, SecretError, hidden_variables, not_dumpable, read_values

if TYPE_CHECKING:
    import ssl
    from collections.abc import Callable, Mapping, Sequence

    from egressd.admission.asks import AskBroker
    from egressd.admission.credentials import ProxyCredentials
    from egressd.admission.tokens import GatewayCredentials, TokenTable
    from egressd.control.children import Children, Issuer
    from egressd.control.prompt import TtyPrompter
    from egressd.control.server import ControlServer, Counts
    from egressd.dashboard.server import Dashboard
    from egressd.files import ReadBytes, Snapshot
    from egressd.observe.captured import CapturedReport
    from egressd.observe.metrics import Metrics, MetricsServer
    from egressd.observe.refusals import RefusalReport
    from egressd.policy.secrets import SecretSpec
    from egressd.proxy import ProxyServer
    from egressd.reload import FileWatcher

_PRESET_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")


class SessionError(Exception):
    """The session cannot start (bad policy, audit file, proxy); the message says why."""


@dataclass(frozen=True)
class Overrides:
    """Command-line additions, re-applied to every reload so an edit never drops them."""

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    mode: str | None = None
    nameservers: tuple[str, ...] = ()
    profile: str | None = None
    # more --policy files or presets, merged with the first (deny wins; docs/providers.md),
    # read again at every reload so an edit of any of them is never half applied
    policies: tuple[str, ...] = ()
    secrets: tuple[SecretSpec, ...] = ()  # exec --secret ...: where values come from, never values
    upstream_proxy: str | None = None  # --upstream-proxy URL: the parent proxy (its url only)

    def apply(self, policy: Policy, read: ReadBytes = Path.read_bytes) -> Policy:
        """The overrides on `policy`; `read` reads the merged files (a watcher's snapshot)."""
        if self.policies:
            from egressd.policy.merge import merge_policies

            more = [load_policy(resolve_policy_path(p), os.environ, read) for p in self.policies]
            policy = merge_policies([policy, *more])
        policy = policy.with_overrides(
            allow=self.allow,
            deny=self.deny,
            mode=self.mode,  # type: ignore[arg-type]  # the CLI's click.Choice checked it
            nameservers=self.nameservers,
            upstream_proxy=self.upstream_proxy,
            secrets=self.secrets,
        )
        if self.profile is not None and self.profile not in policy.profiles:
            known = ", ".join(sorted(policy.profiles)) or "none defined"
            raise PolicyError(policy.source, "--profile", self.profile, f"no such profile (known: {known})")
        return policy


def resolve_policy_path(value: str) -> Path:
    """--policy takes a file, or the name of a built-in preset (`npm`) when no such file exists."""
    path = Path(value)
    if path.exists() or not _PRESET_NAME.fullmatch(value):
        return path
    return builtin_policy_path(value)


def policy_file_shown(value: str | None) -> str | None:
    """The policy file a hint may tell a person to edit: the first --policy when it is a file
    (absolute), None for a built-in preset or no --policy (an edit there is no one's to make)."""
    if value is None or resolve_policy_path(value) != Path(value):
        return None
    return os.path.abspath(value)


def file_policy(path: Path, overrides: Overrides, files: Snapshot) -> Policy:
    """The policy file with the command line's overrides, every file read once through `files`
    (a file watcher's snapshot: the bytes it checked are the bytes parsed)."""
    return overrides.apply(load_policy(path, os.environ, files.read), files.read)


def base_policy(policy_file: str | None) -> Policy:
    """The file's policy, or the built-in default; EGRESSD_MODE applies to both."""
    if policy_file is not None:
        return load_policy(resolve_policy_path(policy_file), env=os.environ)
    # policies/default.yaml, built without reading it (a unit test checks they agree):
    # a run on the default policy never loads PyYAML
    return apply_env_mode(default_policy(), os.environ)


@dataclass(frozen=True)
class Loaded:
    """A policy as the session applies it, with its secrets' values read from the same files."""

    policy: Policy
    secret_values: Mapping[str, str]


@dataclass(frozen=True)
class ListenerTLS:
    """The gateway's proxy port over TLS, so the clients' tokens do not cross a shared network in
    clear: a certificate and key of the operator's, or one minted for `names` from egressd's CA."""

    cert: Path | None = None
    key: Path | None = None
    names: tuple[str, ...] = ()

    def context(self, config_dir: Path | None) -> ssl.SSLContext:
        import ssl

        if self.cert is not None and self.key is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.set_alpn_protocols(["http/1.1"])
            context.load_cert_chain(self.cert, self.key)
            return context
        from egressd import ca
        from egressd.inspect.refusal_certs import listener_context

        config = config_dir or ca.config_dir()
        ca.ensure_ca(config)
        return listener_context(ca.ca_dir(config), list(self.names), config)


@dataclass(frozen=True)
class GatewayOptions:
    """`egressd run --gateway`: clients on other machines, named by the tokens in `tokens`."""

    tokens: Path
    allow_from: tuple[str, ...] = ()  # source networks (CIDR) every client must come from
    socks_listen: tuple[str, int] | None = None  # SOCKS5 listener (none without it)
    tls: ListenerTLS | None = None  # the proxy port speaks TLS (https:// proxy URLs)


def host_loopback(policy: Policy, ports: Sequence[int] = ()) -> Policy:
    """The host's own services — on its loopback and on its own interface addresses (a LAN
    address, a Docker bridge's, a container's own IP) — reachable only on the ports the policy
    names in `loopback.ports` and `ports`, never all of them (none when none are named).

    For clients that are not the host's own processes: a gateway's (other machines) and a
    sandboxed child (its own network). A service listening on 0.0.0.0 answers on every interface
    address, so those count as loopback. Computed at each load, so the addresses are current.
    """
    from dataclasses import replace

    from egressd.remote.interfaces import local_addresses

    own = frozenset(ip for ip in local_addresses() if not ip.is_loopback)
    named = tuple(dict.fromkeys((*policy.loopback.ports, *ports)))
    loopback = replace(
        policy.loopback, ports=named, named_ports_only=True, addresses=policy.loopback.addresses | own
    )
    return replace(policy, loopback=loopback)


@dataclass(frozen=True)
class SessionOptions:
    policy_file: str | None = None
    overrides: Overrides = Overrides()
    listen: tuple[str, int] = ("127.0.0.1", 0)
    audit_path: str | None = None
    trace: bool = False
    socks: bool = True
    inspect: bool = True  # TLS inspection where a rule needs it; --no-inspect turns it off
    upstream_ca: tuple[str, ...] = ()
    config_dir: Path | None = None  # egressd's config dir (the CA); None = EGRESSD_HOME or ~/.config
    metrics: tuple[str, int] | None = None  # --metrics HOST:PORT (checked by the CLI)
    metrics_token_file: str | None = None  # --metrics answers only `Authorization: Bearer` its token
    report: bool = False  # the refusal lines and summary on stderr (the CLI's default; --quiet: off)
    approve_all: bool = False  # --approve-all: every ask approved at once (explicit only, loud)
    prompt: bool = True  # ask on /dev/tty when there is one; --no-prompt: the control API only
    control: bool = True  # serve the control API on the user's Unix socket
    dashboard: bool = False  # --dashboard: serve the web dashboard on loopback (needs the control API)
    passthrough: bool = False  # --passthrough / EGRESSD_PASSTHROUGH=1: the child runs without egressd
    gateway: GatewayOptions | None = None  # run --gateway: token-named clients, any listen address
    # --identify: look up every connection's program (pid, exe) for the audit; None: the command's default
    identify: bool | None = None


class ProxySession:
    """Load, start, issue credentials, stop. Use as a context manager."""

    def __init__(
        self,
        options: SessionOptions,
        *,
        say: Callable[[str], None],
        announce_reloads: bool = False,
        transform: Callable[[Policy], Policy] | None = None,
        command: Sequence[str] | None = None,
        shown_as: str = "exec",
    ) -> None:
        self.options = options
        # what `egressd ps` and the ask prompt show: the child's command, or egressd's own
        self.command = tuple(command) if command else ("egressd", *sys.argv[1:])
        # where refusals are read: the hints of every surface name what this command's user can
        # change (`shown_as`: the egressd command as typed, `exec`, `acp`, `mcp run`, ...)
        self.context = HintContext(
            shown_as, gateway=options.gateway is not None, policy_file=policy_file_shown(options.policy_file)
        )
        self.started = time.time()
        self._say = say
        self._announce = announce_reloads
        # a command may narrow every policy it loads (the sandbox's --only); applied after overrides
        self._transform = transform
        self.proxy: ProxyServer | None = None
        self.watcher: FileWatcher[Loaded] | None = None
        self.audit: AuditLog | None = None
        self.metrics: Metrics | None = None
        self.metrics_server: MetricsServer | None = None
        self.report: RefusalReport | None = None
        self.captured: CapturedReport | None = None
        self.broker: AskBroker | None = None
        self._control: ControlServer | None = None
        self._dashboard: Dashboard | None = None
        self._prompter: TtyPrompter | None = None
        self._counts: Counts | None = None
        self.children: Children | None = None  # attached children (exec --attach), with the control API
        self.control_path: Path | None = None
        self.gateway: GatewayCredentials | None = None
        self._tokens_watcher: FileWatcher[TokenTable] | None = None
        self._vault = EnvVault()
        self._secret_values: dict[str, str] = {}  # read with the policy that names them
        # the files the policy is read from, as absolute paths (`ps`, the dashboard): named once,
        # while the working directory is the one they were given in
        named = [options.policy_file] if options.policy_file is not None else []
        try:
            self.policy_paths = [
                str(resolve_policy_path(n).absolute()) for n in (*named, *options.overrides.policies)
            ]
        except PolicyError as exc:
            raise SessionError(str(exc)) from exc
        self.policy = self._load()
        if options.gateway is not None:
            self._load_gateway(options.gateway)

    # -- policy ----------------------------------------------------------------------------------
    def _apply(self, policy: Policy, read: ReadBytes = Path.read_bytes) -> Loaded:
        """The policy as this session runs it, and its secrets' values; every file it reads (merged
        policies, secrets, the parent proxy's credentials) through `read`."""
        policy = self.options.overrides.apply(policy, read)
        if self.options.gateway is not None:
            policy = host_loopback(policy)
        policy = self._transform(policy) if self._transform else policy
        if policy.upstream_proxy is not None:  # its credentials are read now: at start, on reload
            from egressd.admission.upstream import with_credentials

            policy = with_credentials(policy, os.environ, read)
        # the secrets' values are read with the policy: one that cannot be read fails the load
        try:
            values = read_values(policy.secrets, self._vault, read)
        except SecretError as exc:
            raise PolicyError(policy.source, "secrets", message=str(exc)) from None
        return Loaded(policy, values)

    def _load(self) -> Policy:
        from egressd.reload import FileWatcher, UnsettledError

        try:
            if self.options.policy_file is None:
                loaded = self._apply(base_policy(None))
            else:
                path = resolve_policy_path(self.options.policy_file)
                self.watcher = FileWatcher(
                    path,
                    lambda files: self._apply(load_policy(path, os.environ, files.read), files.read),
                    self._on_change,
                    self._on_error,
                    name="egressd-policy-watch",
                )
                loaded = self.watcher.load()
        except (PolicyError, UnsettledError) as exc:
            raise SessionError(str(exc)) from exc
        self._secret_values = dict(loaded.secret_values)
        return loaded.policy

    # -- the gateway's clients ---------------------------------------------------------------------
    def _load_gateway(self, gateway: GatewayOptions) -> None:
        """The token file (created empty when missing) and the gateway-wide source networks; the
        file is watched like the policy, so `gateway token add/remove` applies without a restart."""
        from egressd.admission.tokens import GatewayCredentials, TokenFileError, parse_network
        from egressd.gateway_tokens import ensure_file, table_from_bytes
        from egressd.reload import FileWatcher, UnsettledError

        path = gateway.tokens
        try:
            nets = [parse_network(text, "--allow-from") for text in gateway.allow_from]
            ensure_file(path)
            self._tokens_watcher = FileWatcher(
                path,
                lambda files: table_from_bytes(files.read(path), str(path)),
                self._on_tokens,
                self._on_tokens_error,
                name="egressd-tokens-watch",
            )
            table = self._tokens_watcher.load()
        except (TokenFileError, OSError, UnsettledError) as exc:
            raise SessionError(f"--tokens: {exc}") from exc
        self.gateway = GatewayCredentials(table, nets)

    def _on_tokens(self, table: TokenTable) -> None:
        assert self.gateway is not None
        self.gateway.set_table(table)
        if self.proxy is not None:
            self.proxy.close_revoked()  # a removed client's open tunnels end now, not when idle
        self._notice(
            "tokens_reload",
            source=str(self._tokens_watcher.path if self._tokens_watcher else ""),
            clients=len(table.entries),
        )
        if self._announce:
            self._say(f"gateway tokens reloaded ({len(table.entries)} clients)")

    def _on_tokens_error(self, message: str) -> None:
        self._notice("tokens_reload_failed", error=message)
        self._say(f"token file reload failed: {' '.join(message.split())}; keeping the last good one")

    def _on_change(self, loaded: Loaded) -> None:
        policy = self.policy = loaded.policy
        self._secret_values = dict(loaded.secret_values)
        if self.audit is not None:
            self.audit.configure(policy.audit.on_failure, policy.audit.max_queue_bytes)
        if self.proxy is not None:
            self.proxy.pipeline.secrets.update(policy.secrets, self._secret_values)
            self.proxy.set_policy(policy)
        self._notice("reload", **_settings(policy))
        if self._announce:
            self._say(f"policy reloaded from {policy.source} (mode: {policy.mode})")

    def _on_error(self, message: str) -> None:
        self._notice("reload_failed", error=message)
        self._say(f"reload failed: {' '.join(message.split())}; keeping the last good policy")

    def _notice(self, kind: str, **fields: object) -> None:
        """A reload is an event like the pipeline's: the audit and metrics observe it on its bus."""
        from egressd.admission.events import Notice

        if self.proxy is not None:
            self.proxy.pipeline.events.emit(Notice(kind, fields))
        elif self.audit is not None:
            self.audit.event(kind, **fields)

    def reopen_audit(self) -> bool:
        """SIGHUP: open the audit file again by its path (logrotate moved it); False without one."""
        if self.audit is None or self.audit.path is None:
            return False
        self.audit.reopen()
        return True

    def reload_now(self) -> bool:
        """SIGHUP: reload the file now; False when there is no file to reload."""
        if self._tokens_watcher is not None:
            self._tokens_watcher.trigger()
        if self.watcher is None:
            return self._tokens_watcher is not None
        self.watcher.trigger()
        return True

    # -- life cycle ------------------------------------------------------------------------------
    def start(self) -> Self:
        from egressd.proxy import EngineError, ProxyServer

        try:
            self.audit = AuditLog(
                self.options.audit_path,
                trace=sys.stderr if self.options.trace else None,
                on_failure=self.policy.audit.on_failure,
                max_queue_bytes=self.policy.audit.max_queue_bytes,
                context=self.context,
            )
        except OSError as exc:
            raise SessionError(f"--audit {self.options.audit_path}: {exc.strerror or exc}") from exc
        self.audit.event("policy", traced=False, **_settings(self.policy))
        gateway = self.options.gateway
        tls = None
        if gateway is not None and gateway.tls is not None:
            import ssl

            from egressd.ca import CAError

            try:
                tls = gateway.tls.context(self.options.config_dir)
            except (OSError, ssl.SSLError, CAError) as exc:
                raise SessionError(f"the TLS listener: {exc}") from exc
        self.proxy = ProxyServer(
            self.policy,
            listen=self.options.listen,
            socks=self.options.socks if gateway is None else gateway.socks_listen is not None,
            socks_listen=gateway.socks_listen if gateway is not None else None,
            credentials=self.gateway,
            health=gateway is not None,
            tls=tls,
            # no audit file and no trace: the proxy skips building records it would throw away
            audit=self.audit if self.audit.enabled else None,
            inspect=self.options.inspect,
            config_dir=self.options.config_dir,
            upstream_ca=self.options.upstream_ca,
            identify=bool(self.options.identify),
        )
        self.proxy.pipeline.context = self.context
        self._start_approvals(self.proxy)
        self.proxy.pipeline.secrets.update(self.policy.secrets, self._secret_values)
        if self.policy.secrets:
            not_dumpable()  # the child (same user) reads neither /proc/<egressd>/environ nor memory
        self._observe(self.proxy.pipeline.events.subscribe)
        try:
            self.proxy.start()
        except EngineError as exc:
            self.close()
            raise SessionError(f"cannot start the proxy: {exc}") from exc
        if self.options.metrics is not None:
            self._serve_metrics(*self.options.metrics)
        if self.watcher is not None:
            self.watcher.start()
        if self._tokens_watcher is not None:
            self._tokens_watcher.start()
        self._start_control(self.proxy)
        self._start_dashboard()
        return self

    def _observe(self, subscribe: Callable[..., None]) -> None:
        """The observers the options ask for, subscribed before the first connection."""
        if self.options.metrics is not None or self.options.control:
            # the control API serves them too (GET /metrics), so they count from the start
            from egressd.observe.metrics import Metrics

            assert self.proxy is not None
            self.metrics = Metrics(
                self.proxy.pipeline, clients=self.gateway.names if self.gateway is not None else None
            )
            subscribe(self.metrics.observe, addresses=False)  # counters
        if self.options.report:
            from egressd.observe.captured import CapturedReport
            from egressd.observe.refusals import RefusalReport

            # with --trace every decision has its line already: only the summary is added
            self.report = RefusalReport(sys.stderr, lines=not self.options.trace, context=self.context)
            subscribe(self.report.observe, addresses=False)  # refusals only
            self.captured = CapturedReport(sys.stderr, lines=not self.options.trace)
            subscribe(self.captured.observe, addresses=False)  # captured decisions only

    def _serve_metrics(self, host: str, port: int) -> None:
        from egressd.observe.metrics import MetricsServer

        assert self.metrics is not None and self.proxy is not None
        token = None
        if self.options.metrics_token_file is not None:
            try:
                token = Path(self.options.metrics_token_file).read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as exc:
                self.close()
                raise SessionError(f"--metrics-token-file: {exc}") from exc
            if len(token) < 16:
                self.close()
                where = self.options.metrics_token_file
                raise SessionError(f"--metrics-token-file {where}: a token of 16 characters or more")
        try:
            self.metrics_server = MetricsServer(self.metrics, host, port, token=token)
        except OSError as exc:
            self.close()
            raise SessionError(f"--metrics {host}:{port}: {exc.strerror or exc}") from exc
        # the child must not reach it through the proxy either (it is egressd's, like its ports)
        register(self.proxy.pipeline.decider, [self.metrics_server.address])
        self._say(f"metrics on {self.metrics_server.url}")

    # -- ask mode, grants and the control API ------------------------------------------------------
    def _start_approvals(self, proxy: ProxyServer) -> None:
        """The ask broker is the pipeline's approver; the terminal prompt one of its approvers."""
        from egressd.admission.asks import AskBroker

        pipeline = proxy.pipeline
        self.broker = AskBroker(
            pipeline.grants,
            timeout=lambda: pipeline.policies.get().ask_timeout,
            command=self.command,
            write_rule=self._write_rule if self._writable_policy() else None,
            approve_all=self.options.approve_all,
            events=pipeline.events,
        )
        pipeline.approver = self.broker
        if self.options.approve_all:
            self._say(
                "WARNING: --approve-all: every ask is approved without asking anyone; the child may "
                "reach any host the policy would have asked about"
            )
        if self.options.prompt and not self.options.approve_all:
            from egressd.control.prompt import TtyPrompter

            self._prompter = TtyPrompter.open(self.broker)
            if self._prompter is not None:
                self._prompter.start()

    def _identify_from_now_on(self) -> None:
        """A watch stream attached: from now on every connection names its program (pid, exe),
        a cost paid only once someone watches (docs/audit.md)."""
        if self.proxy is not None:
            self.proxy.pipeline.identify = True

    def _writable_policy(self) -> bool:
        """An ask answered "always" writes the user's policy file, never a built-in preset."""
        return self.watcher is not None and Path(str(self.options.policy_file)).is_file()

    def _write_rule(self, which: str, rule: str) -> str:
        from egressd.policy_edit import add_rule

        assert self.watcher is not None
        done = add_rule(self.watcher.path, which, rule)
        self.watcher.trigger()  # the reload applies it like any edit (and reports a failure)
        return done

    def _edit_policy(self, op: str, which: str, rule: str) -> str:
        """The dashboard's add/remove of an allow/deny rule: the same file edit as an "always"
        answer (validated, atomic), serialised with it, then applied by the reload."""
        from egressd.policy_edit import edit_rule

        assert self.watcher is not None and self.broker is not None
        with self.broker.write_lock:
            done = edit_rule(self.watcher.path, which, rule, remove=op == "remove")
        self.watcher.trigger()  # the reload applies it like any edit (and reports a failure)
        return done

    def policy_info(self) -> dict[str, Any]:
        """The effective policy (overrides applied) and the file's own allow/deny lists, which are
        the rules the dashboard can remove."""
        from egressd.policy.dump import policy_to_data

        own: dict[str, list[Any]] = {"allow": [], "deny": []}
        if self._writable_policy() and self.watcher is not None:
            raw = load_policy_data(self.watcher.path)
            for which in ("allow", "deny"):
                entries = raw.get(which) if isinstance(raw, dict) else None
                own[which] = [e for e in entries if isinstance(e, str)] if isinstance(entries, list) else []
        return {
            "source": " + ".join(self.policy_paths) or "built-in default",
            "writable": self._writable_policy(),
            "effective": policy_to_data(self.policy),
            "file": own,
        }

    def _start_dashboard(self) -> None:
        """--dashboard: the web page over this instance's own control API; its URL (with the
        token) goes to stderr only — never stdout, never the child's environment."""
        if not self.options.dashboard:
            return
        if self.control_path is None:
            self._say("dashboard off: it needs the control API")
            return
        from egressd.dashboard.server import WHILE_OPEN, Dashboard

        assert self.proxy is not None
        self._dashboard = Dashboard(self.control_path, self.proxy.pipeline.decider)
        self._say(f"dashboard: {self._dashboard.start()}  ({WHILE_OPEN})")

    def _start_control(self, proxy: ProxyServer) -> None:
        """The control API on the user's socket; egressd runs without it (and says so) when the
        run directory is not safe to use."""
        if not self.options.control:
            return
        from egressd.control import paths
        from egressd.control.children import Children
        from egressd.control.server import ControlServer, Counts

        assert self.broker is not None
        try:
            directory = paths.ensure_run_dir(paths.run_dir())
            path = paths.socket_path(directory)
            sock = paths.listen(path)
        except (paths.RunDirError, OSError) as exc:
            self._say(f"control API off: {exc}")
            return
        self._counts = counts = Counts()
        proxy.pipeline.events.subscribe(counts.observe, addresses=False)  # not connection records
        self.children = Children(self._children_issuer())
        server = ControlServer(
            path,
            broker=self.broker,
            grants=proxy.pipeline.grants,
            events=proxy.pipeline.events,
            info=self.info,
            metrics=self.metrics.render if self.metrics is not None else None,
            policy=self.policy_info,
            edit_policy=self._edit_policy if self._writable_policy() else None,
            children=self.children,
            watched=self._identify_from_now_on,
            own=proxy.pipeline.decider,
            recent=lambda: list(counts.recent),
        )
        server.start(sock)
        self._control, self.control_path = server, path

    def info(self) -> dict[str, Any]:
        """What `egressd ps` shows of this instance."""
        from egressd import __version__

        policy = self.policy
        counts = self._counts
        broker = self.broker
        pipeline = self.proxy.pipeline if self.proxy is not None else None
        return {
            "pid": os.getpid(),
            "command": list(self.command),
            "policy": " + ".join(self.policy_paths) or "built-in default",
            "policies": list(self.policy_paths),
            "policy_writable": self._writable_policy(),
            "mode": policy.mode,
            "ask_timeout": policy.ask_timeout,
            "started": self.started,
            "version": __version__,
            "socket": str(self.control_path) if self.control_path else None,
            "counts": {
                "decisions": counts.decisions if counts else 0,
                "allowed": counts.allowed if counts else 0,
                "refused": counts.refused if counts else 0,
                "pending": len(broker.pending()) if broker else 0,
                "grants": len(pipeline.grants.list()) if pipeline else 0,
                "connections": pipeline.active() if pipeline else 0,
            },
            "clients": counts.clients() if counts else {},
            "children": self.children.list() if self.children is not None else [],
            "approvers": {
                "terminal": self._prompter is not None,
                "approve_all": self.options.approve_all,
                "can_answer": broker.can_answer() if broker else False,
            },
        }

    def credentials(self, profile: str | None = None, label: str | None = None) -> ProxyCredentials:
        assert self.proxy is not None, "start() first"
        return self.proxy.issue_credentials(
            profile if profile is not None else self.options.overrides.profile, label
        )

    def _attach_credentials(self, profile: str | None, label: str) -> ProxyCredentials:
        """An attached child's credentials: its own profile (one the policy defines), else this
        session's."""
        if profile is not None and profile not in self.policy.profiles:
            known = ", ".join(sorted(self.policy.profiles)) or "none defined"
            raise KeyError(f"no such profile {profile!r} in {self.policy.source} (known: {known})")
        return self.credentials(profile, label)

    def _children_issuer(self) -> Issuer:
        from egressd.control.children import Issuer
        from egressd.ssh_env import ssh_may_be_allowed

        assert self.proxy is not None
        return Issuer(
            issue=self._attach_credentials,
            revoke=self.proxy.revoke,
            exports=self.exports,
            ssh=lambda: ssh_may_be_allowed(self.policy),
            record=self.record_child,
            hidden=self.hidden_variables,
            started=self.child_started,
        )

    def proxy_urls(self, creds: ProxyCredentials) -> tuple[str, str | None]:
        assert self.proxy is not None
        url = creds.proxy_url(*self.proxy.http_address)
        socks = self.proxy.socks_address
        return url, creds.proxy_url(*socks, scheme="socks5h") if socks else None

    @property
    def ca_bundle(self) -> str | None:
        return getattr(self.proxy, "ca_bundle", None)

    def record_child(self, creds: ProxyCredentials, command: Sequence[str]) -> None:
        """An audit record naming the program a child runs under these credentials, so a reader
        (`egressd policy suggest`) can say which command needed a host. Only the program's name:
        arguments carry tokens (URLs with credentials, headers), and the audit must not."""
        if self.audit is not None and command:
            program = os.path.basename(command[0])
            self.audit.event("child", client=creds.client, profile=creds.profile, program=program)

    def child_env(
        self, base: Mapping[str, str] | None = None, creds: ProxyCredentials | None = None
    ) -> dict[str, str]:
        """The environment of one child: fresh credentials unless given."""
        url, socks = self.proxy_urls(creds or self.credentials())
        return child_environment(
            os.environ if base is None else base,
            url,
            socks,
            ca_bundle=self.ca_bundle,
            placeholders=self.placeholders(),
            hidden=self.hidden_variables(),
        )

    def child_only(self, env: dict[str, str], creds: ProxyCredentials, *, listener: bool) -> dict[str, str]:
        """env plus what clients that cannot send proxy credentials need: with `listener`, a
        credential-free loopback listener for this child's process tree alone (its URL in
        EGRESSD_CHILD_PROXY, the JVM's proxy settings in JAVA_TOOL_OPTIONS); and under inspection
        the JVM's trust store."""
        from egressd.ca import java_truststore_path
        from egressd.child_env import CHILD_PROXY_VAR, java_environment
        from egressd.policy import join_host_port

        assert self.proxy is not None
        address = None
        if listener:
            address = self.proxy.child_only_listener(creds)
            env[CHILD_PROXY_VAR] = f"http://{join_host_port(*address)}"
        store = java_truststore_path(self.ca_bundle) if self.ca_bundle else None
        truststore = str(store) if store is not None and store.is_file() else None
        return java_environment(env, proxy=address, truststore=truststore)

    def child_started(self, creds: ProxyCredentials, pid: int) -> None:
        """The child running with creds is pid (its process tree is its connections' owner)."""
        if self.proxy is not None:
            self.proxy.child_started(creds, pid)

    def exports(self, creds: ProxyCredentials | None = None) -> dict[str, str]:
        url, socks = self.proxy_urls(creds or self.credentials())
        return proxy_exports(url, socks, ca_bundle=self.ca_bundle, placeholders=self.placeholders())

    def placeholders(self) -> dict[str, str]:
        """The secrets' child variables: {variable: placeholder} (never a value)."""
        return self.proxy.pipeline.secrets.child_variables() if self.proxy is not None else {}

    def hidden_variables(self) -> tuple[str, ...]:
        """egressd's own variables that hold secret values: never given to a child."""
        return hidden_variables(self.policy.secrets, self._vault)

    def drain(self, timeout: float) -> None:
        if self.proxy is not None:
            self.proxy.drain(timeout)

    def close(self) -> None:
        if self._dashboard is not None:
            self._dashboard.stop()
            self._dashboard = None
        if self._control is not None:
            self._control.stop()
            self._control = None
        if self.children is not None:
            self.children.close()
        if self._prompter is not None:
            self._prompter.stop()
            self._prompter = None
        if self.watcher is not None:
            self.watcher.stop()
        if self._tokens_watcher is not None:
            self._tokens_watcher.stop()
        if self.proxy is not None:
            self.proxy.stop()
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        if self.captured is not None:
            self.captured.print_summary()  # the programs that ignored the proxy variables
            self.captured = None
        if self.report is not None:
            self.report.print_summary()  # the child has exited (or `run` was stopped)
            self.report = None
        if self.audit is not None:
            self.audit.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_policy_data(path: str | os.PathLike[str]) -> Any:
    """The policy file as plain data (None when unreadable or not a policy's mapping), for listing
    the rules it holds itself — the reload reports a broken file, this only shows less. Decoded
    like the loader decodes it, so a file the loader refuses (duplicate keys) lists nothing."""
    from egressd.policy.loader import policy_data

    source = os.fspath(path)
    try:
        return policy_data(Path(source).read_bytes(), source)
    except (OSError, PolicyError):
        return None


def _settings(policy: Policy) -> dict[str, object]:
    """What the audit keeps of the policy in force (at start, and at each reload): the settings a
    policy drafted from this audit (`egressd policy suggest`) needs to reach what this run reached —
    names that resolve to private addresses, through these nameservers."""
    from egressd.policy.dump import nameservers

    return {
        "source": policy.source,
        "mode": policy.mode,
        "private_allow": policy.private.allow,
        "nameservers": nameservers(policy),
    }
