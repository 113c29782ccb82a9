"""git over SSH through the proxy: a real sshd in the test namespace, a real `git clone` inside
`egressd sandbox` (and `egressd exec`), with GIT_SSH_COMMAND using egressd's connect helper.

sshd runs as the user who runs the tests (an ordinary user binds port 22 in the test namespace,
which lets every user bind low ports).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressd.child.ssh_env import git_ssh_command, proxy_command, ssh_may_be_allowed, with_git_ssh
from egressd.policy import parse_policy
from tests.support.audit_log import audit_records
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import egressd_exec, write_policy
from tests.support.netns import UPSTREAM_V4
from tests.support.sandboxes import egressd_sandbox, sandbox_env
from tests.support.ssh_git import README, SSHD, USER, SshGitServer, ssh_git_server

SSH_HOST = UPSTREAM_V4[6]  # 198.51.100.7


pytestmark = pytest.mark.skipif(
    not os.path.exists(SSHD) or shutil.which("ssh") is None,
    reason="needs openssh-server and openssh-client (scripts/setup.sh installs them)",
)


# -- GIT_SSH_COMMAND -------------------------------------------------------------------------------
def _policy(text: str) -> object:
    return parse_policy({"version": 1, **__import__("yaml").safe_load(text)}, "p.yaml")


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("allow: []", False),
        ("allow: [example.com:443, 10.0.0.0/8:5432]", False),
        ("allow: [github.com:22]", True),
        ("allow: [example.com]", True),  # any port
        ("mode: allow", True),
        ("mode: ask", True),
        ("mode: 'off'\nallow: [github.com:22]", False),
    ],
)
def test_ssh_may_be_allowed(policy: str, expected: bool) -> None:
    assert ssh_may_be_allowed(_policy(policy)) is expected  # type: ignore[arg-type]


def test_git_ssh_command_text() -> None:
    assert proxy_command("/opt/py 3/python") == "'/opt/py 3/python' -I -m egressd.child.connect %h %p"
    assert git_ssh_command(None, "/py") == "ssh -o 'ProxyCommand=/py -I -m egressd.child.connect %h %p'"
    # the user's own GIT_SSH_COMMAND is kept; the option is appended
    assert git_ssh_command("ssh -i key", "/py").startswith("ssh -i key -o 'ProxyCommand=")


def test_with_git_ssh_only_when_ssh_may_be_allowed() -> None:
    env = {"GIT_SSH": "/usr/local/bin/my ssh"}
    assert "GIT_SSH_COMMAND" not in with_git_ssh(env, _policy("allow: [x.com:443]"))  # type: ignore[arg-type]
    got = with_git_ssh(env, _policy("allow: [x.com:22]"), python="/py")  # type: ignore[arg-type]
    assert (
        got["GIT_SSH_COMMAND"]
        == "'/usr/local/bin/my ssh' -o 'ProxyCommand=/py -I -m egressd.child.connect %h %p'"
    )


# -- a real sshd with a bare repository -------------------------------------------------------------
@pytest.fixture
def git_server(tmp_path: Path, work_dir: Path) -> Iterator[SshGitServer]:
    # the client's key and config live in the sandbox's working directory (visible inside)
    with ssh_git_server(tmp_path / "server", work_dir / ".ssh-test", SSH_HOST) as server:
        yield server


@pytest.fixture
def work_dir(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


def test_git_clone_over_ssh_inside_the_sandbox(
    tmp_path: Path, dns: DnsServer, git_server: SshGitServer, work_dir: Path
) -> None:
    dns.add("git.test", SSH_HOST)
    policy = write_policy(tmp_path, f"version: 1\nallow: [git.test:22, {SSH_HOST}:22]\n")
    result = egressd_sandbox(
        ["--policy", str(policy), "--nameserver", dns.nameserver],
        ["git", "clone", "-q", git_server.url, "clone"],
        cwd=work_dir,
        env=git_server.env(sandbox_env(work_dir)),
    )
    assert result.returncode == 0, result.stderr.decode()
    assert (work_dir / "clone" / "README").read_text() == README
    assert git_server.connections() == 1


def test_git_clone_over_ssh_without_the_helper_is_captured(
    tmp_path: Path, dns: DnsServer, git_server: SshGitServer, work_dir: Path
) -> None:
    """git with an ssh command of its own (no ProxyCommand): the capture sends its connection to
    the proxy, which decides git.test:22 by name."""
    dns.add("git.test", SSH_HOST)
    audit = tmp_path / "audit.jsonl"
    policy = write_policy(tmp_path, f"version: 1\nallow: [git.test:22, {SSH_HOST}:22]\n")
    result = egressd_sandbox(
        ["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(audit)],
        ["env", f"GIT_SSH_COMMAND=ssh -F {git_server.ssh_config}", "git", "clone", "-q", git_server.url, "c"],
        cwd=work_dir,
    )
    assert result.returncode == 0, result.stderr.decode()
    assert (work_dir / "c" / "README").read_text() == README
    assert git_server.connections() == 1
    assert any(
        r.get("event") == "decision" and r["host"] == "git.test" and r["decision"] == "allow"
        for r in audit_records(audit)
    )


def test_git_clone_over_ssh_refused_with_the_reason(
    tmp_path: Path, dns: DnsServer, git_server: SshGitServer, work_dir: Path
) -> None:
    dns.add("git.test", SSH_HOST)
    # SSH may be allowed somewhere (so GIT_SSH_COMMAND is set), but not to git.test
    policy = write_policy(tmp_path, "version: 1\nallow: [elsewhere.test:22]\n")
    result = egressd_sandbox(
        ["--policy", str(policy), "--nameserver", dns.nameserver],
        ["git", "clone", "-q", git_server.url, "clone"],
        cwd=work_dir,
        env=git_server.env(sandbox_env(work_dir)),
    )
    assert result.returncode != 0
    assert b"egressd connect git.test:22: the proxy answered: HTTP/1.1 403" in result.stderr
    assert b"(reason: not_allowlisted)" in result.stderr
    assert not (work_dir / "clone").exists()
    assert git_server.connections() == 0


def test_ssh_without_the_helper_gets_nothing(
    tmp_path: Path, dns: DnsServer, git_server: SshGitServer, work_dir: Path
) -> None:
    """Plain ssh inside the sandbox, not told about the proxy and not captured (--no-capture),
    cannot reach the server at all."""
    dns.add("git.test", SSH_HOST)
    policy = write_policy(tmp_path, f"version: 1\nmode: allow\nallow: [{SSH_HOST}:22]\n")
    result = egressd_sandbox(
        ["--policy", str(policy), "--nameserver", dns.nameserver, "--no-capture"],
        ["ssh", "-F", str(git_server.ssh_config), f"{USER}@{SSH_HOST}", "true"],
        cwd=work_dir,
    )
    assert result.returncode == 255
    assert b"Network is unreachable" in result.stderr
    assert git_server.connections() == 0


def test_ssh_without_the_helper_is_captured_and_decided(
    tmp_path: Path, dns: DnsServer, git_server: SshGitServer, work_dir: Path
) -> None:
    """With capture (the default), plain ssh's connection becomes a CONNECT: allowed to the
    allowed host:22 and audited; refused (and audited) when the policy does not allow it."""
    audit = tmp_path / "audit.jsonl"
    command = ["ssh", "-F", str(git_server.ssh_config), f"{USER}@{SSH_HOST}", "true"]
    allowed = write_policy(tmp_path, f"version: 1\nallow: [{SSH_HOST}:22]\n", name="allowed.yaml")
    result = egressd_sandbox(
        ["--policy", str(allowed), "--nameserver", dns.nameserver, "--audit", str(audit)],
        command,
        cwd=work_dir,
    )
    assert result.returncode == 0, result.stderr
    assert git_server.connections() == 1
    refused = write_policy(tmp_path, "version: 1\nallow: [git.test:22]\n", name="refused.yaml")
    result = egressd_sandbox(
        ["--policy", str(refused), "--nameserver", dns.nameserver, "--audit", str(audit)],
        command,
        cwd=work_dir,
    )
    assert result.returncode == 255
    assert git_server.connections() == 1
    decisions = [
        (r["host"], r["port"], r["decision"], r["reason"])
        for r in map(json.loads, audit.read_text().splitlines())
        if r.get("event") == "decision"
    ]
    assert decisions[0][:3] == (SSH_HOST, 22, "allow")
    # a documentation-range literal the policy no longer names: the address guard refuses it
    assert decisions[-1] == (SSH_HOST, 22, "deny", "private_address")


def test_git_clone_over_ssh_with_exec(
    tmp_path: Path, dns: DnsServer, git_server: SshGitServer, work_dir: Path
) -> None:
    """`egressd exec` sets the same GIT_SSH_COMMAND: the clone goes through the proxy too."""
    dns.add("git.test", SSH_HOST)
    policy = write_policy(tmp_path, f"version: 1\nallow: [git.test:22, {SSH_HOST}:22]\n")
    audit = tmp_path / "audit.jsonl"
    result = egressd_exec(
        ["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(audit)],
        ["git", "clone", "-q", git_server.url, str(work_dir / "clone")],
        env=git_server.env(dict(os.environ)),
    )
    assert result.returncode == 0, result.stderr.decode()
    assert (work_dir / "clone" / "README").exists()
    records = audit_records(audit)
    assert any(r["event"] == "decision" and r["host"] == "git.test" and r["port"] == 22 for r in records)
