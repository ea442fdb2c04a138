"""Adaptive batch limit per worker: seed 1's ``enhanced_adaptive_batch``, corrected.

The seed read an undefined ``SLA`` and ``current_bs``, indexed a pandas Series with
``[-1]`` (a label lookup, not the last element) and returned floats. Here, per
``Samples`` of the worker — the requests one report interval finished, as a count, a
mean and a sum of squared deviations (one request is a ``Samples`` of one):

- EWMA of latency with span 50 (alpha = 2 / (span + 1)), in pandas' default
  ``adjust=True`` form, so the first samples are not biased towards zero; ``n``
  requests of mean ``m`` weigh as ``n`` samples of value ``m`` (the order within an
  interval is not reported: exact for one request, the mean's EWMA for more);
- volatility = sample standard deviation of the latest reports holding at least 30
  requests (exactly the last 30 when each holds one; pooled without loss of precision,
  Chan's parallel formula) / EWMA (the seed took the std of the already smoothed
  series, which mostly measures its lag);
- adjusted SLA = SLA × (1 + volatility): a noisy worker is judged less eagerly;
- EWMA > adjusted SLA → limit × 0.7, rounded down, at least 4;
  EWMA < 0.8 × adjusted SLA → limit × 1.1, rounded up (so 4 grows to 5, not back to 4),
  at most 128 and never above the engine's ``max_num_seqs``; otherwise hold.

The latency of a whole request grows with its output length, so a fleet of long
answers reads as slow even when every token comes on time, and a burst of long prompts
that stalls every decode behind its prefill barely moves it. Two per-token signals carry
that pressure, each an EWMA of the same span against its own SLO (``None``: not used):
time to first token (``ttft_slo_ms``: the prefill queue) and inter-token latency
(``itl_slo_ms``: the step time every running request pays, VIP's included). The limit
shrinks when *any* signal is over its target and grows only when *every* one is under
``grow_below`` of it; the evidence names the signal that decided.

The engine's own reports carry the rest of the pressure (``observe_engine``). A
preemption means the worker's KV cache could not hold what it was given (vLLM evicts a
running request to recompute it later, the costliest way to wait): the limit shrinks at
once, without waiting for latencies to show it, and does not grow for
``preemption_hold_s``. A waiting queue that stayed non-empty for ``queue_hold_s`` means
the engine already holds more than it runs: a larger limit would only lengthen that
queue, so the limit does not grow while it lasts.

Nothing changes before 30 requests (the seed's rolling(30) is undefined until then), nor
within ``min_interval_s`` of the previous change, so the limit does not chase noise
and each change has time to show its effect. Factors are applied as exact fractions
(1.1 is 11/10: 10 × 1.1 must give 11, not 11.000000000000002 rounded up to 12).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

from services.controller.policy.decision import Decision, DecisionKind, Evidence


@dataclass(frozen=True)
class BatchConfig:
    sla_ms: float = 1500.0
    """The fleet's P99 target (DESIGN, "The incident to beat")."""
    ttft_slo_ms: float | None = None
    itl_slo_ms: float | None = None
    ewma_span: int = 50
    volatility_samples: int = 30
    shrink_factor: float = 0.7
    grow_factor: float = 1.1
    grow_below: float = 0.8
    """Grow only while the EWMA is under this fraction of the adjusted SLA."""
    floor: int = 4
    ceiling: int = 128
    min_interval_s: float = 5.0
    preemption_hold_s: float = 30.0
    queue_hold_s: float = 5.0

    def __post_init__(self) -> None:
        if self.sla_ms <= 0:
            raise ValueError("sla_ms must be > 0")
        if any(v is not None and v <= 0 for v in (self.ttft_slo_ms, self.itl_slo_ms)):
            raise ValueError("ttft_slo_ms and itl_slo_ms must be > 0 (or None)")
        if self.ewma_span < 1 or self.volatility_samples < 2:
            raise ValueError("need ewma_span >= 1 and volatility_samples >= 2")
        if not (0 < self.shrink_factor < 1 < self.grow_factor):
            raise ValueError("need 0 < shrink_factor < 1 < grow_factor")
        if not 0 < self.grow_below <= 1:
            raise ValueError("grow_below must be in (0, 1]")
        if not 1 <= self.floor <= self.ceiling:
            raise ValueError("need 1 <= floor <= ceiling")
        if min(self.min_interval_s, self.preemption_hold_s, self.queue_hold_s) < 0:
            raise ValueError("min_interval_s, preemption_hold_s and queue_hold_s must be >= 0")


