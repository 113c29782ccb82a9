"""Relay mode: the remote child's traffic comes back through the SSH connection to the local proxy.

The remote child's proxy variables point at `127.0.0.1:<port>` ON THE REMOTE, a port the
session's guard (reaper.py, run by the remote's python3) binds and holds for as long as anything
the command started runs. The guard relays each connection to a Unix socket in the session's
private directory, the remote end of a reverse forward sshd opened, which leads to egressd's
loopback proxy here. Other users of the remote host can connect to that port too, which is why
the child's credentials matter: they get 407. They can never bind it: when the session ends, the
guard freezes the command's tree, ends it, and only then lets go of the port. The credentials
reach the remote in a private file, never in a command line.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from egressd.child import process
from egressd.child.env import CA_BUNDLE_VARS, proxy_exports
from egressd.platform.interfaces import local_addresses
from egressd.policy import Policy
from egressd.remote import reaper, scripts
from egressd.remote.connection import SshConnection, SshError, remote_text
from egressd.remote.supervise import Outcome, supervise
from egressd.session import ProxySession

CA_NAME = "ca.pem"
REMOTE_LOOPBACK = "127.0.0.1"


def relay_policy(policy: Policy, *, client_loopback: bool = False) -> Policy:
    """The policy as the relay applies it: the client's own addresses count as its loopback.

    Through the relay, 127.0.0.1 — and just as well the client's LAN address — reaches services
    listening on the CLIENT (databases, dev servers, local model servers). Those addresses fall
    under the loopback rules, and the loopback is closed to the remote (a remote command's
    "localhost" is not the client's) unless `--client-loopback` opens it. Read again at every
    policy load, so addresses that changed meanwhile are current then.
    """
    own = frozenset(ip for ip in local_addresses() if not ip.is_loopback)
    loopback = dataclasses.replace(policy.loopback, addresses=policy.loopback.addresses | own)
    source = policy.source
    if policy.loopback.allow and not client_loopback:
        loopback = dataclasses.replace(loopback, allow=False)
        source = (
            f"{policy.source} (egressd ssh: the client's loopback and own addresses are closed to the "
            "remote; --client-loopback opens them)"
        )
    return dataclasses.replace(policy, loopback=loopback, source=source)


class Relay:
    """One relayed run; `directory` is the remote session directory once it exists."""

    def __init__(
        self, session: ProxySession, connection: SshConnection, say: Callable[[str], None] = lambda _: None
    ) -> None:
        self.session = session
        self.connection = connection
        self.say = say
        self.directory: str | None = None

    def plan(self) -> tuple[str, bytes | None]:
        """The session plan (the command's variables, the ports the guard holds and the sockets it
        relays them to) and the CA bundle to upload (if any)."""
        proxy = self.session.proxy
        assert proxy is not None, "start the session first"
        creds = self.session.credentials()
        listen = [{"name": "http", "host": REMOTE_LOOPBACK, "port": 0, "relay": "http.sock"}]
        http_url = f"http://{creds.username}:{creds.token}@{REMOTE_LOOPBACK}:{reaper.port_mark('http')}"
        socks_url = None
        if proxy.socks_address is not None:
            listen.append({"name": "socks", "host": REMOTE_LOOPBACK, "port": 0, "relay": "socks.sock"})
            socks_url = (
                f"socks5h://{creds.username}:{creds.token}@{REMOTE_LOOPBACK}:{reaper.port_mark('socks')}"
            )
        exports = proxy_exports(http_url, socks_url, placeholders=self.session.placeholders())
        bundle = self.session.ca_bundle
        if bundle is None:
            return scripts.session_plan(exports, listen=listen), None
        try:
            data = Path(bundle).read_bytes()
        except OSError as exc:
            raise SshError(f"cannot read the CA bundle {bundle}: {exc.strerror or exc}", 2) from exc
        files = dict.fromkeys(CA_BUNDLE_VARS, CA_NAME)
        return scripts.session_plan(exports, files, listen=listen), data

    def forwards(self, directory: str) -> list[tuple[str, str, int]]:
        """(remote socket, local host, local port) for the proxy's ports."""
        proxy = self.session.proxy
        assert proxy is not None
        forwards = [(f"{directory}/http.sock", *proxy.http_address)]
        if proxy.socks_address is not None:
            forwards.append((f"{directory}/socks.sock", *proxy.socks_address))
        return forwards

    def run(self, command: Sequence[str], catcher: process.SignalCatcher) -> Outcome:
        plan, bundle = self.plan()
        self.directory = directory = self.connection.make_directory(plan)
        done = self.connection.helper(
            scripts.prepare_relay_command(directory), input=Path(reaper.__file__).read_bytes()
        )
        if not done.ok:
            why = remote_text(done.stderr) or f"exit status {done.returncode}"
            raise SshError(
                f"relay mode needs python3 ({'.'.join(map(str, scripts.MIN_PYTHON))} or later) on "
                f"{self.connection.name}: it runs the small guard that holds the port the command "
                f"connects to, and ends all the command started when the session ends ({why}). "
                "Install python3 there, or use --egress remote. Nothing was run.",
                exit_code=2,
            )
        if bundle is not None:
            done = self.connection.helper(scripts.put_command(directory, CA_NAME), input=bundle)
            if not done.ok:
                raise SshError(
                    f"cannot copy the CA bundle to {self.connection.name}: {remote_text(done.stderr)}", 2
                )
        self.connection.forward_sockets(self.forwards(directory))
        # With a terminal on stdin the ssh client must stay in the foreground group to read it.
        child = self.connection.start(scripts.relay_guarded(directory, command), new_group=not os.isatty(0))
        try:
            return supervise(child, self.connection, directory, catcher)
        finally:
            if child.poll() is None:
                child.stop(grace=2.0)

    def close(self) -> None:
        """Nothing of its own to stop: the proxy belongs to the session, the rest to the connection."""
