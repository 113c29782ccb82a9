"""Bypass corpus, DNS tricks: the name is allowed, the answer is the attack.

Why: an allowlisted name whose DNS the attacker controls can point anywhere — loopback, the
metadata service, an internal host, or first somewhere harmless and then somewhere else (rebinding).
egressd resolves once, classifies every address, and connects only to the survivors. Each case
asserts the answer, the reason code, and — through servers listening on the SAME port at every
address an answer names — that no refused address got a connection.
"""

from __future__ import annotations

import ipaddress
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.corpus import ProxyClient, Reader, Response, ServerSet, tunnel_get
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun, write_policy
from tests.support.upstreams import free_port

GOOD = "198.51.100.1"  # the one address the strict policy admits (explicit IP rule)
INTERNAL = "192.0.2.1"  # private (documentation range), no rule
VICTIMS = ("127.0.0.1", "::1", INTERNAL)

STRICT = f"""\
version: 1
allow: ["*.allowed.test", {GOOD}]
loopback: {{allow: false}}
limits: {{dns_timeout: 1}}
"""


@dataclass
class Env:
    client: ProxyClient
    servers: ServerSet
    dns: DnsServer
    run: EgressdRun

    @property
    def port(self) -> int:
        return self.servers.port

    def get(self, name: str, port: int | None = None) -> Response | None:
        port = port or self.port
        return self.client.get(f"http://{name}:{port}/dns", host=f"{name}:{port}", timeout=15)


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """egressd with `*.allowed.test` allowed by name; only 198.51.100.1 admitted as an address."""
    tmp = Path(tmp_path_factory.mktemp("dns"))
    policy = write_policy(tmp, STRICT)
    with DnsServer() as dns, ServerSet((GOOD, *VICTIMS)) as servers:
        with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]) as run:
            yield Env(ProxyClient.from_env(run.env), servers, dns, run)
        assert servers.reached(GOOD) == {}


def _served_by(response: Response | None) -> str | None:
    if response is None or response.status != 200:
        return None
    return str(json.loads(response.body)["server"])


def _refused(response: Response | None, status: int, reason: str) -> None:
    assert response is not None
    assert (response.status, response.reason) == (status, reason), response.raw_head[:400]


# -- answers that point where the name may not go ------------------------------------------------
FORBIDDEN_ANSWERS = [
    # (id, addresses answered)
    ("loopback", ["127.0.0.1"]),
    ("loopback-other", ["127.8.9.10"]),
    ("loopback-v6", ["::1"]),
    ("unspecified-reaches-loopback", ["0.0.0.0"]),
    ("unspecified-v6", ["::"]),
    ("metadata", ["169.254.169.254"]),
    ("metadata-mapped", ["::ffff:169.254.169.254"]),
    ("metadata-nat64", ["64:ff9b::a9fe:a9fe"]),
    ("metadata-6to4", ["2002:a9fe:a9fe::1"]),
    ("metadata-aws-v6", ["fd00:ec2::254"]),
    ("loopback-mapped", ["::ffff:127.0.0.1"]),
    ("loopback-compatible", ["::127.0.0.1"]),
    ("unspecified-mapped", ["::ffff:0.0.0.0"]),
    ("link-local-v6", ["fe80::1"]),
    ("multicast", ["224.0.0.1", "ff02::1"]),
    ("broadcast", ["255.255.255.255"]),
    ("private-no-rule", [INTERNAL]),
    ("rfc1918", ["10.0.0.1", "172.16.0.1", "192.168.1.1"]),
    ("cgnat", ["100.64.0.1"]),
    ("ula", ["fd12:3456::1"]),
    ("everything-bad-at-once", ["127.0.0.1", "0.0.0.0", "169.254.169.254", INTERNAL, "::1", "fe80::1"]),
]


@pytest.mark.parametrize(
    "addresses", [c[1] for c in FORBIDDEN_ANSWERS], ids=[c[0] for c in FORBIDDEN_ANSWERS]
)
def test_answer_with_only_refused_addresses(strict: Env, addresses: list[str]) -> None:
    """403 resolved_forbidden naming every address; no connection to any of them."""
    name = f"r{abs(hash(tuple(addresses))) % 10**8}.allowed.test"
    strict.dns.add(name, *addresses)
    before = strict.servers.counts()
    response = strict.get(name)
    _refused(response, 403, "resolved_forbidden")
    assert response is not None and response.proxy_status.startswith(
        "egressd; error=destination_ip_prohibited"
    )
    for address in addresses:  # the detail names every address (in its canonical spelling)
        text = str(ipaddress.ip_address(address))
        assert text in response.proxy_status or text in response.body.decode(), address
    assert strict.servers.counts() == before


