"""Long-prompt share alert (DESIGN, "Pre-filter"): on when more than 30% of the prompts
in the last 5 minutes are longer than 4096 tokens; off once the share stayed below 20%
for a minute (the exit is chosen here: DESIGN gives only the trigger). At least 20
prompts in the window before it can fire, so a quiet minute with two long prompts of
three does not page anyone.

Workers count the long prompts among the requests they finished (``RequestSummary
.long_prompts``, over ``LONG_PROMPT_TOKENS``); the alert reads those counts, per pool."""

from __future__ import annotations

from dataclasses import dataclass, replace

from schemas.telemetry import LONG_PROMPT_TOKENS
from services.controller.policy.decision import Decision, DecisionKind
from services.controller.policy.hysteresis import Latch, Threshold
from services.controller.policy.windows import ShareWindow

LONG_PROMPT_SHARE = Threshold(
    trip_above=0.30, recover_below=0.20, window_s=300.0, recover_hold_s=60.0, min_samples=20
)
METRIC = "long_prompt_share"


@dataclass(frozen=True)
class LongPromptConfig:
    share: Threshold = LONG_PROMPT_SHARE
    step_s: float = 10.0
    """Bucket width of the window."""


class LongPromptAlert:
    def __init__(self, scope: str = "fleet", config: LongPromptConfig | None = None) -> None:
        self.scope = scope
        self.config = config or LongPromptConfig()
        self._window = ShareWindow(self.config.share.window_s, self.config.step_s)
        self._latch = Latch(METRIC, self.config.share)

    @property
    def on(self) -> bool:
        return self._latch.tripped

    def record(self, now: float, prompts: int, long_prompts: int) -> None:
        """``prompts`` finished at ``now``, ``long_prompts`` of them long."""
        self._window.record_many(now, prompts, long_prompts)

    def evaluate(self, now: float) -> Decision[bool] | None:
        was_on = self._latch.tripped
        evidence = self._latch.update(now, self._window.stats(now).share_reading())
        if evidence is None:
            return None
        return Decision(
            scope=self.scope,
            kind=DecisionKind.LONG_PROMPT_ALERT,
            at=now,
            previous_state=was_on,
            new_state=self._latch.tripped,
            evidence=replace(
                evidence,
                thresholds={
                    **evidence.thresholds,
                    "long_prompt_tokens": float(LONG_PROMPT_TOKENS),
                },
            ),
        )
