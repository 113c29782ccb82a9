"""What a session decides by, as one snapshot: the policy as this session applies it, the values of
its secrets read from the same files, and the gateway's token table. Loaded at start, watched, and
put in force whole (`egressd.admission.in_force.InForce`, one assignment on the proxy's loop), so a
request never meets one version's policy with another's secrets.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from egressd.admission.in_force import InForce, PolicyHolder
from egressd.admission.secrets import NO_SECRETS
from egressd.policy import Policy, PolicyError, load_policy
from egressd.session.options import SessionError, SessionOptions
from egressd.session.overrides import base_policy, host_loopback, resolve_policy_path
from egressd.session.secret_values import EnvVault, SecretError, read_values

if TYPE_CHECKING:
    from egressd.admission.events import EventBus
    from egressd.admission.tokens import TokenTable
    from egressd.observe.audit import AuditLog
    from egressd.platform.files import ReadBytes
    from egressd.platform.reload import FileWatcher
    from egressd.session.gateway_options import GatewayOptions
    from egressd.session.proxy import ProxyServer


@dataclass(frozen=True)
class Loaded:
    """A policy as the session applies it, with its secrets' values read from the same files."""

    policy: Policy
    secret_values: Mapping[str, str]

    def in_force(self, before: InForce | None = None) -> InForce:
        """The snapshot this version makes of `before` (the placeholders handed out so far kept)."""
        book = (before.secrets if before is not None else NO_SECRETS).updated(
            self.policy.secrets, self.secret_values
        )
        return InForce(self.policy, book, before.tokens if before is not None else None)


class PolicySource(Protocol):
    """Where a session's policy comes from: `PolicyFile` (a file or the default, watched), or the
    remote agent's channel (egressd.remote.agent)."""

    @property
    def path(self) -> Path | None: ...

    @property
    def writable(self) -> bool: ...

    def load(self) -> Loaded:
        """The first policy (SessionError, or the source's own error: why the session cannot
        start)."""
        ...

    def watch(
        self, on_change: Callable[[Loaded], None], on_error: Callable[[str], None]
    ) -> FileWatcher[Loaded] | None: ...

    def trigger(self) -> bool:
        """Load again now; False when there is nothing to load again."""
        ...


class PolicyFile:
    """The policy as this session runs it: the file (or the built-in default) with the command
    line's overrides, the gateway's host loopback, the command's narrowing (`transform`) and the
    parent proxy's credentials, with the values of its secrets, every file read once through one
    snapshot (egressd.platform.files) and watched together."""

    def __init__(
        self, options: SessionOptions, transform: Callable[[Policy], Policy] | None, vault: EnvVault
    ) -> None:
        self.options = options
        self._transform = transform
        self.vault = vault
        self.path = resolve_policy_path(options.policy_file) if options.policy_file is not None else None
        self.watcher: FileWatcher[Loaded] | None = None

    def load(self) -> Loaded:
        """The first load (SessionError: why it cannot start); a file is watched from now on."""
        path = self.path
        if path is None:  # the default policy: no file to read nor watch
            try:
                return self.build(base_policy(None))
            except PolicyError as exc:
                raise SessionError(str(exc)) from exc
        from egressd.platform.reload import FileWatcher, UnsettledError

        try:
            self.watcher = FileWatcher(
                path,
                lambda files: self.build(load_policy(path, os.environ, files.read), files.read),
                _unwired,
                _unwired,
                name="egressd-policy-watch",
            )
            return self.watcher.load()
        except (PolicyError, UnsettledError) as exc:
            raise SessionError(str(exc)) from exc

    def build(self, policy: Policy, read: ReadBytes = Path.read_bytes) -> Loaded:
        """The policy as this session runs it, and its secrets' values; every file it reads (merged
        policies, secrets, the parent proxy's credentials) through `read`."""
        policy = self.options.overrides.apply(policy, read)
        if self.options.gateway is not None:
            policy = host_loopback(policy)
        policy = self._transform(policy) if self._transform else policy
        if policy.upstream_proxy is not None:  # its credentials are read now: at start, on reload
            from egressd.net.parent_proxy import with_credentials

            policy = with_credentials(policy, os.environ, read)
        # the secrets' values are read with the policy: one that cannot be read fails the load
        try:
            values = read_values(policy.secrets, self.vault, read)
        except SecretError as exc:
            raise PolicyError(policy.source, "secrets", message=str(exc)) from None
        return Loaded(policy, values)

    def watch(
        self, on_change: Callable[[Loaded], None], on_error: Callable[[str], None]
    ) -> FileWatcher[Loaded] | None:
        """The file's watcher, handing on every good new version (None: no file to watch)."""
        if self.watcher is not None:
            self.watcher.on_change, self.watcher.on_error = on_change, on_error
        return self.watcher

    def trigger(self) -> bool:
        """Reload now (SIGHUP, an edit egressd made); False when there is no file."""
        if self.watcher is None:
            return False
        self.watcher.trigger()
        return True

    @property
    def writable(self) -> bool:
        """An ask answered "always" writes the user's policy file, never a built-in preset."""
        return self.watcher is not None and Path(str(self.options.policy_file)).is_file()


