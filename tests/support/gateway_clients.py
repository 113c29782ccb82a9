"""Helpers that several test modules use (so none imports another), from the tests of: `egressd run
--gateway`: clients named by their own tokens, through the real command line."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import netns
from tests.support.corpus import ProxyClient
from tests.support.egressd_cli import EGRESSD, GatewayRun
from tests.support.upstreams import EchoHTTPServer


def token_cli(*args: str, tokens: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*EGRESSD, "gateway", "token", *args, "--tokens", str(tokens)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def add_token(tokens: Path, name: str, *extra: str) -> str:
    done = token_cli("add", name, *extra, tokens=tokens)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def client(run: GatewayRun, name: str, token: str, socks_port: int | None = None) -> ProxyClient:
    host, port = run.address
    return ProxyClient(host=host, port=port, username=name, password=token, socks_port=socks_port)


@pytest.fixture
def upstream() -> Iterator[EchoHTTPServer]:
    """The upstream of these tests, on an address of the namespace that is not one of its interface
    addresses: a gateway counts those (netns.INTERFACE_V4) as its own host."""
    with EchoHTTPServer(netns.UPSTREAM_V4[4], name="gateway-upstream") as server:
        yield server


