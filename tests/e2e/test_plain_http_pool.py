"""Kept-alive upstream connections are shared by a child's client connections, and by nobody else.

Why: a child that sends every request on a new connection (`Connection: close`) made egressd open a
new upstream connection for each; now the upstream connection its last request left is taken again —
but only for a request of the same child that the pipeline has just admitted to the same target, in
the same state. Through the real `egressd run` (and `run --gateway` for two children), with raw
clients, to real servers counting the connections they accept.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.attempts import wait_until
from tests.support.corpus import ProxyClient, Response
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun, GatewayRun, write_policy
from tests.support.gateway_clients import add_token, client, token_cli
from tests.support.gateway_clients import upstream as gateway_upstream  # noqa: F401 - the gateway tests' upstream
from tests.support.plain_http import POLICY, RawClient, ScriptedServer
from tests.support.upstreams import EchoHTTPServer, free_port


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    s = ScriptedServer()
    yield s
    s.close()


def _ok(answer: Response | None) -> bool:
    return answer is not None and answer.status == 200


def test_a_childs_new_connections_reuse_the_upstream_connection(
    tmp_path: Path, server: ScriptedServer
) -> None:
    """Five requests, each on a new client connection with `Connection: close`: one upstream
    connection serves them all, in turn."""
    with EgressdRun(["--policy", str(write_policy(tmp_path, POLICY))]) as run:
        child = ProxyClient.from_env(run.env)
        for i in range(5):
            answer = child.get(f"http://127.0.0.1:{server.port}/r{i}")
            assert _ok(answer) and f'"/r{i}"'.encode() in answer.body, answer
        assert server.connections == 1


def test_a_reload_never_reuses_a_kept_connection(tmp_path: Path, server: ScriptedServer) -> None:
    """A policy reload that still allows the target: the next request gets a new upstream
    connection, pinned under the policy now in force; one that refuses the target refuses it."""
    policy = write_policy(tmp_path, POLICY)
    with EgressdRun(["--policy", str(policy)]) as run:
        child = ProxyClient.from_env(run.env)
        url = f"http://127.0.0.1:{server.port}/"
        assert _ok(child.get(url)) and _ok(child.get(url)) and server.connections == 1
        policy.write_text(POLICY.replace("deny: [denied.test]", "deny: [denied.test, 127.0.0.2]"))
        denied = f"http://127.0.0.2:{server.port}/"
        wait_until(lambda: (a := child.get(denied)) is not None and a.reason == "denylist", "the reload")
        assert _ok(child.get(url))
        assert server.connections == 2
        policy.write_text(POLICY + "loopback: {allow: false}\n")
        refused = wait_until(
            lambda: (a := child.get(url)) is not None and a.status == 403 and a, "the target refused"
        )
        assert refused.reason, refused
        assert server.connections == 2


@pytest.fixture
def gateway(
    tmp_path: Path,
    dns: DnsServer,
    gateway_upstream: EchoHTTPServer,  # noqa: F811
) -> Iterator[tuple[GatewayRun, Path, dict[str, str]]]:
    """`egressd run --gateway` with the tokens of three children, made before it starts (a token
    file reloaded while a test runs would change the state its kept connections were pinned in)."""
    dns.add("up.test", gateway_upstream.host)
    tokens = tmp_path / "tokens.json"
    secrets = {name: add_token(tokens, name) for name in ("one", "two", "agent")}
    policy = write_policy(tmp_path, "version: 1\nallow: [up.test, 198.51.100.0/24]\n")
    options = ["--gateway", "--listen", f"127.0.0.1:{free_port()}", "--tokens", str(tokens)]
    options += ["--policy", str(policy), "--nameserver", dns.nameserver]
    with GatewayRun(options) as run:
        yield run, tokens, secrets


def test_another_child_never_gets_a_kept_connection(
    gateway: tuple[GatewayRun, Path, dict[str, str]],
    gateway_upstream: EchoHTTPServer,  # noqa: F811
) -> None:
    run, _, secrets = gateway
    url = f"http://up.test:{gateway_upstream.port}/"
    one, two = client(run, "one", secrets["one"]), client(run, "two", secrets["two"])
    assert _ok(one.get(url)) and _ok(one.get(url))
    assert gateway_upstream.connections == 1  # the same child: its kept connection
    assert _ok(two.get(url))
    assert gateway_upstream.connections == 2  # another child: never the first one's
    assert _ok(two.get(url)) and _ok(one.get(url))
    assert gateway_upstream.connections == 2


def test_a_revoked_token_never_gets_a_kept_connection(
    gateway: tuple[GatewayRun, Path, dict[str, str]],
    gateway_upstream: EchoHTTPServer,  # noqa: F811
) -> None:
    """A child's token removed and issued again (the same name): the old token is refused, and the
    new one's request is served on a new upstream connection."""
    run, tokens, secrets = gateway
    url = f"http://up.test:{gateway_upstream.port}/"
    old = client(run, "agent", secrets["agent"])
    assert _ok(old.get(url)) and _ok(old.get(url)) and gateway_upstream.connections == 1
    assert token_cli("remove", "agent", tokens=tokens).returncode == 0
    new = client(run, "agent", add_token(tokens, "agent"))
    wait_until(lambda: _ok(new.get(url)), "the new token admitted")
    answer = old.get(url)
    assert answer is not None and answer.status == 407, answer
    assert gateway_upstream.connections == 2
    assert _ok(new.get(url)) and gateway_upstream.connections == 2


def test_a_connection_pinned_under_one_rule_is_never_reused_under_another(
    tmp_path: Path, dns: DnsServer, server: ScriptedServer
) -> None:
    """The same child, the same target, the same state, but another pin: up.test resolves to a
    loopback address, which only the `private: true` rule of /open may use. A request for /open is
    served and leaves its upstream connection kept; a request for /closed (the plain rule: a name
    may not resolve to a loopback address) must be refused by the pin step, on a new connection as
    on the same one, and never be carried by the kept connection."""
    dns.add("up.test", "127.0.0.1")
    policy = "version: 1\nallow:\n  - {host: up.test, paths: [/open], private: true}\n  - up.test\n"
    options = ["--policy", str(write_policy(tmp_path, policy)), "--nameserver", dns.nameserver]
    with EgressdRun(options) as run:
        child = ProxyClient.from_env(run.env)
        base = f"http://up.test:{server.port}"
        assert _ok(child.get(f"{base}/open/a")) and server.connections == 1
        refused = child.get(f"{base}/closed")
        assert refused is not None and refused.status == 403, refused
        assert refused.reason == "resolved_forbidden", refused
        raw = RawClient(run)  # a kept-alive client connection: its next request, after /open's
        assert b" 200 " in raw.get(f"{base}/open/b")
        assert b" 403 " in raw.get(f"{base}/closed")
        assert server.connections == 1
        assert all(b"/closed" not in head for head, _ in server.requests)
