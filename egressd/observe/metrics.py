"""Prometheus metrics of one egressd process: an observer of the admission pipeline's events.

Counters move on the pipeline's events (`pipeline.events.subscribe(metrics.observe)`), the gauges
(open connections, active tunnels) are read from the pipeline when someone scrapes, so nothing
runs per connection for them. The registry is this process's own (`CollectorRegistry`), never
prometheus_client's global one: two proxies in one process (tests, `egressd ssh`) never mix.

No label is unbounded: no host or path label; a client label only on the gateway's own counter,
whose values are the names in its token file (any other name counts as "other"); `reason` is a
fixed set (anything else is counted as "other"), `stage`, `mode`, `decision`, `direction` and
`outcome` are fixed by the code. docs/metrics.md lists every name and label.

Cheap on the hot path (every decision and closed connection): those counters are plain integers,
one cell per label combination made once and kept, turned into Prometheus samples only when
someone scrapes (`_Hot.collect`) — no label dict, no lock, no prometheus_client call per event.
They are written on the proxy's event-loop thread only (the fronts and the embedded mitmproxy share
it). Rare events (DNS lookups, asks, reloads from the watcher's thread, notices) use
prometheus_client's own metrics with pre-bound children.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from egressd.admission.events import Asked, Closed, Decided, Event, Notice, Resolved
from egressd.policy.model import MODES
from egressd.refusal import FAILURE_REASONS, POLICY_REASONS

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.metrics_core import Metric

    from egressd.admission.pipeline import Pipeline

CONTENT_TYPE = CONTENT_TYPE_LATEST

# why a decision allowed (egressd.policy.decide's reasons) and the approver's answers
ALLOW_REASONS = frozenset(
    {"allowlist", "loopback", "builtin", "private_origin", "mode_allow", "learned", "ask", "approved"}
)
ASK_REASONS = frozenset({"ask_refused", "ask_timeout", "no_approver"})
REASONS = ALLOW_REASONS | ASK_REASONS | POLICY_REASONS | FAILURE_REASONS
STAGES = frozenset({"connect", "socks", "request", "inner", "connection", "tls"})
MODE_NAMES = frozenset(MODES)
NOTICES = frozenset(
    {
        "header_timeout",
        "internal_error",
        "credentials_stripped",
        "response_cut",
        # the ask broker's (egressd.admission.asks): a question asked, answered, expired, withdrawn
        "ask",
        "ask_answered",
        "ask_expired",
        "ask_withdrawn",
        # the gateway's token file (egressd.session): reloaded, or a bad version kept out
        "tokens_reload",
        "tokens_reload_failed",
    }
)
CLIENT_STAGES = frozenset({"connect", "socks", "request", "inner"})  # one per ask, not per upstream
OTHER = "other"

DNS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ASK_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _bounded(value: str | None, known: frozenset[str]) -> str:
    return value if value in known else OTHER  # type: ignore[return-value]


class Metrics:
    """The metrics of one proxy; `observe` is its event callback, `render` its scrape."""

    def __init__(
        self,
        pipeline: Pipeline | None = None,
        *,
        mode: Callable[[], str] | None = None,
        clients: Callable[[], frozenset[str]] | None = None,
    ) -> None:
        """`clients`: the gateway's client names now (its token file), to count decisions per client."""
        self.registry = CollectorRegistry(auto_describe=True)
        self._pipeline = pipeline
        if mode is None and pipeline is not None:
            policies = pipeline.policies
            mode = lambda: policies.get().mode  # noqa: E731 - read per decision, changes on reload
        self._mode = mode or (lambda: "enforce")
        r = self.registry
        self.dns = Histogram(
            "egressd_dns_lookup_seconds",
            "How long a connection waited for its DNS answer (A and AAAA), by outcome.",
            ("outcome",),
            buckets=DNS_BUCKETS,
            registry=r,
        )
        self.asks = Histogram(
            "egressd_ask_wait_seconds",
            "How long a decision in mode: ask waited for its answer, by outcome.",
            ("outcome",),
            buckets=ASK_BUCKETS,
            registry=r,
        )
        self.reloads = Counter(
            "egressd_reloads", "Policy reloads, by outcome (ok, failed).", ("outcome",), registry=r
        )
        self.notices = Counter(
            "egressd_notices", "Other events of the pipeline, by kind.", ("kind",), registry=r
        )
        # the hot counters: [count] cells by label values, read by _Hot at scrape time
        self.decided: dict[tuple[str, str, bool, str], list[int]] = {}
        self.inbound = 0  # client connections closed (that named a target)
        self.outbound = 0  # upstream connections opened
        self.bytes_up = 0
        self.bytes_down = 0
        self._clients = clients
        self.by_client: dict[tuple[str | None, bool], list[int]] = {}
        r.register(_Hot(self))
        if pipeline is not None:
            r.register(_Live(pipeline))
        self._reload_ok = self.reloads.labels("ok")
        self._reload_failed = self.reloads.labels("failed")
        self._dns: dict[str, Any] = {o: self.dns.labels(o) for o in ("ok", "dns_error", "dns_timeout")}
        self._asks: dict[str, Any] = {}
        self._notices: dict[str, Any] = {}

    # -- the pipeline's events -------------------------------------------------------------------
    def observe(self, event: Event) -> None:
        """Count one event (called on the proxy's loop thread; never blocks)."""
        kind = type(event)
        if kind is Decided:
            key = (event.stage, self._mode(), event.allowed, event.reason)  # type: ignore[union-attr]
            cell = self.decided.get(key)
            if cell is None:
                cell = self._cell(key)
            cell[0] += 1
            if event.allowed and event.stage == "connection":  # type: ignore[union-attr]
                self.outbound += 1
            if self._clients is not None and event.stage in CLIENT_STAGES:  # type: ignore[union-attr]
                self._count_client(event)  # type: ignore[arg-type]
        elif kind is Closed:
            self.inbound += 1
            self.bytes_up += event.bytes_up  # type: ignore[union-attr]
            self.bytes_down += event.bytes_down  # type: ignore[union-attr]
        elif kind is Resolved:
            child = self._dns.get(event.outcome) or self.dns.labels(OTHER)  # type: ignore[union-attr]
            child.observe(event.seconds)  # type: ignore[union-attr]
        elif kind is Asked:
            self._ask(event)  # type: ignore[arg-type]
        elif kind is Notice:
            self._notice(event)  # type: ignore[arg-type]

    def _cell(self, key: tuple[str, str, bool, str]) -> list[int]:
        """The cell of a label combination seen first now; values outside the fixed sets share
        the "other" cell, so the table stays bounded whatever a reason code says."""
        stage, mode, allowed, reason = key
        bounded = (_bounded(stage, STAGES), _bounded(mode, MODE_NAMES), allowed, _bounded(reason, REASONS))
        cell = self.decided.get(bounded)
        if cell is None:
            cell = self.decided[bounded] = [0]
        return cell  # an unbounded key is never stored: its lookups miss and land here again

    def _count_client(self, event: Decided) -> None:
        key = (event.client, event.allowed)
        cell = self.by_client.get(key)
        if cell is None:
            assert self._clients is not None
            known = event.client is not None and event.client in self._clients()
            bounded = (event.client if known else OTHER, event.allowed)
            cell = self.by_client.get(bounded)
            if cell is None:
                cell = self.by_client[bounded] = [0]
            if known:
                self.by_client[key] = cell
        cell[0] += 1

    def _ask(self, event: Asked) -> None:
        child = self._asks.get(event.outcome)
        if child is None:
            child = self._asks[event.outcome] = self.asks.labels(_bounded(event.outcome, REASONS))
        child.observe(event.seconds)

    def _notice(self, event: Notice) -> None:
        if event.kind == "reload":
            self._reload_ok.inc()
            return
        if event.kind == "reload_failed":
            self._reload_failed.inc()
            return
        kind = _bounded(event.kind, NOTICES)
        child = self._notices.get(kind)
        if child is None:
            child = self._notices[kind] = self.notices.labels(kind)
        child.inc()

    # -- scraping ----------------------------------------------------------------------------------
    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (what GET /metrics answers)."""
        return generate_latest(self.registry)


class _Hot(Collector):
    """The hot counters (decisions, connections, bytes) as Prometheus samples, at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily

        m = self.metrics
        decisions = CounterMetricFamily(
            "egressd_decisions",
            "Decisions of the admission pipeline, by stage, mode, verdict and reason code.",
            labels=("stage", "mode", "decision", "reason"),
        )
        for (stage, mode, allowed, reason), cell in sorted(list(m.decided.items())):
            decisions.add_metric((stage, mode, "allow" if allowed else "deny", reason), cell[0])
        yield decisions
        if m.by_client:
            per_client = CounterMetricFamily(
                "egressd_gateway_client_decisions",
                "The gateway's decisions by client (the names in its token file; others: other) and verdict.",
                labels=("client", "decision"),
            )
            for (client, allowed), cell in sorted(
                list(m.by_client.items()), key=lambda kv: (str(kv[0][0]), kv[0][1])
            ):
                per_client.add_metric((str(client), "allow" if allowed else "deny"), cell[0])
            yield per_client
        connections = CounterMetricFamily(
            "egressd_connections",
            "Connections: inbound = client connections to egressd that named a target (counted when "
            "they close), outbound = upstream connections egressd opened.",
            labels=("direction",),
        )
        connections.add_metric(("inbound",), m.inbound)
        connections.add_metric(("outbound",), m.outbound)
        yield connections
        relayed = CounterMetricFamily(
            "egressd_bytes",
            "Bytes relayed, up = child to upstream, down = upstream to child (counted when the "
            "client connection closes).",
            labels=("direction",),
        )
        relayed.add_metric(("up",), m.bytes_up)
        relayed.add_metric(("down",), m.bytes_down)
        yield relayed


class _Live(Collector):
    """Gauges read from the pipeline at scrape time: nothing to count per connection."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        pipeline = self.pipeline
        conns = pipeline.open_connections()
        yield GaugeMetricFamily(
            "egressd_client_connections_open", "Client connections to egressd open now.", len(conns)
        )
        yield GaugeMetricFamily(
            "egressd_tunnels_active",
            "Admitted CONNECT and SOCKS5 tunnels open now.",
            sum(1 for state in conns if state.tunnel),
        )
        yield GaugeMetricFamily(
            "egressd_upstream_connections_open",
            "Upstream connections egressd holds open now.",
            len(pipeline.limits.upstreams),
        )


# -- the TCP endpoint (--metrics HOST:PORT) ---------------------------------------------------------
class MetricsServer:
    """prometheus_client's WSGI server for one registry, in a daemon thread."""

    def __init__(self, metrics: Metrics, host: str, port: int) -> None:
        from prometheus_client import start_http_server

        self._server: WSGIServer
        self._thread: threading.Thread
        self._server, self._thread = start_http_server(port, addr=host, registry=metrics.registry)
        bound = self._server.server_address
        self.address: tuple[str, int] = (str(bound[0]), int(bound[1]))

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
