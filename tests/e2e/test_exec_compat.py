"""Tools people run under `egressd exec` keep working with capture on (the default), and are
refused with egressd's reason when the policy does not allow where they go.

Compatibility proofs, not fixes: `uv pip install` from a PEP 503 index the test serves (HTTPS, a
wheel it builds), once through the proxy variables uv reads and once with them removed so its
connections are captured; `git clone` over SSH from an sshd the test starts (ssh ignores the proxy
variables: its connection is captured and decided as a TCP connection to the name it looked up).
Names are reserved ones (`pypi.test`, `repo.test`) answered by the test's own DNS server. Where
uv or ssh is captured, egressd names it on stderr and in the exit summary, refused or not.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.audit_log import audit_records
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import egressd_exec, write_policy
from tests.support.netns import UPSTREAM_V4
from tests.support.pypi_index import TINY_INIT, PypiIndex
from tests.support.ssh_git import README, SshGitServer, ssh_git_server

TIMEOUT = 180
SSH_ADDR = UPSTREAM_V4[12]
UV = str(Path(sys.executable).with_name("uv"))
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


def child_env(home: Path) -> dict[str, str]:
    """This environment without the machine's pip and uv settings (an index, a cache elsewhere)."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(("PIP_", "UV_"))}
    env["EGRESSD_HOME"] = str(home)
    return env


def exec_allowing(
    tmp_path: Path, dns: DnsServer, allow: str, command: list[str], env: dict[str, str]
) -> tuple[subprocess.CompletedProcess[bytes], Path]:
    """`egressd exec` of command under a policy that allows `allow` (the test's servers are at
    documentation addresses, private ones: allowed); the result, and the audit log."""
    policy = write_policy(tmp_path, f"version: 1\nprivate: {{allow: true}}\nallow: [{allow}]\n")
    audit = tmp_path / "audit.jsonl"
    options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(audit)]
    return egressd_exec(options, command, env=env, timeout=TIMEOUT), audit


def decisions(audit: Path, host: str) -> list[dict[str, Any]]:
    return [r for r in audit_records(audit) if r.get("event") == "decision" and r.get("host") == host]


def show(result: Any) -> str:
    out, err = result.stdout.decode(errors="replace"), result.stderr.decode(errors="replace")
    return f"exit {result.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"


# -- uv ----------------------------------------------------------------------------------------------
def uv_install(
    tmp_path: Path, dns: DnsServer, ca_file: Path, index: PypiIndex, allow: str, *, captured: bool
) -> tuple[subprocess.CompletedProcess[bytes], Path, Path]:
    """`uv pip install egressd-tiny` from the index under `egressd exec`, trusting the index's CA
    (uv reads SSL_CERT_FILE); `captured`: with the proxy variables removed, so uv connects as a
    program that ignores them does. The result, the audit log, the target directory."""
    target = tmp_path / "target"
    unset = [arg for name in PROXY_VARIABLES for arg in ("-u", name)] if captured else []
    command = ["env", *unset, f"SSL_CERT_FILE={ca_file}", UV, "pip", "install", "--no-config", "--no-cache"]
    command += ["--python", sys.executable, "--target", str(target)]
    command += ["--index-url", f"{index.base_url}/simple/", "egressd-tiny"]
    result, audit = exec_allowing(tmp_path, dns, allow, command, child_env(tmp_path / "home"))
    return result, audit, target


@pytest.mark.parametrize("captured", [False, True], ids=["proxy-variables", "captured"])
def test_uv_pip_install_from_an_allowed_index(
    tmp_path: Path, dns: DnsServer, ca_file: Path, pypi_index: PypiIndex, captured: bool
) -> None:
    result, audit, target = uv_install(tmp_path, dns, ca_file, pypi_index, "pypi.test", captured=captured)
    assert result.returncode == 0, show(result)
    assert (target / "egressd_tiny" / "__init__.py").read_text() == TINY_INIT
    assert any(p.startswith("/packages/egressd_tiny-1.0-py3-none-any.whl") for p in pypi_index.paths)
    allowed = decisions(audit, "pypi.test")
    assert allowed and all(r["decision"] == "allow" for r in allowed), allowed
    assert all(bool(r.get("captured")) is captured for r in allowed if r.get("stage") != "dns"), allowed
    stderr = result.stderr.decode()
    assert ("egressd: uv (pid " in stderr and "ignores the proxy variables" in stderr) is captured, stderr


