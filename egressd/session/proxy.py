"""egressd's proxy: the admission pipeline, the front and (on first need) the embedded mitmproxy,
in one thread with one event loop.

The CLI (exec, run), the sandbox and the SSH relay start one ProxyServer and hand children the
credentials it issues; everything the children send is admitted by the pipeline, and every request
inside an inspected tunnel by the addons in `addons/`.

A wrapped child waits for egressd's start, and most children never connect at all; so `start()`
binds the listening sockets (a port in use fails there, before any child starts) and leaves the
rest to a thread of its own: it loads the pipeline, the front and the event loop (uvloop), serves
the sockets bound already, and only then runs what was asked of the loop meanwhile (`soon`). A
client that connects before the load is done waits in the listening socket's backlog. What the
session needs before that — the credentials, the decider, the grants, the event bus — is made
here, light, and handed to the pipeline when it is built. A load that fails stops the child it
would have served (`_load_failed`): no child runs without its proxy; so does a service the command
asked for (the control API, the dashboard, the metrics port) that cannot start (`start_service`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from egressd.admission.credentials import CredentialStore, ProxyCredentials
from egressd.admission.decide import Decider
from egressd.admission.events import EventBus
from egressd.admission.grants import GrantStore
from egressd.admission.in_force import InForce, PolicyHolder
from egressd.inspect import patches
from egressd.net.loader import load_resolver
from egressd.platform.descriptors import Descriptors, raise_soft_limit
from egressd.platform.listeners import listen, listen_all
from egressd.platform.log import Logger
from egressd.policy import Policy, join_host_port
from egressd.policy.refusal import HintContext

if TYPE_CHECKING:
    import asyncio
    import ssl

    from egressd.admission.approver import Approver
    from egressd.admission.pipeline import Pipeline
    from egressd.front.handed import Handed
    from egressd.front.server import Front
    from egressd.inspect.engine import AddonFactory, InspectionEngine
    from egressd.observe.audit import AuditLog
    from egressd.platform.diag import Diag

logger = Logger(__name__)

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
        self.policies = holder
        # the pipeline's parts a session uses before the pipeline is loaded (Pipeline takes them)
        self.credentials = credentials or CredentialStore()
        self.decider = Decider(holder)
        self.grants = GrantStore()
        self.events = EventBus()
        if audit is not None:
            self.events.subscribe(audit.observe)
        self.audit = audit
        self.approver: Approver | None = None  # the session's ask broker, when it has one
        # where the refusals it answers are read: their hints name what that reader can change
        self.context = HintContext()
        self.identify = identify
        # the pid of the child each token was issued to: its process tree is searched first
        self.children: dict[str, int] = {}
        self.listen = listen
        self.socks = socks
        self.socks_listen = socks_listen
        self.health = health
        self.tls = tls  # the HTTP proxy port speaks TLS with this context (the gateway's --tls-*)
        self.sockets = dict(sockets or {})
        self.http_address: tuple[str, int] = ("", 0)
        self.socks_address: tuple[str, int] | None = None
        self._bound: list[tuple[str, socket.socket]] = []  # (kind, listening socket), served once loaded
        self._pipeline: Pipeline | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        # what was asked of the loop before it ran, in order (None once the load is done or failed)
        self._pending: list[Callable[[], Coroutine[Any, Any, None]]] | None = []
        self._lock = threading.Lock()
        self._abandoned = False  # the load was given up (abandon): nothing is served
        # why the run was stopped once loaded: a service it was asked for could not start
        self.stopped_for: str | None = None
        # TLS inspection: allowed unless --no-inspect; set up at start when the policy needs it
        self.inspect_allowed = inspect
        self.inspects = False  # the CA is ready: tunnels may be inspected
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

    @property
    def pipeline(self) -> Pipeline:
        """The admission pipeline, once loaded (waits for the load: start, then load)."""
        self._wait_loaded()
        assert self._pipeline is not None
        return self._pipeline

    def active(self) -> int:
        """The client connections open now."""
        return self._pipeline.active() if self._pipeline is not None else 0

    @property
    def error(self) -> BaseException | None:
        """Why the proxy could not be loaded or started, once it failed."""
        return self._error

    # -- policy and credentials ----------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        return self.policies.get()

    def set_policy(self, now: InForce) -> None:
        """Put a new snapshot in force (one assignment: egressd.admission.in_force.InForce)."""
        self.policies.set(now)
        loop, inspection = self._loop, self.inspection
        if loop is not None and inspection is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(inspection.set_idle_timeout, now.policy.limits.idle_timeout)

    def issue_credentials(self, profile: str | None = None, label: str | None = None) -> ProxyCredentials:
        return self.credentials.issue(profile, label)

    def revoke(self, creds: ProxyCredentials) -> None:
        pipeline = self._pipeline
        if pipeline is not None:
            pipeline.revoke(creds)
        else:
            self.credentials.revoke(creds)
            self.children.pop(creds.token, None)

    def close_revoked(self) -> None:
        """Close the client connections whose credentials are no longer valid (the gateway's token
        file lost or replaced their token); from any thread."""
        loop, front, store = self._loop, self._front, self.credentials
        if loop is None or front is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(front.close_clients, lambda creds: not store.valid(creds))

    def child_only_listener(self, creds: ProxyCredentials) -> tuple[str, int]:
        """A loopback listener without credentials, admitting only the process tree of the child
        that runs with `creds` (registered by `child_started`): for clients that cannot send proxy
        credentials (Chromium's --proxy-server, the JVM). Bound now, served once loaded."""
        if self._error is not None:
            raise EngineError(str(self._error)) from self._error
        host = self.http_address[0]
        if not ipaddress.ip_address(host).is_loopback:  # --listen 0.0.0.0: this one stays on loopback
            host = "127.0.0.1"
        sock = listen(self.decider, host, 0, backlog=1024)

        async def serve() -> None:
            assert self._front is not None
            await self._front.serve_child_only(sock, creds)

        self.soon(serve)
        address = sock.getsockname()
        return address[0], address[1]

    def child_started(self, creds: ProxyCredentials, pid: int) -> None:
        """The child running with `creds` is pid: its tree is searched first for a connection's
        owner, and only it may use its credential-free listener."""
        self.children[creds.token] = pid
        if self._error is not None or self.stopped_for is not None:
            _stop_trees([pid])

    def run[T](self, coro: Coroutine[Any, Any, T], timeout: float = START_TIMEOUT) -> T:
        """Run `coro` on the proxy's loop and wait for its result, from another thread: a session's
        services (the control API, the dashboard, metrics, the file watchers) live on this loop.
        Waits for the load first."""
        try:
            self._wait_loaded()
        except EngineError:
            coro.close()
            raise
        loop = self._loop
        if loop is None or self._thread is None or not self._thread.is_alive():
            coro.close()
            raise EngineError("the proxy is not running")
        import asyncio  # the loop's thread loaded it

        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    # -- life cycle ----------------------------------------------------------------------------
    def start(self, *, load: bool = True) -> None:
        """Bind the listening sockets (a port in use fails here) and, with `load`, start loading the
        rest in threads of their own (the resolver, and the pipeline and front: `load()`) while the
        child starts; without, the caller calls `load()` once its own start-up is done, so the
        loads' Python does not compete with it for the interpreter."""
        patches.check_version()
        raise_soft_limit()
        self._prepare_inspection()
        try:
            self._bind()
        except OSError as exc:
            for _, sock in self._bound:
                sock.close()
            raise EngineError(str(exc)) from exc
        if load:
            self.load()

    def load(self) -> None:
        """Start loading the proxy in a thread of its own, which starts the resolver's load in
        another (once): the caller's thread, whose child is starting, imports nothing for them."""
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._thread_main, name="egressd-proxy", daemon=True)
        self._thread.start()

    def _wait_loaded(self) -> None:
        if self._thread is None:
            self.load()  # what waits for the proxy needs it now
        if not self._ready.wait(START_TIMEOUT):
            raise EngineError("the proxy did not start in time")
        if self._error is not None:
            raise EngineError(str(self._error)) from self._error

    def _bind(self) -> None:
        """The HTTP (and SOCKS5) listening sockets, egressd's own before they listen; the sockets
        handed in (`sockets`) instead where there are."""
        host, port = self.listen
        kinds = [("http", host, port)]
        if self.socks:
            socks_host, socks_port = self.socks_listen or (host, 0)
            kinds.append(("socks", socks_host, socks_port))
        for kind, host, port in kinds:
            handed = self.sockets.get(kind)
            made = [handed] if handed is not None else listen_all(self.decider, host, port, backlog=4096)
            self._bound += [(kind, sock) for sock in made]
            address = made[0].getsockname()
            if kind == "http":
                self.http_address = address[0], address[1]
            else:
                self.socks_address = address[0], address[1]

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
        self.inspects = True

    def _thread_main(self) -> None:
        """The load, in steps: each starts only while someone may still need the proxy (a load
        given up, `abandon`, stops at the next step instead of taking the CPU the run's end needs)."""
        try:
            # asyncio (here, not before the child: ~15 ms of CPU it need not wait for), in steps:
            # its biggest parts first (logging, with concurrent.futures; ssl), then the rest
            for name in ("concurrent.futures", "ssl", "asyncio"):
                if self._abandoned:
                    return
                __import__(name)
            import asyncio

            if self._abandoned:
                return
            # the resolver's own thread: its first import is asyncio, which it would have waited for
            load_resolver()
            if self._abandoned:
                return
            asyncio.run(self._main(), loop_factory=_loop_factory())
        except BaseException as e:  # noqa: BLE001 - reported to whoever waits, or logged
            if not self._ready.is_set():
                self._load_failed(e)
            else:
                logger.exception("proxy thread failed")

    async def _main(self) -> None:
        import asyncio

        self._loop = asyncio.get_running_loop()
        self._loop.set_exception_handler(_quiet_exception_handler)
        # a CONNECT's task runs at once up to its first real wait (mitmproxy sets this too)
        self._loop.set_task_factory(asyncio.eager_task_factory)
        self._stopping = asyncio.Event()
        try:
            if self._abandoned:
                return
            await self._start_front()
            self._pipeline.limits.descriptors = Descriptors.measure()  # type: ignore[union-attr]
            with self._lock:
                if self._abandoned:
                    return
                pending, self._pending = self._pending or [], None
                self._ready.set()
            for make in pending:
                self._spawn(make)
            await self._stopping.wait()
        finally:
            if self._front is not None:
                self._front.close()
            if self.inspection is not None:
                await self.inspection.stop()

    async def _start_front(self) -> None:
        """The pipeline and the front, loaded now; the front serves the sockets bound at start;
        mitmproxy starts when first needed, and listens nowhere (the front hands it the tunnels to
        inspect)."""
        from egressd.admission.pipeline import Pipeline
        from egressd.front.server import Front
        from egressd.inspect.engine import InspectionEngine

        pipeline = Pipeline(
            self.policies,
            credentials=self.credentials,
            audit=self.audit,
            approver=self.approver,
            grants=self.grants,
            identify=self.identify,
            decider=self.decider,
            events=self.events,
        )
        pipeline.context = self.context
        pipeline.children = self.children
        pipeline.inspection = self.inspects
        refusal_context = None
        if self.inspects:  # refusal_pages: tls needs the CA the child trusts
            from egressd.inspect.refusal_certs import RefusalCerts

            assert self._confdir is not None
            refusal_context = RefusalCerts(self._confdir).context
        self.inspection = InspectionEngine(
            pipeline,
            _inspection_addons,
            idle_timeout=self.policy.limits.idle_timeout,
            confdir=self._confdir if self.inspects else None,
            upstream_roots=self._upstream_roots,
        )
        self._front = Front(pipeline, self.inspection.ready, refusal_context, health=self.health)
        self._pipeline = pipeline
        for kind, sock in self._bound:
            await self._front.adopt(sock, kind, ssl=self.tls if kind == "http" else None)

    def _load_failed(self, error: BaseException) -> None:
        """No proxy for the children: every child started is stopped (its process tree killed, a
        child started later too: `child_started`), and whoever waits is told why."""
        with self._lock:
            if self._abandoned:
                return
            self._error = error
            self._pending = None
            self._ready.set()
        for _, sock in self._bound:
            sock.close()
        _stop_trees(list(self.children.values()))

    def abandon(self) -> bool:
        """Give up the load if it is not done (the children it was for are gone: why wait for it):
        True when given up (now or before) — nothing was served, nothing asked of the loop ran or
        will run."""
        with self._lock:
            if self._abandoned:
                return True
            if self._pending is None:
                return False
            self._pending = None
            self._abandoned = True
        return True

    def soon(self, make: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run make()'s coroutine on the proxy's loop: now when it is loaded, else right after (in
        the order asked), from any thread; never once the load failed."""
        with self._lock:
            if self._pending is not None:
                self._pending.append(make)
                return
        if self._error is not None:
            raise EngineError(str(self._error)) from self._error
        self._background_task(make)

    def start_service(self, start: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        """Start a service of the session on the loop (`soon`): one that cannot start stops the
        children as a failed load does (nobody runs without the control API, dashboard or metrics
        they were promised), and `stopped_for` names it for the command to say and exit on."""

        async def started() -> None:
            try:
                await start()
            except Exception as exc:  # noqa: BLE001 - said by the command, which stops
                self._service_failed(f"the {name} could not start: {exc}")

        self.soon(started)

    def _service_failed(self, why: str) -> None:
        with self._lock:
            if self.stopped_for is None:
                self.stopped_for = why
        _stop_trees(list(self.children.values()))

    def serve_socket(self, handed: Handed) -> None:
        """Accept clients on a listening socket made elsewhere, as on egressd's own ports: the
        launcher makes it inside the child's network namespace, so the child reaches the proxy
        with no relay in between. A listener that grants credentials (`implicit`) is the child's
        alone (the credential-free port): a request without credentials there is the child's.
        Served once loaded: a client waits in its backlog until then."""

        async def serve() -> None:
            assert self._front is not None
            await self._front.serve(handed)

        self.soon(serve)

    def serve_captures(
        self, sock: socket.socket, creds: ProxyCredentials, *, diag: Diag | None = None
    ) -> None:
        """Admit, as the child's (`creds`), every connection a child's capture hands over on `sock`
        (front/captured.py), on the proxy's loop, until the launcher hangs up."""

        async def serve() -> None:
            from egressd.front.captured import serve_captures

            assert self._front is not None
            await serve_captures(self._front, sock, creds, diag)

        self.soon(serve)

    def serve_names(self, sock: socket.socket, profile: str | None) -> None:
        """Answer a sandbox's capture's name questions on `sock` (front/names.py) for a child of
        `profile`, on the proxy's loop, until the sandbox hangs up."""

        async def serve() -> None:
            from egressd.front.names import serve_names

            await serve_names(self.pipeline, sock, profile)

        self.soon(serve)

    def _background_task(self, make: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run make()'s coroutine on the proxy's loop, held here (the loop keeps only weak
        references to its tasks)."""
        loop = self._loop
        if loop is None or self._thread is None or not self._thread.is_alive():
            raise EngineError("the proxy is not running")
        loop.call_soon_threadsafe(self._spawn, make)

    def _spawn(self, make: Callable[[], Coroutine[Any, Any, None]]) -> None:
        assert self._loop is not None
        task = self._loop.create_task(make())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def drain(self, timeout: float) -> None:
        """Refuse new connections and let in-flight ones finish within timeout. The loop goes on
        running: the session stops its services on it (the control API removes its socket), then
        stops the proxy."""
        if self._pipeline is not None:
            self._pipeline.draining = True
        loop = self._loop
        if loop is not None and self._thread is not None and self._thread.is_alive():
            import asyncio

            future = asyncio.run_coroutine_threadsafe(self._stop_listening(), loop)
            try:
                future.result(timeout=5)
            except Exception:  # noqa: BLE001
                logger.exception("could not stop listening")
            deadline = time.monotonic() + timeout
            while self.active() and time.monotonic() < deadline:
                time.sleep(0.05)

    async def _stop_listening(self) -> None:
        if self._front is not None:
            self._front.close_listeners()

    def stop(self) -> None:
        if self._thread is None:  # never loaded: only the sockets bound at start to close
            for _, sock in self._bound:
                sock.close()
        if self._abandoned:  # the load's thread ends on its own, unwaited for (a daemon)
            self._remove_workdir()
            return
        if self._thread is not None:
            self._ready.wait(START_TIMEOUT)  # a load under way: its loop is what stops
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None and self._thread is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(stopping.set)
            self._thread.join(timeout=10)
        self._remove_workdir()

    def _remove_workdir(self) -> None:
        if self._workdir is not None:
            from egressd.inspect import ca

            ca.remove_work_dir(self._workdir)
            self._workdir = None


def _stop_trees(roots: Sequence[int]) -> None:
    """Kill each process and all it started: each stopped first, from the root down, so none acts
    on a child's death or starts another meanwhile (a launcher stops its child when egressd goes,
    but a child run without one has nobody else)."""
    from egressd.platform.peer import tree

    for root in roots:
        pids = tree(root)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
        for pid in (*pids, *tree(root)):  # and what was started before its parent stopped
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


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
    import asyncio

    if isinstance(context.get("exception"), asyncio.CancelledError):
        return
    logger.error(
        "unhandled error in the proxy loop: %s", context.get("message"), exc_info=context.get("exception")
    )
