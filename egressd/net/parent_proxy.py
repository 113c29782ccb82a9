"""The way out through a parent proxy: HTTP CONNECT to the parent, after the pin (docs/upstream-proxy.md).

Everything before stays as it is — credentials, limits, the decision, resolution and the address
filter, the pin — and this is only how the pinned connection is opened: `dial` asks the parent to
CONNECT to the pinned address (`connect_by: address`, the default) or to the canonical name
(`connect_by: name`), and hands back the socket once the parent answered 200, so the tunnel relay,
the plain-HTTP front and mitmproxy use it like a direct connection. Loopback targets and the
`direct:` rules never go through the parent.

The parent's credentials are read here, at start and on every reload (`with_credentials`), from an
EGRESSD_* variable of egressd's own environment or a file; they go into the Proxy-Authorization
header sent to the parent and nowhere else (not the audit, the trace, a detail or an error).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from egressd.policy import AddressClass, Policy, PolicyError, Target, UpstreamProxy, classify
from egressd.policy.reasons import Reason
from egressd.policy.upstream import DEFAULT_CREDENTIALS_ENV
from egressd.wire.connect_client import AnswerError, ConnectClient

MAX_HEAD = 16 * 1024  # the parent's answer to a CONNECT


class ParentFailure(Exception):
    """The parent could not be used; reason is an egressd reason code, detail has no credentials."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


# -- configuration -------------------------------------------------------------------------------------
def with_credentials(
    policy: Policy, env: Mapping[str, str], read: Callable[[Path], bytes] = Path.read_bytes
) -> Policy:
    """The policy with its parent's credentials read now (start, reload; `read`: the policy
    watcher's snapshot, so the file is read once and watched); PolicyError naming where they should
    be, never what was found. No `upstream_proxy`: the policy unchanged."""
    parent = policy.upstream_proxy
    if parent is None:
        return policy
    raw: str | None = None
    if parent.credentials_file is not None:
        path = Path(parent.credentials_file).expanduser()
        try:
            text = read(path).decode("utf-8").strip()
            raw = text.splitlines()[0] if text else ""
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "unreadable"
            raise PolicyError(policy.source, "upstream_proxy.credentials_file", str(path), why) from None
        if not raw:
            raise PolicyError(policy.source, "upstream_proxy.credentials_file", str(path), "empty")
    else:
        name = parent.credentials_env or DEFAULT_CREDENTIALS_ENV
        raw = env.get(name)
        if raw is None and parent.credentials_env is not None:
            raise PolicyError(
                policy.source, "upstream_proxy.credentials_env", name, "not set in egressd's environment"
            )
    authorization = None
    if raw is not None:
        if ":" not in raw or any(ch in raw for ch in "\r\n\0"):
            where = parent.credentials_file or parent.credentials_env or DEFAULT_CREDENTIALS_ENV
            raise PolicyError(policy.source, "upstream_proxy", where, "credentials must read 'user:password'")
        authorization = "Basic " + base64.b64encode(raw.encode("utf-8")).decode("ascii")
    return dataclasses.replace(
        policy, upstream_proxy=dataclasses.replace(parent, authorization=authorization)
    )


def parent_for(policy: Policy, target: Target) -> UpstreamProxy | None:
    """The parent this target's connection goes through, or None (no parent, loopback, `direct`).

    Loopback targets are this machine's, never the parent's; `direct:` rules match the target as
    decided (a CIDR rule matches an IP-literal target)."""
    parent = policy.upstream_proxy
    if parent is None:
        return None
    host = target.host
    if host.ip is not None:
        if classify(host.ip) is AddressClass.LOOPBACK or host.ip in policy.loopback.addresses:
            return None
    elif host.name is not None and (host.name == "localhost" or host.name.endswith(".localhost")):
        return None
    if parent.direct and parent.direct.match(host, target.port) is not None:
        return None
    return parent


