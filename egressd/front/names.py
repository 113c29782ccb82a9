"""The names service a sandbox's capture asks before it answers the child's DNS.

One stream socket per sandbox, between egressd and the sandbox's launcher only (the child never
holds it). A line `ID NAME` asks for NAME; the answer is `ID ADDRESS...`, the real addresses
egressd resolved and kept (Pipeline.addresses_for), `ID !` when the policy refuses the name (no
address), or `ID -`: no real answer, give a stand-in.
Questions are answered concurrently, in any order, at most MAX_IN_FLIGHT at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from egressd.admission.pipeline import Pipeline

MAX_IN_FLIGHT = 64
MAX_LINE = 512


async def serve_names(pipeline: Pipeline, sock: socket.socket, profile: str | None) -> None:
    """Answer the launcher's questions until it hangs up."""
    reader, writer = await asyncio.open_connection(sock=sock, limit=MAX_LINE)
    slots = asyncio.Semaphore(MAX_IN_FLIGHT)
    tasks: set[asyncio.Task[None]] = set()

    async def one(ident: str, name: str) -> None:
        try:
            found = await pipeline.addresses_for(name, profile) if name else None
        except Exception:  # noqa: BLE001 - a bug gives a stand-in: the connection is still decided
            found = None
        finally:
            slots.release()
        answer = " ".join(str(a) for a in found) if found else ("!" if found == () else "-")
        with contextlib.suppress(ConnectionError, OSError):
            writer.write(f"{ident} {answer}\n".encode())

    try:
        while True:
            try:
                line = await reader.readline()
            except (ValueError, asyncio.LimitOverrunError, ConnectionError, OSError):
                break
            if not line:
                break
            ident, _, name = line.decode("ascii", "replace").strip().partition(" ")
            await slots.acquire()
            task = asyncio.create_task(one(ident, name.strip()))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    finally:
        for task in tasks:
            task.cancel()
        writer.close()
