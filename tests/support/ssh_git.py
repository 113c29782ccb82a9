"""A real sshd serving a bare git repository, in the test's network namespace.

Why: git over SSH through egressd (its ProxyCommand helper, or capture for an ssh that was not
told about the proxy) is only proven against a real sshd. It runs as whoever runs the tests and
lets only that user in (an ordinary user binds any port in the test namespace), so the tests run
as an ordinary user too. The client's key and ssh config are written where the caller says (a
sandbox must see them).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"
# sshd runs as whoever runs the tests and lets only that user in
USER = pwd.getpwuid(os.getuid()).pw_name
README = "cloned through egressd\n"


@dataclass
class SshGitServer:
    repo: Path
    ssh_config: Path
    log: Path
    name: str
    port: int

    @property
    def url(self) -> str:
        port = f":{self.port}" if self.port != 22 else ""
        return f"ssh://{USER}@{self.name}{port}{self.repo}"

    def env(self, base: dict[str, str]) -> dict[str, str]:
        env = dict(base)
        # the user's own ssh options (key, known hosts); egressd appends its ProxyCommand
        env["GIT_SSH_COMMAND"] = f"ssh -F {self.ssh_config}"
        return env

    def connections(self) -> int:
        return self.log.read_text().count("Connection from")


def _run(*argv: str, cwd: Path | None = None) -> None:
    subprocess.run(argv, cwd=cwd, check=True, capture_output=True, timeout=60)


def _wait_listening(log: Path, timeout: float = 10) -> None:
    """Until sshd says it listens (not by connecting: the tests count sshd's connections)."""
    deadline = time.monotonic() + timeout
    while "Server listening on" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


@contextlib.contextmanager
def ssh_git_server(
    server: Path, client: Path, address: str, *, name: str = "git.test", port: int = 22
) -> Iterator[SshGitServer]:
    """sshd on address:port with a bare repository of one commit (its README is README);
    `server` holds sshd's files and the repository, `client` the client's key and ssh config."""
    server.mkdir()
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(server / "hostkey"))
    client.mkdir()
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(client / "key"))
    shutil.copy(client / "key.pub", server / "authorized_keys")
    (client / "config").write_text(
        f"Host *\n  IdentityFile {client / 'key'}\n  UserKnownHostsFile /dev/null\n"
        "  StrictHostKeyChecking no\n  BatchMode yes\n  LogLevel ERROR\n"
    )
    config = server / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress {address}\nHostKey {server / 'hostkey'}\n"
        f"AuthorizedKeysFile {server / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
        "PidFile none\nLogLevel VERBOSE\n"
    )
    repo, seed = server / "repo.git", server / "seed"
    _run("git", "init", "-q", "--bare", "-b", "main", str(repo))
    _run("git", "init", "-q", "-b", "main", str(seed))
    (seed / "README").write_text(README)
    _run("git", "-C", str(seed), "add", "README")
    _run("git", "-C", str(seed), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    _run("git", "-C", str(seed), "push", "-q", str(repo), "main")
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # root's sshd: its privilege-separation directory
    log = server / "sshd.log"
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stderr=log.open("wb"))
    try:
        _wait_listening(log)
        yield SshGitServer(repo, client / "config", log, name, port)
    finally:
        proc.terminate()
        proc.wait(10)
