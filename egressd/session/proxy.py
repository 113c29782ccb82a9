"""egressd's proxy: the admission pipeline, the front and (on first need) the embedded mitmproxy,
in one thread with one event loop.

The CLI (exec, run), the sandbox and the SSH relay start one ProxyServer and hand children the
credentials it issues; everything the children send is admitted by the pipeline, and every request
inside an inspected tunnel by the addons in `addons/`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from egressd.admission.credentials import CredentialStore, ProxyCredentials
from egressd.admission.in_force import InForce, PolicyHolder
from egressd.admission.pipeline import Pipeline
from egressd.admission.resolve import load_resolver
from egressd.inspect import patches
from egressd.inspect.engine import AddonFactory, InspectionEngine
from egressd.platform.descriptors import Descriptors, raise_soft_limit
from egressd.policy import Policy, join_host_port

if TYPE_CHECKING:
    import ssl

    from egressd.front.server import Front, Handed
    from egressd.observe.audit import AuditLog
    from egressd.platform.peer import Diag

logger = logging.getLogger(__name__)

START_TIMEOUT = 30.0


class EngineError(RuntimeError):
    """The proxy could not start (bad listen address, port in use, ...)."""


class ProxyServer:
    """The proxy while it runs: the admission pipeline, egressd's front and (on first need) the
    embedded mitmproxy, on one thread with one event loop of its own."""

    def __init__(
        self,
        policy: Policy | PolicyHolder,
        *,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        socks: bool = True,
        audit: AuditLog | None = None,
        nameservers: Sequence[tuple[str, int]] = (),
        inspect: bool = True,
        config_dir: Path | None = None,
        upstream_ca: Sequence[str] = (),
        socks_listen: tuple[str, int] | None = None,
        credentials: CredentialStore | None = None,
        health: bool = False,
        identify: bool = False,
        tls: ssl.SSLContext | None = None,
        sockets: Mapping[str, socket.socket] | None = None,
    ) -> None:
        """`socks_listen`: where SOCKS5 listens (default: the HTTP port's host, any free port);
        `credentials`: who may connect (default: the children this proxy issues credentials to);
        `health`: answer `GET /healthz` on the HTTP port without credentials (the gateway's);
        `sockets`: listening sockets made elsewhere to serve as the "http" and "socks" ports instead
        of binding new ones (a remote session's guard keeps copies: the ports outlive this process).
        `policy`: the policy, or the holder of the snapshot a session swaps on reload."""
        holder = policy if isinstance(policy, PolicyHolder) else PolicyHolder(policy)
        if nameservers:
            servers = [join_host_port(h, p) for h, p in nameservers]
            policy = holder.get().with_overrides(nameservers=servers)
            holder.set(dataclasses.replace(holder.now, policy=policy))
        self.pipeline = Pipeline(
            holder,
            credentials=credentials,
            audit=audit,
            identify=identify,
        )
        self.listen = listen
        self.socks = socks
        self.socks_listen = socks_listen
        self.health = health
        self.tls = tls  # the HTTP proxy port speaks TLS with this context (the gateway's --tls-*)
        self.sockets = dict(sockets or {})
        self.http_address: tuple[str, int] = ("", 0)
        self.socks_address: tuple[str, int] | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        # TLS inspection: allowed unless --no-inspect; set up at start when the policy needs it
        self.inspect_allowed = inspect
        self.config_dir = config_dir
        self.upstream_ca = tuple(upstream_ca)
        self.ca_bundle: str | None = None
        self._front: Front | None = None
        self._stopping: asyncio.Event | None = None
        self._confdir: Path | None = None
        self._upstream_roots: Path | None = None
        # the embedded mitmproxy, for tunnels admitted for inspection (started on first need)
        self.inspection: InspectionEngine | None = None
        self._workdir: Path | None = None  # egressd's own files while it runs, in its hidden home
        self._background: set[asyncio.Task[None]] = set()  # tasks nothing else holds (serve_names)

    # -- policy and credentials ----------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        return self.pipeline.policies.get()

    def set_policy(self, now: InForce) -> None:
        """Put a new snapshot in force (one assignment: egressd.admission.in_force.InForce)."""
        self.pipeline.policies.set(now)
        loop, inspection = self._loop, self.inspection
        if loop is not None and inspection is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(inspection.set_idle_timeout, now.policy.limits.idle_timeout)

    def issue_credentials(self, profile: str | None = None, label: str | None = None) -> ProxyCredentials:
        return self.pipeline.credentials.issue(profile, label)

    def revoke(self, creds: ProxyCredentials) -> None:
        self.pipeline.revoke(creds)

    def close_revoked(self) -> None:
        """Close the client connections whose credentials are no longer valid (the gateway's token
        file lost or replaced their token); from any thread."""
        loop, front, store = self._loop, self._front, self.pipeline.credentials
        if loop is None or front is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(front.close_clients, lambda creds: not store.valid(creds))

    def child_only_listener(self, creds: ProxyCredentials) -> tuple[str, int]:
        """A loopback listener without credentials, admitting only the process tree of the child
        that runs with `creds` (registered by `child_started`): for clients that cannot send proxy
        credentials (Chromium's --proxy-server, the JVM)."""
        loop = self._loop
        if loop is None or self._front is None:
            raise EngineError("the proxy is not running")
        host = self.http_address[0]
        if not ipaddress.ip_address(host).is_loopback:  # --listen 0.0.0.0: this one stays on loopback
            host = "127.0.0.1"
        future = asyncio.run_coroutine_threadsafe(self._front.start_child_only(host, creds), loop)
        return future.result(timeout=START_TIMEOUT)

    def child_started(self, creds: ProxyCredentials, pid: int) -> None:
        """The child running with `creds` is pid: its tree is searched first for a connection's
        owner, and only it may use its credential-free listener."""
        self.pipeline.children[creds.token] = pid

    def run[T](self, coro: Coroutine[Any, Any, T], timeout: float = START_TIMEOUT) -> T:
        """Run `coro` on the proxy's loop and wait for its result, from another thread: a session's
        services (the control API, the dashboard, metrics, the file watchers) live on this loop."""
        loop = self._loop
        if loop is None or self._thread is None or not self._thread.is_alive():
            coro.close()
            raise EngineError("the proxy is not running")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    # -- life cycle ----------------------------------------------------------------------------
    def start(self, *, resolver: bool = True) -> None:
        """`resolver`: load the resolver now, in a thread of its own while the proxy and the child
        start; False: the caller starts the load (resolve.load_resolver) once its own start-up is
        done, so the load's Python does not compete with it for the interpreter."""
        patches.check_version()
        raise_soft_limit()
        if resolver:
            load_resolver()
        self._prepare_inspection()
        self._thread = threading.Thread(target=self._thread_main, name="egressd-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT):
            raise EngineError("the proxy did not start in time")
        if self._error is not None:
            raise EngineError(str(self._error)) from self._error

    def _prepare_inspection(self) -> None:
        """CA and trust files, created on first need: only when the policy would intercept."""
        if not self.inspect_allowed or not self.policy.needs_ca:
            return
        from egressd.inspect import ca

        config = self.config_dir or ca.config_dir()
        try:
            ca.ensure_ca(config)
            self._workdir = ca.own_work_dir(config)
            self._upstream_roots = ca.upstream_trust_file(self.upstream_ca, self._workdir)
        except OSError as exc:
            raise EngineError(f"cannot make egressd's working directory in {config}: {exc}") from exc
        except ca.CAError as exc:
            raise EngineError(str(exc)) from exc
        self._confdir = ca.ca_dir(config)
        self.ca_bundle = str(ca.bundle_path(config))
        self.pipeline.inspection = True

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main(), loop_factory=_loop_factory())
        except BaseException as e:  # noqa: BLE001 - reported to start() or logged
            if not self._ready.is_set():
                self._error = e
                self._ready.set()
            else:
                logger.exception("proxy thread failed")

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.set_exception_handler(_quiet_exception_handler)
        # a CONNECT's task runs at once up to its first real wait (mitmproxy sets this too)
        self._loop.set_task_factory(asyncio.eager_task_factory)
        self._stopping = asyncio.Event()
        host, port = self.listen
        try:
            await self._start_front(host, port)
            self.pipeline.limits.descriptors = Descriptors.measure()  # what is open now is not the budget's
            self._ready.set()
            await self._stopping.wait()
        finally:
            if self._front is not None:
                self._front.close()
            if self.inspection is not None:
                await self.inspection.stop()

    async def _start_front(self, host: str, port: int) -> None:
        """The front listens on the public ports; mitmproxy starts when first needed, and listens
        nowhere (the front hands it the tunnels to inspect)."""
        from egressd.front.server import Front

        refusal_context = None
        if self.pipeline.inspection:  # refusal_pages: tls needs the CA the child trusts
            from egressd.inspect.refusal_certs import RefusalCerts

            assert self._confdir is not None
            refusal_context = RefusalCerts(self._confdir).context
        self.inspection = InspectionEngine(
            self.pipeline,
            _inspection_addons,
            idle_timeout=self.policy.limits.idle_timeout,
            confdir=self._confdir if self.pipeline.inspection else None,
            upstream_roots=self._upstream_roots,
        )
        self._front = Front(self.pipeline, self.inspection.ready, refusal_context, health=self.health)
        self.http_address = await self._listen("http", host, port, self.tls)
        if self.socks:
            socks_host, socks_port = self.socks_listen or (host, 0)
            self.socks_address = await self._listen("socks", socks_host, socks_port)

    async def _listen(
        self, kind: str, host: str, port: int, tls: ssl.SSLContext | None = None
    ) -> tuple[str, int]:
        assert self._front is not None
        sock = self.sockets.get(kind)
        if sock is None:
            return await self._front.start(host, port, kind=kind, ssl=tls)
        return await self._front.adopt(sock, kind, ssl=tls)

    def serve_socket(self, handed: Handed) -> None:
        """Accept clients on a listening socket made elsewhere, as on egressd's own ports: the
        launcher makes it inside the child's network namespace, so the child reaches the proxy
        with no relay in between. A listener that grants credentials (`implicit`) is the child's
        alone (the credential-free port): a request without credentials there is the child's."""
        loop = self._loop
        if loop is None or self._thread is None or not self._thread.is_alive():
            raise EngineError("the proxy is not running")
        assert self._front is not None
        future = asyncio.run_coroutine_threadsafe(self._front.serve(handed), loop)
        future.result(timeout=START_TIMEOUT)

    def serve_captures(
        self, sock: socket.socket, creds: ProxyCredentials, *, diag: Diag | None = None
    ) -> None:
        """Admit, as the child's (`creds`), every connection a child's capture hands over on `sock`
        (front/captured.py), on the proxy's loop, until the launcher hangs up."""
        from egressd.front.captured import serve_captures

        self._background_task(lambda: serve_captures(self._front, sock, creds, diag))  # type: ignore[arg-type]

    def serve_names(self, sock: socket.socket, profile: str | None) -> None:
        """Answer a sandbox's capture's name questions on `sock` (front/names.py) for a child of
        `profile`, on the proxy's loop, until the sandbox hangs up."""
        from egressd.front.names import serve_names

        self._background_task(lambda: serve_names(self.pipeline, sock, profile))

    def _background_task(self, make: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run make()'s coroutine on the proxy's loop, held here (the loop keeps only weak
        references to its tasks)."""
        loop = self._loop
        if loop is None or self._thread is None or not self._thread.is_alive():
            raise EngineError("the proxy is not running")

        def start() -> None:
            task = loop.create_task(make())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

        loop.call_soon_threadsafe(start)

    def drain(self, timeout: float) -> None:
        """Refuse new connections, let in-flight ones finish within timeout, then stop."""
        self.pipeline.draining = True
        loop = self._loop
        if loop is not None and self._thread is not None and self._thread.is_alive():
            future = asyncio.run_coroutine_threadsafe(self._stop_listening(), loop)
            try:
                future.result(timeout=5)
            except Exception:  # noqa: BLE001
                logger.exception("could not stop listening")
            deadline = time.monotonic() + timeout
            while self.pipeline.active() and time.monotonic() < deadline:
                time.sleep(0.05)
        self.stop()

    async def _stop_listening(self) -> None:
        if self._front is not None:
            self._front.close_listeners()

    def stop(self) -> None:
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None and self._thread is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(stopping.set)
            self._thread.join(timeout=10)
        if self._workdir is not None:
            from egressd.inspect import ca

            ca.remove_work_dir(self._workdir)
            self._workdir = None


def _inspection_addons() -> AddonFactory:
    """egressd's mitmproxy addons (imported in the engine's loading thread), made for a pipeline."""
    from egressd.addons.policy_gate import PolicyGate
    from egressd.addons.tunnel_guard import TunnelGuard

    def make(pipeline: Pipeline) -> list[object]:
        return [TunnelGuard(pipeline), PolicyGate(pipeline)]

    return make


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when it is installed (EGRESSD_UVLOOP=0 turns it off): per-connection work is
    mostly event-loop overhead, which uvloop cuts severalfold."""
    if os.environ.get("EGRESSD_UVLOOP", "1") == "0":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    if sys.version_info < (3, 13):
        return uvloop.new_event_loop
    return _eager_start_tolerant_loop(uvloop.Loop)


def _eager_start_tolerant_loop(base: type) -> Callable[[], asyncio.AbstractEventLoop]:
    """On Python 3.13 uvloop (>= 0.22) calls a task factory with `eager_start=`, which
    asyncio.eager_task_factory — set by egressd and by mitmproxy's Master — does not take: every
    factory set on this loop is wrapped to drop it (the factory itself decides eagerness)."""

    class Loop(base):  # type: ignore[misc, valid-type]
        def set_task_factory(self, factory: Any) -> None:
            if factory is None:
                super().set_task_factory(None)
                return

            def tolerant(loop: Any, coro: Any, *, eager_start: bool | None = None, **kwargs: Any) -> Any:
                return factory(loop, coro, **kwargs)

            super().set_task_factory(tolerant)

    return Loop


def _quiet_exception_handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """Connections cancelled at shutdown are expected, not errors to print on the child's stderr."""
    if isinstance(context.get("exception"), asyncio.CancelledError):
        return
    logger.error(
        "unhandled error in the proxy loop: %s", context.get("message"), exc_info=context.get("exception")
    )
