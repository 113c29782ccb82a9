"""File descriptors: how many connections egressd holds at once, and the reserve that lets it answer
a client beyond that (503 `overloaded`) instead of dropping it.

Every client connection, upstream connection, DNS query, file and module import takes a descriptor
(a tunnel mitmproxy inspects no more than one it relays: mitmproxy reads the client's); out of them,
a proxy closes new clients without a word (the event loop's accept), tells others `dns_timeout` (a
query without a socket) and fails imports. So: at start the soft RLIMIT_NOFILE is raised to the hard
limit (children inherit it); what egressd already holds then, and a reserve (a sixteenth of the
limit, at least 64 or a quarter of a smaller one), stay out of the budget. Client connections get at
most half the budget (each needs a second descriptor for its upstream); a client beyond it is read
as usual and its request answered `overloaded`, or, once half the reserve is taken as well, answered
at once. An upstream connection beyond the budget is not opened: `overloaded`. The rest of the
reserve is for what no count sees (DNS queries, the audit, the control API, imports).
"""

from __future__ import annotations

import errno
import os
import resource
from dataclasses import dataclass
from typing import Literal

from egressd.platform.log import Logger

logger = Logger(__name__)

# errors that mean "no descriptor (or buffer) left", whichever call met them
OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# soft limits to try when the hard one is unlimited (macOS refuses more than its per-process cap)
_UNLIMITED_TRIES = (1 << 20, 1 << 16, 10240)

# what to do with a new client: serve it, answer its request `overloaded`, or answer that at once
Room = Literal["serve", "answer", "answer_now"]


def out_of_descriptors(error: BaseException | None) -> bool:
    """True when error (or what caused it) is a call that found no descriptor left."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, OSError) and error.errno in OUT_OF_DESCRIPTORS:
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def raise_soft_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (two descriptors per tunnel: a proxy needs
    more than the usual 1,024, or macOS's 256); the soft limit in force after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    tries = (hard,) if hard != resource.RLIM_INFINITY else _UNLIMITED_TRIES
    for target in tries:
        if soft != resource.RLIM_INFINITY and target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            continue
        return target
    if soft != hard:
        logger.debug("could not raise RLIMIT_NOFILE above %s", soft)
    return soft


def _open_now() -> int:
    """How many descriptors this process holds (what was open before the budget is counted)."""
    for directory in ("/proc/self/fd", "/dev/fd"):
        try:
            return max(0, len(os.listdir(directory)) - 1)  # listing opened one more
        except OSError:
            continue
    return 64


@dataclass(frozen=True)
class Descriptors:
    """The budget of descriptors for connections, measured once the soft limit is raised."""

    limit: int
    budget: int
    reserve: int

    @classmethod
    def measure(cls) -> Descriptors:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        limit = soft if soft != resource.RLIM_INFINITY else _UNLIMITED_TRIES[0]
        reserve = max(limit // 16, min(64, limit // 4))
        return cls(limit=limit, budget=max(0, limit - _open_now() - reserve), reserve=reserve)

    def for_client(self, served: int, clients: int, held: int) -> Room:
        """A new client, with `clients` others open (`served` of them within the budget, the rest
        about to be answered) and `held` descriptors taken for upstream connections."""
        if clients + held >= self.budget + self.reserve // 2:
            return "answer_now"  # half the reserve is gone: keep the rest for what no count sees
        if served < self.budget // 2 and served + held < self.budget:
            return "serve"
        return "answer"

    def fits(self, served: int, held: int, more: int) -> bool:
        """`more` descriptors for upstream connections still fit in the budget, beside `served`
        clients (those waiting for their `overloaded` answer live in the reserve)."""
        return served + held + more <= self.budget
