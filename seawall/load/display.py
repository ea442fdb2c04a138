"""How ``seawall load`` shows its figures: a live panel while it runs, tables at the end."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table

from schemas import ReplyStatus
from seawall.load.stats import ALL, Live, Quantiles, Summary


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def live_panel(figures: Live, duration_s: float, title: str) -> RenderableType:
    grid = Table.grid(padding=(0, 2))
    for _ in range(4):
        grid.add_column(justify="right")
    grid.add_row(
        "elapsed", f"{figures.elapsed_s:.0f}/{duration_s:.0f} s",
        "submitted", str(figures.submitted),
    )  # fmt: skip
    grid.add_row("in flight", str(figures.in_flight), "done", str(figures.done))
    grid.add_row(
        "send rate", f"{figures.send_rate:.1f}/s", "reply rate", f"{figures.done_rate:.1f}/s"
    )
    grid.add_row(
        "P99 latency", f"{_ms(figures.p99_ms)} ms",
        "rejected", f"[yellow]{figures.rejected}[/]" if figures.rejected else "0",
    )  # fmt: skip
    if figures.lost:
        grid.add_row("lost", f"[red]{figures.lost}[/]", "", "")
    return Panel(grid, title=title, expand=False)


def summary_view(summary: Summary) -> RenderableType:
    head = (
        f"{summary.submitted} submitted, {summary.terminal_replies} terminal replies, "
        f"{summary.lost} lost, {summary.retried} retried, {summary.duplicates} duplicates "
        f"dropped; in "
        f"{summary.elapsed_s:.1f} s: {summary.throughput_rps:.2f} replies/s, "
        f"{summary.goodput_rps:.2f} served/s, {summary.tokens_per_s:,.0f} tokens/s"
    )
    seen = set().union(*(cls.by_status for cls in summary.classes.values()))
    statuses = [s for s in [*(r.value for r in ReplyStatus), "lost"] if s == "ok" or s in seen]
    counts = Table(title="requests by priority class", min_width=40)
    times = Table(title="served requests: TTFT and latency (ms)")
    counts.add_column("class")
    times.add_column("class")
    for name in ["sent", *statuses]:
        counts.add_column(name, justify="right")
    for kind in ("TTFT", "latency"):
        for q in ("P50", "P95", "P99"):
            times.add_column(f"{kind} {q}", justify="right")
    for name, cls in summary.classes.items():
        if name == ALL:
            counts.add_section()
            times.add_section()
        counts.add_row(name, str(cls.submitted), *(str(cls.by_status.get(s, 0)) for s in statuses))
        times.add_row(name, *_quantiles(cls.ttft_ms), *_quantiles(cls.latency_ms))
    parts: list[RenderableType] = [head, counts, times]
    for title, what, tally in (
        ("rejections by reason", "reason", summary.rejections_by_reason),
        ("lost requests by cause", "cause", summary.lost_by_cause),
    ):
        if tally:
            table = Table(title=title)
            table.add_column(what)
            table.add_column("count", justify="right")
            for name, n in sorted(tally.items(), key=lambda kv: -kv[1]):
                table.add_row(name, str(n))
            parts.append(table)
    return Group(*parts)


def _quantiles(q: Quantiles) -> tuple[str, str, str]:
    return _ms(q.p50), _ms(q.p95), _ms(q.p99)
