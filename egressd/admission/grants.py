"""Grants: the user's consent for targets the policy would otherwise refuse or ask about.

Two kinds, both held in memory only (never written to the policy):
- one-shot grants (`egressd grant TARGET`): admit exactly ONE matching request or
  connection within their TTL, consumed atomically (two racing requests: one is admitted);
- run grants (an ask answered "for this run"): an exact host and port, until egressd exits.

A grant only widens what the decision refused as `not_allowlisted` or sent to an approver
(`ask`): the pipeline asks here after the one decision and never for always-refused addresses,
deny rules, ports, profiles or loopback (they refuse with other reasons first), and never for an
IP literal that is not a global address (the private-address guard). A name admitted by a grant
resolves under the guard too (private addresses are dropped unless `private.allow`).

Matching is exact: a grant for `x.test` does not cover `a.x.test`, one for `http://x.test/a`
neither `/b`, `/a?q` nor `x.test:444`.

A grant also answers the requests already waiting on an ask it covers (the ask broker listens to
`added`): it admits them as it would have had it come first.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections.abc import Callable, Iterable

from egressd.platform.log import Logger
from egressd.policy import Target, TargetError, normalise_path, parse_target

logger = Logger(__name__)

DEFAULT_TTL = 300.0
MAX_TTL = 24 * 3600.0
WEB_PORTS = (443, 80)  # a grant for a bare HOST


class GrantError(ValueError):
    """A grant that cannot be made; the message says why."""


class Grant:
    """One grant. `scheme`/`path` are set only for a URL naming a path (`path` without the query,
    `query` exactly as given); `ports` holds the ports it covers. A plain class: made by its store,
    read and marked used, never compared nor copied (a dataclass would only add start-up time)."""

    __slots__ = (
        "id",
        "spec",
        "host",
        "ports",
        "once",
        "expires",
        "scheme",
        "path",
        "query",
        "created",
        "used",
    )

    def __init__(
        self,
        id: str,
        spec: str,
        host: str,
        ports: tuple[int, ...],
        once: bool,
        expires: float | None,  # time.monotonic() deadline; None: until egressd exits
        scheme: str | None = None,
        path: str | None = None,
        query: str = "",
    ) -> None:
        self.id = id
        self.spec = spec
        self.host = host
        self.ports = ports
        self.once = once
        self.expires = expires
        self.scheme = scheme
        self.path = path
        self.query = query
        self.created = time.time()
        self.used = False

    @property
    def url_scoped(self) -> bool:
        return self.path is not None

    def live(self, now: float) -> bool:
        return not self.used and (self.expires is None or now < self.expires)

    def covers(self, host: str, port: int) -> bool:
        return host == self.host and port in self.ports

    def covers_request(self, scheme: str | None, path: str | None) -> bool:
        """A request (plain HTTP, or one inside an inspected tunnel) with this scheme and path."""
        if self.path is None:
            return True
        if scheme != self.scheme or path is None:
            return False
        raw_path, _, query = path.partition("?")
        return normalise_path(raw_path) == self.path and query.split("#", 1)[0] == self.query

    def to_json(self, now: float | None = None) -> dict[str, object]:
        now = time.monotonic() if now is None else now
        left = None if self.expires is None else max(0.0, round(self.expires - now, 1))
        return {
            "id": self.id,
            "target": self.spec,
            "host": self.host,
            "ports": list(self.ports),
            "scheme": self.scheme,
            "path": self.path if self.path is None else self.path + (f"?{self.query}" if self.query else ""),
            "once": self.once,
            "expires_in": left,
            "created": self.created,
        }


def parse_grant(spec: str) -> tuple[str, tuple[int, ...], str | None, str | None, str]:
    """(host, ports, scheme, path, query) of `HOST`, `HOST:PORT` or a URL.

    A bare HOST covers the web ports (443, 80); a URL without a path (or `/`) covers its scheme's
    port, any path; a URL with a path covers that path (and query) only — for https that needs
    TLS inspection, because a CONNECT shows no path.
    """
    text = spec.strip()
    try:
        if "://" in text:
            target = parse_target(text)
            return _url_grant(text, target)
        try:
            target = parse_target(text)
            return target.host.text, (target.port,), None, None, ""
        except TargetError as exc:
            if exc.reason != "no port given":
                raise
            target = parse_target(text, default_port=443)
            return target.host.text, WEB_PORTS, None, None, ""
    except TargetError as exc:
        raise GrantError(f"{spec!r}: {exc.reason}") from None


def _url_grant(text: str, target: Target) -> tuple[str, tuple[int, ...], str | None, str | None, str]:
    raw = target.path or "/"
    raw_path, _, query = raw.partition("?")
    if raw_path == "/" and not query and not text.split("://", 1)[1].rstrip("/").count("/"):
        return target.host.text, (target.port,), None, None, ""
    path = normalise_path(raw_path)
    if path is None:
        raise GrantError(f"{text!r}: the path cannot be read unambiguously")
    return target.host.text, (target.port,), target.scheme, path, query


class GrantStore:
    """The grants of one egressd; thread-safe (the control API adds, the proxy's loop takes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._grants: dict[str, Grant] = {}
        self._prefix = secrets.token_hex(2)
        self._ids = itertools.count(1)
        self._listeners: list[Callable[[Grant], None]] = []

    def added(self, listener: Callable[[Grant], None]) -> None:
        """Call `listener(grant)` after each grant is added, on the adding thread; it must not block."""
        self._listeners.append(listener)

    def __bool__(self) -> bool:
        return bool(self._grants)

    def add(self, spec: str, *, once: bool = True, ttl: float | None = DEFAULT_TTL) -> Grant:
        """A new grant; GrantError for a target that cannot be read or a bad TTL."""
        host, ports, scheme, path, query = parse_grant(spec)
        if ttl is not None and not 0 < ttl <= MAX_TTL:
            raise GrantError(f"ttl must be between 0 and {MAX_TTL:g} seconds, not {ttl!r}")
        grant = Grant(
            id=f"g{self._prefix}{next(self._ids)}",
            spec=spec.strip(),
            host=host,
            ports=ports,
            once=once,
            expires=None if ttl is None else time.monotonic() + ttl,
            scheme=scheme,
            path=path,
            query=query,
        )
        with self._lock:
            self._grants[grant.id] = grant
        for listener in list(self._listeners):
            try:
                listener(grant)
            except Exception:  # noqa: BLE001 - a listener never takes a grant back
                logger.exception("egressd: a grant listener failed")
        return grant

    def add_run(self, host: str, port: int) -> Grant:
        """An exact host and port for the rest of this run (an ask answered "run")."""
        with self._lock:
            for grant in self._grants.values():
                if not grant.once and grant.host == host and grant.ports == (port,) and not grant.url_scoped:
                    return grant
        return self.add(_host_port(host, port), once=False, ttl=None)

    def revoke(self, grant_id: str) -> bool:
        with self._lock:
            return self._grants.pop(grant_id, None) is not None

    def list(self) -> list[Grant]:
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            return list(self._grants.values())

    def take(
        self, stage: str, host: str, port: int, scheme: str | None, path: str | None
    ) -> tuple[Grant, bool] | None:
        """The grant that admits this ask, and whether the tunnel must be inspected for it.

        A one-shot grant is consumed here, under the lock. A CONNECT/SOCKS5 tunnel to the host of
        a path-scoped grant is admitted for inspection without consuming it: the request inside
        (stage "inner") is what consumes it.
        """
        now = time.monotonic()
        request = stage in ("request", "inner")
        with self._lock:
            self._expire(now)
            peek: Grant | None = None
            for grant in self._candidates(host, port):
                if not grant.live(now):
                    continue
                if grant.url_scoped and not request:
                    if grant.scheme == "https" and peek is None:
                        peek = grant
                    continue
                if request and not grant.covers_request(scheme, path):
                    continue
                if grant.once:
                    grant.used = True
                    del self._grants[grant.id]
                return grant, False
            return (peek, True) if peek is not None else None

    def _candidates(self, host: str, port: int) -> Iterable[Grant]:
        # run grants last: a one-shot grant the user just made is what they expect to be used
        found = [g for g in self._grants.values() if g.covers(host, port)]
        return sorted(found, key=lambda g: (not g.once, not g.url_scoped, g.created))

    def _expire(self, now: float) -> None:
        for grant_id in [i for i, g in self._grants.items() if not g.live(now)]:
            del self._grants[grant_id]


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
