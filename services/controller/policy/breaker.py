"""The breaker matrix (DESIGN, "Breaker matrix"), per scope: a worker or a pool.

| row                  | trips when           | recovers when        | level          |
|----------------------|----------------------|----------------------|----------------|
| ``error_rate``       | > 30% over 5 min     | < 5% held 2 min      | 1 log only     |
| ``latency_p99_ms``   | P99 > 2000 ms (1 min)| < 800 ms held 5 min  | 2 rate limit   |
| ``cpu_percent``      | mean > 90% (30 s)    | < 70% held 10 min    | 3 reject new   |
| ``gpu_memory_percent``| mean > 85% (30 s)   | < 60% held 3 min     | 4 emergency    |
| ``engine_stalled_s`` | > 10 s (latest, 30 s)| < 1 s held 10 s      | 3 reject new   |

The last row is seawall's, not DESIGN's: a worker whose engine has produced no token
for 10 s while holding requests (``EngineStats.stalled_s``) is isolated and alerted on
(``engine_stalled``) well before its own watchdog restarts it (``engine_stall_s``, 30 s).

Each row is a hysteresis ``Latch``: it trips strictly past its threshold and recovers
only after its recovery condition held for the full duration. Error rate and latency
need ``min_samples`` requests in their window before they can trip (20 by default: a
P99 or a rate of a handful of requests is noise), and the error rate trips only when
the Wilson lower bound of the window's rate passes the threshold (``error_rate_z``).
On the rate alone, the first 20-odd completions of a worker failing 20 % of its
requests passed 30 % in 6 runs of 21 (its failures end early, so they complete first)
and isolated it. Simulated on this module with that bias (2 requests a second, failures
done in 0.1 s, successes in 1 s; ``tests/unit/controller/policy/test_breaker_evidence.py``):
on the rate alone a 20 % worker tripped in 34 runs of 100 within 5 minutes; with the
bound at z = 2.5, in none of 300 over 10 minutes, while a 50 % worker tripped in every
run, after 22 completions at the median (72 at the 95th percentile).
Heartbeat loss (``on_liveness``) is one more cause. The scope's circuit:

- ``closed``: nothing tripped;
- ``open``: some cause tripped; ``level`` is the highest level among the causes. On a
  worker scope admission isolates the worker (removes it from its pool) for heartbeat
  loss, errors, a failed probe or level 3+, and paces it to a share of its slots for
  latency alone (level 2); see ``admission.policy.routing.worker_share``. On a pool scope the
  level says what admission does (log, rate limit, reject new, restart);
- ``half_open``: every cause recovered; the scope keeps its last level and admits
  ``half_open_probes`` probe requests (the shell feeds each completed request of the
  scope to ``record_probe``). All succeed: closed. One fails: open again, with the
  ``half_open_probe`` cause, which clears after ``probe_retry_s``; then half-open again.
  A row tripping while half-open opens the circuit as well. Half-open keeps the level so
  that the guard stays in place around the probes; one-shot actions (restarting a
  worker) belong to the transition into open, not to every state at that level.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from schemas.control import BreakerLevel
from services.controller.policy.decision import Decision, DecisionKind, Evidence, Reading
from services.controller.policy.heartbeat import Liveness
from services.controller.policy.hysteresis import LatchSet, Threshold
from services.controller.policy.windows import GaugeWindow, RequestWindow


class Signal(StrEnum):
    ERROR_RATE = "error_rate"
    LATENCY_P99 = "latency_p99_ms"
    CPU = "cpu_percent"
    GPU_MEMORY = "gpu_memory_percent"
    STALLED = "engine_stalled_s"


HEARTBEAT = "heartbeat"
PROBE = "half_open_probe"

_ROW_LEVELS: Mapping[str, BreakerLevel] = {
    Signal.ERROR_RATE: BreakerLevel.LOG,
    Signal.LATENCY_P99: BreakerLevel.RATE_LIMIT,
    Signal.CPU: BreakerLevel.REJECT_NEW,
    Signal.GPU_MEMORY: BreakerLevel.EMERGENCY,
    Signal.STALLED: BreakerLevel.REJECT_NEW,
}


class Circuit(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


ERROR_RATE_ROW = Threshold(
    trip_above=0.30, recover_below=0.05, window_s=300.0, recover_hold_s=120.0, min_samples=20
)
LATENCY_ROW = Threshold(
    trip_above=2000.0, recover_below=800.0, window_s=60.0, recover_hold_s=300.0, min_samples=20
)
CPU_ROW = Threshold(trip_above=90.0, recover_below=70.0, window_s=30.0, recover_hold_s=600.0)
GPU_MEMORY_ROW = Threshold(trip_above=85.0, recover_below=60.0, window_s=30.0, recover_hold_s=180.0)
STALLED_ROW = Threshold(trip_above=10.0, recover_below=1.0, window_s=30.0, recover_hold_s=10.0)


@dataclass(frozen=True)
class BreakerConfig:
    error_rate: Threshold = ERROR_RATE_ROW
    latency_p99_ms: Threshold = LATENCY_ROW
    cpu_percent: Threshold = CPU_ROW
    gpu_memory_percent: Threshold = GPU_MEMORY_ROW
    engine_stalled_s: Threshold = STALLED_ROW
    error_rate_z: float = 2.5
    """One-sided z of the Wilson lower bound that must pass the error-rate trip (a
    chance of 6 in 1,000 per look that a worker at the threshold shows more): the row
    is looked at again with every report, so one look's confidence must be high."""
    half_open_probes: int = 3
    probe_retry_s: float = 60.0
    heartbeat_level: BreakerLevel = BreakerLevel.LOG
    """Isolation is the open circuit itself; this is only what else to do about it."""

    def __post_init__(self) -> None:
        if self.half_open_probes < 1:
            raise ValueError(f"half_open_probes must be >= 1, got {self.half_open_probes}")
        if self.probe_retry_s < 0:
            raise ValueError(f"probe_retry_s must be >= 0, got {self.probe_retry_s}")

    def rows(self) -> dict[Signal, Threshold]:
        return {
            Signal.ERROR_RATE: self.error_rate,
            Signal.LATENCY_P99: self.latency_p99_ms,
            Signal.CPU: self.cpu_percent,
            Signal.GPU_MEMORY: self.gpu_memory_percent,
            Signal.STALLED: self.engine_stalled_s,
        }


