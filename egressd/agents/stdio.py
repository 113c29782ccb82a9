"""Put egressd in the child's stdio: pipes in place of fds 0 and 1, and a relay thread each way.

Why the swap: `exec` and `sandbox` start the child with egressd's own fds 0/1/2 (the sandbox's
launcher hands them on to the command inside). Putting pipes on fds 0 and 1 before the child starts
lets both launchers run unchanged, while egressd keeps the client's stdin/stdout on other fds and
relays between the two. egressd's own stray prints (sys.stdout) go to stderr meanwhile: stdout
belongs to the JSON-RPC stream.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from egressd.agents.jsonrpc import Handler, Writer, pump

DRAIN_TIMEOUT = 5.0  # after the child exits: what it wrote is still forwarded for this long


class StdioRelay:
    """The two relay threads between the client (egressd's stdin/stdout) and the child."""

    def __init__(self, name: str, warn: Callable[[str], None]) -> None:
        self.name = name
        self.warn = warn
        self.client_in = os.dup(0)
        self.client = Writer(os.dup(1))
        child_in, to_child = os.pipe()
        self.from_child, child_out = os.pipe()
        self.to_child = Writer(to_child)
        sys.stdout.flush()
        os.dup2(child_in, 0)
        os.dup2(child_out, 1)
        os.close(child_in)
        os.close(child_out)
        self._stdout = sys.stdout
        sys.stdout = sys.stderr
        self._threads: list[threading.Thread] = []

    def start(self, from_client: Handler, from_child: Handler, *, strict: bool = True) -> None:
        """Start relaying (before the child starts or after: the pipes hold what it writes).

        strict: the child's lines are judged (see jsonrpc.pump); an MCP server's are only annotated."""

        def upstream() -> None:
            pump(self.client_in, self.to_child, from_client, strict=False, name=f"{self.name} client")
            self.to_child.close()  # the client is gone: the child reads EOF

        def downstream() -> None:
            pump(self.from_child, self.client, from_child, strict=strict, name=self.name, warn=self.warn)

        for target, label in ((upstream, "in"), (downstream, "out")):
            thread = threading.Thread(target=target, name=f"egressd-{self.name}-{label}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def finish(self, timeout: float = DRAIN_TIMEOUT) -> None:
        """The child exited: stop holding its pipes, forward what it wrote, restore sys.stdout."""
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        os.close(devnull)
        deadline = time.monotonic() + timeout
        if len(self._threads) == 2:
            self._threads[1].join(max(deadline - time.monotonic(), 0))
        sys.stdout = self._stdout
