"""Relay mode: the remote child's traffic comes back through the SSH connection to the local proxy.

The remote child's proxy variables point at `127.0.0.1:<port>` ON THE REMOTE, a reverse forward
sshd opened (port of its choice) that leads to egressd's loopback proxy here. Other users of the
remote host can connect to that port too, which is why the child's credentials matter: they get
407. The credentials reach the remote in a private file, never in a command line.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from egressd import process
from egressd.child_env import CA_BUNDLE_VARS, proxy_exports
from egressd.policy import Policy
from egressd.remote import reaper, scripts
from egressd.remote.connection import SshConnection, SshError
from egressd.remote.interfaces import local_addresses
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


_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def _proc_address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """A /proc/net/tcp{,6} address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(text)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def exposed_listeners(proc_net_tcp: str, ports: Collection[int]) -> list[str]:
    """Listening sockets on `ports` bound to a non-loopback address, from /proc/net/tcp{,6} text.

    sshd binds a remote forward on every address, whatever the client asked, when its
    GatewayPorts is `yes`: then other hosts reach egressd's proxy port.
    """
    found = []
    for line in proc_net_tcp.splitlines():
        fields = line.split()
        if len(fields) < 4 or fields[3] != _LISTEN or ":" not in fields[1]:
            continue
        address, _, port = fields[1].partition(":")
        try:
            ip, number = _proc_address(address), int(port, 16)
        except ValueError:
            continue
        mapped = getattr(ip, "ipv4_mapped", None)
        if number in ports and not (mapped or ip).is_loopback:
            found.append(f"[{ip}]:{number}" if ip.version == 6 else f"{ip}:{number}")
    return found


class Relay:
    """One relayed run; `directory` is the remote session directory once it exists."""

    def __init__(
        self, session: ProxySession, connection: SshConnection, say: Callable[[str], None] = lambda _: None
    ) -> None:
        self.session = session
        self.connection = connection
        self.say = say
        self.directory: str | None = None

    def check_loopback_only(self, ports: Collection[int]) -> None:
        """Refuse (exit 2) when sshd bound a forward beyond the remote's loopback (GatewayPorts)."""
        done = self.connection.helper(scripts.remote_command(scripts.LISTENERS))
        if not done.ok or "local_address" not in done.stdout:
            self.say(
                f"cannot check which address {self.connection.name} binds the forward on (no "
                "/proc/net/tcp there); if its sshd has GatewayPorts yes, other hosts reach this proxy port"
            )
            return
        exposed = exposed_listeners(done.stdout, ports)
        if exposed:
            raise SshError(
                f"sshd on {self.connection.name} binds the reverse forward on {', '.join(exposed)}, not "
                "only on its loopback (GatewayPorts yes in its sshd_config): other hosts could reach "
                "egressd's proxy port. Set GatewayPorts no or clientspecified there. Nothing was run.",
                exit_code=2,
            )

    def environment(self) -> tuple[str, bytes | None]:
        """Forward the proxy's ports; the env file text and the CA bundle to upload (if any)."""
        proxy = self.session.proxy
        assert proxy is not None, "start the session first"
        creds = self.session.credentials()
        http_port = self.connection.forward(*proxy.http_address)
        ports = [http_port]
        socks_url = None
        if proxy.socks_address is not None:
            socks_port = self.connection.forward(*proxy.socks_address)
            socks_url = creds.proxy_url(REMOTE_LOOPBACK, socks_port, scheme="socks5h")
            ports.append(socks_port)
        self.check_loopback_only(ports)
        exports = proxy_exports(
            creds.proxy_url(REMOTE_LOOPBACK, http_port), socks_url, placeholders=self.session.placeholders()
        )
        bundle = self.session.ca_bundle
        if bundle is None:
            return scripts.env_file(exports), None
        try:
            data = Path(bundle).read_bytes()
        except OSError as exc:
            raise SshError(f"cannot read the CA bundle {bundle}: {exc.strerror or exc}", 2) from exc
        return scripts.env_file(exports, dict.fromkeys(CA_BUNDLE_VARS, CA_NAME)), data

    def run(self, command: Sequence[str], catcher: process.SignalCatcher) -> Outcome:
        env_text, bundle = self.environment()
        self.directory = directory = self.connection.make_directory(env_text)
        if bundle is not None:
            done = self.connection.helper(scripts.put_command(directory, CA_NAME), input=bundle)
            if not done.ok:
                raise SshError(
                    f"cannot copy the CA bundle to {self.connection.name}: {done.stderr.strip()}", 2
                )
        # the remote end of the session ends all the command started when SSH drops (reaper.py)
        done = self.connection.helper(
            scripts.put_command(directory, scripts.REAPER_NAME), input=Path(reaper.__file__).read_bytes()
        )
        if not done.ok:
            raise SshError(f"cannot prepare the session on {self.connection.name}: {done.stderr.strip()}", 2)
        # With a terminal on stdin the ssh client must stay in the foreground group to read it.
        child = self.connection.start(scripts.relay_wrapped(directory, command), new_group=not os.isatty(0))
        try:
            return supervise(child, self.connection, directory, catcher)
        finally:
            if child.poll() is None:
                child.stop(grace=2.0)

    def close(self) -> None:
        """Nothing of its own to stop: the proxy belongs to the session, the rest to the connection."""
