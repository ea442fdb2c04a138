"""Adaptive batch limit per worker: seed 1's ``enhanced_adaptive_batch``, corrected.

The seed read an undefined ``SLA`` and ``current_bs``, indexed a pandas Series with
``[-1]`` (a label lookup, not the last element) and returned floats. Here, per latency
sample of the worker:

- EWMA of latency with span 50 (alpha = 2 / (span + 1)), in pandas' default
  ``adjust=True`` form, so the first samples are not biased towards zero;
- volatility = sample standard deviation of the last 30 raw latencies / EWMA (the seed
  took the std of the already smoothed series, which mostly measures its lag);
- adjusted SLA = SLA × (1 + volatility): a noisy worker is judged less eagerly;
- EWMA > adjusted SLA → limit × 0.7, rounded down, at least 4;
  EWMA < 0.8 × adjusted SLA → limit × 1.1, rounded up (so 4 grows to 5, not back to 4),
  at most 128 and never above the engine's ``max_num_seqs``; otherwise hold.

Nothing changes before 30 samples (the seed's rolling(30) is undefined until then), nor
within ``min_interval_s`` of the previous change, so the limit does not chase noise
and each change has time to show its effect. Factors are applied as exact fractions
(1.1 is 11/10: 10 × 1.1 must give 11, not 11.000000000000002 rounded up to 12).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from fractions import Fraction

from services.controller.policy.decision import Decision, DecisionKind, Evidence


@dataclass(frozen=True)
class BatchConfig:
    sla_ms: float = 1500.0
    """The fleet's P99 target (DESIGN, "The incident to beat")."""
    ewma_span: int = 50
    volatility_samples: int = 30
    shrink_factor: float = 0.7
    grow_factor: float = 1.1
    grow_below: float = 0.8
    """Grow only while the EWMA is under this fraction of the adjusted SLA."""
    floor: int = 4
    ceiling: int = 128
    min_interval_s: float = 5.0

    def __post_init__(self) -> None:
        if self.sla_ms <= 0:
            raise ValueError("sla_ms must be > 0")
        if self.ewma_span < 1 or self.volatility_samples < 2:
            raise ValueError("need ewma_span >= 1 and volatility_samples >= 2")
        if not (0 < self.shrink_factor < 1 < self.grow_factor):
            raise ValueError("need 0 < shrink_factor < 1 < grow_factor")
        if not 0 < self.grow_below <= 1:
            raise ValueError("grow_below must be in (0, 1]")
        if not 1 <= self.floor <= self.ceiling:
            raise ValueError("need 1 <= floor <= ceiling")
        if self.min_interval_s < 0:
            raise ValueError("min_interval_s must be >= 0")


def _sample_std(values: list[float]) -> float:
    """Sample standard deviation (n - 1, as pandas' ``rolling().std()``), two-pass in
    floats: ``statistics.stdev`` computes in exact fractions, far too slow per sample."""
    mean = math.fsum(values) / len(values)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _exact(factor: float) -> Fraction:
    return Fraction(factor).limit_denominator(10_000)


class AdaptiveBatchLimit:
    """The batch limit of one worker; ``observe`` each completed request's latency.

    The limit stays within [min(floor, cap), cap] with cap = min(ceiling,
    max_num_seqs): an engine configured below the floor is not asked for more than it
    can run. It starts at ``initial_limit`` (clamped), by default at the cap.
    """

    def __init__(
        self,
        scope: str,
        max_num_seqs: int,
        config: BatchConfig | None = None,
        initial_limit: int | None = None,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.scope = scope
        self.config = config or BatchConfig()
        self.cap = min(self.config.ceiling, max_num_seqs)
        self.floor = min(self.config.floor, self.cap)
        start = self.cap if initial_limit is None else initial_limit
        self._limit = max(self.floor, min(self.cap, start))
        self._alpha = 2.0 / (self.config.ewma_span + 1)
        self._weighted_sum = 0.0
        self._weight = 0.0
        self._recent: deque[tuple[float, float]] = deque(maxlen=self.config.volatility_samples)
        self._changed_at = -math.inf
        self._shrink = _exact(self.config.shrink_factor)
        self._grow = _exact(self.config.grow_factor)

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def ewma_ms(self) -> float | None:
        return self._weighted_sum / self._weight if self._weight else None

    def observe(self, now: float, latency_ms: float) -> Decision[int] | None:
        if not math.isfinite(latency_ms) or latency_ms < 0:
            raise ValueError(f"latency_ms must be finite and >= 0, got {latency_ms}")
        decay = 1.0 - self._alpha
        self._weighted_sum = latency_ms + decay * self._weighted_sum
        self._weight = 1.0 + decay * self._weight
        self._recent.append((now, latency_ms))
        cfg = self.config
        if (
            len(self._recent) < cfg.volatility_samples
            or now - self._changed_at < cfg.min_interval_s
        ):
            return None
        ewma = self._weighted_sum / self._weight
        std = _sample_std([latency for _, latency in self._recent])
        volatility = std / ewma if ewma else 0.0
        adjusted_sla = cfg.sla_ms * (1.0 + volatility)
        grow_below = cfg.grow_below * adjusted_sla
        if ewma > adjusted_sla:
            new = max(self.floor, math.floor(self._limit * self._shrink))
            limit_name, limit, sign = "adjusted_sla_ms", adjusted_sla, ">"
        elif ewma < grow_below:
            new = min(self.cap, math.ceil(self._limit * self._grow))
            limit_name, limit, sign = "grow_below_ms", grow_below, "<"
        else:
            return None
        if new == self._limit:
            return None
        previous, self._limit, self._changed_at = self._limit, new, now
        return Decision(
            scope=self.scope,
            kind=DecisionKind.BATCH_LIMIT,
            at=now,
            previous_state=previous,
            new_state=new,
            evidence=Evidence(
                reason=(
                    f"latency EWMA {ewma:.4g}ms {sign} {limit_name} {limit:.4g}ms "
                    f"(SLA {cfg.sla_ms:g}ms x sensitivity {1.0 + volatility:.3g}): "
                    f"limit {previous} -> {new}"
                ),
                window_s=now - self._recent[0][0],
                metrics={
                    "latency_ewma_ms": ewma,
                    "latency_std_ms": std,
                    "volatility": volatility,
                    "samples": float(len(self._recent)),
                },
                thresholds={
                    limit_name: limit,
                    "sla_ms": cfg.sla_ms,
                    "floor": float(self.floor),
                    "cap": float(self.cap),
                },
            ),
        )
