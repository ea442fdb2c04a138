"""The one "held for a duration" helper, and the hysteresis latch built on it.

Used by the breaker matrix, the degradation ladder and the long-prompt alert: each of
their rows is a ``Latch`` that trips when a windowed metric goes strictly past
``trip_above`` (for ``trip_hold_s``, 0 = at once) and recovers only after it stayed
strictly below ``recover_below`` for the full ``recover_hold_s``. Between the two
thresholds nothing changes, so noise there cannot make the latch flap.

"Held continuously" means every reading since the hold began satisfied the condition;
one reading that does not resets the timer. Time is what the caller passes as ``now``
and must not go backwards.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from services.controller.policy.decision import Evidence, Reading


class HoldTimer:
    """Whether a condition has held continuously for at least ``duration_s``."""

    def __init__(self, duration_s: float) -> None:
        if duration_s < 0:
            raise ValueError(f"duration_s must be >= 0, got {duration_s}")
        self.duration_s = duration_s
        self._since: float | None = None

    def observe(self, now: float, condition: bool) -> bool:
        if not condition:
            self._since = None
            return False
        if self._since is None:
            self._since = now
        return now - self._since >= self.duration_s

    def held_for(self, now: float) -> float:
        return 0.0 if self._since is None else now - self._since

    def reset(self) -> None:
        self._since = None


@dataclass(frozen=True)
class Threshold:
    """One row: trip strictly above ``trip_above``, recover strictly below
    ``recover_below``, over a metric computed on ``window_s`` of history.

    A reading on fewer than ``min_samples`` samples (or no reading) is *quiet*: it
    cannot trip the row, and it counts as healthy for recovery, because an isolated
    scope gets no traffic and would otherwise never recover (the half-open probe is what
    checks it really did).
    """

    trip_above: float
    recover_below: float
    window_s: float
    trip_hold_s: float = 0.0
    recover_hold_s: float = 0.0
    min_samples: int = 1

    def __post_init__(self) -> None:
        if self.recover_below > self.trip_above:
            raise ValueError(
                f"recover_below ({self.recover_below}) must not exceed trip_above "
                f"({self.trip_above}): that would leave no hysteresis band"
            )
        if self.window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if self.trip_hold_s < 0 or self.recover_hold_s < 0:
            raise ValueError("hold durations must be >= 0")
        if self.min_samples < 0:
            raise ValueError(f"min_samples must be >= 0, got {self.min_samples}")


class Latch:
    """A named ``Threshold`` with its state; ``update`` returns evidence when it flips."""

    def __init__(self, name: str, threshold: Threshold) -> None:
        self.name = name
        self.threshold = threshold
        self.tripped = False
        self._trip = HoldTimer(threshold.trip_hold_s)
        self._recover = HoldTimer(threshold.recover_hold_s)

    def update(self, now: float, reading: Reading | None) -> Evidence | None:
        t = self.threshold
        value = None if reading is None or reading.samples < t.min_samples else reading.value
        if not self.tripped:
            # A proportion trips on its lower bound: only once the samples show it is past.
            low = value if reading is None or reading.low is None else reading.low
            if not self._trip.observe(
                now, value is not None and low is not None and low > t.trip_above
            ):
                return None
            evidence = self._evidence(now, reading, self._trip, tripping=True)
            self._trip.reset()
            self.tripped = True
            return evidence
        if not self._recover.observe(now, value is None or value < t.recover_below):
            return None
        evidence = self._evidence(now, reading, self._recover, tripping=False)
        self._recover.reset()
        self.tripped = False
        return evidence

    def restore(self, tripped: bool) -> None:
        """Set the state a restarted controller had in force; any hold starts afresh."""
        self.tripped = tripped
        self._trip.reset()
        self._recover.reset()

    def _evidence(
        self, now: float, reading: Reading | None, timer: HoldTimer, *, tripping: bool
    ) -> Evidence:
        t, name = self.threshold, self.name
        limit = t.trip_above if tripping else t.recover_below
        samples = 0 if reading is None else reading.samples
        if reading is not None and samples >= t.min_samples:
            shown = f"{name} {reading.value:.4g} {'>' if tripping else '<'} {limit:.4g}"
            if tripping and reading.low is not None:
                shown = f"{name} {reading.value:.4g} (at least {reading.low:.4g}) > {limit:.4g}"
        else:
            shown = f"{name} quiet ({samples} < {t.min_samples} samples)"
        held = timer.held_for(now)
        reason = f"{shown} over {t.window_s:g}s"
        if timer.duration_s:
            reason += f", held {held:g}s (>= {timer.duration_s:g}s)"
        metrics = {f"{name}.samples": float(samples)}
        if reading is not None:
            metrics[name] = reading.value
            if reading.low is not None:
                metrics[f"{name}.lower_bound"] = reading.low
        return Evidence(
            reason=reason,
            window_s=t.window_s,
            metrics=metrics,
            thresholds={
                name: limit,
                f"{name}.hold_s": timer.duration_s,
                f"{name}.min_samples": float(t.min_samples),
            },
            hold_s=held,
        )


K = TypeVar("K", bound=str)


class LatchSet(Generic[K]):
    """Several named latches fed together; a missing reading is quiet."""

    def __init__(self, rows: Mapping[K, Threshold]) -> None:
        self._latches = [(key, Latch(key, threshold)) for key, threshold in rows.items()]

    def update(self, now: float, readings: Mapping[K, Reading | None]) -> list[Evidence]:
        """Feed every latch; the evidence of those that flipped, in row order."""
        flips = (latch.update(now, readings.get(key)) for key, latch in self._latches)
        return [evidence for evidence in flips if evidence is not None]

    @property
    def tripped(self) -> tuple[K, ...]:
        return tuple(key for key, latch in self._latches if latch.tripped)

    def restore(self, tripped: Iterable[str]) -> None:
        """Trip exactly the rows named in ``tripped`` (other names are ignored)."""
        names = set(tripped)
        for key, latch in self._latches:
            latch.restore(key in names)