def test_mixed_answer_connects_only_to_the_valid_address(strict: Env) -> None:
    """Refused addresses first in the answer: the connection still goes only to 198.51.100.1."""
    strict.dns.add("mixed.allowed.test", "127.0.0.1", "0.0.0.0", "169.254.169.254", INTERNAL, GOOD, "::1")
    before = strict.servers.counts()
    response = strict.get("mixed.allowed.test")
    assert _served_by(response) == f"http-{GOOD}"
    after = strict.servers.counts()
    assert {h: after[h] - before[h] for h in after if after[h] != before[h]} == {GOOD: 1}


def test_mixed_answer_through_connect(strict: Env) -> None:
    strict.dns.add("mixed-tunnel.allowed.test", "127.0.0.1", "::ffff:127.0.0.1", GOOD)
    before = strict.servers.counts()
    with strict.client.connect(f"mixed-tunnel.allowed.test:{strict.port}") as (response, sock):
        assert response is not None and response.status == 200
        assert _served_by(tunnel_get(sock, "mixed-tunnel.allowed.test")) == f"http-{GOOD}"
    after = strict.servers.counts()
    assert {h: after[h] - before[h] for h in after if after[h] != before[h]} == {GOOD: 1}


def test_rebinding_uses_the_validated_address(strict: Env) -> None:
    """First answer 198.51.100.1, every later one 127.0.0.1: a kept-alive connection stays on the
    validated address (one lookup); a new client connection of the same child may be served on the
    kept upstream connection (still the validated address); where none is kept the name is looked up
    again and the new answer refused. Never is 127.0.0.1 reached."""
    strict.dns.add_sequence("rebind.allowed.test", [[GOOD], ["127.0.0.1"]])
    before = strict.servers.counts()
    with strict.client.open() as sock:
        reader = Reader(sock)
        for index in range(3):
            request = f"GET http://rebind.allowed.test:{strict.port}/r{index} HTTP/1.1\r\n"
            request += f"Host: rebind.allowed.test:{strict.port}\r\n"
            sock.sendall(request.encode() + strict.client.auth_header + b"\r\n")
            assert _served_by(reader.response()) == f"http-{GOOD}"
            time.sleep(0.2)
    assert strict.dns.count("rebind.allowed.test", "A") == 1
    # another client connection: the kept upstream connection (the validated address) or, had it
    # gone, a new lookup refused; another port has no kept connection: looked up again, refused
    response = strict.get("rebind.allowed.test")
    assert _served_by(response) == f"http-{GOOD}" or (response and response.reason == "resolved_forbidden")
    _refused(strict.get("rebind.allowed.test", strict.port + 1), 403, "resolved_forbidden")
    after = strict.servers.counts()
    assert {h: after[h] - before[h] for h in after if after[h] != before[h]} == {GOOD: 1}


@pytest.mark.parametrize(
    ("chain", "final"),
    [
        (["internal.corp.test"], [INTERNAL]),
        (["localhost.corp.test"], ["127.0.0.1"]),
        (["metadata.corp.test"], ["169.254.169.254"]),
        (["a.corp.test", "b.corp.test", "c.corp.test", "d.corp.test"], ["127.0.0.1", "::1"]),
        (["evil.test"], ["::ffff:127.0.0.1"]),
    ],
    ids=["to-internal", "to-loopback", "to-metadata", "four-hops-to-loopback", "to-mapped-loopback"],
)
def test_cname_chain_into_internal_names(strict: Env, chain: list[str], final: list[str]) -> None:
    """An allowed name that is a CNAME (chain) for an internal one: the addresses decide, refused."""
    name = f"{chain[0].split('.')[0]}-{len(chain)}.cname.allowed.test"
    previous = name
    for hop in chain:
        strict.dns.add_cname(previous, hop)
        previous = hop
    strict.dns.add(previous, *final)
    before = strict.servers.counts()
    _refused(strict.get(name), 403, "resolved_forbidden")
    assert strict.servers.counts() == before


def test_cname_loop_is_a_dns_error(strict: Env) -> None:
    strict.dns.add_cname("loop.allowed.test", "loop2.corp.test")
    strict.dns.add_cname("loop2.corp.test", "loop.allowed.test")
    _refused(strict.get("loop.allowed.test"), 502, "dns_error")


