"""Wait in asyncio for a descriptor no transport fits: a Unix socket that carries descriptors
(SCM_RIGHTS), which asyncio's streams cannot read, or one peeked at without reading.

Imports nothing of egressd: the sandbox's launcher uses it too, and starts fast."""

from __future__ import annotations

import asyncio


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def ready(fd: int, *, write: bool = False) -> None:
    """Until `fd` is readable (or, `write`, writable)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    add(fd, _wake, future)
    try:
        await future
    finally:
        remove(fd)
