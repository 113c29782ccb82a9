"""results.json (every figure and run), results.md (tables, goals ✔/✘) and ratios.png."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.model import Metric
from bench.peers import (
    ALL_TARGETS,
    DIRECT,
    EGRESSD,
    EXEC,
    MITMPROXY,
    PEERS,
    SANDBOX,
    SANDBOX_TARGETS,
    SQUID,
    SRT,
    TARGETS,
    TINYPROXY,
)

LABELS = {
    DIRECT: "direct",
    TINYPROXY: "tinyproxy",
    SQUID: "Squid",
    MITMPROXY: "mitmproxy",
    SRT: "srt",
    EGRESSD: "egressd",
    EXEC: "egressd exec",
    SANDBOX: "egressd sandbox",
}
GENERATOR_BOUND = 0.9  # load core busier than this: the figure is a floor set by the load side


# -- numbers ------------------------------------------------------------------------------------------
def fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    a = abs(value)
    if a >= 1000:
        return f"{value:,.0f}"
    if a >= 100:
        return f"{value:.0f}"
    if a >= 10:
        return f"{value:.1f}"
    if a >= 1:
        return f"{value:.2f}"
    if a >= 0.01:
        return f"{value:.3f}"
    return f"{value:.2g}"


def fmt_ratio(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.2f}×" if value < 10 else f"{value:.0f}×"


def performance(metric: Metric, target: str, reference: str) -> float | None:
    """How much better target is than reference, > 1 = better (ratio, inverted for lower-is-better)."""
    r = metric.ratio(target, reference)
    if r is None or r <= 0:
        return None
    return r if metric.better == "higher" else 1 / r


# -- goals ----------------------------------------------------------------------------------------------
@dataclass
class Goal:
    text: str
    figure: str
    met: bool | None  # None: cannot be judged (a figure is missing)

    @property
    def mark(self) -> str:
        return "n/a" if self.met is None else ("✔" if self.met else "✘")


def _by_key(metrics: Sequence[Metric]) -> dict[str, Metric]:
    return {m.key: m for m in metrics}


def goals(metrics: Sequence[Metric]) -> list[Goal]:
    by = _by_key(metrics)
    out: list[Goal] = []

    def ratio_goal(
        text: str, key: str, ref: str, op: Callable[[float], bool], bound: str, target: str = EGRESSD
    ) -> None:
        m = by.get(key)
        r = m.ratio(target, ref) if m else None
        if m is None or r is None:
            why = next((m.na[t] for t in (target, ref) if t in m.na), "not measured") if m else "not measured"
            out.append(Goal(text, why, None))
            return
        figure = f"{fmt(m.median(target))} vs {fmt(m.median(ref))} {m.unit} = {fmt_ratio(r)} ({bound})"
        direct = m.ratio(DIRECT, ref)
        if direct is not None and not op(direct):
            # the limit itself misses the goal: the load side, not the proxy, decides this line
            figure += f"; with no proxy at all {fmt_ratio(direct)}: the load side here cannot show this goal"
        out.append(Goal(text, figure, op(r)))

    def value_goal(
        text: str, key: str, op: Callable[[float], bool], bound: str, target: str = EGRESSD
    ) -> None:
        m = by.get(key)
        v = m.median(target) if m else None
        if m is None or v is None:
            why = m.na.get(target, "not measured") if m else "not measured"
            out.append(Goal(text, why, None))
            return
        out.append(Goal(text, f"{fmt(v)} {m.unit} ({bound})", op(v)))

    for key, what in (("w1.raw", "raw TCP"), ("w1.tls", "TLS")):
        ratio_goal(
            f"Tunnel throughput ({what}) ≥ 1.5× tinyproxy", key, TINYPROXY, lambda r: r >= 1.5, "≥ 1.5×"
        )
        ratio_goal(
            f"Tunnel throughput ({what}) ≥ 1.0× mitmproxy passthrough",
            key,
            MITMPROXY,
            lambda r: r >= 1.0,
            "≥ 1.0×",
        )
    for key in sorted(k for k in by if k.startswith("w2.c") and k.count(".") == 1):
        ratio_goal(
            f"Tunnel setup rate ≥ tinyproxy's ({by[key].title})", key, TINYPROXY, lambda r: r >= 1.0, "≥ 1.0×"
        )
        ratio_goal(f"Tunnel setup rate ≥ 1.5× srt ({by[key].title})", key, SRT, lambda r: r >= 1.5, "≥ 1.5×")
        ratio_goal(
            f"Tunnel setup rate ≥ 3× mitmproxy ({by[key].title})", key, MITMPROXY, lambda r: r >= 3.0, "≥ 3×"
        )
    for key, what in (("w4.keepalive", "keep-alive"), ("w4.close", "no keep-alive")):
        ratio_goal(
            f"Plain-HTTP GET rate ≥ tinyproxy's ({what})", key, TINYPROXY, lambda r: r >= 1.0, "≥ 1.0×"
        )
    c100 = next(
        (k for k in by if k.startswith("w3.c") and k.endswith(".added_p50") and k != "w3.c1.added_p50"), None
    )
    if c100 is not None:
        base = c100.removesuffix(".added_p50")
        value_goal(
            "Added latency per CONNECT p50 ≤ 1 ms at concurrency 100", c100, lambda v: v <= 1.0, "≤ 1 ms"
        )
        value_goal(
            "Added latency per CONNECT p99 ≤ 5 ms at concurrency 100",
            f"{base}.added_p99",
            lambda v: v <= 5.0,
            "≤ 5 ms",
        )
    else:
        out.append(
            Goal("Added latency per CONNECT p50 ≤ 1 ms, p99 ≤ 5 ms at concurrency 100", "not measured", None)
        )
    rss, works = by.get("w6.rss"), by.get("w6.working")
    if rss is not None and rss.median(EGRESSD) is not None:
        per = rss.median(EGRESSD) or 0.0
        ok = works.median(EGRESSD) if works else None
        figure = f"{fmt(per)} KiB per tunnel, {fmt(ok)}% still working ({rss.title})"
        out.append(
            Goal(
                "Idle tunnels: ≤ 20 KiB of proxy RSS each, all still working",
                figure,
                per <= 20 and ok == 100.0,
            )
        )
    else:
        out.append(Goal("Idle tunnels: ≤ 20 KiB of proxy RSS each, all still working", "not measured", None))
    value_goal("`egressd exec -- true` ≤ 0.5 s", "w7.exec", lambda v: v <= 0.5, "≤ 0.5 s")
    decide = [m for m in metrics if m.key.startswith("w8.") and m.main and m.median(EGRESSD) is not None]
    if decide:
        worst = max(decide, key=lambda m: m.median(EGRESSD) or 0.0)
        v = worst.median(EGRESSD) or 0.0
        figure = f"slowest case {fmt(v)} µs: {worst.title.removeprefix('decide() per call, ')} (≤ 10 µs)"
        out.append(Goal("Decision ≤ 10 µs with 100,000 rules", figure, v <= 10.0))
    else:
        out.append(Goal("Decision ≤ 10 µs with 100,000 rules", "not measured", None))
    ratio_goal(
        "Real job (npm ci) ≤ 1.10× the direct wall time", "w9.npm", DIRECT, lambda r: r <= 1.10, "≤ 1.10×"
    )
    if any(m.sandbox for m in metrics):  # egressd sandbox against egressd exec and srt
        ratio_goal(
            "Sandbox tunnel throughput ≥ 0.8× egressd exec",
            "sb1.download",
            EXEC,
            lambda r: r >= 0.8,
            "≥ 0.8×",
            SANDBOX,
        )
        for key in sorted(k for k in by if k.startswith("sb2.c") and k.count(".") == 1):
            ratio_goal(
                f"Sandbox setup rate ≥ 0.8× egressd exec (concurrency {key.removeprefix('sb2.c')})",
                key,
                EXEC,
                lambda r: r >= 0.8,
                "≥ 0.8×",
                SANDBOX,
            )
        value_goal(
            "Sandbox added latency per CONNECT p50 ≤ 0.3 ms (over egressd exec, from inside)",
            "sb3.added_p50",
            lambda v: v <= 0.3,
            "≤ 0.3 ms",
            SANDBOX,
        )
        ratio_goal(
            "`egressd sandbox -- true` ≤ `srt true`", "sb4.true", SRT, lambda r: r <= 1.0, "≤ 1.0×", SANDBOX
        )
    return out


# -- JSON ---------------------------------------------------------------------------------------------
def to_json(metrics: Sequence[Metric], meta: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for m in metrics:
        ratios = {
            t: {r: m.ratio(t, r) for r in ALL_TARGETS if r != t and m.ratio(t, r) is not None}
            for t in ALL_TARGETS
            if m.median(t) is not None
        }
        rows.append(
            {
                "key": m.key,
                "workload": m.workload,
                "title": m.title,
                "unit": m.unit,
                "better": m.better,
                "main": m.main,
                "figures": {t: m.summary(t) for t in ALL_TARGETS if t in m.runs or t in m.na},
                "ratios": ratios,  # ratios[a][b] = median(a) / median(b)
                "notes": m.notes,
                "extra": m.extra,
            }
        )
    return {
        "meta": meta,
        "goals": [{"goal": g.text, "figure": g.figure, "met": g.met} for g in goals(metrics)],
        "metrics": rows,
    }


# -- markdown -----------------------------------------------------------------------------------------
def _cell(m: Metric, target: str) -> str:
    values = m.runs.get(target)
    if not values:
        return m.na.get(target, "–").replace("|", "/")
    med = statistics.median(values)
    if len(values) == 1:
        return f"**{fmt(med)}**"
    return f"**{fmt(med)}**<br>{fmt(min(values))}–{fmt(max(values))}"


def _flag(m: Metric, target: str) -> str:
    busy = m.extra.get("load_side_cpu", {}).get(target)
    if busy and statistics.median(busy) >= GENERATOR_BOUND:
        return " ⚑"
    return ""


def _table(metrics: Sequence[Metric]) -> list[str]:
    """The proxy workloads: every target, then egressd ÷ direct and ÷ each peer."""
    ratios = [("egressd ÷ direct", lambda m: m.ratio(EGRESSD, DIRECT) if m.ratio_to_direct else None)]
    ratios += [(f"egressd ÷ {LABELS[p]}", lambda m, p=p: m.ratio(EGRESSD, p)) for p in PEERS]
    return _rows(metrics, TARGETS, ratios)


def _sandbox_table(metrics: Sequence[Metric]) -> list[str]:
    """The sandbox workloads: egressd exec, egressd sandbox and srt, each running the same client."""
    ratios = [
        ("sandbox ÷ exec", lambda m: m.ratio(SANDBOX, EXEC)),
        ("sandbox ÷ srt", lambda m: m.ratio(SANDBOX, SRT)),
    ]
    return _rows(metrics, SANDBOX_TARGETS, ratios)


def _rows(
    metrics: Sequence[Metric],
    targets: Sequence[str],
    ratios: Sequence[tuple[str, Callable[[Metric], float | None]]],
) -> list[str]:
    head = ["workload", "metric", "unit"] + [LABELS[t] for t in targets] + [label for label, _ in ratios]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    last = ""
    for m in metrics:
        wl = m.workload if m.workload != last else ""
        last = m.workload
        arrow = "↑" if m.better == "higher" else "↓"
        cells = [wl, m.title, f"{m.unit} {arrow}"]
        cells += [_cell(m, t) + _flag(m, t) for t in targets]
        cells += [fmt_ratio(ratio(m)) for _, ratio in ratios]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _peer_ratio_table(metrics: Sequence[Metric]) -> list[str]:
    """Every target against every other, for the main figures: 'row ÷ column' of the medians."""
    lines = []
    for m in metrics:
        present = [t for t in (SANDBOX_TARGETS if m.sandbox else TARGETS) if m.median(t) is not None]
        if not m.main or len(present) < 2:
            continue
        lines.append(f"**{m.workload} — {m.title}** ({m.unit}, {m.better} is better)")
        lines.append("")
        lines.append("| ÷ | " + " | ".join(LABELS[t] for t in present) + " |")
        lines.append("|---|" + "---|" * len(present))
        for a in present:
            lines.append(
                f"| {LABELS[a]} | "
                + " | ".join("1" if a == b else fmt_ratio(m.ratio(a, b)) for b in present)
                + " |"
            )
        lines.append("")
    return lines


def to_markdown(metrics: Sequence[Metric], meta: dict[str, Any]) -> str:
    main = [m for m in metrics if m.main and not m.sandbox]
    diag = [m for m in metrics if not m.main and not m.sandbox]
    boxed = [m for m in metrics if m.main and m.sandbox]
    boxed_diag = [m for m in metrics if not m.main and m.sandbox]
    out = [f"# egressd benchmark — {meta.get('started', '')}", ""]
    sizes = meta.get("sizes", {})
    out.append(
        f"Machine: {meta.get('machine', '')}. {meta.get('pinning', '')} Network: {meta.get('netns', '')}. "
        f"Load generator loop: {meta.get('event_loop', '')}. Load average before/after: "
        f"{meta.get('loadavg_start', '')} / {meta.get('loadavg_end', '')}. Wall time of the run: "
        f"{fmt(meta.get('duration_s'))} s. Mode: {meta.get('mode', '')}; runs per figure: "
        f"{sizes.get('repeats', '?')} (npm job: {sizes.get('job_repeats', '?')})."
    )
    sources = meta.get("egressd_sources") or {}
    if len({state.split("+src:")[-1] for state in sources}) > 1:
        listing = "; ".join(f"{state}: {', '.join(w)}" for state, w in sources.items())
        out += [
            "",
            f"**Warning: egressd's source changed during the run** (workloads per source: {listing}).",
        ]
    elif sources:
        heads = ", ".join(sources)
        out += ["", f"egressd source: {heads} (git HEAD + hash of the working tree's egressd sources)."]
    if meta.get("egressd_env"):
        out += ["", f"Extra environment of every egressd: {meta['egressd_env']}."]
    if "other_cpu_share" in meta:
        out.append("")
        out.append(
            f"Other processes on this machine (not the bench) used {fmt(meta['other_cpu_s'])} CPU s "
            f"during the run, {100 * meta['other_cpu_share']:.0f} % of its total capacity: absolute figures "
            "are noisy, ratios within the run are what to compare."
        )
    out.append("")
    out.append(
        "Cells: **median**, then min–max over the runs. Ratios are median ÷ median; ↑ higher is better, "
        "↓ lower is better. ⚑ = the load side (generator + upstream servers, on their own core) used ≥ 90 % "
        "of its core: that figure is bounded by the load side, not by the proxy. Compare ratios within one "
        "run: the machine is shared."
    )
    out += ["", "## Goals (egressd, this run)", "", "| goal | egressd | met |", "|---|---|---|"]
    out += [f"| {g.text} | {g.figure} | {g.mark} |" for g in goals(metrics)]
    if main:
        out += ["", "## Results", ""] + _table(main)
    if diag:
        out += ["", "## Diagnostics", ""] + _table(diag)
    if boxed:
        out += [
            "",
            "## Sandbox workloads (the same client inside each wrapper)",
            "",
            "Each run starts the wrapper with bench/sandbox_client.py as its child (wrapper on the proxy "
            "core, client on the load core); the client reads HTTP_PROXY and measures from inside. "
            "Ratios: egressd sandbox ÷ egressd exec, egressd sandbox ÷ srt.",
            "",
        ]
        out += _sandbox_table(boxed)
    if boxed_diag:
        out += ["", "### Sandbox diagnostics", ""] + _sandbox_table(boxed_diag)
    details = [m for m in metrics if m.key.startswith("w8.") and m.main]
    if details:
        out += [
            "",
            "## Decision details",
            "",
            "| case | 100,000 rules (µs) | 10 rules (µs) | 100,000 rules, target given as a string (µs) |",
            "|---|---|---|---|",
        ]
        for m in details:
            case = m.title.removeprefix("decide() per call, ")
            out.append(
                f"| {case} | {fmt(m.median(EGRESSD))} | {fmt(m.extra.get('10_rules_median_us'))} | "
                f"{fmt(m.extra.get('from_string_median_us'))} |"
            )
    out += ["", "## Every target against every other (main figures)", ""]
    out += _peer_ratio_table(main + boxed)
    notes = [(m, n) for m in metrics for n in m.notes]
    if notes:
        out += ["## Notes", ""]
        out += [f"- {m.workload} / {m.title}: {n}" for m, n in notes]
    out += ["", "## Peers", ""]
    for name, info in meta.get("peers", {}).items():
        if not info.get("config"):
            out += [f"- {name}: {info.get('description', '')}", ""]
            continue
        out.append(
            f"<details><summary>{name}: {info.get('description', '')} — {info.get('version', '')}</summary>"
        )
        out += ["", "```", info.get("config", "").rstrip(), "```", "", "</details>", ""]
    if meta.get("upstreams"):
        up = meta["upstreams"]
        out += ["<details><summary>upstreams (nginx, Python sink/echo servers)</summary>", "", "```"]
        out.append(up.get("nginx.conf", "").rstrip())
        out += ["```", "", "</details>", ""]
    return "\n".join(out) + "\n"


# -- chart --------------------------------------------------------------------------------------------
def chart(metrics: Sequence[Metric], path: Path) -> str | None:
    """Two panels: each proxy vs direct; egressd vs each peer. Normalised so > 1 = better."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no chart: {e}"
    main = [m for m in metrics if m.main and not m.sandbox]
    panel1 = [m for m in main if m.ratio_to_direct and m.median(DIRECT) is not None]
    panel2 = [
        m for m in main if m.median(EGRESSD) is not None and any(m.median(p) is not None for p in PEERS)
    ]
    if not panel1 and not panel2:
        return "no chart: no ratios"
    colours = {
        TINYPROXY: "#4c72b0",
        SQUID: "#55a868",
        MITMPROXY: "#c44e52",
        SRT: "#dd8452",
        EGRESSD: "#8172b2",
    }
    height = 1.6 + 0.42 * (len(panel1) * 4 + len(panel2) * 3) / 2.2
    fig, axes = plt.subplots(1, 2, figsize=(17, max(5.0, height)))
    for ax, rows, series, ref_label in (
        (axes[0], panel1, [TINYPROXY, SQUID, MITMPROXY, SRT, EGRESSD], "direct"),
        (axes[1], panel2, list(PEERS), "peer"),
    ):
        labels = [f"{m.workload.split('.')[0]}. {m.title}"[:60] for m in rows]
        n = len(series)
        width = 0.8 / n
        for i, target in enumerate(series):
            values = []
            for m in rows:
                v = (
                    performance(m, target, DIRECT)
                    if ref_label == "direct"
                    else performance(m, EGRESSD, target)
                )
                values.append(v if v is not None else float("nan"))
            positions = [y + (i - (n - 1) / 2) * width for y in range(len(rows))]
            name = LABELS[target] if ref_label == "direct" else f"egressd vs {LABELS[target]}"
            ax.barh(positions, values, height=width, color=colours[target], label=name)
        ax.axvline(1.0, color="black", linewidth=1)
        ax.set_xscale("log")
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.grid(axis="x", which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        if ref_label == "direct":
            ax.set_title("Each proxy relative to direct (1 = as good as no proxy; > 1 better)", fontsize=10)
        else:
            ax.set_title("egressd relative to each peer (> 1: egressd better)", fontsize=10)
        ax.set_xlabel("relative performance (median ratio; inverted where lower is better), log scale")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write(metrics: Sequence[Metric], meta: dict[str, Any], out: Path, *, with_chart: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if with_chart:
        problem = chart(metrics, out / "ratios.png")
        meta = {**meta, "chart": problem or "ratios.png"}
    (out / "results.json").write_text(json.dumps(to_json(metrics, meta), indent=2, default=str) + "\n")
    (out / "results.md").write_text(to_markdown(metrics, meta))
