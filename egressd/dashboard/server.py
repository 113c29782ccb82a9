"""The dashboard's web server: aiohttp on a free loopback port, on the running event loop (the
proxy's, under `--dashboard`), loaded with its first client (egressd.control.site).

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
from pathlib import Path
from typing import TYPE_CHECKING

from egressd.control.site import LazySite
from egressd.dashboard.guard import PageGuard
from egressd.platform.listeners import OwnAddresses, listen

if TYPE_CHECKING:
    from aiohttp import web

# said beside the printed URL: with no page open, an ask is refused at once (no_approver)
WHILE_OPEN = "asks wait for an answer only while a page is open"


class Dashboard(PageGuard):
    """Serve the dashboard of the egressd whose control socket is `control_path`, until stop().

    `own`: where that egressd keeps its own addresses — the page's port is one of them, so its
    child is refused (`self`) when it asks the proxy for the page."""

    def __init__(self, control_path: Path, own: OwnAddresses, *, host: str = "127.0.0.1") -> None:
        sock = listen(own, host, backlog=64)
        super().__init__(control_path, sock.getsockname()[1])
        # handler_cancellation: a page that goes away ends its event stream at once, and with it the
        # asks it followed (so it stops counting as an approver within the control API's keepalive)
        self._site = LazySite(
            sock, self._app, imports=("egressd.dashboard.app",), name="dashboard", handler_cancellation=True
        )

    @property
    def url(self) -> str:
        """The one URL that opens the page: it carries the token (print it on stderr only)."""
        return f"http://127.0.0.1:{self.port}/?token={self.token}"

    async def start(self) -> str:
        await self._site.start()
        return self.url

    async def stop(self) -> None:
        await self._site.stop()

    def _app(self, stopping: asyncio.Event) -> web.Application:
        from egressd.dashboard.app import make_app

        return make_app(self, stopping)
