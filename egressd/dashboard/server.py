"""The dashboard's web server: aiohttp on a free loopback port, in its own thread and loop.

It is a client of one egressd's control API (the Unix socket only this user can open), so
`egressd dashboard` (attaching to a running instance) and `--dashboard` on exec/run serve the same
page the same way, and everything it can do the control API already checks.

A loopback port is reachable by every local process and by any web page the user visits, so:
- the Host header must be `127.0.0.1:PORT` or `localhost:PORT` (a rebound DNS name is refused);
- every request needs the random token: in the URL printed on stderr once, then a cookie
  (HttpOnly, SameSite=Strict) — the URL is redirected away from at once so it lingers nowhere;
- every state change also needs a same-origin Origin (and Sec-Fetch-Site when sent), a JSON body
  and the CSRF token the page was served with;
- every answer carries a strict Content-Security-Policy (scripts from this origin only, no inline
  script), X-Frame-Options DENY and no-store.
Under `egressd sandbox` the child is in its own network namespace and cannot reach the host's
loopback at all; under `exec` the token is the guard (the child is never told it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from pathlib import Path

from egressd.dashboard.guard import PageGuard
from egressd.listeners import OwnAddresses, listen

logger = logging.getLogger(__name__)

# said beside the printed URL: with no page open, an ask is refused at once (no_approver)
WHILE_OPEN = "asks wait for an answer only while a page is open"


class Dashboard(PageGuard):
    """Serve the dashboard of the egressd whose control socket is `control_path`, until stop().

    `own`: where that egressd keeps its own addresses — the page's port is one of them, so its
    child is refused (`self`) when it asks the proxy for the page."""

    def __init__(self, control_path: Path, own: OwnAddresses, *, host: str = "127.0.0.1") -> None:
        self._sock = listen(own, host, backlog=64)
        super().__init__(control_path, self._sock.getsockname()[1])
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        """The one URL that opens the page: it carries the token (print it on stderr only)."""
        return f"http://127.0.0.1:{self.port}/?token={self.token}"

    # -- life cycle ------------------------------------------------------------------------------
    def start(self) -> str:
        self._thread = threading.Thread(target=self._main, name="egressd-dashboard", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=10)
        return self.url

    def stop(self) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and self._thread is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
            self._thread.join(timeout=5)
        self._sock.close()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_for(self, seconds: float) -> None:
        """Sleep up to `seconds` (less if the server thread ends): a loop that also watches the
        instance it serves stays interruptible."""
        if self._thread is not None:
            self._thread.join(timeout=seconds)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException:  # noqa: BLE001 - egressd runs on without its dashboard
            logger.exception("egressd: the dashboard failed")
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        from aiohttp import web

        from egressd.dashboard.app import make_app

        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        app = make_app(self, self._stop)
        # handler_cancellation: a page that goes away ends its event stream at once, and with it the
        # asks it followed (so it stops counting as an approver within the control API's keepalive)
        runner = web.AppRunner(
            app, handle_signals=False, access_log=None, shutdown_timeout=1, handler_cancellation=True
        )
        await runner.setup()
        await web.SockSite(runner, self._sock).start()
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()
