"""Children attached to a running egressd (`egressd exec --attach`): their tokens and lifetimes.

Each attached child gets fresh credentials of its own (its profile's, if it asks for one), named
in the audit and `egressd ps` by its program and pid. The token lives exactly as long as the
process that asked for it: `exec --attach` asks, then replaces itself with the command (exec), so
the peer of the control connection IS the child; its exit — however it ends, SIGKILL included —
revokes the token (a pidfd on Linux, a short poll elsewhere). `DELETE /v1/children/ID` revokes it
earlier.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from egressd.platform.exits import alive

if TYPE_CHECKING:
    import asyncio

    from egressd.admission.state import ProxyCredentials

MAX_CHILDREN = 4096  # attached at once; beyond it an attach is refused (429)
POLL = 1.0  # seconds between liveness checks where there is no pidfd


class ChildError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Child:
    """One child a session runs: its process and the credentials it was issued. A plain class:
    made by the registry, listed and read, never compared nor copied (a dataclass would only add
    start-up time)."""

    __slots__ = ("id", "pid", "program", "creds", "started")

    def __init__(self, id: str, pid: int, program: str, creds: ProxyCredentials) -> None:
        self.id = id
        self.pid = pid
        self.program = program
        self.creds = creds
        self.started = time.time()

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "pid": self.pid,
            "program": self.program,
            "client": self.creds.client,
            "profile": self.creds.profile,
            "started": self.started,
        }


@dataclass(frozen=True)
class Issuer:
    """What the session lends the registry: issue and revoke credentials, the child's variables."""

    issue: Callable[[str | None, str], ProxyCredentials]  # (profile, label) -> credentials
    revoke: Callable[[ProxyCredentials], None]
    exports: Callable[[ProxyCredentials], dict[str, str]]
    ssh: Callable[[], bool]  # the policy may allow SSH: GIT_SSH_COMMAND through egressd
    record: Callable[[ProxyCredentials, Sequence[str]], None]  # the audit's "child" line
    hidden: Callable[[], Sequence[str]]  # egressd's variables holding secret values: never the child's
    started: Callable[[ProxyCredentials, int], None]  # the child's pid: its process tree owns its connections


class Children:
    """Used on the proxy's loop only, where the control API that attaches and lists them runs."""

    def __init__(self, issuer: Issuer) -> None:
        self.issuer = issuer
        self._children: dict[str, Child] = {}
        self._ids = itertools.count(1)

    def attach(self, pid: int, command: Sequence[str], profile: str | None) -> tuple[Child, dict[str, Any]]:
        """A new child's credentials and the answer for it (ChildError: why not)."""
        program = os.path.basename(command[0]) if command else "?"
        if len(self._children) >= MAX_CHILDREN:
            raise ChildError(429, f"{MAX_CHILDREN} attached children already")
        child_id = f"c{next(self._ids)}"
        try:
            creds = self.issuer.issue(profile, f"{program}[{pid}]")
        except KeyError as exc:
            raise ChildError(400, str(exc.args[0]) if exc.args else "bad profile") from None
        child = Child(child_id, pid, program, creds)
        self._children[child_id] = child
        self.issuer.record(creds, command)
        self.issuer.started(creds, pid)
        answer = {
            **child.to_json(),
            "env": self.issuer.exports(creds),
            "hidden": list(self.issuer.hidden()),
            "ssh": self.issuer.ssh(),
        }
        return child, answer

    def detach(self, child_id: str) -> bool:
        child = self._children.pop(child_id, None)
        if child is None:
            return False
        self.issuer.revoke(child.creds)
        return True

    def list(self) -> list[dict[str, Any]]:
        return [c.to_json() for c in self._children.values()]

    def close(self) -> None:
        for child_id in list(self._children):
            self.detach(child_id)

    # -- lifetimes -----------------------------------------------------------------------------------
    def watch(self, child: Child) -> None:
        """On the control loop: detach the child when its process exits. Raises ChildError (410)
        when it is gone already."""
        import asyncio  # loaded with the control loop

        loop = asyncio.get_running_loop()
        try:
            pidfd = os.pidfd_open(child.pid)
        except ProcessLookupError:
            self.detach(child.id)
            raise ChildError(410, f"process {child.pid} exited before its token was handed over") from None
        except (AttributeError, OSError):  # no pidfd (macOS, old kernels): poll
            loop.call_later(POLL, self._poll, loop, child)
            return

        def gone() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            self.detach(child.id)

        loop.add_reader(pidfd, gone)

    def _poll(self, loop: asyncio.AbstractEventLoop, child: Child) -> None:
        if child.id not in self._children:
            return
        if alive(child.pid):
            loop.call_later(POLL, self._poll, loop, child)
        else:
            self.detach(child.id)
