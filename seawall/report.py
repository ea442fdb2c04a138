"""The post-incident report of a recording (``seawall report run.jsonl --out DIR``):
a Markdown file with a summary table first, then PNG plots, each with what it shows.

Everything is computed from the recording (``seawall.recording``), in windows of
``window_s`` seconds:

- latency percentiles (start of work to reply) by class over time, with the control
  decisions overlaid;
- the preempted/running ratio against latency (vLLM V1 preempts where V0 swapped:
  DESIGN's "swapped/running");
- prompt and generation token rates;
- the head-of-line blocking index, (max - min) / mean response time per window;
- the Pearson correlation of each signal (running, waiting, preemptions, KV usage, GPU
  temperature and power, token rates) with the windows' P99 latency;
- SLO attainment and goodput per class (a request within its class's latency SLO, not
  failed);
- the first minute after each breaker trip: the share of requests that succeeded;
- degradation coverage: the share of requests served while the ladder was engaged, and
  the time spent at each level;
- requests per kWh from the GPUs' power (labelled simulated when the readings were).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from schemas import EngineStats, RequestCompleted, WorkerReport
from seawall.recording import Recording
from seawall.replay import live_decisions

DEFAULT_SLO_MS = {"vip": 2_000.0, "standard": 5_000.0, "bulk": 20_000.0}
"""Latency SLO per class (start of work to the reply), unless the command says others."""


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0-1) by nearest rank; ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Pearson's r of paired samples; ``None`` with fewer than three or no variance."""
    if len(xs) < 3 or len(xs) != len(ys):
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


@dataclass
class Window:
    start: float
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    all_latencies: list[float] = field(default_factory=list)
    running: list[float] = field(default_factory=list)
    waiting: list[float] = field(default_factory=list)
    kv: list[float] = field(default_factory=list)
    temperature: list[float] = field(default_factory=list)
    power_w: list[float] = field(default_factory=list)
    preemptions: float = 0.0
    prompt_tokens: float = 0.0
    completion_tokens: float = 0.0

    def signals(self, window_s: float) -> dict[str, float | None]:
        running = _mean(self.running)
        return {
            "running": running,
            "waiting": _mean(self.waiting),
            "preempted_per_s": self.preemptions / window_s,
            "preempted_running_ratio": (self.preemptions / window_s / running if running else None),
            "kv_cache_usage": _mean(self.kv),
            "gpu_temperature_c": _mean(self.temperature),
            "gpu_power_w": _mean(self.power_w),
            "prompt_tokens_per_s": self.prompt_tokens / window_s,
            "generation_tokens_per_s": self.completion_tokens / window_s,
        }

    @property
    def hol_index(self) -> float | None:
        """(max - min) / mean response time: how unequally requests were served."""
        xs = self.all_latencies
        if len(xs) < 2 or statistics.fmean(xs) == 0:
            return None
        return (max(xs) - min(xs)) / statistics.fmean(xs)


