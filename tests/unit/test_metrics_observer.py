"""The metrics observer alone: bounded labels whatever the events say, and what each event moves."""

from __future__ import annotations

from egressd.admission.events import Asked, Closed, Decided, Notice, Resolved
from egressd.observe.metrics import Metrics
from tests.support.metrics_text import sample


def decided(stage: str, allowed: bool, reason: str, host: str = "h.test") -> Decided:
    return Decided(
        conn="c1",
        client="egressd",
        profile=None,
        stage=stage,
        host=host,
        port=443,  # type: ignore[arg-type]
        allowed=allowed,
        reason=reason,
        rule=None,
        detail="",
    )


def test_labels_stay_bounded() -> None:
    metrics = Metrics(mode=lambda: "enforce")
    for i in range(500):  # reasons and stages outside the fixed sets, and many hosts
        metrics.observe(decided(f"stage{i}", False, f"made_up_{i}", host=f"h{i}.test"))
    metrics.observe(Notice(f"kind{1}", {}))
    text = metrics.render().decode()
    assert sample(text, "egressd_decisions_total", stage="other", reason="other", decision="deny") == 500
    assert len(metrics.decided) == 1
    assert "h1.test" not in text and "made_up" not in text and "stage1" not in text
    assert sample(text, "egressd_notices_total", kind="other") == 1


def test_each_event_moves_its_metric() -> None:
    mode = ["enforce"]
    metrics = Metrics(mode=lambda: mode[0])
    metrics.observe(decided("connection", True, "allowlist"))
    mode[0] = "learn"  # read per decision: a reload that changes the mode shows at once
    metrics.observe(decided("request", True, "learned"))
    metrics.observe(Closed(conn="c1", client=None, host="h", port=1, bytes_up=5, bytes_down=7, duration=0.1))
    metrics.observe(Resolved(0.003, "ok"))
    metrics.observe(Resolved(5.0, "dns_timeout"))
    metrics.observe(Asked(1.5, "approved"))
    metrics.observe(Notice("reload", {"source": "p.yaml", "mode": "learn"}))
    metrics.observe(Notice("reload_failed", {"error": "bad"}))
    text = metrics.render().decode()
    assert (
        sample(text, "egressd_decisions_total", stage="connection", mode="enforce", reason="allowlist") == 1
    )
    assert sample(text, "egressd_decisions_total", stage="request", mode="learn", reason="learned") == 1
    assert sample(text, "egressd_connections_total", direction="outbound") == 1
    assert sample(text, "egressd_connections_total", direction="inbound") == 1
    assert sample(text, "egressd_bytes_total", direction="up") == 5
    assert sample(text, "egressd_bytes_total", direction="down") == 7
    assert sample(text, "egressd_dns_lookup_seconds_bucket", outcome="ok", le="0.005") == 1
    assert sample(text, "egressd_dns_lookup_seconds_count", outcome="dns_timeout") == 1
    assert sample(text, "egressd_ask_wait_seconds_count", outcome="approved") == 1
    assert sample(text, "egressd_reloads_total", outcome="ok") == 1
    assert sample(text, "egressd_reloads_total", outcome="failed") == 1


def test_registries_are_per_instance() -> None:
    one, two = Metrics(), Metrics()
    one.observe(decided("connect", False, "not_allowlisted"))
    assert sample(two.render().decode(), "egressd_decisions_total", reason="not_allowlisted") == 0
