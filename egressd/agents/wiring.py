"""Join a running proxy session to an ACP or MCP relay: the environments, the decision, the refusals.

Kept out of the CLI so `exec` and `sandbox` runs wire the bridges the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Literal

from egressd.agents import acp_asks
from egressd.agents.acp import AcpBridge
from egressd.agents.mcp_run import McpBridge
from egressd.agents.stdio import StdioRelay
from egressd.child.env import child_environment
from egressd.policy import Decision

if TYPE_CHECKING:
    from egressd.admission.state import ProxyCredentials
    from egressd.session import ProxySession


# Where the agent runs: on the host's network, in the sandbox, or (unconfined otherwise) in a
# network namespace of its own; the last two reach the proxy at the launcher's listeners
Network = Literal["host", "sandbox", "own"]


def inside_sandbox_env(
    session: ProxySession, creds: ProxyCredentials, *, own_loopback: bool = False
) -> dict[str, str]:
    """The proxy variables a process started in a launcher's network namespace needs (the
    listeners there); `own_loopback`: loopback skips the proxy (run.OWN_LOOPBACK)."""
    from egressd.sandbox import BRIDGE_HOST, BRIDGE_HTTP_PORT, BRIDGE_SOCKS_PORT
    from egressd.sandbox.launch import with_own_loopback

    assert session.proxy is not None
    socks = (
        creds.proxy_url(BRIDGE_HOST, BRIDGE_SOCKS_PORT, "socks5h") if session.proxy.socks_address else None
    )
    env = child_environment(
        {},
        creds.proxy_url(BRIDGE_HOST, BRIDGE_HTTP_PORT),
        socks,
        ca_bundle=session.ca_bundle,
        placeholders=session.placeholders(),  # a secret's placeholder, never its value
    )
    return with_own_loopback(env) if own_loopback else env


@contextlib.contextmanager
def acp_relay(
    session: ProxySession,
    relay: StdioRelay,
    creds: ProxyCredentials,
    *,
    network: Network,
    warn: Callable[[str], None],
) -> Iterator[AcpBridge]:
    """Relay ACP between egressd's stdin/stdout and the child while the block runs the child."""
    assert session.proxy is not None
    proxy = session.proxy

    def server_env(profile: str | None) -> dict[str, str]:
        server_creds = session.credentials(profile if profile is not None else creds.profile)
        if network == "host":
            return session.exports(server_creds)
        return inside_sandbox_env(session, server_creds, own_loopback=network == "own")

    def terminal_env() -> dict[str, str]:
        # the client runs terminals on this machine, outside any sandbox: the host-side proxy
        return session.exports(session.credentials(creds.profile))

    def decide(host: str, port: int, profile: str | None, scheme: str, path: str) -> Decision:
        return proxy.decider.decide(host, port, profile, scheme=scheme, path=path)

    bridge = AcpBridge(
        relay.client,
        server_env=server_env,
        terminal_env=terminal_env,
        decide=decide,
        agent_profile=creds.profile,
        profiles=lambda: frozenset(session.policy.profiles),
        warn=warn,
        context=session.context,
    )
    proxy.events.subscribe(bridge.observe)
    approvals = session.approvals  # mode: ask's broker
    detach = acp_asks.attach(approvals.broker, bridge, warn) if approvals is not None else None
    relay.start(bridge.from_client, bridge.from_agent)
    try:
        yield bridge
    finally:
        if detach is not None:
            detach()
        relay.finish()
        proxy.events.unsubscribe(bridge.observe)
        bridge.close()


@contextlib.contextmanager
def mcp_relay(session: ProxySession, relay: StdioRelay) -> Iterator[McpBridge]:
    """Relay MCP between egressd's stdin/stdout and the server while the block runs it."""
    assert session.proxy is not None
    events = session.proxy.events
    bridge = McpBridge(session.context)
    events.subscribe(bridge.observe)
    relay.start(bridge.from_client, bridge.from_server, strict=False)
    try:
        yield bridge
    finally:
        relay.finish()
        events.unsubscribe(bridge.observe)
