"""`--policy A --policy B` through the real commands: merged, deny wins, every file watched."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tests.support.corpus import ProxyClient
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD, EgressdRun


def egressd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*EGRESSD, *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )


def test_check_merges_presets_and_keeps_each_presets_ports() -> None:
    ssh = egressd("check", "--policy", "npm", "--policy", "github", "github.com:22")
    assert ssh.returncode == 0 and "allowlist" in ssh.stdout, ssh.stdout + ssh.stderr
    npm_ssh = egressd("check", "--policy", "npm", "--policy", "github", "registry.npmjs.org:22")
    assert npm_ssh.returncode == 1 and "not_allowlisted" in npm_ssh.stdout
    npm = egressd("check", "--policy", "github", "--policy", "npm", "https://registry.npmjs.org/react")
    assert npm.returncode == 0, npm.stdout


def test_a_presets_mode_does_not_outvote_the_users_own(tmp_path: Path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text("version: 1\nmode: ask\ndeny: [registry.yarnpkg.com]\n")
    other = egressd("check", "--policy", str(mine), "--policy", "npm", "elsewhere.test:443")
    assert "mode ask" in other.stdout, other.stdout
    denied = egressd("check", "--policy", str(mine), "--policy", "npm", "registry.yarnpkg.com:443")
    assert denied.returncode == 1 and "denylist" in denied.stdout  # deny wins over npm's allow
    shown = egressd("policy", "show", str(mine), "npm")
    assert shown.returncode == 0 and "mode: ask" in shown.stdout and "registry.npmjs.org:443" in shown.stdout


def test_an_edit_of_the_second_policy_reloads_the_merge(tmp_path: Path) -> None:
    first = tmp_path / "first.yaml"
    first.write_text("version: 1\nallow: [x.test]\n")
    second = tmp_path / "second.yaml"
    second.write_text("version: 1\nallow: [y.test]\n")
    connect = b"CONNECT y.test:443 HTTP/1.1\r\nHost: y.test:443\r\n"
    with DnsServer() as dns:  # y.test: NXDOMAIN, so an allowed y.test fails with dns_error, no packet out
        options = ["--policy", str(first), "--policy", str(second), "--nameserver", dns.nameserver]
        with EgressdRun(options) as run:
            client = ProxyClient.from_env(run.env)
            before = client.exchange(connect + client.auth_header + b"\r\n")
            assert before is not None and before.reason == "dns_error", run.stderr
            second.write_text("version: 1\nallow: [y.test]\ndeny: [y.test]\n")
            deadline, reason = time.monotonic() + 20, before.reason
            while reason == "dns_error" and time.monotonic() < deadline:
                time.sleep(0.1)
                after = client.exchange(connect + client.auth_header + b"\r\n")
                reason = after.reason if after is not None else None
            assert reason == "denylist", run.stderr


def test_sandbox_runs_under_two_policies(tmp_path: Path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text("version: 1\nallow: [x.test]\n")
    done = subprocess.run(
        [*EGRESSD, "sandbox", "--policy", str(mine), "--policy", "npm", "--", "true"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    missing = egressd("exec", "--policy", str(mine), "--policy", "no-such-preset", "--", "true")
    assert missing.returncode == 2 and "no-such-preset" in missing.stderr
