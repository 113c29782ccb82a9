"""Spelling, for methods: `get` is not `GET` (RFC 9110 9.1: methods are case-sensitive), and the
bytes egressd forwards are the bytes it decided, on both fronts.

Why: a rule `{host: path.test, paths: [/ok/], methods: [GET]}` admits GET only. A decision that
upper-cases the method admits `get` as GET and then forwards `get`, which a server may read as
something else (a router that lower-cases, a framework that dispatches on the raw method). Each row
sends one spelling of a method through the real `egressd run` (plain HTTP, and HTTPS egressd
inspects) to a real server and proves what was admitted, and that the server got exactly the method
that was decided — or nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun, write_policy
from tests.support.proxied import FRONTS, Proxied
from tests.support.raw_upstream import RawUpstream, Script, Seen

ADDRESS = "198.51.100.63"
HOSTS = ["path.test", "lower.test", "built.test", "host.test"]
POLICY = """\
version: 1
mode: enforce
allow:
  - {host: path.test, paths: [/ok/], methods: [GET]}
  - {host: lower.test, paths: [/ok/], methods: [get]}   # a rule's methods are read upper-case: GET
  - host.test
builtin:
  - {host: built.test, paths: [/ok/]}                     # GET and HEAD
inspect: [host.test]
private: {allow: true}
"""
# (host, method as sent) -> the refusal's reason, or None when admitted
ROWS: dict[tuple[str, str], str | None] = {
    ("path.test", "GET"): None,
    ("path.test", "get"): "not_allowlisted",
    ("path.test", "Get"): "not_allowlisted",
    ("path.test", "gET"): "not_allowlisted",
    ("path.test", "POST"): "not_allowlisted",
    ("lower.test", "GET"): None,
    ("lower.test", "get"): "not_allowlisted",
    ("built.test", "GET"): None,
    ("built.test", "HEAD"): None,
    ("built.test", "get"): "builtin_path",
    ("built.test", "head"): "builtin_path",
    ("built.test", "Head"): "builtin_path",
    ("host.test", "get"): None,  # a host rule admits every method: forwarded as written
    ("host.test", "PoSt"): None,
}


def _answer(seen: Seen) -> Script:
    return [b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"]


@dataclass
class Setup:
    run: EgressdRun
    plain: RawUpstream
    tls: RawUpstream


@pytest.fixture(scope="module")
def setup(ca: trustme.CA, ca_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    policy = write_policy(tmp_path_factory.mktemp("method-case"), POLICY)
    with DnsServer() as dns:
        for host in HOSTS:
            dns.add(host, ADDRESS)
        with (
            RawUpstream(ADDRESS, _answer, name="case-plain") as plain,
            RawUpstream(ADDRESS, _answer, ca=ca, hostnames=HOSTS, name="case-tls") as tls,
            EgressdRun(
                ["--policy", str(policy), "--nameserver", dns.nameserver, "--upstream-ca", str(ca_file)]
            ) as run,
        ):
            yield Setup(run, plain, tls)


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize(("host", "method"), list(ROWS))
def test_the_method_decided_is_the_method_sent(setup: Setup, front: str, host: str, method: str) -> None:
    upstream = setup.plain if front == "plain" else setup.tls
    path = f"/ok/{front}-{host}-{method}"
    answer = Proxied(setup.run).request(front, f"{host}:{upstream.port}", method, path, [])
    got = [s for s in upstream.requests() if s.target in (path, f"http://{host}:{upstream.port}{path}")]
    refused = ROWS[(host, method)]
    if refused is None:
        assert answer.status == 200, answer.raw[:400]
        assert [s.method for s in got] == [method]  # exactly the bytes decided
    else:
        assert answer.status == 403 and answer.field(b"x-egressd-reason") == refused.encode(), answer.raw[
            :400
        ]
        assert got == []