@pytest.mark.parametrize("captured", [False, True], ids=["proxy-variables", "captured"])
def test_uv_pip_install_from_an_index_the_policy_does_not_allow(
    tmp_path: Path, dns: DnsServer, ca_file: Path, pypi_index: PypiIndex, captured: bool
) -> None:
    """Through the proxy: the CONNECT is refused; captured: pypi.test has no address. Either way
    egressd says on stderr which host it refused and why."""
    result, audit, target = uv_install(
        tmp_path, dns, ca_file, pypi_index, "elsewhere.test", captured=captured
    )
    assert result.returncode != 0, show(result)
    assert not (target / "egressd_tiny").exists()
    assert pypi_index.connections == 0
    refused = decisions(audit, "pypi.test")
    assert refused and all(r["decision"] == "deny" and r["reason"] == "not_allowlisted" for r in refused)
    assert "egressd: refused 1 host: pypi.test (not_allowlisted)" in result.stderr.decode(), show(result)


# -- git over SSH ------------------------------------------------------------------------------------
@pytest.fixture
def repo_server(tmp_path: Path, dns: DnsServer, free_port: int) -> Iterator[SshGitServer]:
    """sshd on repo.test at a port of its own: an allow rule for that port alone does not make
    egressd set its ProxyCommand (that is for port 22), so ssh connects as it would, and is captured."""
    dns.add("repo.test", SSH_ADDR)
    with ssh_git_server(
        tmp_path / "server", tmp_path / "client", SSH_ADDR, name="repo.test", port=free_port
    ) as server:
        yield server


def git_clone(tmp_path: Path, dns: DnsServer, server: SshGitServer, allow: str) -> tuple[Any, Path, Path]:
    clone = tmp_path / "clone"
    command = ["git", "clone", "-q", server.url, str(clone)]
    result, audit = exec_allowing(tmp_path, dns, allow, command, server.env(child_env(tmp_path / "home")))
    return result, audit, clone


def test_git_clone_over_ssh_is_captured_and_allowed(
    tmp_path: Path, dns: DnsServer, repo_server: SshGitServer
) -> None:
    result, audit, clone = git_clone(tmp_path, dns, repo_server, f"'repo.test:{repo_server.port}'")
    assert result.returncode == 0, show(result)
    assert (clone / "README").read_text() == README
    assert repo_server.connections() == 1
    decided = [r for r in decisions(audit, "repo.test") if r.get("stage") != "dns"]
    assert decided and all(r["decision"] == "allow" and r["port"] == repo_server.port for r in decided)
    assert all(r.get("captured") and os.path.basename(r.get("exe") or "") == "ssh" for r in decided), decided
    stderr = result.stderr.decode()
    assert "egressd: ssh (pid " in stderr and "ignores the proxy variables" in stderr, stderr
    summary = next(line for line in stderr.splitlines() if line.startswith("egressd: captured "))
    assert summary.endswith(": ssh (1)"), stderr  # the exit summary names it


def test_git_clone_over_ssh_to_a_port_the_policy_does_not_allow(
    tmp_path: Path, dns: DnsServer, repo_server: SshGitServer
) -> None:
    """repo.test is allowed on another port: its name has its address, and ssh's connection to
    the port the policy does not name is captured and refused, its program named."""
    result, audit, clone = git_clone(tmp_path, dns, repo_server, "'repo.test:443'")
    assert result.returncode != 0, show(result)
    assert not clone.exists() and repo_server.connections() == 0
    refused = [r for r in decisions(audit, "repo.test") if r.get("stage") != "dns"]
    assert refused and all(r["decision"] == "deny" and r["port"] == repo_server.port for r in refused)
    assert all(r.get("captured") and os.path.basename(r.get("exe") or "") == "ssh" for r in refused), refused
    stderr = result.stderr.decode()
    assert f"refused repo.test:{repo_server.port}" in stderr and refused[0]["reason"] in stderr, stderr
    summary = next(line for line in stderr.splitlines() if line.startswith("egressd: captured "))
    assert "egressd: ssh (pid " in stderr and summary.endswith(": ssh (1)"), stderr


def test_git_clone_over_ssh_to_a_name_the_policy_does_not_allow(
    tmp_path: Path, dns: DnsServer, repo_server: SshGitServer
) -> None:
    """A name the policy refuses has no address for ssh; egressd says which and why. (An allow
    rule for port 22 or for any port would lead ssh through egressd's ProxyCommand instead.)"""
    result, audit, clone = git_clone(tmp_path, dns, repo_server, "'elsewhere.test:443'")
    assert result.returncode != 0, show(result)
    assert b"Could not resolve hostname repo.test" in result.stderr, show(result)
    assert not clone.exists() and repo_server.connections() == 0
    refused = decisions(audit, "repo.test")
    assert refused and all(r["decision"] == "deny" and r["reason"] == "not_allowlisted" for r in refused)
    assert "refused repo.test (not_allowlisted)" in result.stderr.decode(), show(result)
