"""Limits apply before the decision, on every front: refused hosts cannot be probed without limit.

Why: a front that took a rate-limit token only after an allow would let a child probe refused
hosts as fast as it liked: with `requests_per_second: 1, burst: 1` three CONNECTs to a refused host
must answer 403, 429, 429 on every front, never 403, 403, 403.
Each front is driven by a real client against a real `egressd run`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.corpus import ProxyClient, tunnel_get
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun, write_policy
from tests.support.upstreams import EchoHTTPServer

POLICY = """\
version: 1
allow: [ok.test]
private: {allow: true}
limits: {requests_per_second: 1, burst: 1}
"""


@pytest.fixture
def client(tmp_path: Path, dns: DnsServer) -> Iterator[ProxyClient]:
    """A fresh `egressd run` (a fresh child token, so a full bucket) for each test."""
    policy = write_policy(tmp_path, POLICY)
    with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]) as run:
        yield ProxyClient.from_env(run.env)


def _connect(client: ProxyClient, authority: str) -> str:
    with client.connect(authority) as (response, _sock):
        assert response is not None, authority
        return f"{response.status} {response.reason}"


def _get(client: ProxyClient, url: str, host: str) -> str:
    response = client.get(url, host=host)
    assert response is not None, url
    return f"{response.status} {response.reason or 'upstream'}"


def _socks5(client: ProxyClient, host: str, port: int) -> int:
    with client.socks5(host, port) as (code, _sock):
        return code


def test_connect_to_a_refused_host_is_rate_limited(client: ProxyClient) -> None:
    """CONNECT: the second and third probe of a refused host are answered 429, not decided."""
    answers = [_connect(client, "refused.test:443") for _ in range(3)]
    assert answers == ["403 not_allowlisted", "429 rate_limited", "429 rate_limited"]


def test_connect_refusals_and_allows_share_one_bucket(client: ProxyClient, dns: DnsServer) -> None:
    """A refused CONNECT takes the token an allowed one would have needed (one bucket per child)."""
    with EchoHTTPServer("127.0.0.1") as upstream:
        dns.add("ok.test", upstream.host)
        answers = [_connect(client, "refused.test:443"), _connect(client, f"ok.test:{upstream.port}")]
    assert answers == ["403 not_allowlisted", "429 rate_limited"]
    assert upstream.connections == 0


def test_absolute_form_request_to_a_refused_host_is_rate_limited(client: ProxyClient) -> None:
    """Plain HTTP: the same order (it was already right there; kept right by the shared step)."""
    answers = [_get(client, "http://refused.test/x", "refused.test") for _ in range(3)]
    assert answers == ["403 not_allowlisted", "429 rate_limited", "429 rate_limited"]


def test_socks5_connect_to_a_refused_host_is_rate_limited(client: ProxyClient) -> None:
    """SOCKS5 (by name, ATYP 3): "not allowed by ruleset" once, then "general failure" (429's code)."""
    codes = [_socks5(client, "refused.test", 443) for _ in range(3)]
    assert codes == [0x02, 0x01, 0x01]


def test_an_inspected_tunnel_takes_one_token_per_request(tmp_path: Path, dns: DnsServer) -> None:
    """The front hands a tunnel to inspect to mitmproxy, whose requests inside are limited and
    decided again: the CONNECT costs one token, not two. Burst 2 = the CONNECT plus one request inside it."""
    policy = write_policy(
        tmp_path,
        "version: 1\nallow:\n  - {host: ok.test, paths: [/v1/]}\nprivate: {allow: true}\n"
        "limits: {requests_per_second: 0.2, burst: 2}\n",
    )
    with EchoHTTPServer("127.0.0.1") as upstream:
        dns.add("ok.test", upstream.host)
        with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]) as run:
            client = ProxyClient.from_env(run.env)
            with client.connect(f"ok.test:{upstream.port}") as (response, sock):
                assert response is not None and response.status == 200, response and response.raw_head
                inner = tunnel_get(sock, "ok.test", path="/v1/item")
            assert inner is not None and (inner.status, inner.reason) == (200, None), inner and inner.raw_head
            assert _connect(client, f"ok.test:{upstream.port}") == "429 rate_limited"
    assert [r["path"] for r in upstream.requests] == ["/v1/item"]
