"""Host side of the sandbox's only way out: Unix sockets relayed to the proxy's TCP listeners.

The engine listens on TCP loopback only, and a network namespace cannot reach the host's loopback.
A Unix socket can cross: it is bind-mounted into the sandbox. The sockets live in a fresh
directory of mode 0700 (each socket 0600), so no other user on the host can connect; the proxy
behind them still demands the child's credentials on every request. Every sandbox's directory lies
in one per-user parent (`egressd-UID`, 0700, checked to be this user's own), which each
sandbox hides: a child never reaches another sandbox's sockets. The relay copies bytes and
decides nothing. It runs in its own thread and event loop, like the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

from egressd.sandbox.splice import close_quietly, splice

START_TIMEOUT = 10.0
# sun_path holds 108 bytes with the NUL; leave room for the rest of the path
MAX_PARENT = 108 - 1 - len(f"/egressd-{os.getuid()}/sandbox-XXXXXXXX/socks.sock")


class RelayError(RuntimeError):
    """The relay could not start; the message says why."""


def relay_home(parent: str | None = None) -> Path:
    """The per-user parent of every sandbox's socket directory, created 0700 or accepted only if it
    is a real directory of this user that nobody else can enter (another user may have made it
    first in a shared /tmp)."""
    parent = parent or tempfile.gettempdir()
    if len(parent.encode()) > MAX_PARENT:  # a Unix socket path must stay short
        parent = "/tmp"
    path = Path(parent) / f"egressd-{os.getuid()}"
    try:
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
        info = os.lstat(path)
    except OSError as exc:
        raise RelayError(f"cannot create the sandbox's socket directory {path}: {exc.strerror}") from exc
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise RelayError(f"{path} is not a private directory of this user; remove it and try again")
    return Path(os.path.realpath(path))


class UnixRelay:
    """`name.sock` in a private directory -> a TCP address, for each route. Start, then stop."""

    def __init__(self, routes: Mapping[str, tuple[str, int]], *, parent: str | None = None) -> None:
        self.routes = dict(routes)
        self._parent = parent
        self.directory: Path | None = None
        self.common: Path | None = None  # the per-user parent of every sandbox's directory
        self.paths: dict[str, str] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._connections: set[asyncio.Task[None]] = set()

    def start(self) -> dict[str, str]:
        """Create the directory and sockets; return {route name: socket path}."""
        for attempt in range(3):  # another sandbox may remove the empty parent as we start
            self.common = relay_home(self._parent)
            try:
                # mkdtemp creates the directory with mode 0700: only this user can reach the sockets
                self.directory = Path(tempfile.mkdtemp(prefix="sandbox-", dir=self.common))
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise RelayError(
                        f"cannot create the sandbox's socket directory in {self.common}"
                    ) from None
            except OSError as exc:
                raise RelayError(
                    f"cannot create the sandbox's socket directory in {self.common}: {exc.strerror or exc}"
                ) from exc
        self.paths = {name: str(self.directory / f"{name}.sock") for name in self.routes}
        self._thread = threading.Thread(target=self._thread_main, name="egressd-unix-relay", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT) or self._error is not None:
            self.stop()
            raise RelayError(f"cannot start the sandbox relay: {self._error or 'timed out'}")
        return dict(self.paths)

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported to start() or lost after stop()
            self._error = self._error or exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        servers = []
        try:
            for name, target in self.routes.items():
                path = self.paths[name]
                server = await asyncio.start_unix_server(lambda r, w, t=target: self._serve(r, w, t), path)
                os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
                servers.append(server)
        except OSError as exc:
            self._error = exc
            self._ready.set()
            raise
        self._ready.set()
        await self._stop.wait()
        for server in servers:
            server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, target: tuple[str, int]
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            try:
                upstream = await asyncio.open_connection(*target)
            except OSError:
                await close_quietly(writer)
                return
            await splice((reader, writer), upstream)
        except asyncio.CancelledError:
            # stop() ends open connections by cancelling them; a cancelled client_connected_cb task
            # makes asyncio's StreamReaderProtocol print a CancelledError traceback (Python 3.12),
            # so the connection ends here, quietly, as a finished task
            writer.close()
        finally:
            self._connections.discard(task)

    def stop(self) -> None:
        """Close the listeners and open connections, remove the sockets and their directory."""
        if self._loop is not None and self._stop is not None and self._thread is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
        if self.common is not None:
            with contextlib.suppress(OSError):  # still in use by another sandbox: it stays
                self.common.rmdir()

    def __enter__(self) -> UnixRelay:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
