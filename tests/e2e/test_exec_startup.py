"""What `egressd exec` loads to start: only what the child's traffic needs, and that only once the
child is on its way.

A wrapped command pays egressd's start-up before it runs, so the heavy parts wait for their first
use: mitmproxy for the first inspected tunnel, aiohttp for the control API's first client,
prometheus_client for the first scrape, and each command's module for that command. What serving
any connection needs — the admission pipeline, the front, the event loop (uvloop) and dnspython —
loads in threads of their own once the child was let start, its listeners bound before: a client
that connects meanwhile waits in their backlog; `egressd exec -- true` may exit before the loads
are done. Checked on the real command with `python -X importtime` (every module the process
imports, on any thread, is listed on its stderr, in the order they finish).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from egressd.platform.exits import EXIT_CANNOT_RUN
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import write_policy
from tests.support.startup import (
    MARKED,
    SERVING,
    among,
    broken_h11,
    first_on_path,
    immediate_client,
    imported,
    loaded_before_the_child,
    unstartable_sites,
)
from tests.support.upstreams import EchoHTTPServer

# loaded only when used (a subpackage listed here stands for all of it)
LATER = (
    "httpx",  # dnspython's DNS-over-HTTPS (never used by egressd)
    "httpx2",
    "aioquic",
    "mitmproxy.master",  # the first tunnel inspected
    "aiohttp",  # the control API's first client, the dashboard
    "prometheus_client",  # the first scrape, --metrics
    "egressd.cli.sandbox",  # other commands
    "egressd.cli.ssh",
    "egressd.cli.acp",
    "egressd.agents",
    "egressd.remote",
)


def loaded_early(names: set[str]) -> list[str]:
    return sorted(n for n in names for p in LATER if n == p or n.startswith(p + "."))


def importtime_exec(
    options: list[str], command: list[str], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "egressd", "exec", *options, "--", *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_exec_true_loads_none_of_the_later_parts(tmp_path: Path) -> None:
    env = {**os.environ, "EGRESSD_HOME": str(tmp_path / "home")}
    result = importtime_exec(["--policy", str(write_policy(tmp_path))], ["true"], env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert loaded_early(imported(result)) == []
    # the control API stopped before any client came: quietly
    assert "Traceback" not in result.stderr and "control API failed" not in result.stderr


def test_exec_on_the_default_policy_never_loads_pyyaml(tmp_path: Path) -> None:
    """No policy file, nothing to parse: PyYAML is loaded only to read one."""
    env = {**os.environ, "EGRESSD_HOME": str(tmp_path / "home")}
    result = importtime_exec([], ["true"], env)
    assert result.returncode == 0, result.stderr[-2000:]
    names = imported(result)
    assert loaded_early(names) == []
    assert "egressd.policy.loader" in names
    assert not {n for n in names if n == "yaml" or n.startswith(("yaml.", "egressd.policy.strict_yaml"))}


def test_the_resolver_loads_without_doh(tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer) -> None:
    dns.add("up.test", upstream.host)
    env = {**os.environ, "EGRESSD_HOME": str(tmp_path / "home")}
    url = f"http://up.test:{upstream.port}/hello"
    options = ["--policy", str(write_policy(tmp_path)), "--nameserver", dns.nameserver]
    result = importtime_exec(options, ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", url], env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "200"
    names = imported(result)
    assert "dns.asyncresolver" in names  # resolved with dnspython
    assert not {"httpx", "httpx2", "h2", "aioquic"} & names  # its DoH/DoQ transports stay unloaded


def test_exec_lets_its_child_start_before_it_loads_what_serving_needs(tmp_path: Path) -> None:
    """The cut is where the launcher is let start the child in its network namespace (the setup
    pipe's end); the proxy's listeners are bound by then, and the child's environment names them."""
    env = {**os.environ, "EGRESSD_HOME": str(tmp_path / "home")}
    policy = write_policy(tmp_path)
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", MARKED, "exec", "--policy", str(policy), "--", "true"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert among(loaded_before_the_child(result), SERVING) == []


def test_a_child_that_connects_at_once_is_served_by_the_pipeline(tmp_path: Path) -> None:
    """A client that connects the instant the child starts, before the proxy may be loaded, waits
    and is admitted as any other: the allowed target answers, the other is refused and never
    reached."""
    with EchoHTTPServer() as allowed, EchoHTTPServer() as refused:
        policy = write_policy(tmp_path, f"version: 1\nloopback: {{allow: true, ports: [{allowed.port}]}}\n")
        env = {**os.environ, "EGRESSD_HOME": str(tmp_path / "home")}
        child = [sys.executable, "-c", immediate_client(allowed.port, refused.port)]
        result = subprocess.run(
            [sys.executable, "-m", "egressd", "exec", "--policy", str(policy), "--", *child],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.splitlines() == ["200", "403 loopback_port"], result.stderr[-3000:]
        assert refused.connections == 0


def exec_stopped(tmp_path: Path, stand_in: Path, options: list[str]) -> subprocess.CompletedProcess[str]:
    """`egressd exec OPTIONS` with `stand_in` first on its PYTHONPATH, of a child that would say
    "survived" 30 s on: it is stopped before, and egressd fails (its stderr says why)."""
    env = {**os.environ, "EGRESSD_HOME": str(tmp_path / "home")}
    env = first_on_path(stand_in, env)
    result = subprocess.run(
        [sys.executable, "-m", "egressd", "exec", *options, "--", "sh", "-c", "sleep 30; echo survived"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == EXIT_CANNOT_RUN, result.stderr[-3000:]
    assert "survived" not in result.stdout
    return result


@pytest.mark.parametrize("capture", [True, False], ids=["captured", "no-capture"])
def test_a_proxy_that_cannot_load_stops_the_child_and_says_why(tmp_path: Path, capture: bool) -> None:
    """What serving needs loads once the child started: when it cannot (here h11, which the
    pipeline imports, fails to import), the child is stopped, never left running without its
    proxy, and egressd says why and fails."""
    options = ["--policy", str(write_policy(tmp_path)), *([] if capture else ["--no-capture"])]
    result = exec_stopped(tmp_path, broken_h11(tmp_path), options)
    assert "the proxy could not start" in result.stderr and "h11" in result.stderr, result.stderr[-3000:]


def test_a_service_that_cannot_start_stops_the_child_and_says_which(tmp_path: Path) -> None:
    """A session's services start on the proxy's loop once it is loaded, while the child runs: one
    that cannot (here the metrics port, its site failing to start) stops the child as a failed load
    does, and egressd names it and fails, never running on without what it was asked to serve."""
    options = ["--policy", str(write_policy(tmp_path)), "--metrics", "127.0.0.1:0"]
    result = exec_stopped(tmp_path, unstartable_sites(tmp_path), options)
    assert "the metrics port could not start" in result.stderr, result.stderr[-3000:]
    assert "a test's stand-in" in result.stderr, result.stderr[-3000:]


def test_run_stops_when_a_service_cannot_start(tmp_path: Path) -> None:
    """`egressd run` (no child) serves until stopped: a service that cannot start stops it too, said."""
    env = {**os.environ, "EGRESSD_HOME": str(tmp_path / "home")}
    env = first_on_path(unstartable_sites(tmp_path), env)
    options = ["--policy", str(write_policy(tmp_path)), "--metrics", "127.0.0.1:0"]
    command = [sys.executable, "-m", "egressd", "run", *options]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_CANNOT_RUN, result.stderr[-3000:]
    assert "the metrics port could not start" in result.stderr, result.stderr[-3000:]


def test_a_port_in_use_fails_before_the_child_starts(tmp_path: Path) -> None:
    """The listening sockets are bound before the child starts, the rest of the proxy loads after:
    a port taken already is said, and the child never runs."""
    env = {**os.environ, "EGRESSD_HOME": str(tmp_path / "home")}
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        options = ["--policy", str(write_policy(tmp_path)), "--listen", f"127.0.0.1:{port}"]
        result = subprocess.run(
            [sys.executable, "-m", "egressd", "exec", *options, "--", "sh", "-c", "echo ran"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode != 0
    assert result.stdout == ""
    assert "cannot start the proxy" in result.stderr and "in use" in result.stderr, result.stderr[-3000:]
