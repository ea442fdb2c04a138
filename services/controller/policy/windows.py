"""Sliding-window statistics per scope, in time buckets that merge.

A window of ``size_s`` is kept as buckets of ``step_s`` seconds (bucket ``k`` holds the
samples with ``floor(t / step_s) == k``). A query at ``now`` over ``window_s`` (at most
``size_s``) merges the buckets from the one holding ``now - window_s`` to the current,
partly filled one: every sample at most ``window_s`` old counts, and none older than
``window_s + step_s``. Buckets that no query can reach any more expire. Because buckets
merge, so do windows: a pool's window is the merge of its workers' windows (same
``size_s`` and ``step_s``).

- ``RequestWindow``: latencies in a DDSketch per bucket (quantiles within the sketch's
  relative accuracy) plus request and error counts; ``counts`` reads the counts alone,
  without merging a sketch.
- ``GaugeWindow``: a sampled gauge (GPU memory %, temperature, host CPU %): latest value,
  minimum, maximum, mean; or counts per report (preemptions), read as a rate.
- ``ShareWindow``: how many of the events counted were hits (e.g. long prompts).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, Self, TypeVar, cast

from ddsketch.ddsketch import BaseDDSketch
from ddsketch.mapping import LogarithmicMapping
from ddsketch.store import DenseStore

from services.controller.policy.decision import Reading


class _Bucket(Protocol):
    def merge(self, other: Self) -> None: ...


B = TypeVar("B", bound=_Bucket)
S = TypeVar("S")


class _Window(Generic[B]):
    def __init__(self, size_s: float, step_s: float, new_bucket: Callable[[], B]) -> None:
        if step_s <= 0 or size_s < step_s:
            raise ValueError(f"need 0 < step_s <= size_s, got step {step_s}, size {size_s}")
        self.size_s = size_s
        self.step_s = step_s
        self._new_bucket = new_bucket
        self._buckets: dict[int, B] = {}
        self._closed: dict[tuple[int, int], B] = {}
        """(oldest, newest) → the merge of buckets ``oldest`` to ``newest - 1``: closed
        buckets no longer change, so a query repeated within one step merges two
        buckets, not the whole window (the controller asks every scope every tick)."""
        self._summaries: dict[tuple[int, int, float, object], object] = {}
        """(oldest, newest, window_s, kind) → the statistics last summarized there, dropped
        whenever a sample lands or the window moves a step: a worker's windows are read
        when its report is reacted to and again by the next tick, mostly with nothing
        added in between (a tick of a pool of 834 workers: 60-74 ms of CPU before, 28-33
        after)."""

    def _index(self, now: float) -> int:
        return math.floor(now / self.step_s)

    def _expire(self, now: float) -> None:
        oldest = self._index(now - self.size_s)
        for index in [i for i in self._buckets if i < oldest]:
            del self._buckets[index]

    def _bucket_at(self, now: float) -> B:
        self._summaries.clear()  # the caller adds a sample to what it gets
        self._expire(now)
        index = self._index(now)
        if any(index < newest for _, newest in self._closed):
            self._closed.clear()  # a sample for a bucket a cached merge holds
        if index not in self._buckets:
            self._buckets[index] = self._new_bucket()
        return self._buckets[index]

    def _span(self, now: float, window_s: float | None) -> tuple[int, int, float]:
        """The oldest and newest bucket within ``window_s`` of ``now``, and that window
        (buckets past their reach expired)."""
        window_s = self.size_s if window_s is None else window_s
        if not 0 < window_s <= self.size_s:
            raise ValueError(f"window_s must be in (0, {self.size_s}], got {window_s}")
        self._expire(now)
        return self._index(now - window_s), self._index(now), window_s

    def _fold(self, now: float, window_s: float | None) -> tuple[B, float]:
        """The merge of the buckets within ``window_s`` of ``now``, and that window."""
        oldest, newest, window_s = self._span(now, window_s)
        closed = self._closed.get((oldest, newest))
        if closed is None:
            closed = self._new_bucket()
            for index, bucket in self._buckets.items():
                if oldest <= index < newest:
                    closed.merge(bucket)
            for key in [k for k in self._closed if k[1] != newest]:
                del self._closed[key]
            self._closed[(oldest, newest)] = closed
        total = self._new_bucket()
        total.merge(closed)
        current = self._buckets.get(newest)
        if current is not None:
            total.merge(current)
        return total, window_s

    def _summary(self, now: float, window_s: float | None, summarize: Callable[[B, float], S]) -> S:
        """``summarize`` of the merge within ``window_s`` of ``now`` (``_fold``), reused
        until a sample lands or the window moves a step (``_reuse``)."""
        return self._reuse(now, window_s, summarize, lambda: summarize(*self._fold(now, window_s)))

    def _reuse(
        self, now: float, window_s: float | None, kind: object, compute: Callable[[], S]
    ) -> S:
        """What ``compute`` gives for ``window_s`` at ``now``, computed once per ``kind``
        until a sample lands or the window moves a step. The summaries are frozen, so
        every reader may hold the same one."""
        window = self.size_s if window_s is None else window_s
        key = (self._index(now - window), self._index(now), window, kind)
        if any(k[1] != key[1] for k in self._summaries):
            self._summaries.clear()
        if key not in self._summaries:
            self._summaries[key] = compute()
        return cast(S, self._summaries[key])

    def merge(self, other: Self) -> None:
        """Add ``other``'s samples to this window (``other`` is left unchanged)."""
        if (other.size_s, other.step_s) != (self.size_s, self.step_s):
            raise ValueError("windows merge only with the same size_s and step_s")
        self._closed.clear()
        self._summaries.clear()
        for index, bucket in other._buckets.items():
            if index not in self._buckets:
                self._buckets[index] = self._new_bucket()
            self._buckets[index].merge(bucket)


