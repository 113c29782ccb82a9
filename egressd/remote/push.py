"""Client side of remote egress: the local policy (watched) and the feed that pushes it over SSH.

The policy is loaded here exactly as `exec` loads it — the file or preset, EGRESSD_MODE, then the
command line's --allow/--deny/--mode/--nameserver — and every good new version of the file is
pushed at once; a version that does not load is reported and not pushed (the remote keeps the
last good one, as a local reload would).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from egressd.platform.reload import FileWatcher, UnsettledError
from egressd.policy import Policy, PolicyError
from egressd.remote import scripts
from egressd.remote.channel import ChannelError, decode, encode, policy_message
from egressd.remote.connection import SshConnection, SshError, remote_text
from egressd.remote.spawn import PIPE, Child
from egressd.remote.supervise import accepted_status
from egressd.session import Overrides, SessionError, base_policy, file_policy, resolve_policy_path

LISTEN_TIMEOUT = 30.0


class LocalPolicy:
    """The client's policy; `watch()` calls `on_change` with every good new version."""

    def __init__(
        self, policy_file: str | None, overrides: Overrides, on_error: Callable[[str], None]
    ) -> None:
        self.policy_file = policy_file
        self.overrides = overrides
        self.on_error = on_error
        self.watcher: FileWatcher[Policy] | None = None
        self.policy = self._load()

    def _load(self) -> Policy:
        try:
            if self.policy_file is None:
                return self.overrides.apply(base_policy(None))
            path = resolve_policy_path(self.policy_file)
            self.watcher = FileWatcher(
                path,
                lambda files: file_policy(path, self.overrides, files),
                self._changed,
                self.on_error,
                name="egressd-policy-watch",
            )
            return self.watcher.load()
        except (PolicyError, UnsettledError) as exc:
            raise SessionError(str(exc)) from exc

    def _changed(self, policy: Policy) -> None:
        self.policy = policy
        self._on_change(policy)

    def watch(self, on_change: Callable[[Policy], None]) -> None:
        self._on_change = on_change
        if self.watcher is not None:
            self.watcher.start()

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()


class AuditFile:
    """The client's --audit file in remote egress mode: the agent's records, marked with the host."""

    def __init__(self, path: str, remote: str) -> None:
        self.remote = remote
        self._lock = threading.Lock()
        self._file: TextIO = open(  # noqa: SIM115 - open for the whole run
            path, "a", buffering=1, encoding="utf-8", opener=lambda p, f: os.open(p, f, 0o600)
        )

    def write(self, record: dict[str, Any]) -> None:
        record = {**record, "remote": self.remote}
        with self._lock, contextlib.suppress(OSError, ValueError):
            self._file.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


class PolicyFeed:
    """The `egressd remote-agent feed` session: policies go in on its stdin, answers come out."""

    def __init__(
        self,
        connection: SshConnection,
        egressd: list[str],
        directory: str,
        *,
        say: Callable[[str], None],
        announce: bool,
        audit: AuditFile | None,
    ) -> None:
        self.connection = connection
        self.say = say
        self.announce = announce
        self.audit = audit
        command = [*egressd, "remote-agent", "feed", "--socket", scripts.channel_path(directory)]
        self.child: Child = connection.start_helper(
            scripts.remote_command('exec "$@"', *command), stdin=PIPE, stdout=PIPE
        )
        self._seq = 0
        self._secrets_warned = False
        self._sources: dict[int, str] = {}
        self._lock = threading.Lock()
        self._exit: int | None = None
        self._done = threading.Event()  # the exit report came, or the feed ended
        self._reader: threading.Thread | None = None

    def wait_listening(self) -> None:
        """Block until the feed listens for the agent (lines before that are shell noise)."""
        assert self.child.stdout is not None
        deadline = time.monotonic() + LISTEN_TIMEOUT
        buffer = b""
        while time.monotonic() < deadline:
            line, sep, rest = buffer.partition(b"\n")
            if sep:
                buffer = rest
                with contextlib.suppress(ChannelError):
                    if decode(line).get("type") == "listening":
                        self._reader = threading.Thread(
                            target=self._read, args=(buffer,), name="egressd-policy-feed", daemon=True
                        )
                        self._reader.start()
                        return
                continue
            block = _read_with_timeout(self.child.stdout, deadline - time.monotonic())
            if not block:
                break
            buffer += block
        raise SshError(f"the policy channel to {self.connection.name} did not start", exit_code=2)

    def push(self, policy: Policy) -> None:
        if policy.secrets and not self._secrets_warned:
            self._secrets_warned = True
            self.say(
                "secrets stay on this machine: the command on the remote host gets neither their values "
                "nor placeholders (docs/secrets.md)"
            )
        with self._lock:
            self._seq += 1
            self._sources[self._seq] = policy.source
            data = encode(policy_message(policy, self._seq))
            if self.child.stdin is None:
                return
            try:
                _write_all(self.child.stdin, data)
            except OSError as exc:
                self.say(f"cannot push the policy to {self.connection.name}: {exc.strerror or exc}")

    def _read(self, buffer: bytes) -> None:
        assert self.child.stdout is not None
        try:
            while True:
                while b"\n" in buffer:
                    line, _, buffer = buffer.partition(b"\n")
                    with contextlib.suppress(ChannelError):
                        self._handle(decode(line))
                block = os.read(self.child.stdout, 65536)
                if not block:
                    return
                buffer += block
        except OSError:
            return
        finally:
            self._done.set()

    def _handle(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        seq = message.get("seq")
        source = self._sources.get(seq, "?") if isinstance(seq, int) else "?"
        if kind == "applied" and isinstance(seq, int) and seq > 1 and self.announce:
            self.say(f"{self.connection.name} applied the policy from {source}")
        elif kind == "rejected":
            error = remote_text(str(message.get("error")))
            self.say(f"{self.connection.name} refused the policy from {source}: {error}")
        elif kind == "audit" and self.audit is not None and isinstance(message.get("record"), dict):
            self.audit.write(message["record"])
        elif kind == "exit":
            status = accepted_status(message.get("returncode"))
            if status is None:
                self.say(
                    f"{self.connection.name} reported an exit status egressd does not take "
                    f"({remote_text(repr(message.get('returncode')))[:40]}); using the session's own"
                )
            self._exit = status
            self._done.set()

    def exit_report(self, timeout: float) -> int | None:
        """The remote command's exact exit status, as the agent reported it (None if it did not)."""
        self._done.wait(timeout)
        return self._exit

    def close(self) -> None:
        with self._lock:
            if self.child.stdin is not None:
                os.close(self.child.stdin)
                self.child.stdin = None
        if self.child.wait(3.0) is None:
            self.child.stop(grace=1.0)
        if self._reader is not None:
            self._reader.join(2.0)
        self.child.close_pipes()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_with_timeout(fd: int, timeout: float) -> bytes:
    """Up to 64 KiB from fd; b"" at EOF or when nothing came within `timeout` seconds."""
    ready, _, _ = select.select([fd], [], [], max(timeout, 0.0))
    return os.read(fd, 65536) if ready else b""
