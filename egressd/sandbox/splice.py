"""Copy bytes both ways between two asyncio stream pairs, keeping half-closes.

Used by the sandbox's capture (intercept.py) once the proxy admitted a CONNECT. It never looks at
the bytes: the proxy at the far end is the only thing that decides. Half-close is forwarded (SSH, git and
request/response protocols rely on it), and both sides are closed when both directions end.
"""

from __future__ import annotations

import asyncio
import contextlib

CHUNK = 64 * 1024


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        # the peer went away: make the other direction see it too
        writer.close()


async def splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    """Relay a <-> b until both directions reach EOF, then close both writers."""
    try:
        await asyncio.gather(_pump(a[0], b[1]), _pump(b[0], a[1]))
    finally:
        for writer in (a[1], b[1]):
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()


async def close_quietly(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError, OSError):
        await writer.wait_closed()
