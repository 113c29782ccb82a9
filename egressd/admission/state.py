"""What admission knows of one client connection (the policy in force: egressd.admission.in_force)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from egressd.platform.descriptors import Room
from egressd.policy import Program, join_host_port

if TYPE_CHECKING:
    from egressd.platform.diag import Diag

DEFAULT_USERNAME = "egressd"


def asker(client: object, profile: object) -> str:
    """Who asks, as a person is told: `profile fetch`, `client ci` (a gateway's client, an attached
    child), or `the child (no profile)`: egressd's own child without a profile has the proxy
    username egressd's default, which names nobody."""
    if isinstance(profile, str) and profile:
        return f"profile {profile}"
    if isinstance(client, str) and client and client != DEFAULT_USERNAME:
        return f"client {client}"
    return "the child (no profile)"


@dataclass(frozen=True, slots=True)
class ProxyCredentials:
    """What a child puts in its proxy URL; the username names its profile.

    A gateway client (`egressd run --gateway`) is named by its username and carries the profile of
    its token entry; its `token` is then only its key for limits and revocation
    (`gateway:NAME:HASH-PREFIX`), never the secret, which egressd keeps hashed."""

    username: str
    token: str
    gateway: bool = False
    gateway_profile: str | None = None
    # an attached child's `program[pid]` (egressd exec --attach): who it is in the audit and `ps`
    label: str | None = field(default=None, compare=False)
    # made from the fields above when the credentials are (every decision's record reads both: a
    # property is a Python call)
    client: str = field(init=False, compare=False, repr=False)  # the name decisions are recorded under
    profile: str | None = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # the attached child's label, else the username; a gateway client's profile is its entry's
        object.__setattr__(self, "client", self.label or self.username)
        if self.gateway:
            object.__setattr__(self, "profile", self.gateway_profile)
        else:
            object.__setattr__(self, "profile", None if self.username == DEFAULT_USERNAME else self.username)

    def proxy_url(self, host: str, port: int, scheme: str = "http") -> str:
        return f"{scheme}://{self.username}:{self.token}@{join_host_port(host, port)}"


@dataclass(frozen=True, slots=True)
class Identity:
    """What the lookup found for one connection (every field None when nothing was found)."""

    pid: int | None = None
    exe: str | None = None
    cmdline: tuple[str, ...] = ()
    in_tree: bool = False  # held only by the child (the tree's root) or its descendants
    program: Program | None = None
    why: str = ""  # when pid is None: why the owner is unknown


@dataclass(slots=True)
class ConnState:
    """What egressd knows about one client connection, whichever front accepted it."""

    # first what a front knows at accept: Pipeline.open_conn passes these by position (a class
    # called with keywords gets them as a dict, unpacked again for __init__: per connection)
    conn_id: str
    peer: str
    # credentials the listener grants: only the child can reach it (the sandbox's credential-free
    # port); a request without Proxy-Authorization counts as the child's, a wrong one is refused
    implicit: ProxyCredentials | None = None
    # the socket's two ends as (host, port): the client's, then egressd's (the owner lookup reads them)
    ends: tuple[tuple[str, int], tuple[str, int]] | None = None
    # the listener admits only the process tree of the child its implicit credentials were issued
    # to (`egressd exec`'s credential-free listener): its pid is looked up when a request comes
    tree_only: bool = False
    # the listener is in a child's network namespace: its sockets are looked up there (platform.diag)
    diag: Diag | None = None
    started: float = field(default_factory=time.monotonic)
    creds: ProxyCredentials | None = None
    host: str | None = None  # the canonical target of the last decision
    port: int | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    tunnel: bool = False  # an admitted CONNECT / SOCKS5 tunnel: its set-up authenticated what is inside
    granted: tuple[str, int] | None = None  # a tunnel a grant or an approval admitted: (host, port)
    identity: Identity | None = None  # who holds the client's socket, once looked up
    # the capture took it from a client that ignored the proxy variables (front/captured.py)
    captured: bool = False
    # accepted within egressd's capacity ("serve"), or beyond it: its request is answered
    # `overloaded` ("answer"), or that answer goes out at once ("answer_now")
    room: Room = "serve"
    # the HTTP requests this connection asked, with their answers (egressd.admission.pipeline)
    remembered: dict[tuple[object, ...], Any] | None = None

    @property
    def profile(self) -> str | None:
        return self.creds.profile if self.creds else None

    @property
    def client_name(self) -> str | None:
        return self.creds.client if self.creds else None

    @property
    def client_key(self) -> str:
        """Whose limits and redirect memory apply: the child's token, or this connection's id."""
        return self.creds.token if self.creds is not None else self.conn_id
