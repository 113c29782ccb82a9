"""Which follow-up requests are redirects to another origin, so their credentials can be stripped.

A redirect response from origin A to a URL on origin B is remembered per child; the child's next
request for exactly that URL is the follow-up, whatever connection it arrives on. Entries expire and
are bounded, so a child that never follows cannot grow the memory.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from urllib.parse import urljoin, urlsplit, urlunsplit

from egressd.policy import TargetError, canonical_host, join_host_port

TTL_SECONDS = 120.0
MAX_ENTRIES = 1024
_DEFAULT_PORTS = {"http": 80, "https": 443}


def origin_of(url: str) -> tuple[str, str, int] | None:
    """(scheme, canonical host, port) of an absolute http(s) URL, or None."""
    try:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in _DEFAULT_PORTS or not parts.hostname:
            return None
        host = canonical_host(parts.hostname).text
        port = parts.port or _DEFAULT_PORTS[scheme]
    except (ValueError, TargetError):
        return None
    return scheme, host, port


def _key(url: str) -> str | None:
    origin = origin_of(url)
    if origin is None:
        return None
    parts = urlsplit(url)
    scheme, host, port = origin
    return urlunsplit((scheme, join_host_port(host, port), parts.path or "/", parts.query, ""))


def _origin_text(origin: tuple[str, str, int]) -> str:
    scheme, host, port = origin
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"


class RedirectMemory:
    def __init__(self, ttl: float = TTL_SECONDS, max_entries: int = MAX_ENTRIES) -> None:
        self._ttl = ttl
        self._max = max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()

    def remember(self, client: str, request_url: str, location: str) -> None:
        """Note a redirect when it leaves the request's origin; same-origin redirects keep headers."""
        target = urljoin(request_url, location)
        source, dest = origin_of(request_url), origin_of(target)
        key = _key(target)
        if source is None or dest is None or key is None or source == dest:
            return
        with self._lock:
            self._entries[(client, key)] = (_origin_text(source), time.monotonic() + self._ttl)
            self._entries.move_to_end((client, key))
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)

    def expects(self, client: str, scheme: str, host: str, port: int) -> bool:
        """A redirect sent this child to that origin: its tunnel must be opened up to strip headers."""
        prefix = f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}/"
        now = time.monotonic()
        with self._lock:
            return any(
                c == client and k.startswith(prefix) and exp >= now
                for (c, k), (_, exp) in self._entries.items()
            )

    def take(self, client: str, url: str) -> str | None:
        """The origin that redirected this child to url (once), or None."""
        if not self._entries:
            return None  # the common case, without parsing url
        key = _key(url)
        if key is None:
            return None
        with self._lock:
            entry = self._entries.pop((client, key), None)
        if entry is None or entry[1] < time.monotonic():
            return None
        return entry[0]
