"""``seawall alerts``: the controller's alerts, for operators.

Reads ``llm.alerts`` from the beginning with no consumer group (it changes nothing on the
broker), keeps the latest record per fingerprint, prints each alert as it fired or
resolved (re-publications of a firing alert are not printed again), then the alerts
active now: firing, and re-published within their ``valid_for_s`` — a firing alert whose
controller stopped re-publishing it is shown as stale, not silently dropped. ``--all``
also lists the alerts that resolved; ``--follow`` keeps printing until Ctrl-C.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from schemas import Alert
from seawall.events import evidence_text, tail
from seawall_client.serde import ALERT, DecodeError, decode
from services.common.bus import topics_of
from services.common.settings import CommonSettings

_COLOURS = {"critical": "red", "warning": "yellow", "info": "cyan"}


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S")


def stale(alert: Alert, now: float) -> bool:
    """Firing, but not re-published for longer than it may be trusted."""
    return alert.status == "firing" and now >= alert.last_seen + alert.valid_for_s


def format_alert(alert: Alert) -> str:
    """An alert's change as two lines of rich markup: what and when, then the evidence."""
    colour = "green" if alert.status == "resolved" else _COLOURS[alert.severity]
    head = (
        f"[dim]{_when(alert.last_seen)}[/] [{colour}]{alert.status.upper()}[/] "
        f"[bold]{escape(alert.rule)}[/] {escape(alert.scope)} "
        f"[dim]{alert.severity}, fired {alert.count}x since {_when(alert.first_seen)}[/]"
    )
    evidence = alert.evidence
    return (
        f"{head}\n    {escape(alert.summary)}: {escape(evidence.reason)} "
        f"[dim]({escape(evidence_text(evidence))})[/]"
    )


class AlertView:
    """The tail's state, without I/O: feed it records, print what it returns."""

    def __init__(self, show_resolved: bool = False) -> None:
        self.show_resolved = show_resolved
        self.latest: dict[str, Alert] = {}
        self.invalid = 0

    def feed(
        self, raw: bytes | None, headers: Sequence[tuple[str, bytes]] | None = None
    ) -> str | None:
        """The markup to print for an alert record (``headers``: unused; alerts are
        not signed)."""
        try:
            alert = decode(ALERT, raw)
        except DecodeError as e:
            self.invalid += 1
            return f"[yellow]skipped a record that is not an alert ({escape(e.reason)})[/]"
        before = self.latest.get(alert.fingerprint)
        if before is not None and before.last_seen > alert.last_seen:
            return None  # an older record read late
        self.latest[alert.fingerprint] = alert
        changed = before is None or (before.status, before.count, before.severity) != (
            alert.status,
            alert.count,
            alert.severity,
        )
        return format_alert(alert) if changed else None

    def summary(self, now: float) -> Table:
        shown = sorted(
            (a for a in self.latest.values() if a.status == "firing" or self.show_resolved),
            key=lambda a: (
                a.status != "firing",
                -["info", "warning", "critical"].index(a.severity),
                a.rule,
                a.scope,
            ),
        )
        active = sum(1 for a in shown if a.status == "firing" and not stale(a, now))
        title = f"alerts active ({active})" + (", and resolved" if self.show_resolved else "")
        table = Table(title=title, title_justify="left")
        for column in ("severity", "rule", "scope", "since", "last seen", "count", "summary"):
            table.add_column(column, overflow="fold")
        for a in shown:
            if a.status == "resolved":
                status = f"[green]resolved {_when(a.last_seen)}[/]"
            elif stale(a, now):
                status = f"[red]{_when(a.last_seen)} (stale: not re-published)[/]"
            else:
                status = _when(a.last_seen)
            table.add_row(
                f"[{_COLOURS[a.severity]}]{a.severity}[/]",
                escape(a.rule),
                escape(a.scope),
                _when(a.first_seen),
                status,
                str(a.count),
                escape(a.summary),
            )
        return table


def run_alerts(
    settings: CommonSettings, show_resolved: bool, follow: bool, console: Console
) -> int:
    """Print the alerts' changes, then those active; the exit status: 0 done, 1 no broker
    or no alerts topic."""
    try:
        topic = topics_of(settings).alerts
        return asyncio.run(tail(settings, topic, AlertView(show_resolved), follow, console))
    except KeyboardInterrupt:
        return 0