class TokenFile:
    """The gateway's token file (created empty when missing) and its source networks; watched like
    the policy, so `gateway token add/remove` applies without a restart."""

    def __init__(self, gateway: GatewayOptions) -> None:
        from egressd.admission.tokens import TokenFileError, parse_network
        from egressd.platform.reload import FileWatcher
        from egressd.session.token_file import table_from_bytes

        self.path = path = gateway.tokens
        try:
            self.networks = [parse_network(text, "--allow-from") for text in gateway.allow_from]
        except TokenFileError as exc:
            raise SessionError(f"--tokens: {exc}") from exc
        self.watcher: FileWatcher[TokenTable] = FileWatcher(
            path,
            lambda files: table_from_bytes(files.read(path), str(path)),
            _unwired,
            _unwired,
            name="egressd-tokens-watch",
        )

    def load(self) -> TokenTable:
        from egressd.admission.tokens import TokenFileError
        from egressd.platform.reload import UnsettledError
        from egressd.session.token_file import ensure_file

        try:
            ensure_file(self.path)
            return self.watcher.load()
        except (TokenFileError, OSError, UnsettledError) as exc:
            raise SessionError(f"--tokens: {exc}") from exc

    def watch(
        self, on_change: Callable[[TokenTable], None], on_error: Callable[[str], None]
    ) -> FileWatcher[TokenTable]:
        self.watcher.on_change, self.watcher.on_error = on_change, on_error
        return self.watcher


class Reloads:
    """Puts each new version in force on the proxy's loop — one new snapshot, one assignment — then
    tells the audit and the metrics (a Notice on the pipeline's bus) and, when asked, the user."""

    def __init__(
        self,
        in_force: PolicyHolder,
        proxy: ProxyServer,
        audit: AuditLog,
        say: Callable[[str], None],
        *,
        announce: bool,
        tokens_path: Path | None = None,
    ) -> None:
        self.in_force = in_force
        self.proxy = proxy
        self.events: EventBus = proxy.events
        self.audit = audit
        self._say = say
        self._announce = announce
        self._tokens_path = tokens_path

    def policy(self, loaded: Loaded) -> None:
        policy = loaded.policy
        self.proxy.set_policy(loaded.in_force(self.in_force.now))
        self.audit.configure(policy.audit.on_failure, policy.audit.max_queue_bytes)
        self.notice("reload", **settings(policy))
        if self._announce:
            self._say(f"policy reloaded from {policy.source} (mode: {policy.mode})")

    def policy_failed(self, message: str) -> None:
        self.notice("reload_failed", error=message)
        self._say(f"reload failed: {' '.join(message.split())}; keeping the last good policy")

    def tokens(self, table: TokenTable) -> None:
        self.proxy.set_policy(dataclasses.replace(self.in_force.now, tokens=table))
        self.proxy.close_revoked()  # a removed client's open tunnels end now, not when idle
        self.notice("tokens_reload", source=str(self._tokens_path or ""), clients=len(table.entries))
        if self._announce:
            self._say(f"gateway tokens reloaded ({len(table.entries)} clients)")

    def tokens_failed(self, message: str) -> None:
        self.notice("tokens_reload_failed", error=message)
        self._say(f"token file reload failed: {' '.join(message.split())}; keeping the last good one")

    def notice(self, kind: str, **fields: object) -> None:
        """A reload is an event like the pipeline's: the audit and metrics observe it on its bus."""
        from egressd.admission.events import Notice

        self.events.emit(Notice(kind, fields))


def settings(policy: Policy) -> dict[str, object]:
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


def _unwired(_: object) -> None:
    """A watcher's callback until the session wires it (it is started only after that)."""
