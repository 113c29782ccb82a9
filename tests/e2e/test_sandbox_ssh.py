"""git over SSH through the proxy: a real sshd in the test namespace, a real `git clone` inside
`egressd sandbox` (and `egressd exec`), with GIT_SSH_COMMAND using egressd's connect helper.

sshd runs as the user who runs the tests (an ordinary user binds port 22 in the test namespace,
which lets every user bind low ports).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from egressd.child.ssh_env import git_ssh_command, proxy_command, ssh_may_be_allowed, with_git_ssh
from egressd.policy import parse_policy
from tests.support.audit_log import audit_records
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import egressd_exec, write_policy
from tests.support.netns import UPSTREAM_V4
from tests.support.sandboxes import egressd_sandbox, sandbox_env

SSHD = "/usr/sbin/sshd"
SSH_HOST = UPSTREAM_V4[6]  # 198.51.100.7

# sshd runs as whoever runs the tests and lets only that user in
USER = pwd.getpwuid(os.getuid()).pw_name

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
@dataclass
class GitServer:
    repo: Path
    ssh_config: Path
    log: Path

    @property
    def url(self) -> str:
        return f"ssh://{USER}@git.test{self.repo}"

    def env(self, base: dict[str, str]) -> dict[str, str]:
        env = dict(base)
        # the user's own ssh options (key, known hosts); egressd appends its ProxyCommand
        env["GIT_SSH_COMMAND"] = f"ssh -F {self.ssh_config}"
        return env


def _run(*argv: str, cwd: Path | None = None) -> None:
    subprocess.run(argv, cwd=cwd, check=True, capture_output=True, timeout=60)


def _wait_listening(log: Path, timeout: float = 10) -> None:
    """Until sshd says it listens (not by connecting: the tests count sshd's connections)."""
    deadline = time.monotonic() + timeout
    while "Server listening on" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


@pytest.fixture
def git_server(tmp_path: Path, work_dir: Path) -> Iterator[GitServer]:
    server = tmp_path / "server"
    server.mkdir()
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(server / "hostkey"))
    # the client's key and config live in the sandbox's working directory (visible inside)
    client = work_dir / ".ssh-test"
    client.mkdir()
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(client / "key"))
    shutil.copy(client / "key.pub", server / "authorized_keys")
    (client / "config").write_text(
        f"Host *\n  IdentityFile {client / 'key'}\n  UserKnownHostsFile /dev/null\n"
        "  StrictHostKeyChecking no\n  BatchMode yes\n  LogLevel ERROR\n"
    )
    config = server / "sshd_config"
    config.write_text(
        f"Port 22\nListenAddress {SSH_HOST}\nHostKey {server / 'hostkey'}\n"
        f"AuthorizedKeysFile {server / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
        "PidFile none\nLogLevel VERBOSE\n"
    )
    # a bare repository with one commit
    repo, seed = server / "repo.git", tmp_path / "seed"
    _run("git", "init", "-q", "--bare", "-b", "main", str(repo))
    _run("git", "init", "-q", "-b", "main", str(seed))
    (seed / "README").write_text("cloned through egressd\n")
    _run("git", "-C", str(seed), "add", "README")
    _run("git", "-C", str(seed), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    _run("git", "-C", str(seed), "push", "-q", str(repo), "main")
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # root's sshd: its privilege-separation directory
    log = server / "sshd.log"
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stderr=log.open("wb"))
    try:
        _wait_listening(log)
        yield GitServer(repo, client / "config", log)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def work_dir(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


def _connections(server: GitServer) -> int:
    return server.log.read_text().count("Connection from")


def test_git_clone_over_ssh_inside_the_sandbox(
    tmp_path: Path, dns: DnsServer, git_server: GitServer, work_dir: Path
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
    assert (work_dir / "clone" / "README").read_text() == "cloned through egressd\n"
    assert _connections(git_server) == 1


def test_git_clone_over_ssh_without_the_helper_is_captured(
    tmp_path: Path, dns: DnsServer, git_server: GitServer, work_dir: Path
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
    assert (work_dir / "c" / "README").read_text() == "cloned through egressd\n"
    assert _connections(git_server) == 1
    assert any(
        r.get("event") == "decision" and r["host"] == "git.test" and r["decision"] == "allow"
        for r in audit_records(audit)
    )


def test_git_clone_over_ssh_refused_with_the_reason(
    tmp_path: Path, dns: DnsServer, git_server: GitServer, work_dir: Path
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
    assert _connections(git_server) == 0


def test_ssh_without_the_helper_gets_nothing(
    tmp_path: Path, dns: DnsServer, git_server: GitServer, work_dir: Path
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
    assert _connections(git_server) == 0


def test_ssh_without_the_helper_is_captured_and_decided(
    tmp_path: Path, dns: DnsServer, git_server: GitServer, work_dir: Path
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
    assert _connections(git_server) == 1
    refused = write_policy(tmp_path, "version: 1\nallow: [git.test:22]\n", name="refused.yaml")
    result = egressd_sandbox(
        ["--policy", str(refused), "--nameserver", dns.nameserver, "--audit", str(audit)],
        command,
        cwd=work_dir,
    )
    assert result.returncode == 255
    assert _connections(git_server) == 1
    decisions = [
        (r["host"], r["port"], r["decision"], r["reason"])
        for r in map(json.loads, audit.read_text().splitlines())
        if r.get("event") == "decision"
    ]
    assert decisions[0][:3] == (SSH_HOST, 22, "allow")
    # a documentation-range literal the policy no longer names: the address guard refuses it
    assert decisions[-1] == (SSH_HOST, 22, "deny", "private_address")


def test_git_clone_over_ssh_with_exec(
    tmp_path: Path, dns: DnsServer, git_server: GitServer, work_dir: Path
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
