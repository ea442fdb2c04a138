"""The controller's Prometheus metrics: every state it holds and the inputs behind it.

States are per scope: a pool's breaker, degradation level and the signals its policies
read; each worker's breaker and batch limit, and its signals too where
``controller_worker_signals`` asks for them (a dozen series per worker then, so tens of
thousands for a large fleet). They are not kept as labelled gauges (setting each child
after every evaluation, and rendering children one lock at a time on each scrape, took
a third of a 1,000-worker controller's time): after each evaluation ``StateExporter``
takes a snapshot of plain tuples, and ``STATE`` — one collector in the registry —
renders the latest snapshot of every live exporter when Prometheus scrapes. A scope
that went away (a worker forgotten, a pool moved to another controller instance) is
simply absent from the next snapshot: no ghosts.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator

from prometheus_client import REGISTRY, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from schemas import Alert
from services.controller.decider.pool import Output, PoolDecider
from services.controller.policy import Circuit

CIRCUIT_VALUES = {Circuit.CLOSED: 0, Circuit.HALF_OPEN: 1, Circuit.OPEN: 2}

STATE_FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "seawall_controller_breaker_state": (
        "Breaker circuit per scope: 0 closed, 1 half-open, 2 open",
        ("scope",),
    ),
    "seawall_controller_breaker_level": (
        "Breaker action level per scope (0 none, 1 log, 2 rate limit, 3 reject new, 4 emergency)",
        ("scope",),
    ),
    "seawall_controller_breaker_tripped": (
        "1 for each cause (matrix row, heartbeat, failed probe) tripped in a scope",
        ("scope", "cause"),
    ),
    "seawall_controller_degradation_level": ("Degradation level per pool (0-3)", ("scope",)),
    "seawall_controller_batch_limit": ("Batch limit (in-flight cap) per worker", ("worker",)),
    "seawall_controller_batch_latency_ewma_ms": (
        "Latency EWMA the adaptive batch limit judges, per worker",
        ("worker",),
    ),
    "seawall_controller_alert_active": (
        "1 per alert firing in this instance's pools (Prometheus' SeawallControllerAlert "
        "forwards each to Alertmanager)",
        ("rule", "scope", "pool", "severity"),
    ),
    "seawall_controller_signal": (
        "The policies' inputs at the last evaluation, per scope and signal "
        "(error rate, P99 ms, CPU %, GPU memory %, GPU temperature and their sample counts)",
        ("scope", "signal"),
    ),
}
Snapshot = dict[str, list[tuple[tuple[str, ...], float]]]
"""Family name → (label values, value) of each series."""


class _StateCollector(Collector):
    """Renders the latest snapshot of every live ``StateExporter`` at scrape time (in
    the metrics server's thread: it reads only snapshots, which are never changed
    once taken — an export replaces its exporter's reference)."""

    def __init__(self) -> None:
        self.exporters: weakref.WeakSet[StateExporter] = weakref.WeakSet()

    def collect(self) -> Iterator[Metric]:
        snapshots = [e.snapshot for e in list(self.exporters)]
        for name, (documentation, labels) in STATE_FAMILIES.items():
            family = GaugeMetricFamily(name, documentation, labels=list(labels))
            for snapshot in snapshots:
                for values, value in snapshot.get(name, ()):
                    family.add_metric(list(values), value)
            yield family


STATE = _StateCollector()
REGISTRY.register(STATE)

POOLS = Gauge("seawall_controller_pools", "Pools this controller instance decides for")
TELEMETRY = Counter(
    "seawall_controller_telemetry_total",
    "Telemetry records read, by type and outcome (used, stale, invalid, failed)",
    ["type", "outcome"],
)
EVENTS = Counter(
    "seawall_controller_events_total",
    "Control events published, by kind and cause (change, republish)",
    ["kind", "cause"],
)
ALERTS_FIRING = Gauge(
    "seawall_alerts_firing", "Alerts firing in the pools this controller instance decides for"
)
TICK_SECONDS = Gauge(
    "seawall_controller_tick_seconds", "Duration of the last evaluation of every pool"
)


def count_output(telemetry_type: str | None, output: Output) -> None:
    if telemetry_type is not None:
        TELEMETRY.labels(telemetry_type, "stale" if output.stale else "used").inc()
    for event in output.changes:
        EVENTS.labels(event.kind, "change").inc()
    for event in output.republished:
        EVENTS.labels(event.kind, "republish").inc()


class StateExporter:
    """Takes the deciders' states as a snapshot for ``STATE`` to render; the workers'
    own policy inputs only with ``worker_signals`` (``controller_worker_signals``)."""

    def __init__(self, *, worker_signals: bool = False) -> None:
        self.snapshot: Snapshot = {}
        self._worker_signals = worker_signals
        STATE.exporters.add(self)

    def export(self, deciders: Iterable[PoolDecider], alerts: Iterable[Alert] = ()) -> None:
        snapshot: Snapshot = {name: [] for name in STATE_FAMILIES}
        breaker_state = snapshot["seawall_controller_breaker_state"]
        breaker_level = snapshot["seawall_controller_breaker_level"]
        tripped = snapshot["seawall_controller_breaker_tripped"]
        limits = snapshot["seawall_controller_batch_limit"]
        ewmas = snapshot["seawall_controller_batch_latency_ewma_ms"]
        signals = snapshot["seawall_controller_signal"]
        pools = 0
        for decider in deciders:
            pools += 1
            for scope, status in decider.breakers().items():
                breaker_state.append(((scope,), CIRCUIT_VALUES[status.circuit]))
                breaker_level.append(((scope,), int(status.level)))
                tripped.extend(((scope, cause), 1) for cause in status.tripped)
            snapshot["seawall_controller_degradation_level"].append(
                ((decider.scope,), decider.degradation.level)
            )
            for worker, (limit, ewma) in decider.batch_limits().items():
                limits.append(((worker,), limit))
                if ewma is not None:
                    ewmas.append(((worker,), ewma))
            for scope, inputs in decider.inputs.items():
                if scope == decider.scope or self._worker_signals:
                    signals.extend(((scope, signal), value) for signal, value in inputs.items())
        snapshot["seawall_controller_alert_active"] = [
            ((a.rule, a.scope, a.pool or "", a.severity), 1) for a in alerts
        ]
        POOLS.set(pools)
        self.snapshot = snapshot
