"""Prometheus metrics of one egressd process: an observer of the admission pipeline's events.

Counters move on the pipeline's events (`pipeline.events.subscribe(metrics.observe)`), the gauges
(open connections, active tunnels) are read from the pipeline when someone scrapes, so nothing
runs per connection for them. The registry is this process's own (`CollectorRegistry`), never
prometheus_client's global one: two proxies in one process (tests, `egressd ssh`) never mix.

No label is unbounded: no host or path label; a client label only on the gateway's own counter,
whose values are the names in its token file (any other name counts as "other"); `reason` is one
of the registry's codes (egressd.policy.reasons; anything else is counted as "other"); `stage`,
`mode`, `decision`, `direction` and `outcome` are fixed by the code. docs/metrics.md lists every
name and label.

Cheap on the hot path (every decision, closed connection and DNS lookup): every counter and
histogram is plain integers, one cell per label combination made once and kept, turned into
Prometheus samples only when someone scrapes (`_Hot.collect`) — no label dict, no lock, no
prometheus_client call per event. prometheus_client itself is imported with the first scrape: a
child's start does not wait for it. The cells are written on the proxy's event-loop
thread (the fronts, the embedded mitmproxy and the file watchers share it); an ask answered on the
terminal counts from its thread, and an integer addition or a dict insert is atomic under the GIL.
The HTTP answer (`GET /metrics` on the control socket and on `--metrics HOST:PORT`) is
egressd.control.app's.

Samples follow prometheus_client's own conventions, so the text reads like any client's: every
counter and histogram series has its `_created` timestamp (when the series began) exactly when
prometheus_client's own Counter would (not with PROMETHEUS_DISABLE_CREATED_SERIES), a gauge never
has one; the gauges of what is open now end in `_open`; `egressd_build_info` is the usual info
gauge (value 1, the versions as labels).
"""

from __future__ import annotations

import bisect
import platform
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from egressd.admission.events import Asked, Closed, Decided, Event, Notice, Resolved
from egressd.policy.model import MODES
from egressd.policy.reasons import Reason

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

    from egressd.admission.pipeline import Pipeline

# every reason code egressd gives (its one registry), the decisions' and the approver's answers
REASONS: frozenset[str] = frozenset(Reason)
STAGES = frozenset({"connect", "socks", "request", "inner", "connection", "tls", "dns"})
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


def content_type() -> str:
    """The Content-Type of `Metrics.render()`'s text."""
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    return CONTENT_TYPE_LATEST


