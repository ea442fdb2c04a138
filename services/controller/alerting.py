"""What in a pool's state deserves an alert (``policy.alerts.Condition``), read from its
``PoolDecider`` at every full tick. Pure: no I/O, no clock.

- ``breaker_open``: a breaker not closed, or closed but acting (level ≥ rate limit);
  critical for a pool refusing new work, a warning otherwise. A worker whose heartbeat
  is lost has its breaker open for that reason: it gets ``heartbeat_lost`` instead
  (one cause, one alert);
- ``heartbeat_lost``: a worker not heard from past the heartbeat timeout (warning);
- ``engine_stalled``: a worker whose engine produced no token for its breaker row's
  threshold while holding requests (critical: its requests wait on a hung GPU until
  the worker's watchdog restarts it); it replaces ``breaker_open`` for that worker;
- ``degradation``: the pool's ladder engaged (warning; critical from level 3, when
  requests are answered from the static fallback);
- ``long_prompt_share``: prompts over ``LONG_PROMPT_TOKENS`` above 30 % of the pool's
  requests in five minutes (warning; ``policy.shares``);
- ``output_inconsistency``: more than 10 % of the pool's shadow runs in five minutes
  disagree with their original's output (warning; ``policy.shares``).

Each carries the evidence of the decision in force behind it, so a notification says
why without another lookup.
"""

from __future__ import annotations

from schemas import BreakerLevel, Evidence
from schemas.alerts import AlertRule
from services.controller.decider.pool import PoolDecider
from services.controller.policy import Circuit
from services.controller.policy.alerts import Condition

STALLED = "engine_stalled_s"
"""The breaker row of a worker whose engine stopped producing tokens."""
STATIC_FALLBACK_LEVEL = 3
"""The ladder's rung at which requests get the static fallback (DESIGN)."""


def _evidence(decider: PoolDecider, key: str, fallback: str) -> Evidence:
    event = decider.in_force.get(key)
    return event.evidence if event is not None else Evidence(reason=fallback)


def conditions(decider: PoolDecider) -> list[Condition]:
    pool, found = decider.pool, []
    lost = decider.lost_workers()
    for scope in sorted(lost):
        found.append(
            Condition(
                "heartbeat_lost",
                scope,
                pool,
                "warning",
                f"{scope} of pool {pool} is not heard from (heartbeat lost)",
                _evidence(decider, f"breaker/{scope}", "heartbeat lost"),
            )
        )
    for scope, status in sorted(decider.breakers().items()):
        acting = status.circuit is not Circuit.CLOSED or status.level >= BreakerLevel.RATE_LIMIT
        if not acting or scope in lost:
            continue
        refusing = status.circuit is Circuit.OPEN or status.level >= BreakerLevel.REJECT_NEW
        if STALLED in status.tripped:
            found.append(
                Condition(
                    "engine_stalled",
                    scope,
                    pool,
                    "critical",
                    f"the engine of {scope} in pool {pool} produces no tokens for the "
                    "requests it holds (isolated)",
                    _evidence(decider, f"breaker/{scope}", "engine stalled"),
                )
            )
            continue
        found.append(
            Condition(
                "breaker_open",
                scope,
                pool,
                "critical" if scope == decider.scope and refusing else "warning",
                f"breaker of {scope} is {status.circuit.value} at level "
                f"{status.level.name.lower()} ({', '.join(status.tripped) or 'recovering'})",
                _evidence(decider, f"breaker/{scope}", "breaker acting"),
            )
        )
    level = decider.degradation.level
    if level > 0:
        found.append(
            Condition(
                "degradation",
                decider.scope,
                pool,
                "critical" if level >= STATIC_FALLBACK_LEVEL else "warning",
                f"pool {pool} is degraded to level {level} "
                f"({', '.join(decider.degradation.triggered) or 'holding'})",
                _evidence(decider, f"degradation/{decider.scope}", "degraded"),
            )
        )
    shares: tuple[tuple[AlertRule, Evidence | None, str, str, str], ...] = (
        ("long_prompt_share", decider.long_prompts, "long_prompt_share", "of its prompts",
         f"long prompts are over their share in pool {pool}"),
        ("output_inconsistency", decider.output_mismatches, "output_mismatch_rate",
         "of its shadow runs", f"outputs of pool {pool} are not reproduced by their shadow runs"),
    )  # fmt: skip
    for rule, evidence, metric, of_what, summary in shares:
        if evidence is None:
            continue
        share = evidence.metrics.get(metric)
        shown = "" if share is None else f" ({share:.0%} {of_what})"
        found.append(Condition(rule, decider.scope, pool, "warning", summary + shown, evidence))
    return found
