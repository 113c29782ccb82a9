"""Remote egress mode: egressd runs on the remote host and the traffic leaves from there.

The client checks that egressd is installed there (before anything runs), starts the policy
feed, pushes its policy, then runs `egressd remote-agent guard DIR egressd remote-agent run -- CMD`
as the session: the guard (reaper.py) binds the proxy's ports and hands them to the agent, so they
stay held until everything the command started has ended, even when the agent dies. Every change
of the local policy file is pushed at once; the remote's own policy files and EGRESSD_MODE are
never consulted: the remote egressd decides with the client's policy, but it decides.
"""

from __future__ import annotations

import os
import posixpath
import shlex
from collections.abc import Callable, Mapping, Sequence

from egressd.child import process
from egressd.policy import Policy
from egressd.remote import scripts
from egressd.remote.connection import SshConnection, SshError, remote_text
from egressd.remote.push import AuditFile, LocalPolicy, PolicyFeed
from egressd.remote.supervise import Outcome, supervise


class RemoteEgress:
    """One remote-egress run; `directory` is the remote session directory once it exists."""

    def __init__(
        self,
        connection: SshConnection,
        local: LocalPolicy,
        egressd: Sequence[str],
        agent_options: Sequence[str],
        *,
        listen: Sequence[Mapping[str, object]] = (),
        say: Callable[[str], None],
        announce: bool,
        audit: AuditFile | None,
        files: Mapping[str, bytes] | None = None,
    ) -> None:
        self.connection = connection
        self.files = dict(files or {})
        self.local = local
        self.egressd = list(egressd)
        self.agent_options = list(agent_options)
        self.listen = list(listen)
        self.say = say
        self.announce = announce
        self.audit = audit
        self.directory: str | None = None
        self.feed: PolicyFeed | None = None

    def check_installed(self) -> str:
        """The remote egressd's version line; SshError (exit 2) when it cannot run there."""
        done = self.connection.helper(scripts.version_command(self.egressd))
        lines = [line for line in done.stdout.splitlines() if line.startswith("egressd ")]
        if done.ok and lines:
            return remote_text(lines[-1])
        why = remote_text(done.stderr) or f"exit status {done.returncode}"
        raise SshError(
            f"egressd is not installed on {self.connection.name} (`{shlex.join(self.egressd)} --version` "
            f"failed there: {why}). --egress remote runs egressd on the remote host: install it there "
            "(pip install egressd), point --remote-egressd at it, or leave out --egress remote to relay "
            "the traffic through this machine. Nothing was run.",
            exit_code=2,
        )

    def _pushed(self, policy: Policy) -> None:
        if self.feed is not None:
            self.feed.push(policy)
        if self.announce:
            where = self.connection.name
            self.say(f"policy reloaded from {policy.source} (mode: {policy.mode}); pushing it to {where}")

    def run(self, command: Sequence[str], catcher: process.SignalCatcher) -> Outcome:
        self.check_installed()
        self.directory = directory = self.connection.make_directory(scripts.session_plan(listen=self.listen))
        agent_files: list[str] = []
        for name, data in self.files.items():  # --upstream-ca files, for the remote proxy
            done = self.connection.helper(scripts.put_command(directory, name), input=data)
            if not done.ok:
                raise SshError(f"cannot copy {name} to {self.connection.name}: {done.stderr.strip()}", 2)
            agent_files += ["--upstream-ca", posixpath.join(directory, name)]
        self.feed = feed = PolicyFeed(
            self.connection, self.egressd, directory, say=self.say, announce=self.announce, audit=self.audit
        )
        feed.wait_listening()
        feed.push(self.local.policy)
        self.local.watch(self._pushed)
        agent = [
            *self.egressd,
            "remote-agent",
            "guard",
            directory,
            "--",
            *self.egressd,
            "remote-agent",
            "run",
            "--channel",
            scripts.channel_path(directory),
            *self.agent_options,
            *agent_files,
            "--",
            *command,
        ]
        child = self.connection.start(scripts.exec_command(agent), new_group=not os.isatty(0))
        try:
            return supervise(child, self.connection, directory, catcher, exit_report=feed.exit_report)
        finally:
            if child.poll() is None:
                child.stop(grace=2.0)

    def close(self) -> None:
        self.local.stop()
        if self.feed is not None:
            self.feed.close()
        if self.audit is not None:
            self.audit.close()