@dataclass
class Analysis:
    start: float
    window_s: float
    windows: list[Window]
    completions: list[RequestCompleted]
    decisions: list[tuple[float, str, str]]
    """(time, key, state) of the controller's decisions."""
    slo_ms: dict[str, float]
    energy_kwh: float
    simulated_power: bool

    def by_class(self) -> dict[str, list[RequestCompleted]]:
        out: defaultdict[str, list[RequestCompleted]] = defaultdict(list)
        for c in self.completions:
            out[c.priority.value].append(c)
        return dict(out)

    def slo(self) -> dict[str, dict[str, float]]:
        """Per class: requests, within SLO (share), failed, goodput (per second)."""
        span = max(self.window_s, len(self.windows) * self.window_s)
        out = {}
        for cls, done in sorted(self.by_class().items()):
            slo = self.slo_ms.get(cls, max(self.slo_ms.values()))
            good = [c for c in done if c.error is None and c.latency_ms <= slo]
            out[cls] = {
                "requests": float(len(done)),
                "failed": float(sum(1 for c in done if c.error is not None)),
                "slo_ms": slo,
                "attainment": len(good) / len(done),
                "goodput_per_s": len(good) / span,
                "p50_ms": percentile([c.latency_ms for c in done], 0.5) or 0.0,
                "p99_ms": percentile([c.latency_ms for c in done], 0.99) or 0.0,
            }
        return out

    def correlations(self) -> dict[str, float | None]:
        """Each signal's Pearson r with the windows' P99 latency."""
        rows = [(w.signals(self.window_s), percentile(w.all_latencies, 0.99)) for w in self.windows]
        out: dict[str, float | None] = {}
        for name in rows[0][0] if rows else ():
            pairs = [(s[name], p99) for s, p99 in rows if s[name] is not None and p99 is not None]
            out[name] = pearson([float(x) for x, _ in pairs], [float(y) for _, y in pairs])  # type: ignore[arg-type]
        return out

    def after_trips(self) -> list[tuple[float, str, int, float | None]]:
        """Per breaker trip (closed → open): when, which key, requests finished in the
        next minute and the share of them that succeeded."""
        out = []
        last: dict[str, str] = {}
        for t, key, state in self.decisions:
            was = last.get(key, "closed")
            last[key] = state
            if (
                not key.startswith("breaker/")
                or not state.startswith("open")
                or was.startswith("open")
            ):
                continue
            pool = (
                key.removeprefix("breaker/").split(":", 1)[1]
                if key.startswith("breaker/pool:")
                else None
            )
            done = [
                c
                for c in self.completions
                if t <= c.at < t + 60 and (pool is None or c.pool == pool)
            ]
            ok = sum(1 for c in done if c.error is None)
            out.append((t, key, len(done), ok / len(done) if done else None))
        return out

    def degradation(self) -> tuple[float, dict[int, float]]:
        """The share of requests finished while a ladder was engaged (any pool), and
        seconds spent at each level (summed over pools)."""
        levels: defaultdict[str, list[tuple[float, int]]] = defaultdict(list)
        for t, key, state in self.decisions:
            if key.startswith("degradation/"):
                levels[key].append((t, int(state.split()[1])))
        end = self.start + len(self.windows) * self.window_s
        seconds: defaultdict[int, float] = defaultdict(float)
        engaged: list[tuple[float, float]] = []
        for changes in levels.values():
            for (t, level), nxt in zip(changes, [*changes[1:], (end, 0)], strict=True):
                seconds[level] += max(0.0, nxt[0] - t)
                if level > 0:
                    engaged.append((t, nxt[0]))
        served = sum(1 for c in self.completions if any(a <= c.at < b for a, b in engaged))
        share = served / len(self.completions) if self.completions else 0.0
        return share, dict(seconds)