@dataclass(frozen=True)
class Samples:
    """Requests a worker finished together (one report interval): their latencies as a
    count, mean and sum of squared deviations from that mean (``m2``), and the means of
    the per-token signals over the requests that had them."""

    count: int
    latency_mean_ms: float
    latency_m2: float = 0.0
    ttft_count: int = 0
    ttft_mean_ms: float = 0.0
    itl_count: int = 0
    itl_mean_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.ttft_count <= self.count:
            raise ValueError("need count >= 1 and 0 <= ttft_count <= count")
        if not 0 <= self.itl_count <= self.count:
            raise ValueError("need 0 <= itl_count <= count")
        for name in ("latency_mean_ms", "latency_m2", "ttft_mean_ms", "itl_mean_ms"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {value}")

    @classmethod
    def one(
        cls, latency_ms: float, ttft_ms: float | None = None, itl_ms: float | None = None
    ) -> Samples:
        """One request: its latency, and where known its time to first token and mean
        inter-token latency."""
        return cls(
            1,
            latency_ms,
            ttft_count=0 if ttft_ms is None else 1,
            ttft_mean_ms=ttft_ms or 0.0,
            itl_count=0 if itl_ms is None else 1,
            itl_mean_ms=itl_ms or 0.0,
        )


def _pooled_std(parts: Iterable[tuple[int, float, float]]) -> float:
    """Sample standard deviation (n - 1, as pandas' ``rolling().std()``) of groups given
    as (count, mean, m2), combined with Chan et al.'s parallel formula: no sum of
    squares, so no cancellation between large, close latencies."""
    n, mean, m2 = 0, 0.0, 0.0
    for count, part_mean, part_m2 in parts:
        total = n + count
        delta = part_mean - mean
        mean += delta * count / total
        m2 += part_m2 + delta * delta * n * count / total
        n = total
    return math.sqrt(max(0.0, m2) / (n - 1)) if n > 1 else 0.0


def _exact(factor: float) -> Fraction:
    return Fraction(factor).limit_denominator(10_000)


class _Ewma:
    """pandas' adjusted EWMA (``adjust=True``): unbiased from the first sample."""

    def __init__(self, alpha: float) -> None:
        self._decay = 1.0 - alpha
        self._weighted_sum = 0.0
        self._weight = 0.0

    def add(self, value: float, n: int = 1) -> None:
        """``n`` samples of ``value``: as ``n`` calls of one, in closed form."""
        decay_n = self._decay**n
        weight = float(n) if self._decay == 1.0 else (1.0 - decay_n) / (1.0 - self._decay)
        self._weighted_sum = value * weight + decay_n * self._weighted_sum
        self._weight = weight + decay_n * self._weight

    @property
    def value(self) -> float | None:
        return self._weighted_sum / self._weight if self._weight else None


class AdaptiveBatchLimit:
    """The batch limit of one worker; ``observe`` the requests it finished.

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
        alpha = 2.0 / (self.config.ewma_span + 1)
        self._latency = _Ewma(alpha)
        self._token_signals = {
            name: _Ewma(alpha)
            for name, slo in (("ttft", self.config.ttft_slo_ms), ("itl", self.config.itl_slo_ms))
            if slo is not None
        }
        self._recent: deque[tuple[float, Samples]] = deque()
        self._recent_count = 0
        self._changed_at = -math.inf
        self._preempted_at = -math.inf
        self._queued_since: float | None = None
        self._shrink = _exact(self.config.shrink_factor)
        self._grow = _exact(self.config.grow_factor)

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def ewma_ms(self) -> float | None:
        return self._latency.value

    def observe(self, now: float, samples: Samples) -> Decision[int] | None:
        """Requests the worker finished (a report interval's, or one)."""
        self._latency.add(samples.latency_mean_ms, samples.count)
        self._recent.append((now, samples))
        self._recent_count += samples.count
        while self._recent_count - self._recent[0][1].count >= self.config.volatility_samples:
            self._recent_count -= self._recent.popleft()[1].count
        for name, count, mean in (
            ("ttft", samples.ttft_count, samples.ttft_mean_ms),
            ("itl", samples.itl_count, samples.itl_mean_ms),
        ):
            signal = self._token_signals.get(name)
            if signal is not None and count:
                signal.add(mean, count)
        cfg = self.config
        if (
            self._recent_count < cfg.volatility_samples
            or now - self._changed_at < cfg.min_interval_s
        ):
            return None
        ewma = self._latency.value
        assert ewma is not None  # a sample was just added
        std = _pooled_std((p.count, p.latency_mean_ms, p.latency_m2) for _, p in self._recent)
        volatility = std / ewma if ewma else 0.0
        adjusted_sla = cfg.sla_ms * (1.0 + volatility)
        # (signal, its EWMA, its target, how the target reads in the evidence)
        signals = [("latency", ewma, adjusted_sla, "adjusted_sla_ms")]
        for name, slo in (("ttft", cfg.ttft_slo_ms), ("itl", cfg.itl_slo_ms)):
            value = self._token_signals[name].value if name in self._token_signals else None
            if slo is not None and value is not None:
                signals.append((name, value, slo, f"{name}_slo_ms"))
        over = [sig for sig in signals if sig[1] > sig[2]]
        if over:
            name, value, limit, limit_name = max(over, key=lambda sig: sig[1] / sig[2])
            new = max(self.floor, math.floor(self._limit * self._shrink))
            sign = ">"
        elif not self._engine_full(now) and all(
            sig[1] < cfg.grow_below * sig[2] for sig in signals
        ):
            name, value, target, target_name = max(signals, key=lambda sig: sig[1] / sig[2])
            limit, limit_name = cfg.grow_below * target, f"grow_below_{target_name}"
            new = min(self.cap, math.ceil(self._limit * self._grow))
            sign = "<"
        else:
            return None
        metrics = {
            "latency_ewma_ms": ewma,
            "latency_std_ms": std,
            "volatility": volatility,
            "samples": float(self._recent_count),
        }
        thresholds = {
            "sla_ms": cfg.sla_ms,
            "floor": float(self.floor),
            "cap": float(self.cap),
            limit_name: limit,
        }
        for sig_name, sig_value, target, target_name in signals[1:]:
            metrics[f"{sig_name}_ewma_ms"] = sig_value
            thresholds[target_name] = target
        reason = (
            f"{name} EWMA {value:.4g}ms {sign} {limit_name} {limit:.4g}ms "
            f"(SLA {cfg.sla_ms:g}ms x sensitivity {1.0 + volatility:.3g})"
        )
        return self._change(now, new, reason, now - self._recent[0][0], metrics, thresholds)

    def observe_engine(
        self, now: float, preempted: int, waiting: int, kv_cache_usage: float
    ) -> Decision[int] | None:
        """One report of the worker's engine (its ``EngineStats``): ``preempted``
        requests since its previous report, ``waiting`` in its queue now. Shrinks on a
        preemption."""
        if waiting <= 0:
            self._queued_since = None
        elif self._queued_since is None:
            self._queued_since = now
        if preempted <= 0:
            return None
        self._preempted_at = now
        if now - self._changed_at < self.config.min_interval_s:
            return None
        new = max(self.floor, math.floor(self._limit * self._shrink))
        reason = (
            f"{preempted} preemptions since the engine's previous report "
            f"(KV cache {kv_cache_usage:.0%} used, {waiting} waiting)"
        )
        metrics = {
            "preemptions": float(preempted),
            "kv_cache_usage": kv_cache_usage,
            "waiting": float(waiting),
        }
        thresholds = {"floor": float(self.floor), "cap": float(self.cap)}
        return self._change(now, new, reason, 0.0, metrics, thresholds)

    def _engine_full(self, now: float) -> bool:
        """Whether the engine's reports forbid growth (see the module docstring)."""
        cfg = self.config
        queued = self._queued_since is not None and now - self._queued_since >= cfg.queue_hold_s
        return queued or now - self._preempted_at < cfg.preemption_hold_s

    def _change(
        self,
        now: float,
        new: int,
        reason: str,
        window_s: float,
        metrics: dict[str, float],
        thresholds: dict[str, float],
    ) -> Decision[int] | None:
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
                reason=f"{reason}: limit {previous} -> {new}",
                window_s=window_s,
                metrics=metrics,
                thresholds=thresholds,
            ),
        )
