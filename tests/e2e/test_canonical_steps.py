"""Every step after canonicalisation uses the canonical target: the choice to inspect, on every front.

Why: a step that compares the client's spelling instead of the canonical target lets a child reach
a path-restricted host uninspected by spelling it differently on SOCKS5 (``API.TEST``,
``api.test.``): the decision canonicalises the name, and a choice to intercept made on the spelling
would pass the tunnel through, every path reaching the server. And a policy whose only path rule is
a ``deny`` must turn inspection on, or the proxy refuses every connection (``needs_inspection``)
while ``egressd check`` says allow. Real clients, a real
`egressd run`, a real TLS upstream on 127.0.0.1 and the tests' own DNS server.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from tests.support.corpus import ProxyClient, Response, read_response
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD, EgressdRun, write_policy
from tests.support.upstreams import EchoHTTPSServer

NAME = "api.test"
# the client's spellings of NAME: each must be decided, inspected and audited as NAME
SPELLINGS = ["api.test", "API.TEST", "api.test.", "Api.Test.", "API.test"]

PATH_ALLOW = """\
version: 1
allow:
  - {host: api.test, paths: [/v1/]}
private: {allow: true}
"""

DENY_ONLY = """\
version: 1
allow: [api.test]
deny:
  - {host: api.test, paths: [/admin]}
private: {allow: true}
"""


@dataclass
class Lab:
    """One `egressd run` with a policy, its raw client and the TLS upstream behind NAME."""

    run: EgressdRun
    client: ProxyClient
    upstream: EchoHTTPSServer
    policy: Path

    @property
    def bundle(self) -> str:
        """The child's CA bundle: system roots plus egressd's CA (set only when inspection is on)."""
        return self.run.env["SSL_CERT_FILE"]


@contextlib.contextmanager
def _lab(tmp: Path, policy_text: str, ca: trustme.CA, ca_file: Path) -> Iterator[Lab]:
    policy = write_policy(tmp, policy_text)
    with (
        pytest.MonkeyPatch.context() as patch,
        DnsServer() as dns,
        EchoHTTPSServer("127.0.0.1", ca=ca, hostnames=[NAME]) as upstream,
    ):
        patch.setenv("EGRESSD_HOME", str(tmp / "home"))  # egressd's CA lands here, not in ~/.config
        dns.add(NAME, "127.0.0.1")
        options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--upstream-ca", str(ca_file)]
        with EgressdRun(options) as run:
            yield Lab(run, ProxyClient.from_env(run.env), upstream, policy)


@pytest.fixture(scope="module")
def path_lab(tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA, ca_file: Path) -> Iterator[Lab]:
    with _lab(tmp_path_factory.mktemp("path-allow"), PATH_ALLOW, ca, ca_file) as lab:
        yield lab


@pytest.fixture(scope="module")
def deny_lab(tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA, ca_file: Path) -> Iterator[Lab]:
    with _lab(tmp_path_factory.mktemp("deny-only"), DENY_ONLY, ca, ca_file) as lab:
        yield lab


@contextlib.contextmanager
def _tunnel(lab: Lab, front: str, spelling: str) -> Iterator[socket.socket]:
    """An established tunnel to spelling:port through `front` (CONNECT or SOCKS5 by name, ATYP 3)."""
    port = lab.upstream.port
    if front == "socks5":
        with lab.client.socks5(spelling, port) as (code, sock):
            assert code == 0, (spelling, f"SOCKS5 reply {code}")
            yield sock
        return
    with lab.client.connect(f"{spelling}:{port}") as (response, sock):
        assert response is not None and response.status == 200, (spelling, response and response.raw_head)
        yield sock


def _get(lab: Lab, front: str, spelling: str, path: str) -> Response | str:
    """GET path inside TLS through a tunnel named spelling, trusting only the child's CA bundle.

    A tunnel egressd passed through uninspected answers with the upstream's own certificate, which
    that bundle does not trust: returned as the text "not inspected: ...".
    """
    with _tunnel(lab, front, spelling) as sock:
        context = ssl.create_default_context(cafile=lab.bundle)
        try:
            tls = context.wrap_socket(sock, server_hostname=NAME)
        except ssl.SSLError as exc:
            return f"not inspected: {exc}"
        with tls:
            tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {NAME}\r\nConnection: close\r\n\r\n".encode())
            response = read_response(tls)
            assert response is not None, (front, spelling, path, "closed without an answer")
            return response


def _outcome(result: Response | str) -> str:
    """`200 upstream`, `403 <reason>` or why not inspected: comparable in one assertion."""
    if isinstance(result, str):
        return result
    return f"{result.status} {result.reason or 'upstream'}"


FRONTS = ["socks5", "connect"]


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_path_rule_host_is_inspected_in_every_spelling(path_lab: Lab, front: str, spelling: str) -> None:
    """A host admitted only for /v1/ is intercepted however the client spells it: /v1/ reaches the
    server through egressd's certificate, /admin is refused inside the tunnel and never arrives."""
    before = len(path_lab.upstream.requests)
    allowed = _outcome(_get(path_lab, front, spelling, "/v1/item"))
    refused = _outcome(_get(path_lab, front, spelling, "/admin"))
    assert (allowed, refused) == ("200 upstream", "403 not_allowlisted"), (front, spelling)
    assert [r["path"] for r in path_lab.upstream.requests[before:]] == ["/v1/item"], (front, spelling)


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_path_scoped_deny_is_enforced_in_every_spelling(deny_lab: Lab, front: str, spelling: str) -> None:
    """`deny: [{host: api.test, paths: [/admin]}]` alone turns inspection on for api.test: /admin is
    refused with the deny rule's reason in every spelling, other paths reach the server."""
    before = len(deny_lab.upstream.requests)
    allowed = _outcome(_get(deny_lab, front, spelling, "/other"))
    refused = _outcome(_get(deny_lab, front, spelling, "/admin"))
    assert (allowed, refused) == ("200 upstream", "403 denylist"), (front, spelling)
    assert [r["path"] for r in deny_lab.upstream.requests[before:]] == ["/other"], (front, spelling)


def _check(lab: Lab, target: str) -> tuple[int, str]:
    result = subprocess.run(
        [*EGRESSD, "check", "--policy", str(lab.policy), target], capture_output=True, text=True, timeout=60
    )
    return result.returncode, result.stdout.splitlines()[0]


def test_proxy_and_check_agree_on_a_deny_only_path_rule(deny_lab: Lab) -> None:
    """`egressd check` and the proxy give the same answer for the same URL (one decision function)."""
    assert _check(deny_lab, f"https://{NAME}/other") == (0, "allow")
    assert _check(deny_lab, f"https://{NAME}/admin") == (1, "deny")
    assert _outcome(_get(deny_lab, "connect", NAME, "/other")) == "200 upstream"
    assert _outcome(_get(deny_lab, "connect", NAME, "/admin")) == "403 denylist"