class _RequestBucket:
    def __init__(self, mapping: LogarithmicMapping) -> None:
        # One mapping per window, shared (it never changes): ``DDSketch(accuracy)`` built
        # a new one for every bucket and every fold (1.6 % of a controller's samples at
        # 1,000 workers, py-spy).
        self.latencies = BaseDDSketch(
            mapping=mapping, store=DenseStore(), negative_store=DenseStore(), zero_count=0.0
        )
        self.count = 0
        self.errors = 0
        self.ttft_count = 0
        self.ttft_sum_ms = 0.0

    def merge(self, other: Self) -> None:
        self.latencies.merge(other.latencies)
        self.count += other.count
        self.errors += other.errors
        self.ttft_count += other.ttft_count
        self.ttft_sum_ms += other.ttft_sum_ms


def wilson_lower(hits: int, n: int, z: float) -> float:
    """The Wilson score lower bound of a proportion seen as ``hits`` of ``n``, at the
    one-sided confidence ``z`` standard deviations give: below it the true proportion
    lies with that small a chance. Unlike the plain rate it stays low on a handful of
    samples (3 errors in the first 10 requests are 30 %, and prove nothing), and
    approaches the rate as samples come in."""
    if n <= 0:
        return 0.0
    p = hits / n
    z2 = z * z
    centre = p + z2 / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, (centre - spread) / (1 + z2 / n))


@dataclass(frozen=True)
class RequestCounts:
    window_s: float
    count: int
    errors: int

    @property
    def error_rate(self) -> float:
        return self.errors / self.count if self.count else 0.0

    def error_rate_reading(self, z: float | None = None) -> Reading | None:
        """The error rate; with ``z``, with its Wilson lower bound at that one-sided
        confidence (``Reading.low``)."""
        if not self.count:
            return None
        low = None if z is None else wilson_lower(self.errors, self.count, z)
        return Reading(self.error_rate, self.count, low)


@dataclass(frozen=True)
class RequestStats(RequestCounts):
    p50_ms: float | None
    p99_ms: float | None
    ttft_mean_ms: float | None = None
    """Mean time to first token of the requests that had one (``None``: none had)."""

    def p99_reading(self) -> Reading | None:
        return None if self.p99_ms is None else Reading(self.p99_ms, self.count)


class RequestWindow(_Window[_RequestBucket]):
    """Completed requests of a scope. Failed requests count in the latency quantiles
    too: a request that timed out after 30 s is exactly the tail P99 must show."""

    def __init__(
        self, size_s: float = 300.0, step_s: float = 10.0, relative_accuracy: float = 0.01
    ) -> None:
        mapping = LogarithmicMapping(relative_accuracy)
        super().__init__(size_s, step_s, lambda: _RequestBucket(mapping))
        self.relative_accuracy = relative_accuracy

    def record(self, now: float, latency_ms: float, ok: bool) -> None:
        if not math.isfinite(latency_ms) or latency_ms < 0:
            raise ValueError(f"latency_ms must be finite and >= 0, got {latency_ms}")
        bucket = self._bucket_at(now)
        bucket.latencies.add(latency_ms)
        bucket.count += 1
        bucket.errors += 0 if ok else 1

    def record_many(
        self,
        now: float,
        latencies: BaseDDSketch,
        errors: int,
        ttft_count: int = 0,
        ttft_sum_ms: float = 0.0,
    ) -> None:
        """Requests finished together (a worker's report interval): their latencies as
        a sketch of this window's relative accuracy, how many of them failed, and the
        count and sum of their times to first token."""
        count = round(latencies.count)
        if not 0 <= errors <= count:
            raise ValueError(f"need 0 <= errors <= count, got {errors} of {count}")
        bucket = self._bucket_at(now)
        bucket.latencies.merge(latencies)
        bucket.count += count
        bucket.errors += errors
        bucket.ttft_count += ttft_count
        bucket.ttft_sum_ms += ttft_sum_ms

    def stats(self, now: float, window_s: float | None = None) -> RequestStats:
        return self._summary(now, window_s, _request_stats)

    def counts(self, now: float, window_s: float | None = None) -> RequestCounts:
        """What ``stats`` counts, without merging the latency sketches (an error rate
        needs no quantile): the breaker reads its error rate over five minutes and its
        P99 over one, and folded five minutes of sketches, and took two quantiles, only
        to count (reactions 15-20 % cheaper without, in-process)."""
        return self._reuse(now, window_s, RequestCounts, lambda: self._counts(now, window_s))

    def _counts(self, now: float, window_s: float | None) -> RequestCounts:
        oldest, newest, window_s = self._span(now, window_s)
        count = errors = 0
        for index, bucket in self._buckets.items():
            if oldest <= index <= newest:
                count += bucket.count
                errors += bucket.errors
        return RequestCounts(window_s, count, errors)


