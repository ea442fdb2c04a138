"""The controller's Prometheus metrics: every state it holds and the inputs behind it.

States are gauges per scope, refreshed after each evaluation from the engines of the
pools this instance owns; label sets of scopes that went away (a worker forgotten, a
pool moved to another controller instance) are removed, so that dashboards do not show
ghosts.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Gauge

from services.controller.engine import Output, PoolEngine
from services.controller.policy import Circuit

CIRCUIT_VALUES = {Circuit.CLOSED: 0, Circuit.HALF_OPEN: 1, Circuit.OPEN: 2}

BREAKER_STATE = Gauge(
    "seawall_controller_breaker_state",
    "Breaker circuit per scope: 0 closed, 1 half-open, 2 open",
    ["scope"],
)
BREAKER_LEVEL = Gauge(
    "seawall_controller_breaker_level",
    "Breaker action level per scope (0 none, 1 log, 2 rate limit, 3 reject new, 4 emergency)",
    ["scope"],
)
BREAKER_TRIPPED = Gauge(
    "seawall_controller_breaker_tripped",
    "1 for each cause (matrix row, heartbeat, failed probe) tripped in a scope",
    ["scope", "cause"],
)
DEGRADATION_LEVEL = Gauge(
    "seawall_controller_degradation_level", "Degradation level per pool (0-3)", ["scope"]
)
BATCH_LIMIT = Gauge(
    "seawall_controller_batch_limit", "Batch limit (in-flight cap) per worker", ["worker"]
)
BATCH_EWMA = Gauge(
    "seawall_controller_batch_latency_ewma_ms",
    "Latency EWMA the adaptive batch limit judges, per worker",
    ["worker"],
)
SIGNAL = Gauge(
    "seawall_controller_signal",
    "The policies' inputs at the last evaluation, per scope and signal "
    "(error rate, P99 ms, CPU %, GPU memory %, GPU temperature and their sample counts)",
    ["scope", "signal"],
)
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
    """Mirrors the engines' states into the gauges; drops label sets that went away."""

    def __init__(self) -> None:
        self._exported: dict[Gauge, set[tuple[str, ...]]] = {}

    def export(self, engines: Iterable[PoolEngine]) -> None:
        values: dict[Gauge, dict[tuple[str, ...], float]] = {}

        def put(gauge: Gauge, labels: tuple[str, ...], value: float) -> None:
            values.setdefault(gauge, {})[labels] = value

        pools = 0
        for engine in engines:
            pools += 1
            for scope, status in engine.breakers().items():
                put(BREAKER_STATE, (scope,), CIRCUIT_VALUES[status.circuit])
                put(BREAKER_LEVEL, (scope,), int(status.level))
                for cause in status.tripped:
                    put(BREAKER_TRIPPED, (scope, cause), 1)
            put(DEGRADATION_LEVEL, (engine.scope,), engine.degradation.level)
            for worker, (limit, ewma) in engine.batch_limits().items():
                put(BATCH_LIMIT, (worker,), limit)
                if ewma is not None:
                    put(BATCH_EWMA, (worker,), ewma)
            for scope, signals in engine.inputs.items():
                for signal, value in signals.items():
                    put(SIGNAL, (scope, signal), value)
        POOLS.set(pools)
        for gauge in {*values, *self._exported}:
            current = values.get(gauge, {})
            for labels in self._exported.get(gauge, set()) - current.keys():
                gauge.remove(*labels)
            for labels, value in current.items():
                gauge.labels(*labels).set(value)
            self._exported[gauge] = set(current)