def analyse(
    recording: Recording, window_s: float = 10.0, slo_ms: dict[str, float] | None = None
) -> Analysis:
    entries = recording.entries
    start = float(recording.header["since"])
    first = min((e.t for e in entries), default=start)
    start = max(start, first)
    end = max((e.t for e in entries), default=start)
    n = max(1, math.ceil((end - start) / window_s) + 1)
    windows = [Window(start + i * window_s) for i in range(n)]

    def window(t: float) -> Window:
        return windows[min(n - 1, max(0, int((t - start) // window_s)))]

    completions = [
        e.value
        for e in recording.of("completion")
        if isinstance(e.value, RequestCompleted) and not e.value.repeat
    ]
    for c in completions:
        w = window(c.at)
        w.latencies[c.priority.value].append(c.latency_ms)
        w.all_latencies.append(c.latency_ms)
    previous_preempted: dict[str, int] = {}
    energy_j = 0.0
    last_power: dict[tuple[str, int], tuple[float, float]] = {}
    simulated = False
    for entry in recording.of("telemetry"):
        report = entry.value
        if not isinstance(report, WorkerReport):
            continue
        w = window(entry.t)
        stats: EngineStats | None = report.engine
        if stats is not None:
            w.running.append(stats.running)
            w.waiting.append(stats.waiting)
            w.kv.append(stats.kv_cache_usage)
            before = previous_preempted.get(report.worker_id)
            if before is not None and stats.preempted_total >= before:
                w.preemptions += stats.preempted_total - before
            previous_preempted[report.worker_id] = stats.preempted_total
        for gpu in report.gpus:
            simulated = simulated or gpu.simulated
            if gpu.temperature_c is not None:
                w.temperature.append(gpu.temperature_c)
            if gpu.power_w is None:  # not reported (a MIG instance): no energy from it
                continue
            w.power_w.append(gpu.power_w)
            key = (report.worker_id, gpu.gpu_index)
            if key in last_power:
                t0, p0 = last_power[key]
                energy_j += (p0 + gpu.power_w) / 2 * max(0.0, entry.t - t0)
            last_power[key] = (entry.t, gpu.power_w)
        if report.requests is not None:
            w.prompt_tokens += report.requests.prompt_tokens
            w.completion_tokens += report.requests.completion_tokens
    decisions = [(d.t, d.key, d.state) for d in live_decisions(recording)]
    return Analysis(
        start,
        window_s,
        windows,
        completions,
        decisions,
        {**DEFAULT_SLO_MS, **(slo_ms or {})},
        energy_j / 3.6e6,
        simulated,
    )


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "—" if value is None else format(value, spec)


def write_report(analysis: Analysis, out: Path) -> Path:
    """The Markdown report and its plots into ``out``; the report's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    a = analysis
    xs = [w.start - a.start for w in a.windows]
    lines: list[str] = ["# Post-incident report", ""]
    total = len(a.completions)
    failed = sum(1 for c in a.completions if c.error is not None)
    everything = [c.latency_ms for c in a.completions]
    simulated = " (simulated GPU power)" if a.simulated_power else ""
    span = len(a.windows) * a.window_s
    per_kwh = total / a.energy_kwh if a.energy_kwh > 0 else None
    trips = a.after_trips()
    coverage, seconds = a.degradation()
    lines += [
        "## Summary",
        "",
        "| measure | value |",
        "|---|---|",
        f"| time covered | {span:.0f} s in {len(a.windows)} windows of {a.window_s:g} s |",
        f"| requests finished | {total} ({failed} failed) |",
        f"| latency P50 / P99 | {_fmt(percentile(everything, 0.5), '.0f')} / "
        f"{_fmt(percentile(everything, 0.99), '.0f')} ms |",
        f"| controller decisions | {len(a.decisions)} |",
        f"| breaker trips | {len(trips)} |",
        f"| requests served while degraded | {coverage:.1%} |",
        f"| energy | {a.energy_kwh * 1000:.3f} Wh{simulated} |",
        f"| requests per kWh | {_fmt(per_kwh, ',.0f')}{simulated} |",
        "",
        "### SLO attainment and goodput per class",
        "",
        "| class | requests | failed | SLO (ms) | within SLO | goodput (req/s) | P50 (ms) "
        "| P99 (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cls, row in a.slo().items():
        lines.append(
            f"| {cls} | {row['requests']:.0f} | {row['failed']:.0f} | {row['slo_ms']:.0f} | "
            f"{row['attainment']:.1%} | {row['goodput_per_s']:.2f} | {row['p50_ms']:.0f} | "
            f"{row['p99_ms']:.0f} |"
        )
    lines += ["", "### The first minute after each breaker trip", ""]
    if trips:
        lines += ["| at (s) | breaker | requests in the minute | succeeded |", "|---|---|---|---|"]
        lines += [
            f"| {t - a.start:.0f} | {key} | {n} | {_fmt(share, '.1%')} |"
            for t, key, n, share in trips
        ]
    else:
        lines.append("No breaker tripped.")
    lines += ["", "### Degradation coverage", ""]
    lines.append(
        ", ".join(f"level {lvl}: {s:.0f} s" for lvl, s in sorted(seconds.items()))
        or "The ladder was never engaged."
    )
    lines += ["", "### Correlation of each signal with P99 latency (Pearson's r, per window)", ""]
    lines += ["| signal | r |", "|---|---|"]
    correlations = a.correlations()
    lines += [f"| {name} | {_fmt(r)} |" for name, r in correlations.items()]

    # -- plots ------------------------------------------------------------------------
    def save(fig: object, name: str, title: str, what: str) -> None:
        fig.savefig(out / name, dpi=90)  # type: ignore[attr-defined]
        plt.close(fig)  # type: ignore[arg-type]
        lines.extend(["", f"## {title}", "", what, "", f"![{title}]({name})"])

    fig, ax = plt.subplots(figsize=(10, 4))
    classes = sorted({c for w in a.windows for c in w.latencies})
    for cls in classes:
        for q, style in ((0.5, ":"), (0.99, "-")):
            ys = [percentile(w.latencies.get(cls, []), q) for w in a.windows]
            ax.plot(
                xs,
                [math.nan if y is None else y for y in ys],
                style,
                label=f"{cls} P{int(q * 100)}",
            )
    for t, key, state in a.decisions:
        if not state.startswith(("closed", "limit")) and not state.startswith("level 0"):
            ax.axvline(t - a.start, color="red", alpha=0.3)
            ax.text(
                t - a.start,
                ax.get_ylim()[1] * 0.95,
                f"{key.split('/')[0]}: {state.split()[0]}",
                rotation=90,
                fontsize=6,
                va="top",
            )
    ax.set_xlabel("seconds")
    ax.set_ylabel("latency (ms)")
    ax.legend(fontsize=7)
    save(
        fig,
        "latency.png",
        "Latency by class, with the decisions",
        "P50 (dotted) and P99 (solid) per window; red lines: breaker opens, ladder rungs.",
    )

    fig, ax = plt.subplots(figsize=(10, 4))
    ratio = [w.signals(a.window_s)["preempted_running_ratio"] for w in a.windows]
    p99 = [percentile(w.all_latencies, 0.99) for w in a.windows]
    ax.plot(xs, [math.nan if r is None else r for r in ratio], label="preempted / running (per s)")
    ax2 = ax.twinx()
    ax2.plot(xs, [math.nan if p is None else p for p in p99], "k--", label="P99 latency (ms)")
    ax.set_xlabel("seconds")
    ax.legend(loc="upper left", fontsize=7)
    ax2.legend(loc="upper right", fontsize=7)
    save(
        fig,
        "preemption.png",
        "Preempted/running ratio against latency",
        "Preemptions per second per running request (vLLM V1 preempts where V0 swapped).",
    )

    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(xs, [w.prompt_tokens / a.window_s for w in a.windows], label="prompt tokens/s")
    ax.plot(xs, [w.completion_tokens / a.window_s for w in a.windows], label="generation tokens/s")
    ax.set_xlabel("seconds")
    ax.legend(fontsize=7)
    save(fig, "tokens.png", "Token rates", "Prompt and generation tokens per second, fleet-wide.")

    fig, ax = plt.subplots(figsize=(10, 3))
    hol = [w.hol_index for w in a.windows]
    ax.plot(xs, [math.nan if h is None else h for h in hol])
    ax.set_xlabel("seconds")
    ax.set_ylabel("(max - min) / mean")
    save(
        fig,
        "hol.png",
        "Head-of-line blocking index",
        "(max - min) / mean response time per window: high when some requests wait behind others.",
    )

    fig, ax = plt.subplots(figsize=(8, 4))
    names = [n for n, r in correlations.items() if r is not None]
    ax.barh(names, [correlations[n] or 0.0 for n in names])
    ax.set_xlim(-1, 1)
    ax.set_xlabel("Pearson r with P99 latency")
    fig.tight_layout()
    save(
        fig,
        "correlation.png",
        "Which signals moved with latency",
        "Pearson's r of each signal's window mean with the window's P99 latency.",
    )

    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
