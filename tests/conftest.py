"""Session set-up for egressd's tests: an isolated network namespace plus shared fixtures.

Why: integration tests run real clients through a real proxy to real servers. The whole pytest process
first moves into a fresh network namespace (only ``lo``, with documentation-range addresses standing in
for upstream hosts), so no test — even one exposing a bug that lets refused traffic through — can send
a packet off this machine. Support code is imported as ``tests.support.*``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import trustme  # noqa: E402

from tests.support import netns  # noqa: E402

if TYPE_CHECKING:
    from egressd.session.proxy import ProxyServer
from tests.support.dns_server import DnsServer  # noqa: E402
from tests.support.loops import DEFAULT_LOOP, LOOP_FACTORIES  # noqa: E402
from tests.support.npm_registry import NpmRegistry  # noqa: E402
from tests.support.pypi_index import TINY_INIT, PypiIndex  # noqa: E402
from tests.support.upstreams import (  # noqa: E402
    EchoHTTPServer,
    EchoHTTPSServer,
    RefusingPort,
    StallingPort,
    TcpEchoServer,
    make_ca,
    write_ca_file,
)
from tests.support.upstreams import free_port as _free_port  # noqa: E402

# Proxy settings from the caller's environment would point clients (curl, requests, urllib, node)
# at a proxy that does not exist inside the namespace; tests set their own explicitly.
_PROXY_VARS = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
    "FTP_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "no_proxy",
    "ftp_proxy",
)

_NETNS_STATUS: dict[str, str] = {}

UPSTREAM_TLS_NAMES = ["up.test", "other.test", "198.51.100.2"]


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Enter the isolated namespace before anything starts a thread; refuse to run outside it."""
    config.addinivalue_line("markers", "slow: a slow test (deselect with -m 'not slow')")
    config.addinivalue_line(
        "markers",
        "needs_root(reason): needs root of the host, for the reason given (network namespaces of its "
        "own, mounts, useradd, docker); a run as an ordinary user deselects it: -m 'not needs_root'",
    )
    if netns.in_test_netns():
        return
    try:
        _NETNS_STATUS["status"] = netns.enter_test_netns()
    except (netns.NetnsError, OSError) as exc:
        raise pytest.UsageError(
            f"integration tests need root or unprivileged user namespaces: {exc}. "
            "Refusing to run outside an isolated network namespace."
        ) from exc
    for var in _PROXY_VARS:
        os.environ.pop(var, None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A needs_root mark must say why: the reason is what a reviewer checks before trusting that the
    unprivileged run may leave the test out."""
    for item in items:
        for mark in item.iter_markers("needs_root"):
            if len(mark.args) != 1 or not isinstance(mark.args[0], str) or not mark.args[0].strip():
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.needs_root needs its reason")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Run as an ordinary user, a test that needs root fails with its reason (never a silent skip):
    the unprivileged run deselects exactly these with -m 'not needs_root'."""
    mark = item.get_closest_marker("needs_root")
    if mark is not None and not netns.real_root():
        pytest.fail(f"needs root: {mark.args[0]} (as an ordinary user, deselect with -m 'not needs_root')")


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """pytest-asyncio's hook: each loop egressd runs on for a test marked ON_EVERY_LOOP
    (tests/support/loops.py), else asyncio's."""
    marker = item.get_closest_marker("asyncio")
    if marker is not None and marker.kwargs.get("loop_factories"):
        return LOOP_FACTORIES
    return DEFAULT_LOOP


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Show where the session runs, so a log proves the isolation."""
    status = _NETNS_STATUS.get("status", "NOT isolated")
    return [f"egressd test netns: {status}; links: {', '.join(netns.links())}"]


# ------------------------------------------------------------------------------------------------
# Fixtures
# ------------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def egressd_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh EGRESSD_HOME per test: a CA egressd creates lands there, never in ~/.config."""
    home = tmp_path_factory.mktemp("egressd-home")
    monkeypatch.setenv("EGRESSD_HOME", str(home))
    return home


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A fresh working directory: the writable directory of a sandboxed child."""
    path = tmp_path / "work"
    path.mkdir()
    return path


@pytest.fixture
def shared_tmpdir() -> Iterator[Path]:
    """A short TMPDIR outside /tmp (the sandbox's relay sockets go there, and a Unix socket path
    must stay short): the read-only root shows it to every sandbox."""
    path = Path(tempfile.mkdtemp(prefix="egressd-test-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


NPM_ADDR = "198.51.100.31"  # the npm_registry fixture's address in the test network namespace


@pytest.fixture
def npm_registry(ca: trustme.CA, dns: DnsServer) -> Iterator[NpmRegistry]:
    """A local npm registry (HTTPS, the session CA) as registry.test, with three tiny packages."""
    dns.add("registry.test", NPM_ADDR)
    with NpmRegistry(NPM_ADDR, ca=ca, hostnames=["registry.test"]) as registry:
        registry.add("egressd-tiny-dep", "1.0.0")
        registry.add("egressd-tiny", "1.0.0", dependencies={"egressd-tiny-dep": "^1.0.0"})
        registry.add("egressd-unlisted", "1.0.0")
        yield registry


PYPI_ADDR = "198.51.100.32"  # the pypi_index fixture's address in the test network namespace


@pytest.fixture
def pypi_index(ca: trustme.CA, dns: DnsServer) -> Iterator[PypiIndex]:
    """A PEP 503 simple index (HTTPS, the session CA) as pypi.test, serving egressd-tiny 1.0 (a
    wheel it builds, its egressd_tiny/__init__.py is TINY_INIT)."""
    dns.add("pypi.test", PYPI_ADDR)
    with PypiIndex(PYPI_ADDR, ca=ca, hostnames=["pypi.test"]) as index:
        index.add_wheel("egressd-tiny", "1.0", {"egressd_tiny/__init__.py": TINY_INIT})
        yield index


@pytest.fixture
def dns() -> Iterator[DnsServer]:
    """A started, empty DnsServer on 127.0.0.1 (UDP+TCP, same port); unknown names → NXDOMAIN."""
    with DnsServer() as server:
        yield server


@pytest.fixture(scope="session")
def ca() -> trustme.CA:
    """Session CA for the test upstreams' certificates."""
    return make_ca()


@pytest.fixture(scope="session")
def ca_file(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """PEM file with the session CA certificate only (for CURL_CA_BUNDLE, SSL_CERT_FILE, ...)."""
    return write_ca_file(ca, tmp_path_factory.mktemp("ca") / "upstream-ca.pem")


@pytest.fixture
def upstream() -> Iterator[EchoHTTPServer]:
    """Plain HTTP echo server on 198.51.100.1 (ephemeral port)."""
    with EchoHTTPServer(netns.UPSTREAM_V4[0], name="upstream") as server:
        yield server


@pytest.fixture
def upstream_tls(ca: trustme.CA) -> Iterator[EchoHTTPSServer]:
    """HTTPS echo server on 198.51.100.2 with a certificate for up.test, other.test, 198.51.100.2."""
    with EchoHTTPSServer(
        netns.UPSTREAM_V4[1], name="upstream-tls", ca=ca, hostnames=UPSTREAM_TLS_NAMES
    ) as server:
        yield server


@pytest.fixture
def upstream_v6() -> Iterator[EchoHTTPServer]:
    """Plain HTTP echo server on 2001:db8::1."""
    with EchoHTTPServer(netns.UPSTREAM_V6[0], name="upstream-v6") as server:
        yield server


@pytest.fixture
def public_upstream() -> Iterator[EchoHTTPServer]:
    """Plain HTTP echo server on 3fff::1, an address SSRF-guarded clients take for a public one."""
    with EchoHTTPServer(netns.PUBLIC_V6[0], name="public-upstream") as server:
        yield server


@pytest.fixture
def tcp_echo() -> Iterator[TcpEchoServer]:
    """Raw TCP echo server on 198.51.100.3."""
    with TcpEchoServer(netns.UPSTREAM_V4[2]) as server:
        yield server


@pytest.fixture
def echo_engine(tcp_echo: TcpEchoServer) -> Iterator[ProxyServer]:
    """An in-process engine whose policy allows only the TCP echo server."""
    host, port = tcp_echo.address
    yield from _engine({"allow": [f"{host}:{port}"]})


def _engine(rules: dict[str, list[str]]) -> Iterator[ProxyServer]:
    """An in-process engine with these policy rules (mode enforce), stopped after the test."""
    from egressd.policy import parse_policy
    from egressd.session.proxy import ProxyServer

    engine = ProxyServer(parse_policy({"version": 1, "mode": "enforce", **rules}, "test"))
    engine.start()
    assert engine.pipeline is not None  # waits for the load: tests read its front (`_front`)
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture
def inspected_echo(tcp_echo: TcpEchoServer) -> Iterator[TcpEchoServer]:
    """A second raw TCP echo server on tcp_echo's address, which inspecting_engine inspects."""
    with TcpEchoServer(tcp_echo.address[0], name="tcp-echo-inspected") as server:
        yield server


@pytest.fixture
def inspecting_engine(tcp_echo: TcpEchoServer, inspected_echo: TcpEchoServer) -> Iterator[ProxyServer]:
    """An in-process engine that allows both echo servers and inspects inspected_echo: a tunnel to
    it is handed to the embedded mitmproxy (the one thing that starts it), one to tcp_echo is not."""
    relayed, inspected = (f"{h}:{p}" for h, p in (tcp_echo.address, inspected_echo.address))
    yield from _engine({"allow": [relayed, inspected], "inspect": [inspected]})


@pytest.fixture
def refusing_port() -> Iterator[RefusingPort]:
    """A reserved port on 198.51.100.4 where connecting is refused (RST)."""
    with RefusingPort(netns.UPSTREAM_V4[3]) as port:
        yield port


@pytest.fixture
def stalling_port() -> Iterator[StallingPort]:
    """A port on 198.51.100.5 where connecting hangs until the client's timeout."""
    with StallingPort(netns.UPSTREAM_V4[4]) as port:
        yield port


@pytest.fixture
def free_port() -> int:
    """A TCP port number free on 127.0.0.1 at the moment of asking."""
    return _free_port("127.0.0.1")
