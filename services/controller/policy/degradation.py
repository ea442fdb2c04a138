"""The degradation ladder (DESIGN, "Degradation ladder"), per pool.

| rung | trigger (DESIGN)        | exit (chosen here)         | response                 |
|------|-------------------------|----------------------------|--------------------------|
| 1    | P99 > 2 s for 5 min     | P99 < 1.5 s held 5 min     | non-VIP to the small pool|
| 1    | preemptions > 1/s (1 min)| < 0.1/s held 2 min        | non-VIP to the small pool|
| 2    | error rate > 15% (1 min)| < 5% held 2 min            | cap long ``max_tokens``  |
| 3    | GPU temperature > 85 °C | < 75 °C held 3 min         | static canned replies    |

DESIGN gives only the triggers; the preemption trigger is added here. Preemptions are
how an engine says its KV cache cannot hold what it runs (vLLM evicts a running request
and recomputes it later): latency shows it only minutes later, once recomputation has
piled up, while admission's KV pacing should have kept it from happening at all. A pool
preempting more than once a second for a minute needs load taken off it, which is what
rung 1 does. The exits: rung 1 leaves at 1.5 s, the fleet's P99
target, so the small pool is released only once the big one meets the target again;
rung 2 mirrors the breaker's 5% recovery; rung 3 needs 10 °C of cooling so a GPU
hovering at its limit does not switch canned replies on and off. Temperature is the
window's maximum (one hot GPU is enough); P99 and error rate need 20 requests. The
level in force is the highest triggered rung.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from services.controller.policy.decision import Decision, DecisionKind, Evidence, Reading
from services.controller.policy.hysteresis import LatchSet, Threshold
from services.controller.policy.windows import GaugeWindow, RequestWindow


class Trigger(StrEnum):
    LATENCY_P99 = "latency_p99_ms"
    PREEMPTIONS = "preemptions_per_s"
    ERROR_RATE = "error_rate"
    GPU_TEMPERATURE = "gpu_temperature_c"


_RUNGS: Mapping[Trigger, int] = {
    Trigger.LATENCY_P99: 1,
    Trigger.PREEMPTIONS: 1,
    Trigger.ERROR_RATE: 2,
    Trigger.GPU_TEMPERATURE: 3,
}

SLOW_RUNG = Threshold(
    trip_above=2000.0,
    recover_below=1500.0,
    window_s=60.0,
    trip_hold_s=300.0,
    recover_hold_s=300.0,
    min_samples=20,
)
PREEMPTION_RUNG = Threshold(
    trip_above=1.0, recover_below=0.1, window_s=60.0, trip_hold_s=60.0, recover_hold_s=120.0
)
ERROR_RUNG = Threshold(
    trip_above=0.15, recover_below=0.05, window_s=60.0, recover_hold_s=120.0, min_samples=20
)
HOT_RUNG = Threshold(trip_above=85.0, recover_below=75.0, window_s=30.0, recover_hold_s=180.0)


@dataclass(frozen=True)
class DegradationConfig:
    latency_p99_ms: Threshold = SLOW_RUNG
    preemptions_per_s: Threshold = PREEMPTION_RUNG
    error_rate: Threshold = ERROR_RUNG
    gpu_temperature_c: Threshold = HOT_RUNG

    def rows(self) -> dict[Trigger, Threshold]:
        return {
            Trigger.LATENCY_P99: self.latency_p99_ms,
            Trigger.PREEMPTIONS: self.preemptions_per_s,
            Trigger.ERROR_RATE: self.error_rate,
            Trigger.GPU_TEMPERATURE: self.gpu_temperature_c,
        }


@dataclass(frozen=True)
class DegradationStatus:
    level: int = 0
    triggered: tuple[str, ...] = ()


def degradation_readings(
    config: DegradationConfig,
    now: float,
    requests: RequestWindow,
    gpu_temperature: GaugeWindow,
    preemptions: GaugeWindow,
) -> dict[Trigger, Reading | None]:
    """``preemptions`` holds, per engine report, the preemptions since that engine's
    previous report."""
    return {
        Trigger.LATENCY_P99: requests.stats(now, config.latency_p99_ms.window_s).p99_reading(),
        Trigger.PREEMPTIONS: preemptions.stats(
            now, config.preemptions_per_s.window_s
        ).rate_reading(),
        Trigger.ERROR_RATE: requests.counts(now, config.error_rate.window_s).error_rate_reading(),
        Trigger.GPU_TEMPERATURE: gpu_temperature.stats(
            now, config.gpu_temperature_c.window_s
        ).max_reading(),
    }


class DegradationLadder:
    def __init__(self, scope: str, config: DegradationConfig | None = None) -> None:
        self.scope = scope
        self.config = config or DegradationConfig()
        self._rungs = LatchSet(self.config.rows())
        self._status = DegradationStatus()

    @property
    def status(self) -> DegradationStatus:
        return self._status

    def restore(self, status: DegradationStatus) -> None:
        """Resume from the status a previous controller had in force, without a
        decision; the rungs in ``status.triggered`` must recover in full again."""
        self._rungs.restore(status.triggered)
        self._status = status

    def evaluate(
        self, now: float, readings: Mapping[Trigger, Reading | None]
    ) -> Decision[DegradationStatus] | None:
        """Feed the triggers (see ``degradation_readings``); a missing one is quiet."""
        evidence = self._rungs.update(now, readings)
        if not evidence:
            return None
        triggered = self._rungs.tripped
        previous = self._status
        self._status = DegradationStatus(
            level=max((_RUNGS[name] for name in triggered), default=0), triggered=triggered
        )
        return Decision(
            scope=self.scope,
            kind=DecisionKind.DEGRADATION,
            at=now,
            previous_state=previous,
            new_state=self._status,
            evidence=Evidence.combine(evidence),
        )