def _request_stats(total: _RequestBucket, window_s: float) -> RequestStats:
    return RequestStats(
        window_s=window_s,
        count=total.count,
        errors=total.errors,
        p50_ms=total.latencies.get_quantile_value(0.50),
        p99_ms=total.latencies.get_quantile_value(0.99),
        ttft_mean_ms=total.ttft_sum_ms / total.ttft_count if total.ttft_count else None,
    )


class _GaugeBucket:
    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.minimum = math.inf
        self.maximum = -math.inf
        self.latest_at = -math.inf
        self.latest = math.nan

    def add(self, at: float, value: float) -> None:
        self.count += 1
        self.total += value
        self.minimum = min(self.minimum, value)
        self.maximum = max(self.maximum, value)
        if at >= self.latest_at:
            self.latest_at, self.latest = at, value

    def merge(self, other: Self) -> None:
        self.count += other.count
        self.total += other.total
        self.minimum = min(self.minimum, other.minimum)
        self.maximum = max(self.maximum, other.maximum)
        if other.count and other.latest_at >= self.latest_at:
            self.latest_at, self.latest = other.latest_at, other.latest


@dataclass(frozen=True)
class GaugeStats:
    """``None`` everywhere when the window holds no sample."""

    window_s: float
    count: int
    latest: float | None
    minimum: float | None
    maximum: float | None
    mean: float | None
    total: float = 0.0

    def rate_reading(self) -> Reading | None:
        """The samples' sum per second of the window: for a gauge that records counts
        (e.g. preemptions since the previous report), their rate."""
        return Reading(self.total / self.window_s, self.count) if self.count else None

    def mean_reading(self) -> Reading | None:
        return None if self.mean is None else Reading(self.mean, self.count)

    def max_reading(self) -> Reading | None:
        return None if self.maximum is None else Reading(self.maximum, self.count)

    def latest_reading(self) -> Reading | None:
        """The newest sample: for a gauge that is itself a duration (how long something
        has lasted), what holds now."""
        return None if self.latest is None else Reading(self.latest, self.count)


class GaugeWindow(_Window[_GaugeBucket]):
    def __init__(self, size_s: float = 600.0, step_s: float = 10.0) -> None:
        super().__init__(size_s, step_s, _GaugeBucket)

    def record(self, now: float, value: float) -> None:
        if not math.isfinite(value):
            raise ValueError(f"gauge value must be finite, got {value}")
        self._bucket_at(now).add(now, value)

    def stats(self, now: float, window_s: float | None = None) -> GaugeStats:
        return self._summary(now, window_s, _gauge_stats)


def _gauge_stats(total: _GaugeBucket, window_s: float) -> GaugeStats:
    if not total.count:
        return GaugeStats(window_s, 0, None, None, None, None)
    return GaugeStats(
        window_s=window_s,
        count=total.count,
        latest=total.latest,
        minimum=total.minimum,
        maximum=total.maximum,
        mean=total.total / total.count,
        total=total.total,
    )


class _ShareBucket:
    def __init__(self) -> None:
        self.total = 0
        self.hits = 0

    def merge(self, other: Self) -> None:
        self.total += other.total
        self.hits += other.hits


@dataclass(frozen=True)
class ShareStats:
    window_s: float
    total: int
    hits: int

    @property
    def share(self) -> float:
        return self.hits / self.total if self.total else 0.0

    def share_reading(self) -> Reading | None:
        return Reading(self.share, self.total) if self.total else None


class ShareWindow(_Window[_ShareBucket]):
    def __init__(self, size_s: float = 300.0, step_s: float = 10.0) -> None:
        super().__init__(size_s, step_s, _ShareBucket)

    def record(self, now: float, hit: bool) -> None:
        self.record_many(now, 1, 1 if hit else 0)

    def record_many(self, now: float, total: int, hits: int) -> None:
        """``total`` events at ``now``, ``hits`` of them hits."""
        if not 0 <= hits <= total:
            raise ValueError(f"hits must be within 0..total, got {hits} of {total}")
        bucket = self._bucket_at(now)
        bucket.total += total
        bucket.hits += hits

    def stats(self, now: float, window_s: float | None = None) -> ShareStats:
        return self._summary(now, window_s, _share_stats)


def _share_stats(total: _ShareBucket, window_s: float) -> ShareStats:
    return ShareStats(window_s=window_s, total=total.total, hits=total.hits)
