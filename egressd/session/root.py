"""One proxy session, wired: what is built from what, started in which order, stopped in reverse.

`egressd exec`, `run`, `sandbox`, `ssh` and the remote agent all run this session and differ only
in how they run the child and where the policy comes from; so a reload, the audit or a credential
works the same in each. Everything runs on the proxy's one event loop but the terminal prompt
(session/approvals.py says why) and the command's own thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Self

from egressd.admission.events import Decided
from egressd.admission.in_force import PolicyHolder
from egressd.observe.audit import AuditLog
from egressd.policy import PolicyError
from egressd.policy.refusal import HintContext
from egressd.session.options import SessionError, SessionOptions
from egressd.session.overrides import policy_file_shown, resolve_policy_path
from egressd.session.secret_values import EnvVault, hidden_variables, not_dumpable
from egressd.session.snapshot import Loaded, PolicyFile, PolicySource, Reloads, TokenFile, settings

if TYPE_CHECKING:
    import socket
    import ssl

    from egressd.admission.credentials import ProxyCredentials
    from egressd.admission.tokens import GatewayCredentials, TokenTable
    from egressd.observe.captured import CapturedReport
    from egressd.observe.metrics import Metrics
    from egressd.observe.refusals import RefusalReport
    from egressd.policy import Policy
    from egressd.session.approvals import Approvals
    from egressd.session.child import ChildSetup
    from egressd.session.proxy import ProxyServer
    from egressd.session.services import ControlAPI, Service


class ProxySession:
    """Load, start, issue credentials, stop. Use as a context manager.

    `transform`: how the command narrows every policy it loads (the sandbox's --only); `source`:
    another policy source than the file; `audit`: another audit than the file; `sockets`: the
    proxy's listening sockets, made elsewhere (a remote session's guard); `load_later`: the command
    starts the proxy's load itself once its child is on its way (`load()`, ProxyServer.start)."""

    def __init__(
        self,
        options: SessionOptions,
        *,
        say: Callable[[str], None],
        announce_reloads: bool = False,
        transform: Callable[[Policy], Policy] | None = None,
        command: Sequence[str] | None = None,
        shown_as: str = "exec",
        source: PolicySource | None = None,
        audit: AuditLog | None = None,
        sockets: Mapping[str, socket.socket] | None = None,
        load_later: bool = False,
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
        self._audit = audit
        self._sockets = sockets
        self._load_later = load_later
        # the files the policy is read from, as absolute paths (`ps`, the dashboard): named once,
        # while the working directory is the one they were given in
        named = [options.policy_file] if options.policy_file is not None else []
        try:
            self.policy_paths = [
                str(resolve_policy_path(n).absolute()) for n in (*named, *options.overrides.policies)
            ]
        except PolicyError as exc:
            raise SessionError(str(exc)) from exc

        # what the session decides by, loaded now: a bad file fails before anything starts
        self.vault = EnvVault()
        self.source: PolicySource = source or PolicyFile(options, transform, self.vault)
        now = self.source.load().in_force()
        self.tokens = TokenFile(options.gateway) if options.gateway is not None else None
        if self.tokens is not None:
            now = dataclasses.replace(now, tokens=self.tokens.load())
        self.in_force = PolicyHolder(now)
        self.gateway: GatewayCredentials | None = None
        if self.tokens is not None:
            from egressd.admission.tokens import GatewayCredentials

            self.gateway = GatewayCredentials(self._token_table, self.tokens.networks)

        # built by start()
        self.audit: AuditLog | None = None
        self.proxy: ProxyServer | None = None
        self.approvals: Approvals | None = None
        self.metrics: Metrics | None = None
        self.report: RefusalReport | None = None
        self.captured: CapturedReport | None = None
        self.reloads: Reloads | None = None
        self.child: ChildSetup | None = None
        self.control: ControlAPI | None = None
        self._services: list[Service] = []  # started on the proxy's loop, in this order

    @property
    def policy(self) -> Policy:
        return self.in_force.get()

    def _token_table(self) -> TokenTable:
        tokens = self.in_force.now.tokens
        assert tokens is not None
        return tokens

    # -- life cycle ------------------------------------------------------------------------------
    def start(self) -> Self:
        from egressd.session.approvals import Approvals
        from egressd.session.child import ChildSetup
        from egressd.session.proxy import EngineError, ProxyServer

        options = self.options
        self.audit = audit = self._audit or _open_audit(options, self.policy, self.context)
        audit.event("policy", traced=False, **settings(self.policy))
        self.proxy = proxy = ProxyServer(
            self.in_force,
            listen=options.listen,
            socks=options.socks if options.gateway is None else options.gateway.socks_listen is not None,
            socks_listen=options.gateway.socks_listen if options.gateway is not None else None,
            credentials=self.gateway,
            health=options.gateway is not None,
            tls=_listener_tls(options),
            # no audit file and no trace: the proxy skips building records it would throw away
            audit=audit if audit.enabled else None,
            inspect=options.inspect,
            config_dir=options.config_dir,
            upstream_ca=options.upstream_ca,
            identify=bool(options.identify),
            sockets=self._sockets,
        )
        proxy.context = self.context
        self.approvals = Approvals(proxy, options, self.source, self.command, self._say)
        self.child = ChildSetup(proxy, self.in_force, self.vault, audit, options.overrides.profile)
        self.reloads = Reloads(
            self.in_force,
            proxy,
            audit,
            self._say,
            announce=self._announce,
            tokens_path=self.tokens.path if self.tokens else None,
        )
        self._observe()
        if self.policy.secrets:
            not_dumpable()  # the child (same user) reads neither /proc/<egressd>/environ nor memory
        try:
            proxy.start(load=not self._load_later)
        except EngineError as exc:
            self.close()
            raise SessionError(f"cannot start the proxy: {exc}") from exc
        self.approvals.start()
        try:
            for service in self._build_services():
                proxy.start_service(service.start, service.name)
                self._services.append(service)
        except SessionError:
            self.close()
            raise
        return self

    def load(self) -> None:
        """Start loading the proxy (with `load_later`: the command's child is on its way)."""
        assert self.proxy is not None
        self.proxy.load()

    def give_up_load(self) -> None:
        """Nothing is left for the proxy to serve (the sandbox it was for is gone): a load still
        under way stops at its next step instead of taking the CPU the run's end needs; close()
        then lets go of what never started."""
        if self.proxy is not None:
            self.proxy.abandon()

    @property
    def failure(self) -> str | None:
        """Why the proxy could not serve the child (its load failed, or a service it was asked for
        could not start), if it could not."""
        if self.proxy is None:
            return None
        if self.proxy.error is not None:
            return f"the proxy could not start: {self.proxy.error}; the command was stopped"
        if self.proxy.stopped_for is not None:
            return f"{self.proxy.stopped_for}; the command was stopped"
        return None

    def _observe(self) -> None:
        """The observers the options ask for, subscribed before the first connection."""
        assert self.proxy is not None
        subscribe = self.proxy.events.subscribe
        if self.options.metrics is not None or self.options.control:
            # the control API serves them too (GET /metrics), so they count from the start
            from egressd.observe.metrics import Metrics

            clients = self.gateway.names if self.gateway is not None else None
            proxy, policies = self.proxy, self.in_force
            self.metrics = Metrics(
                lambda: proxy.pipeline, mode=lambda: policies.now.policy.mode, clients=clients
            )
            subscribe(self.metrics.observe, addresses=False)  # counters
        if self.options.report:
            from egressd.observe.captured import CapturedReport
            from egressd.observe.refusals import RefusalReport

            # with --trace every decision has its line already: only the summary is added
            self.report = RefusalReport(sys.stderr, lines=not self.options.trace, context=self.context)
            subscribe(self.report.observe, addresses=False, kinds=(Decided,))  # refusals only
            self.captured = CapturedReport(sys.stderr, lines=not self.options.trace)
            subscribe(self.captured.observe, addresses=False, kinds=(Decided,))  # captured decisions only

    def _build_services(self) -> Iterator[Service]:
        """The services, each built just before it starts (a failure stops the ones before it)."""
        from egressd.session.services import ControlAPI, DashboardPage, MetricsPort, Watching

        assert self.proxy is not None and self.reloads is not None and self.approvals is not None
        assert self.child is not None
        proxy, reloads = self.proxy, self.reloads
        if self.options.metrics is not None:
            assert self.metrics is not None
            port = MetricsPort(
                self.metrics, proxy.decider, self.options.metrics, self.options.metrics_token_file
            )
            self._say(f"metrics on {port.url}")
            yield port
        if (watcher := self.source.watch(reloads.policy, reloads.policy_failed)) is not None:
            yield Watching(watcher)
        if self.tokens is not None:
            yield Watching(self.tokens.watch(reloads.tokens, reloads.tokens_failed))
        if self.options.control and (opened := ControlAPI.socket(self._say)) is not None:
            from egressd.session.info import policy_info, ps_info

            self.control = ControlAPI(
                *opened,
                proxy=proxy,
                broker=self.approvals.broker,
                issuer=self.child.issuer(),
                info=lambda: ps_info(self),
                policy=lambda: policy_info(self),
                edit_policy=self.approvals.edit_policy if self.source.writable else None,
                metrics=self.metrics,
            )
            yield self.control
        if self.options.dashboard:
            if self.control is None:
                self._say("dashboard off: it needs the control API")
            else:
                yield DashboardPage(self.control.path, proxy.decider, self._say)

    def close(self) -> None:
        """Everything start() started, in reverse."""
        proxy = self.proxy
        if proxy is not None and (proxy.abandon() or proxy.error is not None):
            # the child is gone before the proxy was loaded, or it could not be: the services
            # never started, what they hold goes here
            _stop_unstarted(self._services)
            self._services.clear()
        while self._services:
            service = self._services.pop()
            with contextlib.suppress(Exception):
                proxy.run(service.stop())  # type: ignore[union-attr]
        if self.approvals is not None:
            self.approvals.stop()
            self.approvals = None
        if proxy is not None:
            proxy.stop()
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

    # -- while it runs ---------------------------------------------------------------------------
    def apply(self, loaded: Loaded) -> None:
        """Put a policy in force now, from any thread (the remote agent's pushed policies)."""
        assert self.proxy is not None and self.reloads is not None
        reloads = self.reloads

        async def on_the_loop() -> None:
            reloads.policy(loaded)

        self.proxy.run(on_the_loop())

    def reopen_audit(self) -> bool:
        """SIGHUP: open the audit file again by its path (logrotate moved it); False without one."""
        if self.audit is None or self.audit.path is None:
            return False
        self.audit.reopen()
        return True

    def reload_now(self) -> bool:
        """SIGHUP: reload the files now; False when there is none to reload."""
        if self.tokens is not None:
            self.tokens.watcher.trigger()
        return self.source.trigger() or self.tokens is not None

    def drain(self, timeout: float) -> None:
        if self.proxy is not None:
            self.proxy.drain(timeout)

    # -- what a command hands its child (session/child.py) ----------------------------------------
    def credentials(self, profile: str | None = None, label: str | None = None) -> ProxyCredentials:
        assert self.child is not None, "start() first"
        return self.child.credentials(profile, label)

    def record_child(self, creds: ProxyCredentials, command: Sequence[str]) -> None:
        assert self.child is not None
        self.child.record(creds, command)

    def child_env(
        self, base: Mapping[str, str] | None = None, creds: ProxyCredentials | None = None
    ) -> dict[str, str]:
        assert self.child is not None
        return self.child.environment(base, creds)

    def child_only(self, env: dict[str, str], creds: ProxyCredentials, *, listener: bool) -> dict[str, str]:
        assert self.child is not None
        return self.child.child_only(env, creds, listener=listener)

    def child_started(self, creds: ProxyCredentials, pid: int) -> None:
        if self.child is not None:
            self.child.started(creds, pid)

    def exports(self, creds: ProxyCredentials | None = None) -> dict[str, str]:
        assert self.child is not None
        return self.child.exports(creds)

    def proxy_urls(self, creds: ProxyCredentials) -> tuple[str, str | None]:
        assert self.child is not None
        return self.child.proxy_urls(creds)

    @property
    def ca_bundle(self) -> str | None:
        return self.proxy.ca_bundle if self.proxy is not None else None

    def placeholders(self) -> dict[str, str]:
        """The secrets' child variables: {variable: placeholder} (never a value)."""
        return self.in_force.now.secrets.child_variables()

    def hidden_variables(self) -> tuple[str, ...]:
        """egressd's own variables that hold secret values: never given to a child."""
        return hidden_variables(self.policy.secrets, self.vault)


def _stop_unstarted(services: Sequence[Service]) -> None:
    """Stop services whose start never ran (the proxy's loop never did): each only lets go of what
    it was built with (its socket, its file), and its stop awaits nothing, so it runs to its end
    here, with no event loop (none may be loaded)."""
    for service in reversed(services):
        stop = service.stop()
        with contextlib.suppress(Exception):  # StopIteration: it ended
            stop.send(None)
        stop.close()  # one that waited on something after all is not waited for


def _open_audit(options: SessionOptions, policy: Policy, context: HintContext) -> AuditLog:
    try:
        return AuditLog(
            options.audit_path,
            trace=sys.stderr if options.trace else None,
            on_failure=policy.audit.on_failure,
            max_queue_bytes=policy.audit.max_queue_bytes,
            context=context,
        )
    except OSError as exc:
        raise SessionError(f"--audit {options.audit_path}: {exc.strerror or exc}") from exc


def _listener_tls(options: SessionOptions) -> ssl.SSLContext | None:
    """The gateway's proxy port over TLS (--tls-cert/--tls-key or --tls-name), else None."""
    if options.gateway is None or options.gateway.tls is None:
        return None
    import ssl

    from egressd.inspect.ca import CAError

    try:
        return options.gateway.tls.context(options.config_dir)
    except (OSError, ssl.SSLError, CAError) as exc:
        raise SessionError(f"the TLS listener: {exc}") from exc
