"""The policy channel of remote egress mode: JSON lines between the client and the remote agent.

client → agent: {"type": "policy", "seq", "source", "policy": <file-format data>}
agent → client: {"type": "applied"|"rejected", "seq", "error"?}, {"type": "audit", "record"},
                {"type": "exit", "returncode"}; the feeder adds {"type": "listening"} first.
The policy travels in the policy file format (`policy_to_data`), so the remote builds it with the
same loader and validation as a file, and never reads a policy of its own.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from typing import Any

from egressd.policy import Policy
from egressd.policy.dump import policy_to_data
from egressd.policy.loader import parse_policy

MAX_LINE = 4 * 1024 * 1024
PUSHED_SUFFIX = " (pushed over SSH)"


class ChannelError(Exception):
    """A malformed message, or a line longer than MAX_LINE."""


def encode(message: dict[str, Any]) -> bytes:
    return (json.dumps(message, separators=(",", ":"), default=str) + "\n").encode()


def decode(line: bytes) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ChannelError(f"not a channel message: {line[:80]!r}") from exc
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ChannelError(f"not a channel message: {line[:80]!r}")
    return message


# not pushed: secrets (their values never travel) and what the decision never reads (acknowledgements,
# a preset's description), so a remote egressd that predates those keys still loads the policy
_NOT_PUSHED = ("preset", "providers", "secrets")


def policy_message(policy: Policy, seq: int) -> dict[str, Any]:
    """The policy as the remote agent gets it: without `secrets:` (their values come from this
    machine's environment, files or commands, and never travel; the client warns once), nor what
    the decision never reads (`preset:`, `providers:`)."""
    data = {k: v for k, v in policy_to_data(policy).items() if k not in _NOT_PUSHED}
    return {"type": "policy", "seq": seq, "source": policy.source, "policy": data}


def read_policy(message: dict[str, Any]) -> Policy:
    """The Policy a `policy` message carries; PolicyError when it does not load here."""
    source = str(message.get("source") or "<client>").removesuffix(PUSHED_SUFFIX)
    return parse_policy(message.get("policy"), source=source + PUSHED_SUFFIX)


class LineChannel:
    """Messages over a stream socket; send() may be called from any thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = b""
        self._send_lock = threading.Lock()
        self._closed = False

    @classmethod
    def connect(cls, path: str, timeout: float = 10.0) -> LineChannel:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(path)
        sock.settimeout(None)
        return cls(sock)

    def send(self, message: dict[str, Any]) -> bool:
        """False when the other end is gone (the caller decides whether that matters)."""
        data = encode(message)
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError:
                return False
        return True

    def receive(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next message; None at EOF, or once this end closed the channel (another thread may
        be waiting here then). socket.timeout (TimeoutError) after `timeout`."""
        try:
            self.sock.settimeout(timeout)
            while b"\n" not in self._buffer:
                if len(self._buffer) > MAX_LINE:
                    raise ChannelError("channel message too long")
                block = self.sock.recv(65536)
                if not block:
                    return None
                self._buffer += block
        except OSError:
            if self._closed:
                return None
            raise
        finally:
            with contextlib.suppress(OSError):
                self.sock.settimeout(None)
        line, _, self._buffer = self._buffer.partition(b"\n")
        return decode(line)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
