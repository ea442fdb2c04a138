"""The controller's gauges mirror the deciders' states and drop scopes that went away."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from schemas import TelemetryEvent
from services.controller.decider.config import DeciderConfig
from services.controller.decider.pool import PoolDecider
from services.controller.metrics import StateExporter
from tests.unit.controller.decider.test_pool import T0, engine_stats, gpu, heartbeat, report

pytestmark = pytest.mark.unit


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_states_and_inputs_are_exported_and_ghosts_removed() -> None:
    decider = PoolDecider("main", DeciderConfig(), T0)
    worker = "metrics-w1"
    scope = f"worker:{worker}"
    telemetry: list[TelemetryEvent] = [
        heartbeat(worker, T0),
        engine_stats(worker, T0, batch_limit=16),
        gpu(worker, T0, temperature_c=91.0),
        report(worker, T0, [100.0] * 30, errors=30),
    ]
    for event in telemetry:
        decider.observe(event, T0)
    decider.tick(T0 + 1)
    exporter = StateExporter(worker_signals=True)
    exporter.export([decider])

    limit, ewma = decider.batch_limits()[worker]
    assert sample("seawall_controller_batch_limit", worker=worker) == limit
    assert sample("seawall_controller_batch_latency_ewma_ms", worker=worker) == ewma
    assert sample("seawall_controller_breaker_state", scope=scope) == 2  # open
    assert sample("seawall_controller_breaker_level", scope=scope) == 1
    assert sample("seawall_controller_breaker_tripped", scope=scope, cause="error_rate") == 1
    assert sample("seawall_controller_degradation_level", scope="pool:main") == 3
    assert sample("seawall_controller_signal", scope=scope, signal="error_rate") == 1.0
    assert (
        sample("seawall_controller_signal", scope="pool:main", signal="ladder.gpu_temperature_c")
        == 91.0
    )

    decider.observe(heartbeat(worker, T0 + 2, status="stopped"), T0 + 2)
    exporter.export([decider])
    assert sample("seawall_controller_batch_limit", worker=worker) is None
    assert sample("seawall_controller_breaker_state", scope=scope) is None
    assert sample("seawall_controller_signal", scope=scope, signal="error_rate") is None
    assert sample("seawall_controller_breaker_state", scope="pool:main") == 2


def test_worker_signals_are_exported_only_when_asked_for() -> None:
    decider = PoolDecider("quiet", DeciderConfig(), T0)
    decider.observe(heartbeat("quiet-w1", T0), T0)
    decider.tick(T0 + 1)
    exporter = StateExporter()
    exporter.export([decider])
    assert sample("seawall_controller_breaker_state", scope="worker:quiet-w1") == 0
    assert (
        sample("seawall_controller_signal", scope="worker:quiet-w1", signal="cpu_percent") is None
    )
    assert sample("seawall_controller_signal", scope="pool:quiet", signal="cpu_percent") == 20.0
