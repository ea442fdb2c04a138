"""Alerts on a share of a pool's events over a window (pure): on when the share is
above ``trip_above`` with at least ``min_samples`` events in the window, off once it
stayed below ``recover_below`` for the hold. A quiet window reads as healthy, so an
alert clears when its events stop. Two of them:

- **Long prompts** (DESIGN, "Pre-filter"): more than 30 % of the prompts in the last 5
  minutes longer than 4096 tokens; off once the share stayed below 20 % for a minute
  (the exit is chosen here: DESIGN gives only the trigger). At least 20 prompts, so a
  quiet minute with two long prompts of three pages nobody. Workers count them among
  the requests they finish (``RequestSummary.long_prompts``).
- **Output mismatches** (the output-consistency check, ``services.workers.shadows``):
  more than 10 % (``controller_output_mismatch_rate``) of a pool's shadow runs in 5
  minutes disagree with their original; off below half that for a minute; at least 10
  comparisons. Not 0 %: vLLM's greedy output
  is not bitwise batch-invariant, so a healthy pool can show a few mismatches at
  temperature 0 — the rate, not one mismatch, says a model or its numerics changed.
  Workers count them among their shadow runs (``RequestSummary.consistency_*``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from schemas.telemetry import LONG_PROMPT_TOKENS
from services.controller.policy.decision import Decision, DecisionKind
from services.controller.policy.hysteresis import Latch, Threshold
from services.controller.policy.windows import ShareStats, ShareWindow

LONG_PROMPT_SHARE = Threshold(
    trip_above=0.30, recover_below=0.20, window_s=300.0, recover_hold_s=60.0, min_samples=20
)
OUTPUT_MISMATCH_RATE = Threshold(
    trip_above=0.10, recover_below=0.05, window_s=300.0, recover_hold_s=60.0, min_samples=10
)


@dataclass(frozen=True)
class ShareAlertConfig:
    kind: DecisionKind
    metric: str
    """The share's name in the evidence (metrics and thresholds)."""
    share: Threshold
    step_s: float = 10.0
    """Bucket width of the window."""
    context: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    """Further figures the evidence's thresholds carry (what counts as an event)."""

    def on(self, share: Threshold) -> ShareAlertConfig:
        """This alert on another threshold, its window keeping its number of buckets: a
        window scaled in time (``controller_time_scale``) gets buckets scaled alike, and
        never one wider than itself."""
        return replace(self, share=share, step_s=self.step_s * share.window_s / self.share.window_s)


LONG_PROMPTS = ShareAlertConfig(
    DecisionKind.LONG_PROMPT_ALERT,
    "long_prompt_share",
    LONG_PROMPT_SHARE,
    context=MappingProxyType({"long_prompt_tokens": float(LONG_PROMPT_TOKENS)}),
)
OUTPUT_MISMATCHES = ShareAlertConfig(
    DecisionKind.OUTPUT_CONSISTENCY_ALERT, "output_mismatch_rate", OUTPUT_MISMATCH_RATE
)


class ShareAlert:
    def __init__(self, config: ShareAlertConfig, scope: str = "fleet") -> None:
        self.scope = scope
        self.config = config
        self._window = ShareWindow(config.share.window_s, config.step_s)
        self._latch = Latch(config.metric, config.share)

    @property
    def on(self) -> bool:
        return self._latch.tripped

    def record(self, now: float, events: int, hits: int) -> None:
        """``events`` counted at ``now``, ``hits`` of them the kind the share is of."""
        self._window.record_many(now, events, hits)

    def stats(self, now: float, window_s: float | None = None) -> ShareStats:
        """The events of the last ``window_s`` (the whole window by default)."""
        return self._window.stats(now, window_s)

    def evaluate(self, now: float) -> Decision[bool] | None:
        was_on = self._latch.tripped
        evidence = self._latch.update(now, self._window.stats(now).share_reading())
        if evidence is None:
            return None
        return Decision(
            scope=self.scope,
            kind=self.config.kind,
            at=now,
            previous_state=was_on,
            new_state=self._latch.tripped,
            evidence=replace(evidence, thresholds={**evidence.thresholds, **self.config.context}),
        )
