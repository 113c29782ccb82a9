"""An aiohttp application served on the running event loop (the proxy's, in a session) from a
socket egressd made and bound itself: the control API, the dashboard and the metrics port.

aiohttp and the application's module (~0.25 s of CPU) are imported in a worker thread when the
first client connects, which waits in the socket's backlog meanwhile: a run nobody talks to (a CI
job, `egressd exec -- true`) never pays the import, a child's start never competes with it for the
CPU, and the loop keeps serving connections while it loads.
"""

from __future__ import annotations

import contextlib
import importlib
import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from egressd.platform.log import Logger

if TYPE_CHECKING:
    import asyncio

    from aiohttp import web

logger = Logger(__name__)


class LazySite:
    """Serve `make_app(stopping)` on the listening socket `sock` until stop(); `stopping` is set
    when it stops, so long-lived answers (event streams) end. `imports`: the modules the app needs,
    loaded off the loop before it is made; `name`: what egressd says failed."""

    def __init__(
        self,
        sock: socket.socket,
        make_app: Callable[[asyncio.Event], web.Application],
        *,
        imports: Sequence[str],
        name: str,
        **runner_options: Any,
    ) -> None:
        import asyncio  # a site is made where its loop is on its way

        self.sock = sock
        self._make_app = make_app
        self._imports = ("aiohttp.web", *imports)
        self._name = name
        self._runner_options = runner_options
        self._loop: asyncio.AbstractEventLoop | None = None
        self._serving: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self.stopping = asyncio.Event()

    async def start(self) -> None:
        import asyncio

        self._loop = asyncio.get_running_loop()
        self.sock.setblocking(False)
        self._loop.add_reader(self.sock.fileno(), self._first_client)

    def _first_client(self) -> None:
        assert self._loop is not None
        self._loop.remove_reader(self.sock.fileno())
        self._serving = self._loop.create_task(self._serve())

    async def _serve(self) -> None:
        import asyncio

        try:
            await asyncio.to_thread(_load, self._imports)
            if self.stopping.is_set():
                return
            from aiohttp import web

            runner = web.AppRunner(
                self._make_app(self.stopping),
                handle_signals=False,
                access_log=None,
                shutdown_timeout=1,
                **self._runner_options,
            )
            await runner.setup()
            self._runner = runner
            await web.SockSite(runner, self.sock).start()
        except Exception:  # egressd runs on without it
            logger.exception("egressd: the %s failed", self._name)

    async def stop(self) -> None:
        self.stopping.set()
        if self._loop is not None and self._serving is None:
            with contextlib.suppress(ValueError, OSError):  # the socket closed meanwhile
                self._loop.remove_reader(self.sock.fileno())
        if self._serving is not None:
            await self._serving
        if self._runner is not None:
            await self._runner.cleanup()
        self.sock.close()


def _load(modules: Sequence[str]) -> None:
    for module in modules:
        importlib.import_module(module)
