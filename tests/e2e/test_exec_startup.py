"""What `egressd exec` loads to start: only what the child's traffic needs.

A wrapped command pays egressd's start-up before it runs, so the heavy parts wait for their first
use: mitmproxy for the first inspected tunnel, aiohttp for the control API's first client,
prometheus_client for the first scrape, and each command's module for that command. dnspython,
which every lookup needs, loads at start in a thread of its own while the child starts (an import
at the first lookup could fail with the process out of descriptors); `egressd exec -- true` may
exit before it is done. Checked on the real command with `python -X importtime` (every module the
process imports, on any thread, is listed on its stderr).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import write_policy
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


def imported(result: subprocess.CompletedProcess[str]) -> set[str]:
    names = set()
    for line in result.stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rsplit("|", 1)[1].strip())
    assert "egressd.session.proxy" in names, result.stderr[-2000:]  # the listing is there
    return names


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
