"""The dashboard page's guards: which Host, token, origin and CSRF token a request must carry,
and the headers every answer gets (see egressd/dashboard/server.py for why each is needed).

Kept apart from the server so the routes (egressd/dashboard/app.py) and the server both read
them without importing each other."""

from __future__ import annotations

import hmac
import json
import secrets
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any

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
STATIC = {"app.js": "text/javascript", "style.css": "text/css", "icon.svg": "image/svg+xml"}
SAFE_METHODS = ("GET", "HEAD")
SSE_KEEPALIVE = 2.0  # a page that went away is noticed by then (a browser may not close at once)


class PageGuard:
    """The secrets and names one dashboard page is opened with, and the checks on them."""

    def __init__(self, control_path: Path, port: int) -> None:
        self.control_path = control_path
        self.token = secrets.token_urlsafe(32)
        self.csrf = secrets.token_urlsafe(32)
        self.port = port
        self.hosts = frozenset({f"127.0.0.1:{port}", f"localhost:{port}"})
        self.origins = frozenset(f"http://{h}" for h in self.hosts)

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
