"""`egressd remote-agent run`: egressd on the remote host, under the client's policy only.

It takes every policy from the channel (never from a file, never from EGRESSD_MODE here: the
client already applied its own), runs the proxy, runs the command like `exec` does, and answers
each policy with `applied` or `rejected` (a bad push keeps the last good policy). When the
channel ends — the client went away or SSH dropped — the command and everything it started,
detached or not, is hung up (SIGHUP, SIGKILL 5 s later; the agent is their subreaper): none may
run on under a policy its client can no longer change. What is left when the command exits ends
the same way, since the proxy it would use goes with the agent.

The agent runs under the session's guard (reaper.py, `egressd remote-agent guard`), which bound
the proxy's ports and handed them over (LISTEN_FDS): if the agent dies (SIGKILL, the OOM killer, a
crash), the command dies with it (its parent-death signal), the guard ends whatever the command
left, and nobody else can bind the ports meanwhile, because the guard still holds them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from egressd.child import process
from egressd.child.ssh_env import with_git_ssh
from egressd.observe.audit import AuditLog
from egressd.platform.exits import exec_failure
from egressd.policy import Policy, PolicyError
from egressd.remote import reaper
from egressd.remote.channel import ChannelError, LineChannel, read_policy
from egressd.remote.spawn import tethered
from egressd.session import ProxySession, SessionError, SessionOptions

if TYPE_CHECKING:
    from egressd.sandbox.layout import Layout
    from egressd.session.snapshot import Loaded

FIRST_POLICY_TIMEOUT = 30.0
HANGUP_GRACE = 5.0


class AgentError(Exception):
    """The agent cannot start the command; exit 2 with this message."""


class ChannelAudit(AuditLog):
    """The audit records go back to the client (which writes its --audit file); trace stays here."""

    def __init__(self, channel: LineChannel | None, trace: TextIO | None) -> None:
        super().__init__(None, trace=trace)
        self._channel = channel

    @property
    def enabled(self) -> bool:
        return self._channel is not None or super().enabled

    def _forward(self, record: dict[str, Any]) -> dict[str, Any]:
        if self._channel is not None:
            self._channel.send({"type": "audit", "record": record})
        return record

    def decision(self, **fields: Any) -> dict[str, Any]:
        return self._forward(super().decision(**fields))

    def closed(self, **fields: Any) -> dict[str, Any]:
        return self._forward(super().closed(**fields))

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return self._forward(super().event(kind, **fields))


def inherited_sockets(environ: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, socket.socket]:
    """The listening sockets the session's guard handed over ({"http": ..., "socks": ...}), by
    systemd's convention (LISTEN_PID, LISTEN_FDS from fd 3, LISTEN_FDNAMES); the variables are
    removed, and the command inherits none of the sockets."""
    pid, count = environ.pop("LISTEN_PID", None), environ.pop("LISTEN_FDS", "0")
    names = environ.pop("LISTEN_FDNAMES", "").split(":")
    if pid != str(os.getpid()) or not count.isdigit():
        return {}
    found = {}
    for index, name in enumerate(names[: int(count)]):
        fd = 3 + index
        os.set_inheritable(fd, False)
        found[name] = socket.socket(fileno=fd)
    return found


def _check_profile(policy: Policy, profile: str | None) -> Policy:
    if profile is not None and profile not in policy.profiles:
        raise PolicyError(policy.source, "--profile", profile, "no such profile in the pushed policy")
    return policy


@dataclass(frozen=True)
class SandboxPlan:
    """`--sandbox`: bubblewrap found and probed on this host, and the layout for the command."""

    bwrap: str
    disable_userns: bool
    layout: Layout

    @classmethod
    def prepare(cls, rw: Sequence[str], show: Sequence[str] = (), hide: Sequence[str] = ()) -> SandboxPlan:
        """Check before anything runs: the command never runs unconfined (AgentError instead).

        The layout is the local sandbox's (egressd sandbox), with the remote working directory
        as its project — except the login's home, the usual working directory of an SSH session,
        which stays masked as every home is: empty but for a short list of harmless configuration
        and what --show names (read-only), and `--rw`/`--ro` paths. The command starts there.
        """
        from egressd.sandbox import preflight
        from egressd.sandbox.layout import plan_layout
        from egressd.sandbox.mounts import MountError

        if not sys.platform.startswith("linux"):
            raise AgentError(f"--sandbox on the remote needs Linux (bubblewrap), not {sys.platform}")
        cwd = os.path.realpath(os.getcwd())
        project = None if cwd == os.path.realpath(os.path.expanduser("~")) else cwd
        try:
            # a project other than the home is read-only: the command writes where --rw says
            layout = plan_layout(
                SessionOptions(),
                workdir=project,
                rw=rw,
                ro=(project,) if project is not None else (),
                show=show,
                hide=hide,
            )
            # never a bwrap an earlier sandboxed command could have written (a --rw path on PATH)
            bwrap = preflight.locate_bwrap(writable=[m.path for m in layout.mounts if m.writable])
            disable_userns = preflight.supports_disable_userns(bwrap)
            preflight.probe(bwrap, disable_userns)
        except (preflight.SandboxUnavailable, MountError) as exc:
            raise AgentError(f"--sandbox: {exc}") from exc
        return cls(bwrap, disable_userns, layout)


class PushedPolicy:
    """The session's policy source here: the first policy from the channel, checked against the
    command's profile (never a file, never EGRESSD_MODE: the client applied its own). Later pushes
    are the agent's to apply (`Agent._apply`): nothing is watched."""

    path = None
    writable = False

    def __init__(self, channel: LineChannel, profile: str | None) -> None:
        self.channel = channel
        self.profile = profile
        self.seq: object = None

    def load(self) -> Loaded:
        from egressd.session.snapshot import Loaded

        try:
            message = self.channel.receive(timeout=FIRST_POLICY_TIMEOUT)
        except (TimeoutError, ChannelError, OSError) as exc:
            raise AgentError(f"no policy from the client: {exc or type(exc).__name__}") from exc
        if message is None or message.get("type") != "policy":
            raise AgentError("no policy from the client (the channel closed)")
        try:
            policy = _check_profile(read_policy(message), self.profile)
        except PolicyError as exc:
            self.channel.send({"type": "rejected", "seq": message.get("seq"), "error": str(exc)})
            raise AgentError(f"the client's policy does not load here: {exc}") from exc
        self.seq = message.get("seq")
        return Loaded(policy, {})  # secrets never reach a remote agent (remote/channel.py)

    def watch(self, on_change: Callable[[Loaded], None], on_error: Callable[[str], None]) -> None:
        return None

    def trigger(self) -> bool:
        return False


