"""A session's services, each a task or a site of the proxy's one event loop: the file watchers,
the metrics port, the control API and the dashboard. Each is built with what it serves, started
on the loop with `start()` and stopped there with `stop()`; the root orders them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from egressd.session.options import SessionError

if TYPE_CHECKING:
    import asyncio

    from egressd.admission.asks import AskBroker
    from egressd.admission.decide import Decider
    from egressd.control.children import Issuer
    from egressd.observe.metrics import Metrics
    from egressd.platform.reload import FileWatcher
    from egressd.session.proxy import ProxyServer
    from egressd.tools.policy_edit import PolicyEditor


class Service(Protocol):
    name: str  # what egressd says could not start

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class Watching:
    """A file watcher as a task of the loop: its reloads are put in force there."""

    def __init__(self, watcher: FileWatcher[Any]) -> None:
        self.watcher = watcher
        self.name = f"watcher of {watcher.path}"
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        import asyncio  # loaded with the proxy's loop, which runs this

        self._task = asyncio.get_running_loop().create_task(self.watcher.watch())

    async def stop(self) -> None:
        self.watcher.stop()
        if self._task is not None:
            await self._task


class MetricsPort:
    """`--metrics HOST:PORT`: the control API's metrics answer on TCP, one of egressd's own
    addresses (the child cannot read it through the proxy); with `--metrics-token-file`, only to
    whoever holds the token."""

    name = "metrics port"

    def __init__(
        self, metrics: Metrics, own: Decider, address: tuple[str, int], token_file: str | None
    ) -> None:
        from egressd.control.site import LazySite
        from egressd.platform.listeners import listen

        token = _metrics_token(token_file)
        host, port = address
        try:
            sock = listen(own, host, port)
        except OSError as exc:
            raise SessionError(f"--metrics {host}:{port}: {exc.strerror or exc}") from exc
        self.address: tuple[str, int] = sock.getsockname()[:2]

        def app(_: asyncio.Event) -> Any:
            from egressd.control.app import metrics_app

            return metrics_app(metrics.render, token)

        self.site = LazySite(sock, app, imports=("egressd.control.app",), name="metrics port")

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"

    async def start(self) -> None:
        await self.site.start()

    async def stop(self) -> None:
        await self.site.stop()


def _metrics_token(token_file: str | None) -> str | None:
    if token_file is None:
        return None
    try:
        token = Path(token_file).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SessionError(f"--metrics-token-file: {exc}") from exc
    if len(token) < 16:
        raise SessionError(f"--metrics-token-file {token_file}: a token of 16 characters or more")
    return token


class ControlAPI:
    """The control API on the user's socket (docs/control-api.md), with what only it serves: the
    per-child counts of `ps` and the dashboard, and the children attached to this egressd."""

    name = "control API"

    def __init__(
        self,
        path: Path,
        sock: Any,
        *,
        proxy: ProxyServer,
        broker: AskBroker,
        issuer: Issuer,
        info: Callable[[], dict[str, Any]],
        policy: Callable[[], dict[str, Any]],
        edit_policy: PolicyEditor | None,
        metrics: Metrics | None,
    ) -> None:
        from egressd.admission.events import Decided
        from egressd.control.children import Children
        from egressd.control.server import ControlServer, Counts

        self.path, self._sock = path, sock
        self.counts = counts = Counts()
        proxy.events.subscribe(counts.observe, addresses=False, kinds=(Decided,))  # not connection records
        self.children = Children(issuer)

        def watched() -> None:
            """A watch stream attached: from now on every connection names its program (pid,
            exe), a cost paid only once someone watches (docs/audit.md); on the proxy's loop,
            so after its load."""
            proxy.pipeline.identify = True

        self.server = ControlServer(
            path,
            broker=broker,
            grants=proxy.grants,
            events=proxy.events,
            info=info,
            metrics=metrics.render if metrics is not None else None,
            policy=policy,
            edit_policy=edit_policy,
            children=self.children,
            watched=watched,
            own=proxy.decider,
            recent=lambda: list(counts.recent),
        )

    @classmethod
    def socket(cls, say: Callable[[str], None]) -> tuple[Path, Any] | None:
        """The listening socket in the user's run directory; None (and said) when that directory is
        not safe to use: egressd runs without the control API then."""
        from egressd.control import paths

        try:
            directory = paths.ensure_run_dir(paths.run_dir())
            path = paths.socket_path(directory)
            return path, paths.listen(path)
        except (paths.RunDirError, OSError) as exc:
            say(f"control API off: {exc}")
            return None

    async def start(self) -> None:
        await self.server.start(self._sock)

    async def stop(self) -> None:
        await self.server.stop()
        self.children.close()


class DashboardPage:
    """`--dashboard`: the web page over this instance's own control API; its URL (with the token)
    goes to stderr only — never stdout, never the child's environment."""

    name = "dashboard"

    def __init__(self, control_path: Path, own: Decider, say: Callable[[str], None]) -> None:
        from egressd.dashboard.server import WHILE_OPEN, Dashboard

        self.dashboard = Dashboard(control_path, own)
        # said once its port is bound: a page opened before the proxy's loop serves it waits
        say(f"dashboard: {self.dashboard.url}  ({WHILE_OPEN})")

    async def start(self) -> None:
        await self.dashboard.start()

    async def stop(self) -> None:
        await self.dashboard.stop()
