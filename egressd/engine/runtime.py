"""Shared state of one running proxy: policy, gatekeeper, credentials, audit and live connections.

The addons are thin adapters that all read this one object, whether egressd embeds mitmproxy or a
stock `mitmdump -s addons/<name>.py` loads them (then `shared_runtime()` builds it from the
environment).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from egressd.engine.credentials import CredentialStore, ProxyCredentials
from egressd.engine.gate import Gatekeeper, PolicyHolder
from egressd.engine.limits import TokenBuckets
from egressd.engine.redirects import RedirectMemory

if TYPE_CHECKING:
    from egressd.audit import AuditLog
    from egressd.engine.gate import Admission


@dataclass
class ConnState:
    """What egressd knows about one client connection."""

    conn_id: str
    peer: str
    started: float = field(default_factory=time.monotonic)
    creds: ProxyCredentials | None = None
    host: str | None = None
    port: int | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    admissions: dict[str, Admission] = field(default_factory=dict)  # by server connection id
    request_admitted: set[tuple[str, int]] = field(default_factory=set)  # plain-HTTP targets decided
    intercept: set[tuple[str, int]] = field(default_factory=set)  # tunnels to TLS-intercept
    head_seen: bool = False  # a request head / CONNECT / SOCKS request arrived (header_timeout)

    @property
    def profile(self) -> str | None:
        return self.creds.profile if self.creds else None

    @property
    def client_name(self) -> str | None:
        return self.creds.username if self.creds else None


class Runtime:
    def __init__(
        self,
        policies: PolicyHolder,
        *,
        credentials: CredentialStore | None = None,
        audit: AuditLog | None = None,
        require_auth: bool = True,
    ) -> None:
        self.policies = policies
        self.gate = Gatekeeper(policies)
        self.credentials = credentials or CredentialStore()
        self.audit = audit
        self.require_auth = require_auth
        self.draining = False
        # TLS inspection is available (CA ready, TLS addon loaded); off with --no-inspect
        self.inspection = False
        self.redirects = RedirectMemory()
        self.buckets = TokenBuckets()
        self.upstreams: set[str] = set()  # ids of upstream connections open now (limits.max_connections)
        self.conns: dict[str, ConnState] = {}
        self._lock = threading.Lock()

    def open_conn(self, client_id: str, peer: str) -> ConnState:
        state = ConnState(conn_id=uuid.uuid4().hex[:12], peer=peer)
        with self._lock:
            self.conns[client_id] = state
        return state

    def conn(self, client_id: str) -> ConnState | None:
        return self.conns.get(client_id)

    def close_conn(self, client_id: str) -> ConnState | None:
        with self._lock:
            return self.conns.pop(client_id, None)

    def active(self) -> int:
        return len(self.conns)


_shared: Runtime | None = None
_shared_lock = threading.Lock()


def set_shared_runtime(runtime: Runtime) -> None:
    global _shared
    with _shared_lock:
        _shared = runtime


def shared_runtime() -> Runtime:
    """The process' runtime; under a stock mitmdump it is built from EGRESSD_POLICY/EGRESSD_AUDIT."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = _runtime_from_environment()
        return _shared


def _runtime_from_environment() -> Runtime:
    from egressd.audit import AuditLog
    from egressd.engine import pinning
    from egressd.policy import default_policy, load_policy

    pinning.install()
    path = os.environ.get("EGRESSD_POLICY")
    policy = load_policy(path, env=os.environ) if path else default_policy()
    audit_path = os.environ.get("EGRESSD_AUDIT")
    audit = AuditLog(audit_path, trace=sys.stderr if os.environ.get("EGRESSD_TRACE") else None)
    # Under a stock mitmdump nobody issues per-child tokens: the operator owns the listener.
    return Runtime(PolicyHolder(policy), audit=audit, require_auth=False)