class Agent:
    def __init__(
        self,
        channel: LineChannel,
        *,
        profile: str | None,
        listen: tuple[str, int],
        trace: bool,
        audit_to_client: bool,
        say: Callable[[str], None],
        inspect: bool = True,
        upstream_ca: Sequence[str] = (),
        sandbox: SandboxPlan | None = None,
        sockets: dict[str, socket.socket] | None = None,
    ) -> None:
        self.channel = channel
        self.sockets = sockets or {}
        self.sandbox = sandbox
        self.options = SessionOptions(
            listen=listen, inspect=inspect, upstream_ca=tuple(upstream_ca), control=False, prompt=False
        )
        self.profile = profile
        self.say = say
        self.trace = trace
        self.audit = ChannelAudit(channel if audit_to_client else None, sys.stderr if trace else None)
        self.lost = threading.Event()
        self.session: ProxySession | None = None

    # -- policies ----------------------------------------------------------------------------
    def _listen(self) -> None:
        """Apply every further policy the client pushes; mark the channel lost at its end."""
        try:
            while (message := self.channel.receive()) is not None:
                if message.get("type") == "policy":
                    self._apply(message)
        except (ChannelError, OSError) as exc:
            self.say(f"policy channel failed: {exc}")
        finally:
            self.lost.set()

    def _apply(self, message: dict[str, Any]) -> None:
        from egressd.session.snapshot import Loaded

        assert self.session is not None and self.session.reloads is not None
        seq = message.get("seq")
        try:
            policy = _check_profile(read_policy(message), self.profile)
        except PolicyError as exc:
            error = " ".join(str(exc).split())
            self.say(f"refused a policy from the client: {error}; keeping the last good one")
            self.session.reloads.notice("reload_failed", error=str(exc))
            self.channel.send({"type": "rejected", "seq": seq, "error": str(exc)})
            return
        self.session.apply(Loaded(policy, {}))
        self.channel.send({"type": "applied", "seq": seq})

    # -- the command -------------------------------------------------------------------------
    def run(self, command: Sequence[str], catcher: process.SignalCatcher) -> int:
        """The command under the session the first policy starts (egressd.session)."""
        source = PushedPolicy(self.channel, self.profile)
        session = ProxySession(
            self.options,
            say=self.say,
            announce_reloads=self.trace,
            command=command,
            source=source,
            audit=self.audit,
            sockets=self.sockets,
        )
        try:
            session.start()
        except SessionError as exc:
            raise AgentError(str(exc)) from exc
        self.session = session
        try:
            self.channel.send({"type": "applied", "seq": source.seq})
            threading.Thread(target=self._listen, name="egressd-policy-channel", daemon=True).start()
            creds = session.credentials(self.profile)
            # git over SSH through the proxy, as `exec` does
            env = with_git_ssh(session.child_env(os.environ, creds), session.policy)
            reaper.become_subreaper()  # detached children stay below the agent
            if self.sandbox is not None:
                returncode = self._run_sandboxed(self.sandbox, command, creds, catcher)
            else:
                try:
                    # dies with the agent: no command runs on without its proxy and policy
                    pid = process.spawn(tethered(command, signo=signal.SIGKILL), env, catcher)
                except OSError as exc:
                    returncode = exec_failure(command[0], exc)
                else:
                    returncode = self._wait(pid, catcher)
            self.channel.send({"type": "exit", "returncode": returncode})
            return returncode
        finally:
            session.close()

    def _run_sandboxed(
        self, plan: SandboxPlan, command: Sequence[str], creds: Any, catcher: process.SignalCatcher
    ) -> int:
        """The command in bubblewrap, its only way out this agent's proxy; hung up if SSH drops."""
        from egressd.sandbox.runner import run_bwrap

        done = threading.Event()

        def hang_up_when_lost() -> None:
            while not done.wait(0.25):
                if self.lost.is_set():
                    self.say("the client is gone (policy channel closed): hanging up the sandbox")
                    # run_bwrap waits for bubblewrap itself: signal, never reap
                    reaper.end_tree(os.getpid(), None, grace=HANGUP_GRACE, collect=False)
                    return

        watcher = threading.Thread(target=hang_up_when_lost, name="egressd-sandbox-hangup", daemon=True)
        watcher.start()
        try:
            assert self.session is not None
            outcome = run_bwrap(
                self.session,
                creds,
                command,
                plan.layout,
                bwrap=plan.bwrap,
                disable_userns=plan.disable_userns,
                catcher=catcher,
            )
        finally:
            done.set()
            watcher.join()
        if outcome.error:
            raise AgentError(f"the sandbox did not start: {outcome.error}; {command[0]} was not run")
        reaper.end_tree(os.getpid(), None, grace=1.0)  # what the command left behind
        return outcome.returncode

    def _wait(self, pid: int, catcher: process.SignalCatcher) -> int:
        returncode: int | None = None
        while returncode is None:
            for done, status in reaper.reap():  # the command, and orphans re-parented here
                if done == pid:
                    returncode = reaper.exit_code(status)
            if returncode is not None:
                break
            if self.lost.is_set():
                self.say("the client is gone (policy channel closed): hanging up the command")
                for done, status in reaper.end_tree(os.getpid(), os.getpgrp(), grace=HANGUP_GRACE):
                    if done == pid:
                        returncode = reaper.exit_code(status)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # without /proc only the group was hung up
                if returncode is None:
                    _, status = os.waitpid(pid, 0)
                    returncode = reaper.exit_code(status)
                return returncode
            got = catcher.wait(0.25)
            if got is None or got.signo == signal.SIGCHLD or got.from_kernel:
                continue  # the terminal already signalled the whole group, the command included
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, got.signo)
        reaper.end_tree(os.getpid(), None, grace=1.0)  # what the command left behind
        return returncode