class _Series:
    """One histogram's observations by outcome: bucket counts, sum, and when each series began."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...], outcomes: tuple[str, ...] = ()):
        self.name, self.help, self.bounds = name, help_text, buckets
        self.cells: dict[str, tuple[list[int], list[float]]] = {}  # outcome -> (counts, [sum, created])
        for outcome in outcomes:  # shown (at zero) before the first observation
            self.cell(outcome)

    def cell(self, outcome: str) -> tuple[list[int], list[float]]:
        found = self.cells.get(outcome)
        if found is None:
            found = self.cells[outcome] = ([0] * (len(self.bounds) + 1), [0.0, time.time()])
        return found

    def observe(self, outcome: str, seconds: float) -> None:
        counts, totals = self.cell(outcome)
        counts[bisect.bisect_left(self.bounds, seconds)] += 1  # le: a value on a bound is in it
        totals[0] += seconds

    def family(self, created_series: bool) -> Metric:
        from prometheus_client.core import HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        family = HistogramMetricFamily(self.name, self.help, labels=("outcome",))
        for outcome, (counts, (total, created)) in sorted(list(self.cells.items())):
            running, buckets = 0, []
            for bound, count in zip((*self.bounds, float("inf")), counts, strict=True):
                running += count
                buckets.append((floatToGoString(bound), running))
            family.add_metric((outcome,), buckets, total)
            if created_series:
                family.add_sample(f"{self.name}_created", {"outcome": outcome}, created)
        return family


class Metrics:
    """The metrics of one proxy; `observe` is its event callback, `render` its scrape."""

    def __init__(
        self,
        pipeline: Callable[[], Pipeline] | None = None,
        *,
        mode: Callable[[], str] | None = None,
        clients: Callable[[], frozenset[str]] | None = None,
    ) -> None:
        """`pipeline`: the pipeline, read at the first scrape (the gauges); `mode`: the policy's mode
        now (read per decision, it changes on reload); `clients`: the gateway's client names now
        (its token file), to count decisions per client."""
        self._pipeline = pipeline
        self._mode = mode or (lambda: "enforce")
        self._registry: CollectorRegistry | None = None
        self._registry_lock = threading.Lock()
        self.dns = _Series(
            "egressd_dns_lookup_seconds",
            "How long a connection waited for its DNS answer (A and AAAA), by outcome.",
            DNS_BUCKETS,
            ("ok", "dns_error", "dns_timeout"),
        )
        self.asks = _Series(
            "egressd_ask_wait_seconds",
            "How long a decision in mode: ask waited for its answer, by outcome.",
            ASK_BUCKETS,
        )
        # the counters: [count, created] cells by label values, read by _Hot at scrape time
        self.decided: dict[tuple[str, str, bool, str], list[float]] = {}
        self.inbound = 0  # client connections closed (that named a target)
        self.outbound = 0  # upstream connections opened
        self.bytes_up = 0
        self.bytes_down = 0
        self.reloads: dict[str, list[float]] = {o: [0, time.time()] for o in ("ok", "failed")}
        self.notices: dict[str, list[float]] = {}  # kind -> [count, created]
        self.started = time.time()
        self._clients = clients
        self.by_client: dict[tuple[str | None, bool], list[float]] = {}
        self.created_series = True  # as prometheus_client's own counters (set with the registry)

    @property
    def registry(self) -> CollectorRegistry:
        """This process's own registry, made (and prometheus_client imported) on first use."""
        with self._registry_lock:
            if self._registry is None:
                from prometheus_client import CollectorRegistry

                self.created_series = _created_series()
                registry = CollectorRegistry(auto_describe=True)
                registry.register(_Hot(self))
                if self._pipeline is not None:
                    registry.register(_Live(self._pipeline(), self))
                self._registry = registry
            return self._registry

    # -- the pipeline's events -------------------------------------------------------------------
    def observe(self, event: Event) -> None:
        """Count one event (called on the proxy's loop thread; never blocks)."""
        kind = type(event)
        if kind is Decided:
            # each field read once: a named tuple's field is read by the generic attribute lookup
            stage, allowed = event.stage, event.allowed  # type: ignore[union-attr]
            key = (stage, self._mode(), allowed, event.reason)  # type: ignore[union-attr]
            cell = self.decided.get(key)
            if cell is None:
                cell = self._cell(key)
            cell[0] += 1
            if allowed and stage == "connection":
                self.outbound += 1
            if self._clients is not None and stage in CLIENT_STAGES:
                self._count_client(event)  # type: ignore[arg-type]
        elif kind is Closed:
            self.inbound += 1
            self.bytes_up += event.bytes_up  # type: ignore[union-attr]
            self.bytes_down += event.bytes_down  # type: ignore[union-attr]
        elif kind is Resolved:
            outcome = event.outcome if event.outcome in self.dns.cells else OTHER  # type: ignore[union-attr]
            self.dns.observe(outcome, event.seconds)  # type: ignore[union-attr]
        elif kind is Asked:
            self.asks.observe(_bounded(event.outcome, REASONS), event.seconds)  # type: ignore[union-attr]
        elif kind is Notice:
            self._notice(event)  # type: ignore[arg-type]

    def _cell(self, key: tuple[str, str, bool, str]) -> list[float]:
        """The cell of a label combination seen first now; values outside the fixed sets share
        the "other" cell, so the table stays bounded whatever a reason code says."""
        stage, mode, allowed, reason = key
        bounded = (_bounded(stage, STAGES), _bounded(mode, MODE_NAMES), allowed, _bounded(reason, REASONS))
        cell = self.decided.get(bounded)
        if cell is None:
            cell = self.decided[bounded] = [0, time.time()]
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
                cell = self.by_client[bounded] = [0, time.time()]
            if known:
                self.by_client[key] = cell
        cell[0] += 1

    def _notice(self, event: Notice) -> None:
        if event.kind in ("reload", "reload_failed"):
            self.reloads["ok" if event.kind == "reload" else "failed"][0] += 1
            return
        kind = _bounded(event.kind, NOTICES)
        cell = self.notices.get(kind)
        if cell is None:
            cell = self.notices[kind] = [0, time.time()]
        cell[0] += 1

    # -- scraping ----------------------------------------------------------------------------------
    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (what GET /metrics answers)."""
        from prometheus_client.exposition import generate_latest

        return generate_latest(self.registry)


def _created_series() -> bool:
    """Whether prometheus_client's own counters show `_created` here (PROMETHEUS_DISABLE_CREATED_SERIES
    turns them off): asked of a real, unregistered Counter, so egressd's series follow whatever
    switch the library honours."""
    from prometheus_client import Counter

    probe = Counter("egressd_probe", "probe", registry=None)
    return any(sample.name.endswith("_created") for family in probe.collect() for sample in family.samples)


class _Hot:
    """Every counter and histogram of Metrics as Prometheus samples, at scrape time (a collector)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily

        m = self.metrics
        created = m.created_series

        def when(value: float) -> float | None:
            return value if created else None

        yield m.dns.family(created)
        yield m.asks.family(created)
        for name, help_text, cells in (
            ("egressd_reloads", "Policy reloads, by outcome (ok, failed).", m.reloads),
            ("egressd_notices", "Other events of the pipeline, by kind.", m.notices),
        ):
            label = "outcome" if name == "egressd_reloads" else "kind"
            family = CounterMetricFamily(name, help_text, labels=(label,))
            for value, (count, began) in sorted(list(cells.items())):
                family.add_metric((value,), count, created=when(began))
            yield family
        decisions = CounterMetricFamily(
            "egressd_decisions",
            "Decisions of the admission pipeline, by stage, mode, verdict and reason code.",
            labels=("stage", "mode", "decision", "reason"),
        )
        for (stage, mode, allowed, reason), (count, began) in sorted(list(m.decided.items())):
            labels = (stage, mode, "allow" if allowed else "deny", reason)
            decisions.add_metric(labels, count, created=when(began))
        yield decisions
        if m.by_client:
            per_client = CounterMetricFamily(
                "egressd_gateway_client_decisions",
                "The gateway's decisions by client (the names in its token file; others: other) and verdict.",
                labels=("client", "decision"),
            )
            for (client, allowed), (count, began) in sorted(
                list(m.by_client.items()), key=lambda kv: (str(kv[0][0]), kv[0][1])
            ):
                verdict = "allow" if allowed else "deny"
                per_client.add_metric((str(client), verdict), count, created=when(began))
            yield per_client
        connections = CounterMetricFamily(
            "egressd_connections",
            "Connections: inbound = client connections to egressd that named a target (counted when "
            "they close), outbound = upstream connections egressd opened.",
            labels=("direction",),
        )
        connections.add_metric(("inbound",), m.inbound, created=when(m.started))
        connections.add_metric(("outbound",), m.outbound, created=when(m.started))
        yield connections
        relayed = CounterMetricFamily(
            "egressd_bytes",
            "Bytes relayed, up = child to upstream, down = upstream to child (counted when the "
            "client connection closes).",
            labels=("direction",),
        )
        relayed.add_metric(("up",), m.bytes_up, created=when(m.started))
        relayed.add_metric(("down",), m.bytes_down, created=when(m.started))
        yield relayed


