"""The incident benchmark's figures: per priority class and window, from what each
client saw, and the plot.

Latency is arrival → the reply at the client (end to end, non-streaming answers of
customer-service length) over the requests that were not refused outright: answers,
and requests whose client gave up (timed out, or expired in a queue), which count at
the timeout — what their clients waited. Refusals (quota, breaker) and canned replies
are counted by reason, not timed. Success: an answer from a model (plain or degraded)
before the timeout. Goodput: such answers within the SLO, per second of the window.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from _common import ratio, summary
from _incident_des import Outcome
from _incident_scenario import CLASSES, Scenario
from _incident_seawall import Change, Trace

ROLLING_WINDOW_S = 5.0
ROLLING_STEP_S = 1.0
COLORS = {"vip": "tab:red", "standard": "tab:blue", "bulk": "tab:green"}


def timed(outcomes: Sequence[Outcome]) -> list[float]:
    return [o.latency for o in outcomes if o.latency is not None and o.kind != "static"]


def figures(outcomes: Sequence[Outcome], span_s: float, slo_s: float) -> dict[str, Any]:
    """One class in one window."""
    latency = summary(timed(outcomes))
    answered = [o for o in outcomes if o.answered]
    good = sum(1 for o in answered if o.latency is not None and o.latency <= slo_s)
    refused = Counter(o.reason for o in outcomes if not o.answered)
    degraded = Counter(o.reason for o in answered if o.kind == "degraded")
    n = len(outcomes)
    return {
        "requests": n,
        "p50_s": latency["p50"],
        "p99_s": latency["p99"],
        "max_s": latency["max"],
        "success_rate": len(answered) / n if n else None,
        "goodput_per_s": good / span_s,
        "within_slo_share": good / n if n else None,
        "not_answered_by_reason": dict(sorted(refused.items())),
        "degraded_by_reason": dict(sorted(degraded.items())),
        "long_prompts": sum(1 for o in outcomes if o.arrival.long),
        "long_prompts_answered": sum(1 for o in answered if o.arrival.long),
    }


def per_window(s: Scenario, outcomes: Sequence[Outcome]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, (lo, hi) in s.windows().items():
        inside = [o for o in outcomes if lo <= o.arrival.at < hi]
        out[name] = {
            c.value: figures([o for o in inside if o.arrival.priority is c], hi - lo, s.slo_s)
            for c in CLASSES
        }
        out[name]["all"] = figures(inside, hi - lo, s.slo_s)
    return out


RATIO_KEYS = ("p50_s", "p99_s", "success_rate", "goodput_per_s")


def ratios(
    b: Mapping[str, Mapping[str, Mapping[str, Any]]],
    a: Mapping[str, Mapping[str, Mapping[str, Any]]],
) -> dict[str, dict[str, dict[str, float | None]]]:
    """(b) / (a) per window, class and figure."""
    return {w: {c: {k: ratio(b[w][c][k], a[w][c][k]) for k in RATIO_KEYS} for c in b[w]} for w in b}


def rolling_p99(s: Scenario, outcomes: Sequence[Outcome]) -> dict[str, list[tuple[float, float]]]:
    """Per class: (window end, P99) over requests arriving in the last ``ROLLING_WINDOW_S``."""
    out: dict[str, list[tuple[float, float]]] = {}
    for c in CLASSES:
        mine = sorted(
            (o.arrival.at, o.latency)
            for o in outcomes
            if o.arrival.priority is c and o.latency is not None and o.kind != "static"
        )
        series: list[tuple[float, float]] = []
        t = ROLLING_WINDOW_S
        lo = hi = 0
        while t <= s.end:
            while lo < len(mine) and mine[lo][0] < t - ROLLING_WINDOW_S:
                lo += 1
            while hi < len(mine) and mine[hi][0] < t:
                hi += 1
            p99 = summary([lat for _, lat in mine[lo:hi]])["p99"]
            if p99 is not None:
                series.append((t, float(p99)))
            t += ROLLING_STEP_S
        out[c.value] = series
    return out


def notable(changes: Sequence[Change], after_s: float) -> list[Change]:
    """The decisions worth a line on the plot: pool-scope changes, and each worker's
    breaker opening (batch limits are drawn as a series instead)."""
    return [
        c
        for c in changes
        if c.at >= after_s
        and (c.key.endswith(("pool:main", "pool:small")) or c.summary.startswith("breaker open"))
        and not c.key.startswith("batch_limit/")
    ]


def plot(
    s: Scenario,
    runs: Mapping[str, Sequence[Outcome]],
    trace: Trace,
    steady_p99: Mapping[str, float | None],
    path: Path,
    title: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        4, 1, figsize=(11, 13), sharex=True, gridspec_kw={"height_ratios": [3, 3, 1.6, 1.6]}
    )
    titles = {"uncontrolled": "(a) no control plane", "seawall": "(b) seawall, every defence on"}
    series = {name: rolling_p99(s, outcomes) for name, outcomes in runs.items()}
    top = 1.15 * max(y for run in series.values() for xy in run.values() for _, y in xy)
    for ax, name in zip(axes[:2], runs, strict=True):
        for c, xy in series[name].items():
            ax.plot(
                *zip(*xy, strict=True),
                color=COLORS[c],
                label=f"{c} rolling P99 ({ROLLING_WINDOW_S:g} s)",
            )
        base = steady_p99.get(name)
        if base is not None:
            ax.axhline(base, color="grey", linestyle=":", label=f"steady P99, all ({base:.2f} s)")
        ax.axhline(s.slo_s, color="grey", linestyle="--", linewidth=0.8, label=f"SLO {s.slo_s:g} s")
        ax.set_ylim(0, top)
        ax.set_ylabel("latency (s)")
        ax.set_title(titles[name], fontsize=10, loc="left")
    _mark_decisions(axes[1], notable(trace.changes, s.warmup_s), top)
    for ax in axes:
        ax.axvspan(s.burst_start, s.burst_end, color="orange", alpha=0.12, label="burst")
        ax.grid(True, alpha=0.3)
    for ax in axes[:2]:
        ax.legend(fontsize=7, loc="upper right")
    _traffic_panel(axes[2], s, runs["seawall"])
    _control_panel(axes[3], trace)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _mark_decisions(ax: Any, marks: Sequence[Change], top: float) -> None:
    for i, change in enumerate(marks):
        pool = "/pool:" in change.key
        ax.axvline(change.at, color="black" if pool else "purple", alpha=0.5, linewidth=0.8)
        if pool:
            label = f"{change.key.split('/')[-1]}: {change.summary}"
            ax.annotate(label, (change.at, top * (0.92 - 0.08 * (i % 6))), fontsize=7)
    ax.plot([], [], color="purple", alpha=0.5, label="a worker's breaker opens")
    ax.plot([], [], color="black", alpha=0.5, label="pool decision")


def _traffic_panel(ax: Any, s: Scenario, outcomes: Sequence[Outcome]) -> None:
    arrived, refused = _per_second(outcomes, s.end)
    ax.plot(range(len(arrived)), arrived, color="grey", label="arrivals per s")
    ax.plot(range(len(refused)), refused, color="tab:brown", label="(b) refused by quota per s")
    ax.set_ylabel("requests / s")
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title("the same traffic in both runs", fontsize=10, loc="left")


def _control_panel(ax: Any, trace: Trace) -> None:
    ts = [x["t"] for x in trace.samples]
    steps = (
        ("open_worker_breakers", "purple", "main workers with an open breaker"),
        ("pool_breaker_level", "tab:orange", "pool:main breaker level (0: closed)"),
        ("degradation_level", "black", "degradation level (main)"),
    )
    for key, color, label in steps:
        ax.step(ts, [x[key] for x in trace.samples], where="post", color=color, label=label)
    ax.set_ylabel("count, level")
    twin = ax.twinx()
    means = [x["batch_limit_mean"] for x in trace.samples]
    twin.step(ts, means, where="post", color="teal", linestyle="--", label="mean batch limit")
    twin.set_ylabel("batch limit (main)")
    twin.set_ylim(0, 70)
    handles, labels = ax.get_legend_handles_labels()
    more_handles, more_labels = twin.get_legend_handles_labels()
    ax.legend(handles + more_handles, labels + more_labels, fontsize=7, loc="center right")
    ax.set_title("(b) the control plane's state", fontsize=10, loc="left")
    ax.set_xlabel("virtual time (s)")


def _per_second(outcomes: Sequence[Outcome], end: float) -> tuple[list[int], list[int]]:
    """Arrivals, and those refused by quota, per second of arrival."""
    arrived, refused = [0] * (int(end) + 1), [0] * (int(end) + 1)
    for o in outcomes:
        arrived[int(o.arrival.at)] += 1
        refused[int(o.arrival.at)] += o.reason == "quota_exceeded"
    return arrived, refused


def control_summary(s: Scenario, trace: Trace) -> dict[str, Any]:
    """What the controller decided after the warm-up, counted; and how far admission's
    backlog and the main pool's batch limits went."""
    after = [c for c in trace.changes if c.at >= s.warmup_s]
    limits: dict[str, int] = {}
    moves: Counter[str] = Counter()
    for c in trace.changes:
        if c.key.startswith("batch_limit/"):
            new = int(c.summary.split()[-1])
            old = limits.get(c.key)
            if c.at >= s.warmup_s and old is not None:
                moves["grow" if new > old else "shrink"] += 1
            limits[c.key] = new
    lo, hi = s.windows()["burst"]
    burst = [x for x in trace.samples if lo <= x["t"] < hi]
    return {
        "pool_decisions": [
            {"at_s": c.at, "key": c.key, "decision": c.summary, "reason": c.reason}
            for c in after
            if "/pool:" in c.key
        ],
        "worker_breaker_decisions": dict(
            Counter(c.summary for c in after if c.key.startswith("breaker/worker:"))
        ),
        "batch_limit_moves": dict(moves),
        "min_mean_batch_limit_in_burst": min((x["batch_limit_mean"] for x in burst), default=None),
        "max_backlog": {
            c.value: max((x["backlog"][c.value] for x in trace.samples), default=0) for c in CLASSES
        },
        "late_answers": trace.late_answers,
    }