# -- the dialer ----------------------------------------------------------------------------------------
async def dial(
    parent: UpstreamProxy,
    targets: tuple[str, ...],
    port: int,
    connect_timeout: float,
    attempts: list[str],
) -> tuple[socket.socket, tuple[str, int]]:
    """A connected socket to the first target the parent CONNECTs to, and that target.

    Each target is one CONNECT on its own connection to the parent, bounded by connect_timeout, all
    within twice that. The parent down or unreachable: `upstream_proxy_unreachable`; 407 or 403
    (its credentials or its rules): `upstream_proxy_refused`, at once; another answer (the parent
    could not reach that target) tries the next target, then fails as connect_error/timeout."""
    deadline = time.monotonic() + 2 * connect_timeout
    kinds: list[str] = []
    for target in targets:
        authority = f"[{target}]:{port}" if ":" in target else f"{target}:{port}"
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            attempts.append(f"{authority} via {parent.where}: not tried, 2x connect_timeout used up")
            kinds.append(Reason.CONNECT_TIMEOUT)
            break
        try:
            sock = await asyncio.wait_for(_open_parent(parent), timeout=min(connect_timeout, remaining))
        except (OSError, TimeoutError) as exc:
            why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
            attempts.append(f"parent proxy {parent.where}: {why}")
            raise ParentFailure(
                Reason.UPSTREAM_PROXY_UNREACHABLE, f"the parent proxy {parent.where} cannot be reached: {why}"
            ) from None
        try:
            status, phrase = await asyncio.wait_for(
                _handshake(sock, target, port, parent.authorization),
                timeout=max(0.1, min(connect_timeout, deadline - time.monotonic())),
            )
        except BaseException as exc:
            sock.close()
            if not isinstance(exc, OSError | TimeoutError | ParentFailure):
                raise  # cancelled (the client went away): the socket is closed all the same
            why = (
                "no answer in time"
                if isinstance(exc, TimeoutError)
                else exc.detail
                if isinstance(exc, ParentFailure)
                else (exc.strerror or str(exc))
            )
            attempts.append(f"{authority} via {parent.where}: {why}")
            raise ParentFailure(
                Reason.UPSTREAM_PROXY_UNREACHABLE, f"the parent proxy {parent.where} failed: {why}"
            ) from None
        answer = f"{status} {phrase}".strip()
        attempts.append(f"{authority} via {parent.where}: {answer}")
        if status == 200:
            return sock, (target, port)
        sock.close()
        if status in (403, 407):
            what = "its credentials" if status == 407 else "its rules"
            raise ParentFailure(
                Reason.UPSTREAM_PROXY_REFUSED,
                f"the parent proxy {parent.where} refused CONNECT {authority}: {answer} ({what})",
            )
        kinds.append(Reason.CONNECT_TIMEOUT if status == 504 else Reason.CONNECT_ERROR)
    detail = "; ".join(attempts) or "no address to connect to"
    raise ParentFailure(kinds[-1] if kinds else Reason.CONNECT_ERROR, detail)


async def _open_parent(parent: UpstreamProxy) -> socket.socket:
    """A non-blocking socket connected to the parent (its name resolved by the system)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(parent.host, parent.port, type=socket.SOCK_STREAM)
    error: OSError = OSError(f"no address for {parent.host}")
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:
            sock.close()
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    raise error


async def _handshake(
    sock: socket.socket, target: str, port: int, authorization: str | None
) -> tuple[int, str]:
    """Send the CONNECT, read the parent's answer head byte by byte — nothing after it is read, so
    the first bytes of the tunnel (a server that speaks first) stay in the socket for the relay."""
    loop = asyncio.get_running_loop()
    client = ConnectClient(target, port, authorization)
    await loop.sock_sendall(sock, client.request)
    read = 0
    while not client.status:
        byte = await loop.sock_recv(sock, 1)
        if not byte:
            raise ParentFailure(Reason.UPSTREAM_PROXY_UNREACHABLE, "closed the connection without answering")
        read += 1
        if read > MAX_HEAD:
            raise ParentFailure(Reason.UPSTREAM_PROXY_UNREACHABLE, "answered a head too long to read")
        try:
            client.feed(byte)
        except AnswerError:
            raise ParentFailure(Reason.UPSTREAM_PROXY_UNREACHABLE, "did not answer in HTTP/1") from None
    safe = "".join(ch if 0x20 <= ord(ch) < 0x7F else "?" for ch in client.reason)[:80]
    return client.status, safe
