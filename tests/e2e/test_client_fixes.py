"""node's NODE_OPTIONS and wget's WGETRC: clients that need more than the proxy and CA variables.

Real node (the one installed here) runs clean with the NODE_OPTIONS egressd gives it; a node that
would refuse `--disable-warning` (older than 20.11) never gets it. Real wget fetches through an
inspected tunnel from a local HTTPS server with only what egressd gives it (no CA option, no CA
variable it reads), and the user's own wgetrc still applies.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from egressd.child.client_fixes import (
    NODE_WARNING_FLAG,
    node_options,
    node_supports_disable_warning,
    wgetrc_text,
)
from egressd.child.env import CA_BUNDLE_VARS
from tests.support.audit_log import audit_records
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import egressd_exec, write_policy
from tests.support.upstreams import EchoHTTPSServer

WGET_ADDR = "198.51.100.34"


def plain_env(**extra: str) -> dict[str, str]:
    """The test's environment without inherited CA variables (trust comes from egressd or nothing)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in CA_BUNDLE_VARS and k not in ("SSL_CERT_DIR", "NODE_OPTIONS", "WGETRC")
    }
    env.update(extra)
    return env


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        (None, False),
        ((18, 19, 1), False),
        ((20, 10, 0), False),
        ((20, 11, 0), True),
        ((20, 20, 2), True),
        ((21, 2, 0), False),
        ((21, 3, 0), True),
        ((22, 0, 0), True),
        ((22, 21, 0), True),
        ((24, 5, 0), True),
    ],
)
def test_disable_warning_only_where_node_accepts_it(
    version: tuple[int, int, int] | None, supported: bool
) -> None:
    assert node_supports_disable_warning(version) is supported
    assert (node_options("--max-old-space-size=64", version) is not None) is supported


@pytest.mark.parametrize(
    ("current", "expected"),
    [
        (None, NODE_WARNING_FLAG),
        ("", NODE_WARNING_FLAG),
        ("  ", NODE_WARNING_FLAG),
        ("--max-old-space-size=64", f"--max-old-space-size=64 {NODE_WARNING_FLAG}"),
        (f"--trace-warnings {NODE_WARNING_FLAG}", None),  # already there: left as the user wrote it
        ("--disable-warning=DEP0040", f"--disable-warning=DEP0040 {NODE_WARNING_FLAG}"),
    ],
)
def test_the_users_node_options_are_kept(current: str | None, expected: str | None) -> None:
    assert node_options(current, (22, 21, 0)) == expected


def test_real_node_runs_clean_with_the_users_options_kept(tmp_path: Path) -> None:
    script = "console.log(JSON.stringify({opts: process.env.NODE_OPTIONS, heap: process.execArgv}))"
    env = plain_env(NODE_OPTIONS="--max-old-space-size=96")
    done = egressd_exec(["--quiet"], ["node", "-e", script], env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr == b"", done.stderr  # no warning of any kind, from node or egressd
    seen = json.loads(done.stdout)
    version = tuple(int(x) for x in subprocess.check_output(["node", "--version"], text=True)[1:].split("."))
    if node_supports_disable_warning(version):  # type: ignore[arg-type]
        assert seen["opts"] == f"--max-old-space-size=96 {NODE_WARNING_FLAG}"
    else:
        assert seen["opts"] == "--max-old-space-size=96"


FAKE_OLD_NODE = """#!/bin/sh
# an old node: v18 refuses to start on a NODE_OPTIONS flag it does not know
if [ "$1" = "--version" ]; then echo v18.19.1; exit 0; fi
case " $NODE_OPTIONS " in
  *--disable-warning*) echo "node: --disable-warning= is not allowed in NODE_OPTIONS" >&2; exit 9;;
esac
echo "ran with NODE_OPTIONS=[$NODE_OPTIONS]"
"""


def test_a_node_that_rejects_the_flag_never_gets_it(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    node = bin_dir / "node"
    node.write_text(FAKE_OLD_NODE)
    node.chmod(node.stat().st_mode | stat.S_IXUSR)
    env = plain_env(PATH=f"{bin_dir}:{os.environ['PATH']}", NODE_OPTIONS="--max-old-space-size=64")
    done = egressd_exec(["--quiet"], ["node", "app.js"], env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"ran with NODE_OPTIONS=[--max-old-space-size=64]\n"


@pytest.fixture
def wget_server(ca: trustme.CA, dns: DnsServer) -> Iterator[EchoHTTPSServer]:
    dns.add("wget.test", WGET_ADDR)
    with EchoHTTPSServer(WGET_ADDR, ca=ca, hostnames=["wget.test"]) as server:
        yield server


def test_wget_trusts_egressd_through_an_inspected_tunnel_with_the_users_wgetrc(
    tmp_path: Path, dns: DnsServer, ca_file: Path, wget_server: EchoHTTPSServer
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / ".wgetrc").write_text("user_agent = my-own-agent/1.0\ntries = 1")  # no final newline
    policy = write_policy(tmp_path, "version: 1\nallow: [wget.test, 198.51.100.0/24]\ninspect: [wget.test]\n")
    audit = tmp_path / "audit.jsonl"
    options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--upstream-ca", str(ca_file)]
    options += ["--audit", str(audit), "--quiet"]
    env = plain_env(HOME=str(home), EGRESSD_HOME=str(tmp_path / "egressd-home"))
    url = wget_server.url_for("wget.test", "/through-wget")
    done = egressd_exec(options, ["wget", "-q", "-O", "-", url], env=env)
    assert done.returncode == 0, done.stderr
    echoed = json.loads(done.stdout)
    assert echoed["path"] == "/through-wget"
    headers = {k.lower(): v for k, v in echoed["headers"].items()}
    assert headers["user-agent"] == "my-own-agent/1.0"  # the user's wgetrc applied too
    inspected = audit_records(audit)
    # the request was read inside the tunnel: inspected, so wget trusted egressd's certificate
    assert any(r.get("method") == "GET" and r.get("path") == "/through-wget" for r in inspected), inspected
    # without egressd's WGETRC, wget does not trust egressd's certificate for the host
    bare = egressd_exec(options, ["sh", "-c", f'unset WGETRC; wget -q -O - "{url}"'], env=env)
    assert bare.returncode != 0 and bare.stdout == b""


def test_wgetrc_text_appends_the_bundle_after_the_users_settings() -> None:
    assert wgetrc_text("", "/b.pem").endswith("ca_certificate = /b.pem\n")
    text = wgetrc_text("ca_certificate = /mine.pem\ntries = 2", "/b.pem")
    assert text.index("ca_certificate = /mine.pem") < text.index("ca_certificate = /b.pem")
    assert "tries = 2\n" in text
