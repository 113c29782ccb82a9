"""The fixtures of the `egressd ssh` tests: the lab (module scope), servers inside its namespaces.

Loaded by each such test module with `pytest_plugins = ("tests.support.ssh_fixtures",)`, so the
module-scoped lab is built once per module; see ssh_lab.py for the topology.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import trustme

from tests.support.dns_server import DnsServer
from tests.support.ssh_lab import INTERNET, SshLab
from tests.support.upstreams import EchoHTTPServer, EchoHTTPSServer


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshLab]:
    """Needs root (the modules using it are marked needs_root): named network namespaces, sshd."""
    with SshLab(tmp_path_factory.mktemp("ssh-lab")) as built:
        yield built


@pytest.fixture
def internet(lab: SshLab) -> Iterator[EchoHTTPServer]:
    """An HTTP echo server inside the internet namespace (on 198.18.0.6)."""
    server = lab.in_internet(lambda: EchoHTTPServer(INTERNET, name="internet").start())
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def internet_tls(lab: SshLab, ca: trustme.CA) -> Iterator[EchoHTTPSServer]:
    """An HTTPS echo server inside the internet namespace, certificate for up.test (session CA)."""
    server = lab.in_internet(
        lambda: EchoHTTPSServer(INTERNET, name="internet-tls", ca=ca, hostnames=["up.test"]).start()
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def names(dns: DnsServer) -> DnsServer:
    """The client's DNS: every test name points at the internet namespace's server."""
    for name in ("up.test", "denied.test", "nope.test"):
        dns.add(name, INTERNET)
    return dns


@pytest.fixture
def remote_dns(lab: SshLab) -> Iterator[DnsServer]:
    """A DNS server INSIDE the remote namespace (127.0.0.1 there): the remote egressd resolves."""
    server = lab.in_remote(lambda: DnsServer("127.0.0.1").start())
    for name in ("up.test", "denied.test"):
        server.add(name, INTERNET)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def routed(lab: SshLab) -> Iterator[None]:
    with lab.direct_route():
        yield
