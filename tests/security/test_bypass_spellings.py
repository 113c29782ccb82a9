"""Bypass corpus, target spellings: every way of writing a host, through the real proxy.

Why: a proxy that decides on one reading of a host and connects to another is the classic egress
bypass (``0x7f.1``, ``[::ffff:169.254.169.254]``, ``allowed.test@evil.test``). Each spelling goes
through three front ends of one `egressd run` (absolute-form HTTP, CONNECT, SOCKS5 by name) and
must get the expected outcome AND reason code; behind every address a wrong reading could reach
sits a connection-counting server on the same port, and none of them may see a connection.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.corpus import ProxyClient, Response, ServerSet, tunnel_get
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun, write_policy
from tests.support.spellings import (
    ALLOW,
    ALLOWED_V4,
    ALLOWED_V6,
    CASES,
    DNS_NAMES,
    FORBID,
    INVALID,
    POLICY,
    PRIV,
    SERVER_HOSTS,
    Case,
)


@dataclass
class Corpus:
    client: ProxyClient
    servers: ServerSet
    dns: DnsServer
    run: EgressdRun

    @property
    def port(self) -> int:
        return self.servers.port


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Corpus]:
    """One `egressd run`, one DNS server and the counting servers for the whole table."""
    tmp = tmp_path_factory.mktemp("spellings")
    policy = write_policy(Path(tmp), POLICY)
    with DnsServer() as dns, ServerSet(SERVER_HOSTS) as servers:
        for name, address in DNS_NAMES.items():
            dns.add(name, address)
        with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]) as run:
            yield Corpus(ProxyClient.from_env(run.env), servers, dns, run)
        assert servers.reached(ALLOWED_V4, ALLOWED_V6) == {}


def _answered_by(response: Response | None) -> str | None:
    if response is None or response.reason is not None:
        return None
    try:
        return str(json.loads(response.body)["server"])
    except (ValueError, KeyError):
        return None


def _expected_server(case: Case) -> str:
    v6 = ":" in case.host and "ffff" not in case.host.lower()
    return f"http-{ALLOWED_V6}" if v6 else f"http-{ALLOWED_V4}"


def _outcome(expect: str, case: Case, response: Response | None, inner: Response | None) -> str | None:
    """None when ``response`` (and the tunnel's ``inner`` answer) is the outcome ``expect``, else why not."""
    if response is None:
        return "closed without an answer"
    if expect == ALLOW:
        if response.status != 200:
            return f"{response.status} {response.reason}"
        answered = _answered_by(inner if inner is not None else response)
        return None if answered == _expected_server(case) else f"answered by {answered}"
    if expect == INVALID:
        ok = (response.status, response.reason) in ((400, "bad_request"), (403, "invalid_target"))
        return None if ok else f"{response.status} {response.reason}"
    if (response.status, response.reason) != (403, expect):
        return f"{response.status} {response.reason}"
    error = "destination_ip_prohibited" if expect in (FORBID, PRIV) else "http_request_denied"
    return None if response.proxy_status.startswith(f"egressd; error={error}") else response.proxy_status


def _check(case: Case, response: Response | None, inner: Response | None = None) -> None:
    problems = [_outcome(e, case, response, inner) for e in (case.expect, case.also) if e is not None]
    assert None in problems, (case.host, case.why, problems, response.raw_head[:300] if response else None)


def _leaks(corpus: Corpus, before: dict[str, int]) -> dict[str, int]:
    """New connections to any server other than the allowed ones."""
    after = corpus.servers.counts()
    allowed = {ALLOWED_V4, ALLOWED_V6}
    return {h: after[h] - before[h] for h in after if after[h] != before[h] and h not in allowed}


IDS = [f"{x.expect}:{x.host[:40]}" for x in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_absolute_form_http(corpus: Corpus, case: Case) -> None:
    """``GET http://HOST:PORT/`` — the target decides; the Host header agrees with it."""
    before = corpus.servers.counts()
    response = corpus.client.get(f"http://{case.host}:{corpus.port}/spell", host=f"{case.host}:{corpus.port}")
    _check(case, response)
    assert _leaks(corpus, before) == {}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_connect(corpus: Corpus, case: Case) -> None:
    """``CONNECT HOST:PORT`` — the tunnel goes to the decided address or nowhere. Twice, the same
    head bytes: the second is decided again, and reaches the same server or nothing."""
    before = corpus.servers.counts()
    for _attempt in range(2):
        with corpus.client.connect(f"{case.host}:{corpus.port}") as (response, sock):
            inner = tunnel_get(sock, case.host) if response is not None and response.status == 200 else None
            _check(case, response, inner)
    assert _leaks(corpus, before) == {}


SOCKS_CASES = [(case, name) for case, name in zip(CASES, IDS, strict=True) if len(case.host.encode()) <= 255]


@pytest.mark.parametrize("case", [c for c, _ in SOCKS_CASES], ids=[i for _, i in SOCKS_CASES])
def test_socks5_by_name(corpus: Corpus, case: Case) -> None:
    """SOCKS5 CONNECT with the spelling as a domain name (ATYP 3; a name longer than the 255 bytes
    SOCKS5 can carry is not a SOCKS5 case): same decision, reply 0x02."""
    before = corpus.servers.counts()
    with corpus.client.socks5(case.host, corpus.port) as (code, sock):
        if code == 0:
            answered = _answered_by(tunnel_get(sock, case.host))
            assert ALLOW in (case.expect, case.also), (case.host, "allowed, answered by", answered)
            assert answered == _expected_server(case)
        else:
            assert case.expect != ALLOW, (case.host, code)
            assert code == 0x02, (case.host, code)  # "connection not allowed by ruleset"
    assert _leaks(corpus, before) == {}


@pytest.mark.parametrize(
    "front",
    [
        "absolute-form",
        "connect",
        "socks5",
    ],
)
def test_idna2008_name_is_reachable(corpus: Corpus, front: str) -> None:
    """An allowed IDNA2008 name (``faß.test`` = ``xn--fa-hia.test``) is reachable through every front end.

    Not a bypass but the reverse: mitmproxy's request reader decodes hosts with Python's IDNA 2003
    codec, which rejects this A-label ("does not round-trip"), so an allowed host is refused with 400.
    """
    host = "xn--fa-hia.test"
    if front == "absolute-form":
        response = corpus.client.get(f"http://{host}:{corpus.port}/", host=f"{host}:{corpus.port}")
        assert response is not None and response.status == 200, response and response.raw_head
        assert _answered_by(response) == f"http-{ALLOWED_V4}"
    elif front == "connect":
        with corpus.client.connect(f"{host}:{corpus.port}") as (response, sock):
            assert response is not None and response.status == 200, response and response.raw_head
            assert _answered_by(tunnel_get(sock, host)) == f"http-{ALLOWED_V4}"
    else:
        with corpus.client.socks5(host, corpus.port) as (code, sock):
            assert code == 0
            assert _answered_by(tunnel_get(sock, host)) == f"http-{ALLOWED_V4}"
