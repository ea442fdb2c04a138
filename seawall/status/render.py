"""``seawall status`` as tables for a terminal (rich)."""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from seawall.status.fold import Decided, FleetStatus


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if abs(seconds) < 120:
        return f"{seconds:.1f}s ago"
    if abs(seconds) < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.0f}h ago"


def _opt(value: object) -> str:
    return "-" if value is None else str(value)


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def _when_decided(decided: Decided) -> str:
    text = _ago(decided.age_s)
    return f"[red]{text} (expired)[/]" if decided.expired else text


def _workers(status: FleetStatus) -> Table:
    table = _table(
        "workers", "worker", "pool", "state", "seen", "in flight", "run/wait", "KV", "limit", "GPUs"
    )
    for w in status.workers:
        state = "[green]alive[/]" if w.alive else "[red]stale[/]"
        if w.status not in (None, "serving"):
            state += f" ({w.status})"
        gpus = ", ".join(
            f"{g.index}: "
            + ("-" if g.temperature_c is None else f"{g.temperature_c:.0f}°C")
            + ("" if g.utilization_pct is None else f" {g.utilization_pct:.0f}%")
            + (" sim" if g.simulated else "")
            for g in w.gpus
        )
        table.add_row(
            escape(w.worker_id),
            escape(w.pool),
            state,
            _ago(w.last_seen_s),
            _opt(w.in_flight),
            "-" if w.running is None else f"{w.running}/{w.waiting}",
            "-" if w.kv_cache_usage is None else f"{w.kv_cache_usage:.0%}",
            _opt(w.batch_limit),
            escape(gpus) or "-",
        )
    return table


def _pools(status: FleetStatus) -> Table:
    table = _table(
        "pools", "pool", "workers alive", "in flight", "waiting", "degradation", "breaker"
    )
    for p in status.pools:
        table.add_row(
            escape(p.pool),
            f"{p.alive}/{p.workers}",
            str(p.in_flight),
            str(p.waiting),
            _opt(p.degradation),
            _opt(p.breaker),
        )
    return table


def _decisions(title: str, rows: Iterable[tuple[str, Decided]]) -> Table:
    """Breakers or degradation levels: scope, state, when, why."""
    table = _table(title, "scope", "state", "decided", "reason")
    for scope, decided in rows:
        table.add_row(
            escape(scope),
            escape(decided.summary),
            _when_decided(decided),
            escape(decided.reason),
        )
    return table


def _batch_limits(status: FleetStatus) -> Table:
    reported = {w.worker_id: w.batch_limit for w in status.workers}
    table = _table("batch limits", "worker", "limit", "reported", "decided", "reason")
    for b in status.batch_limits:
        table.add_row(
            escape(b.worker_id),
            str(b.limit),
            _opt(reported.get(b.worker_id)),
            _when_decided(b.decided),
            escape(b.decided.reason),
        )
    return table


def _overrides(status: FleetStatus) -> Table:
    table = _table("operators' overrides", "scope", "state", "issuer", "decided", "reason")
    for o in status.overrides:
        table.add_row(
            escape(o.scope),
            escape(o.decided.summary),
            escape(o.issuer),
            _when_decided(o.decided),
            escape(o.decided.reason),
        )
    return table


def _lags(status: FleetStatus) -> Table:
    table = _table("consumer lag", "group", "topic", "partitions", "committed", "end", "lag")
    for x in status.lags:
        table.add_row(
            escape(x.group),
            escape(x.topic),
            *(str(n) for n in (x.partitions, x.committed, x.end, x.lag)),
        )
    committing = {x.group for x in status.lags}
    for group in status.groups:
        if group not in committing:
            table.add_row(escape(group), "[dim](nothing committed)[/]", "", "", "", "")
    return table


def render(status: FleetStatus, console: Console) -> None:
    """The status as rich tables."""
    console.print(
        f"telemetry: last {status.window_s:g}s, {status.telemetry_events} records · "
        f"control state: newest decision {_ago(status.control_age_s)} "
        f"({status.control_events} events read)",
        highlight=False,
    )
    if status.control_refused:
        console.print(
            f"[red]{status.control_refused} control records refused[/] (not signed by a "
            "trusted key, or not their signer's to issue): the followers ignore them",
            highlight=False,
        )
    if status.invalid_records:
        console.print(f"[yellow]skipped {status.invalid_records} undecodable records[/]")
    tables = (
        _workers(status),
        _pools(status),
        _decisions("breakers", ((b.scope, b.decided) for b in status.breakers)),
        _decisions("degradation", ((d.scope, d.decided) for d in status.degradations)),
        _batch_limits(status),
        _overrides(status),
        _lags(status),
    )
    for table in tables:
        console.print(table if table.row_count else f"[dim]{table.title}: none[/]")
