"""What a child of a session gets: its credentials, its environment (the proxy's URLs, the CA
bundle, the secrets' placeholders, never egressd's own variables that hold secret values), the
JVM's settings, and the audit line naming its program."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from egressd.child.env import child_environment, proxy_exports
from egressd.session.secret_values import EnvVault, hidden_variables

if TYPE_CHECKING:
    from egressd.admission.credentials import ProxyCredentials
    from egressd.admission.in_force import PolicyHolder
    from egressd.control.children import Issuer
    from egressd.observe.audit import AuditLog
    from egressd.session.proxy import ProxyServer


class ChildSetup:
    """Credentials and environments for the children of one running proxy; `profile`: the
    command line's (--profile), for a child that names none."""

    def __init__(
        self,
        proxy: ProxyServer,
        in_force: PolicyHolder,
        vault: EnvVault,
        audit: AuditLog,
        profile: str | None,
    ) -> None:
        self.proxy = proxy
        self.in_force = in_force
        self.vault = vault
        self.audit = audit
        self.profile = profile

    @property
    def ca_bundle(self) -> str | None:
        return self.proxy.ca_bundle

    def credentials(self, profile: str | None = None, label: str | None = None) -> ProxyCredentials:
        return self.proxy.issue_credentials(profile if profile is not None else self.profile, label)

    def attach_credentials(self, profile: str | None, label: str) -> ProxyCredentials:
        """An attached child's credentials: its own profile (one the policy defines), else this
        session's."""
        policy = self.in_force.get()
        if profile is not None and profile not in policy.profiles:
            known = ", ".join(sorted(policy.profiles)) or "none defined"
            raise KeyError(f"no such profile {profile!r} in {policy.source} (known: {known})")
        return self.credentials(profile, label)

    def issuer(self) -> Issuer:
        """What the control API's registry of attached children may do (exec --attach)."""
        from egressd.child.ssh_env import ssh_may_be_allowed
        from egressd.control.children import Issuer

        return Issuer(
            issue=self.attach_credentials,
            revoke=self.proxy.revoke,
            exports=self.exports,
            ssh=lambda: ssh_may_be_allowed(self.in_force.get()),
            record=self.record,
            hidden=self.hidden_variables,
            started=self.started,
        )

    def proxy_urls(self, creds: ProxyCredentials) -> tuple[str, str | None]:
        url = creds.proxy_url(*self.proxy.http_address)
        socks = self.proxy.socks_address
        return url, creds.proxy_url(*socks, scheme="socks5h") if socks else None

    def record(self, creds: ProxyCredentials, command: Sequence[str]) -> None:
        """An audit record naming the program a child runs under these credentials, so a reader
        (`egressd policy suggest`) can say which command needed a host. Only the program's name:
        arguments carry tokens (URLs with credentials, headers), and the audit must not."""
        if command:
            program = os.path.basename(command[0])
            self.audit.event("child", client=creds.client, profile=creds.profile, program=program)

    def environment(
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
        from egressd.child.env import CHILD_PROXY_VAR, java_environment
        from egressd.inspect.ca import java_truststore_path
        from egressd.policy import join_host_port

        address = None
        if listener:
            address = self.proxy.child_only_listener(creds)
            env[CHILD_PROXY_VAR] = f"http://{join_host_port(*address)}"
        store = java_truststore_path(self.ca_bundle) if self.ca_bundle else None
        truststore = str(store) if store is not None and store.is_file() else None
        return java_environment(env, proxy=address, truststore=truststore)

    def started(self, creds: ProxyCredentials, pid: int) -> None:
        """The child running with creds is pid (its process tree is its connections' owner)."""
        self.proxy.child_started(creds, pid)

    def exports(self, creds: ProxyCredentials | None = None) -> dict[str, str]:
        url, socks = self.proxy_urls(creds or self.credentials())
        return proxy_exports(url, socks, ca_bundle=self.ca_bundle, placeholders=self.placeholders())

    def placeholders(self) -> dict[str, str]:
        """The secrets' child variables: {variable: placeholder} (never a value)."""
        return self.in_force.now.secrets.child_variables()

    def hidden_variables(self) -> tuple[str, ...]:
        """egressd's own variables that hold secret values: never given to a child."""
        return hidden_variables(self.in_force.get().secrets, self.vault)