@dataclass(frozen=True)
class BreakerStatus:
    """Maps one to one onto ``schemas.control.BreakerState``."""

    circuit: Circuit = Circuit.CLOSED
    level: BreakerLevel = BreakerLevel.NONE
    tripped: tuple[str, ...] = ()
    probe_requests: int = 0


def breaker_readings(
    config: BreakerConfig,
    now: float,
    requests: RequestWindow,
    cpu_percent: GaugeWindow,
    gpu_memory_percent: GaugeWindow,
    engine_stalled_s: GaugeWindow | None = None,
) -> dict[Signal, Reading | None]:
    """The matrix's signals over each row's window: error rate and P99 of the requests,
    the mean of each gauge (one hot sample must not trip a row), and the latest stall a
    worker reported (a duration: the newest is what holds; a pool has none)."""
    return {
        Signal.ERROR_RATE: requests.counts(now, config.error_rate.window_s).error_rate_reading(
            config.error_rate_z
        ),
        Signal.LATENCY_P99: requests.stats(now, config.latency_p99_ms.window_s).p99_reading(),
        Signal.CPU: cpu_percent.stats(now, config.cpu_percent.window_s).mean_reading(),
        Signal.GPU_MEMORY: gpu_memory_percent.stats(
            now, config.gpu_memory_percent.window_s
        ).mean_reading(),
        Signal.STALLED: None
        if engine_stalled_s is None
        else engine_stalled_s.stats(now, config.engine_stalled_s.window_s).latest_reading(),
    }