@pytest.mark.parametrize(
    ("setup", "status", "reason"),
    [("servfail", 502, "dns_error"), ("nxdomain", 502, "dns_error"), ("nodata", 502, "dns_error")],
)
def test_dns_failures(strict: Env, setup: str, status: int, reason: str) -> None:
    name = f"{setup}.allowed.test"
    if setup == "servfail":
        strict.dns.servfail(name)
    elif setup == "nxdomain":
        strict.dns.nxdomain(name)
    else:
        strict.dns.add(name)  # the name exists, with no A or AAAA records
    before = strict.servers.counts()
    _refused(strict.get(name), status, reason)
    assert strict.servers.counts() == before


def test_dns_server_that_never_answers(strict: Env) -> None:
    """A blackholed name is a 502 dns_timeout after dns_timeout (1 s), not a hang."""
    strict.dns.blackhole("silent.allowed.test")
    started = time.monotonic()
    _refused(strict.get("silent.allowed.test"), 502, "dns_timeout")
    assert time.monotonic() - started < 5


def test_huge_answer(strict: Env) -> None:
    """500 A records (truncated over UDP, retried over TCP): at most 4 are used, the first works."""
    addresses = strict.dns.huge("huge.allowed.test", count=500)
    assert addresses[0] == GOOD
    before = strict.servers.counts()
    assert _served_by(strict.get("huge.allowed.test")) == f"http-{GOOD}"
    assert any(t == "tcp" for q, _, t in strict.dns.query_log if q == "huge.allowed.test")
    after = strict.servers.counts()
    assert {h: after[h] - before[h] for h in after if after[h] != before[h]} == {GOOD: 1}


def test_refused_name_is_never_resolved(strict: Env) -> None:
    """A name the policy refuses costs no DNS query at all (no leak of the name to the resolver)."""
    strict.dns.add("not-allowed.test", GOOD)
    strict.dns.clear_log()
    _refused(strict.get("not-allowed.test"), 403, "not_allowlisted")
    _refused(strict.get("169.254.169.254"), 403, "forbidden_address")
    assert strict.dns.queries == []


# -- a permissive policy (private.allow) must still keep loopback rules for loopback in any form ----
@dataclass
class Permissive:
    env: Env
    self_port: int


@pytest.fixture(scope="module")
def permissive(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Permissive]:
    """private.allow: true, loopback only on egressd's own port (which is still never allowed)."""
    tmp = Path(tmp_path_factory.mktemp("dns-permissive"))
    self_port = free_port("127.0.0.1")
    policy = write_policy(
        tmp,
        f'version: 1\nallow: ["*.lan.test"]\nprivate: {{allow: true}}\nloopback: {{ports: [{self_port}]}}\n',
    )
    with DnsServer() as dns, ServerSet((GOOD, *VICTIMS)) as servers:
        options = [
            "--policy",
            str(policy),
            "--nameserver",
            dns.nameserver,
            "--listen",
            f"127.0.0.1:{self_port}",
        ]
        with EgressdRun(options) as run:
            yield Permissive(Env(ProxyClient.from_env(run.env), servers, dns, run), self_port)
        assert servers.reached(GOOD, INTERNAL) == {}


@pytest.mark.parametrize(
    "answer",
    ["127.0.0.1", "::1", "::ffff:127.0.0.1", "::ffff:7f00:1", "::127.0.0.1"],
    ids=["v4", "v6", "mapped", "mapped-hex", "compatible"],
)
def test_private_allow_keeps_loopback_ports(permissive: Permissive, answer: str) -> None:
    """A name resolving to loopback — however spelled — obeys loopback.ports even with private.allow."""
    env = permissive.env
    name = f"lo-{answer.replace(':', '-').replace('.', '-')}.lan.test"
    env.dns.add(name, answer)
    before = env.servers.counts()
    _refused(env.get(name), 403, "resolved_forbidden")
    assert env.servers.counts() == before


@pytest.mark.parametrize("answer", ["127.0.0.1", "::ffff:127.0.0.1", "::1"], ids=["v4", "mapped", "v6"])
def test_name_resolving_to_egressd_itself(permissive: Permissive, answer: str) -> None:
    """A name resolving to egressd's own listener (port allowed in loopback.ports) is refused: a
    child must not loop back into the proxy (it would come back with egressd's own address)."""
    env = permissive.env
    name = f"self-{answer.replace(':', '-').replace('.', '-')}.lan.test"
    env.dns.add(name, answer)
    _refused(env.get(name, permissive.self_port), 403, "resolved_forbidden")


def test_private_allow_admits_private_names(permissive: Permissive) -> None:
    """Control: with private.allow, a name resolving to a private address does connect."""
    env = permissive.env
    env.dns.add("printer.lan.test", INTERNAL)
    assert _served_by(env.get("printer.lan.test")) == f"http-{INTERNAL}"
