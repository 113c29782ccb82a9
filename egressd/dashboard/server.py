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
import hmac
import json
import logging
import secrets
import socket
import threading
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

COOKIE = "egressd_dashboard"
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
STATIC = {"app.js": "text/javascript", "style.css": "text/css"}
SAFE_METHODS = ("GET", "HEAD")
SSE_KEEPALIVE = 2.0  # a page that went away is noticed by then (a browser may not close at once)


class Dashboard:
    """Serve the dashboard of the egressd whose control socket is `control_path`, until stop()."""

    def __init__(self, control_path: Path, *, host: str = "127.0.0.1") -> None:
        self.control_path = control_path
        self.token = secrets.token_urlsafe(32)
        self.csrf = secrets.token_urlsafe(32)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self.port: int = self._sock.getsockname()[1]
        self.hosts = frozenset({f"127.0.0.1:{self.port}", f"localhost:{self.port}"})
        self.origins = frozenset(f"http://{h}" for h in self.hosts)
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

    # -- the checks (pure, so they are table-tested) -------------------------------------------------
    def host_ok(self, host: str | None) -> bool:
        return host is not None and host.lower() in self.hosts

    def token_ok(self, value: str | None) -> bool:
        return value is not None and hmac.compare_digest(value.encode(), self.token.encode())

    def same_origin(self, origin: str | None, fetch_site: str | None) -> bool:
        """A state change must come from this page: its Origin (browsers send it on every POST),
        and Sec-Fetch-Site when the browser sends that."""
        if origin is None or origin.lower() not in self.origins:
            return False
        return fetch_site in (None, "same-origin")

    def csrf_ok(self, value: str | None) -> bool:
        return value is not None and hmac.compare_digest(value.encode(), self.csrf.encode())


def static_file(name: str) -> bytes:
    return resources.files("egressd.dashboard").joinpath("static", name).read_bytes()


Handler = Callable[[Any], Awaitable[Any]]


def sse(item: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(item, default=str, separators=(",", ":")).encode() + b"\n\n"