class Breaker:
    def __init__(self, scope: str, config: BreakerConfig | None = None) -> None:
        self.scope = scope
        self.config = config or BreakerConfig()
        self._rows = LatchSet(self.config.rows())
        self._lost = False
        self._probe_failed_at: float | None = None
        self._probe_level = BreakerLevel.NONE
        self._probe_successes = 0
        self._status = BreakerStatus()

    @property
    def status(self) -> BreakerStatus:
        return self._status

    def evaluate(
        self, now: float, readings: Mapping[Signal, Reading | None]
    ) -> Decision[BreakerStatus] | None:
        """Feed the matrix's signals (see ``breaker_readings``); a missing one is quiet."""
        evidence = self._rows.update(now, readings)
        if self._probe_failed_at is not None:
            elapsed = now - self._probe_failed_at
            if elapsed >= self.config.probe_retry_s:
                self._probe_failed_at = None
                evidence.append(
                    Evidence(
                        reason=f"{elapsed:g}s since the failed probe, ready to probe again",
                        metrics={"since_probe_failure_s": elapsed},
                        thresholds={"probe_retry_s": self.config.probe_retry_s},
                        hold_s=elapsed,
                    )
                )
        return self._settle(now, evidence)

    def restore(self, status: BreakerStatus, now: float) -> None:
        """Resume from the status a previous controller had in force (its last event),
        without a decision: the causes named in ``status.tripped`` are tripped again and
        must recover in full (holds start at ``now``); a failed probe waits its
        ``probe_retry_s`` again from ``now``."""
        self._rows.restore(status.tripped)
        self._lost = HEARTBEAT in status.tripped
        probe_failed = PROBE in status.tripped
        self._probe_failed_at = now if probe_failed else None
        self._probe_level = status.level if probe_failed else BreakerLevel.NONE
        self._probe_successes = 0
        self._status = status

    def on_liveness(self, decision: Decision[Liveness]) -> Decision[BreakerStatus] | None:
        """Apply a ``HeartbeatMonitor`` decision about this scope."""
        if decision.scope != self.scope:
            raise ValueError(f"liveness of {decision.scope} fed to the breaker of {self.scope}")
        self._lost = decision.new_state is Liveness.LOST
        return self._settle(decision.at, [decision.evidence])

    def record_probes(self, now: float, passed: int, failed: int) -> Decision[BreakerStatus] | None:
        """Requests completed while half-open, reported together (one interval's): a
        failure among them fails the probe, whatever their order; ignored in other
        states."""
        if failed:
            return self.record_probe(now, False)
        if self._status.circuit is not Circuit.HALF_OPEN or passed <= 0:
            return None
        needed = self.config.half_open_probes - self._probe_successes
        self._probe_successes += max(0, min(passed, needed) - 1)
        return self.record_probe(now, True)

    def record_probe(self, now: float, ok: bool) -> Decision[BreakerStatus] | None:
        """The outcome of a request completed while half-open; ignored in other states."""
        if self._status.circuit is not Circuit.HALF_OPEN:
            return None
        wanted = self.config.half_open_probes
        if not ok:
            self._probe_failed_at, self._probe_level = now, self._status.level
            failure = Evidence(
                reason=f"half-open probe failed after {self._probe_successes} of {wanted} passed",
                metrics={"probe_successes": self._probe_successes, "probe_failures": 1},
                thresholds={"probe_requests": wanted, "probe_retry_s": self.config.probe_retry_s},
            )
            return self._settle(now, [failure])
        self._probe_successes += 1
        if self._probe_successes < wanted:
            return None
        success = Evidence(
            reason=f"all {wanted} half-open probes succeeded",
            metrics={"probe_successes": self._probe_successes},
            thresholds={"probe_requests": wanted},
        )
        return self._settle(now, [success], probes_passed=True)

    def _level_of(self, cause: str) -> BreakerLevel:
        if cause == HEARTBEAT:
            return self.config.heartbeat_level
        if cause == PROBE:
            return self._probe_level  # the level the failed probe was guarding
        return _ROW_LEVELS[cause]

    def _settle(
        self, now: float, evidence: Sequence[Evidence], *, probes_passed: bool = False
    ) -> Decision[BreakerStatus] | None:
        causes: tuple[str, ...] = self._rows.tripped
        causes += (HEARTBEAT,) if self._lost else ()
        causes += (PROBE,) if self._probe_failed_at is not None else ()
        previous = self._status
        if causes:
            level = max(self._level_of(cause) for cause in causes)
            new = BreakerStatus(Circuit.OPEN, level, causes)
        elif previous.circuit is Circuit.CLOSED or probes_passed:
            new = BreakerStatus()
        else:
            new = BreakerStatus(Circuit.HALF_OPEN, previous.level, (), self.config.half_open_probes)
        if new == previous:
            return None
        if new.circuit is not previous.circuit:
            self._probe_successes = 0
        self._status = new
        return Decision(
            scope=self.scope,
            kind=DecisionKind.BREAKER,
            at=now,
            previous_state=previous,
            new_state=new,
            evidence=Evidence.combine(evidence),
        )
