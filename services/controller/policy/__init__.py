"""The controller's pure policy cores: no Kafka, no faust, no clock reads.

Every method takes ``now`` (seconds of the injected clock). Each core keeps its state per
scope and returns a ``Decision`` only when that state changes, with the ``Evidence``
(window, metrics, thresholds, hold) that caused it; the controller's shell feeds them
telemetry, publishes decisions as control events and re-publishes the state in force.
"""

from services.controller.policy.batch import AdaptiveBatchLimit, BatchConfig, Samples
from services.controller.policy.breaker import (
    Breaker,
    BreakerConfig,
    BreakerStatus,
    Circuit,
    Signal,
    breaker_readings,
)
from services.controller.policy.decision import Decision, DecisionKind, Evidence, Reading
from services.controller.policy.degradation import (
    DegradationConfig,
    DegradationLadder,
    DegradationStatus,
    Trigger,
    degradation_readings,
)
from services.controller.policy.heartbeat import HeartbeatConfig, HeartbeatMonitor, Liveness
from services.controller.policy.hysteresis import HoldTimer, Latch, LatchSet, Threshold
from services.controller.policy.shares import ShareAlert, ShareAlertConfig
from services.controller.policy.windows import (
    GaugeStats,
    GaugeWindow,
    RequestStats,
    RequestWindow,
    ShareStats,
    ShareWindow,
)

__all__ = [
    "AdaptiveBatchLimit",
    "BatchConfig",
    "Breaker",
    "BreakerConfig",
    "BreakerStatus",
    "Circuit",
    "Decision",
    "DecisionKind",
    "DegradationConfig",
    "DegradationLadder",
    "DegradationStatus",
    "Evidence",
    "GaugeStats",
    "GaugeWindow",
    "HeartbeatConfig",
    "HeartbeatMonitor",
    "HoldTimer",
    "Latch",
    "LatchSet",
    "Liveness",
    "Reading",
    "RequestStats",
    "RequestWindow",
    "Samples",
    "ShareAlert",
    "ShareAlertConfig",
    "ShareStats",
    "ShareWindow",
    "Signal",
    "Threshold",
    "Trigger",
    "breaker_readings",
    "degradation_readings",
]