class _Live:
    """Gauges read from the pipeline at scrape time: nothing to count per connection (a collector)."""

    def __init__(self, pipeline: Pipeline, metrics: Metrics) -> None:
        self.pipeline = pipeline
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        pipeline = self.pipeline
        audit = pipeline.audit
        yield _build_info()
        dropped = CounterMetricFamily(
            "egressd_audit_records_dropped",
            "Audit records that could not be written (a full disk, a reader that stopped reading), "
            "since the start: each one is counted.",
            labels=(),
        )
        began = self.metrics.started if self.metrics.created_series else None
        dropped.add_metric((), audit.lost if audit is not None else 0, created=began)
        yield dropped
        yield GaugeMetricFamily(
            "egressd_audit_writable",
            "1 while the audit log takes records, 0 while it cannot (then audit.on_failure: refuse "
            "refuses new work).",
            1 if audit is None or audit.writable else 0,
        )
        yield GaugeMetricFamily(
            "egressd_audit_queue_bytes",
            "Bytes of audit records waiting for a pipe's reader (at most audit.max_queue_bytes).",
            audit.queued_bytes if audit is not None else 0,
        )
        conns = pipeline.open_connections()
        yield GaugeMetricFamily(
            "egressd_client_connections_open", "Client connections to egressd open now.", len(conns)
        )
        yield GaugeMetricFamily(
            "egressd_tunnels_open",
            "Admitted CONNECT and SOCKS5 tunnels open now.",
            sum(1 for state in conns if state.tunnel),
        )
        yield GaugeMetricFamily(
            "egressd_upstream_connections_open",
            "Upstream connections egressd holds open now.",
            len(pipeline.limits.upstreams),
        )


def _build_info() -> Metric:
    """egressd_build_info: which egressd, on which Python and mitmproxy, answers (value 1)."""
    from importlib import metadata

    from prometheus_client.core import GaugeMetricFamily

    from egressd import __version__

    try:
        mitmproxy = metadata.version("mitmproxy")
    except metadata.PackageNotFoundError:
        mitmproxy = "none"
    info = GaugeMetricFamily(
        "egressd_build_info",
        "Always 1: the versions of egressd, Python and mitmproxy as labels.",
        labels=("version", "python", "mitmproxy"),
    )
    info.add_metric((__version__, platform.python_version(), mitmproxy), 1)
    return info
