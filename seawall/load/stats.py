"""What ``seawall load`` saw, pure: per-request outcomes → live figures, the summary and
its JSON document.

Latency and TTFT quantiles are over the requests that were served (``ok`` or
``degraded``): a rejection answers in milliseconds and would flatter the tail. TTFT is
to the first streamed chunk; latency to the terminal reply, from when the request was
first sent (retries included). A request with no terminal reply by the end of the run
is ``lost``, whatever the reason (timed out, still in flight after the drain, failed to
send); ``lost_by_cause`` says which.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

from schemas import Priority, ReasonCode, ReplyStatus

SERVED = frozenset({ReplyStatus.OK, ReplyStatus.DEGRADED})
ALL = "all"


@dataclass(frozen=True, slots=True)
class Outcome:
    index: int
    priority: Priority
    sent_at: float
    """Seconds from the start of the run, as are the other times."""
    done_at: float
    """When the terminal reply arrived; for a lost request, when it was given up."""
    status: ReplyStatus | None
    """``None``: no terminal reply (lost)."""
    reason: ReasonCode = ReasonCode.NONE
    first_chunk_at: float | None = None
    completion_tokens: int = 0
    attempts: int = 1
    cause: str = ""
    """Why a lost request has no reply."""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_chunk_at is None else self.first_chunk_at - self.sent_at

    @property
    def latency_s(self) -> float | None:
        return None if self.status is None else self.done_at - self.sent_at


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile by linear interpolation between closest ranks (numpy's
    default, ``statistics.quantiles(method="inclusive")``); ``None`` when empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Quantiles:
    """Milliseconds; ``None`` without samples."""

    p50: float | None
    p95: float | None
    p99: float | None

    @classmethod
    def of_seconds(cls, values: Iterable[float]) -> Quantiles:
        ms = [v * 1000 for v in values]
        return cls(percentile(ms, 50), percentile(ms, 95), percentile(ms, 99))


@dataclass(frozen=True, slots=True)
class ClassSummary:
    submitted: int
    by_status: dict[str, int]
    ttft_ms: Quantiles
    latency_ms: Quantiles


@dataclass(frozen=True, slots=True)
class Summary:
    submitted: int
    terminal_replies: int
    lost: int
    duplicates: int
    retried: int
    """Requests answered on a later attempt than their first (the SDK's retries)."""
    elapsed_s: float
    """From the start of the run to the last terminal reply."""
    throughput_rps: float
    """Terminal replies per second."""
    goodput_rps: float
    """Served (ok or degraded) replies per second."""
    tokens_per_s: float
    by_status: dict[str, int]
    rejections_by_reason: dict[str, int]
    lost_by_cause: dict[str, int]
    classes: dict[str, ClassSummary]
    """Per priority class that had traffic, and ``"all"``."""


def _class_summary(outcomes: Sequence[Outcome]) -> ClassSummary:
    served = [o for o in outcomes if o.status in SERVED]
    return ClassSummary(
        submitted=len(outcomes),
        by_status=dict(Counter(o.status.value if o.status else "lost" for o in outcomes)),
        ttft_ms=Quantiles.of_seconds(t for o in served if (t := o.ttft_s) is not None),
        latency_ms=Quantiles.of_seconds(t for o in served if (t := o.latency_s) is not None),
    )


def summarize(outcomes: Sequence[Outcome], *, duplicates: int) -> Summary:
    """The run's figures; ``outcomes`` holds one record per submitted request. Rates are
    over the time from the start of the run to the last terminal reply."""
    answered = [o for o in outcomes if o.status is not None]
    served = [o for o in answered if o.status in SERVED]
    elapsed_s = max((o.done_at for o in answered), default=0.0)
    per_s = 1 / elapsed_s if elapsed_s > 0 else 0.0
    classes = {
        p.value: _class_summary(of_class)
        for p in Priority
        if (of_class := [o for o in outcomes if o.priority is p])
    }
    return Summary(
        submitted=len(outcomes),
        terminal_replies=len(answered),
        lost=len(outcomes) - len(answered),
        duplicates=duplicates,
        retried=sum(1 for o in answered if o.attempts > 1),
        elapsed_s=elapsed_s,
        throughput_rps=len(answered) * per_s,
        goodput_rps=len(served) * per_s,
        tokens_per_s=sum(o.completion_tokens for o in served) * per_s,
        by_status=dict(Counter(o.status.value for o in answered if o.status is not None)),
        rejections_by_reason=dict(
            Counter(o.reason.value for o in answered if o.status is ReplyStatus.REJECTED)
        ),
        lost_by_cause=dict(Counter(o.cause for o in outcomes if o.status is None)),
        classes=classes | {ALL: _class_summary(outcomes)},
    )


def document(
    summary: Summary, config: Mapping[str, object], client: Mapping[str, int]
) -> dict[str, object]:
    """The JSON document of a run: its configuration, the summary, the clients' tallies."""
    return {"config": dict(config), **asdict(summary), "client": dict(client)}


@dataclass(frozen=True, slots=True)
class Live:
    """The live view's figures at ``elapsed_s``."""

    elapsed_s: float
    submitted: int
    in_flight: int
    done: int
    lost: int
    send_rate: float
    """Requests sent per second over the recent window."""
    done_rate: float
    p99_ms: float | None
    """P99 latency of the requests served in the recent window."""
    rejected: int


def live(
    sent_at: Sequence[float], finished: Sequence[Outcome], now: float, window_s: float = 10.0
) -> Live:
    """``sent_at``: send times so far; ``finished``: outcomes so far (lost ones too),
    both in the order they happened (ascending times)."""
    since = now - window_s
    span = min(window_s, max(now, 1.0))
    recent_sends = len(sent_at) - bisect.bisect_left(sent_at, since)
    recent = finished[bisect.bisect_left(finished, since, key=lambda o: o.done_at) :]
    answered = [o for o in recent if o.status is not None]
    lost = sum(1 for o in finished if o.status is None)
    return Live(
        elapsed_s=now,
        submitted=len(sent_at),
        in_flight=len(sent_at) - len(finished),
        done=len(finished) - lost,
        lost=lost,
        send_rate=recent_sends / span,
        done_rate=len(answered) / span,
        p99_ms=Quantiles.of_seconds(
            t for o in answered if o.status in SERVED and (t := o.latency_s) is not None
        ).p99,
        rejected=sum(1 for o in finished if o.status is ReplyStatus.REJECTED),
    )
