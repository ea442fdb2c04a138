"""Heartbeat loss: a worker not heard from for more than ``timeout_s`` is lost.

Workers beat about once a second (``WorkerHeartbeat``). ``check`` reports the workers
whose silence went strictly past the timeout; ``beat`` reports a lost worker that is
heard from again. Feed both kinds of decision to the worker's ``Breaker.on_liveness``:
loss isolates the worker (circuit open), and its return sends it through the half-open
probe before it gets work again. A worker's first heartbeat registers it silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from services.controller.policy.decision import Decision, DecisionKind, Evidence


class Liveness(StrEnum):
    ALIVE = "alive"
    LOST = "lost"


@dataclass(frozen=True)
class HeartbeatConfig:
    timeout_s: float = 10.0
    """Ten missed one-second beats: long enough to ride out a GC pause or a broker
    hiccup, well inside the 60 s in which a killed worker must be recovered from."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@dataclass
class _Worker:
    last_seen: float
    liveness: Liveness = Liveness.ALIVE


class HeartbeatMonitor:
    def __init__(self, config: HeartbeatConfig | None = None) -> None:
        self.config = config or HeartbeatConfig()
        self._workers: dict[str, _Worker] = {}

    def liveness(self, scope: str) -> Liveness | None:
        worker = self._workers.get(scope)
        return None if worker is None else worker.liveness

    def beat(self, scope: str, now: float) -> Decision[Liveness] | None:
        worker = self._workers.get(scope)
        if worker is None:
            self._workers[scope] = _Worker(last_seen=now)
            return None
        previous_seen = worker.last_seen
        worker.last_seen = max(worker.last_seen, now)
        if worker.liveness is Liveness.ALIVE:
            return None
        worker.liveness = Liveness.ALIVE
        gap = now - previous_seen
        timeout = self.config.timeout_s
        return Decision(
            scope=scope,
            kind=DecisionKind.HEARTBEAT,
            at=now,
            previous_state=Liveness.LOST,
            new_state=Liveness.ALIVE,
            evidence=Evidence(
                reason=f"heartbeat resumed after {gap:g}s of silence (timeout {timeout:g}s)",
                window_s=timeout,
                metrics={"heartbeat_gap_s": gap, "last_seen_at": previous_seen},
                thresholds={"heartbeat_timeout_s": timeout},
            ),
        )

    def restore(self, scope: str, now: float, liveness: Liveness) -> None:
        """Track a worker a previous controller knew, as last seen at ``now`` (the
        restart), without a decision: one that stays silent is lost after the timeout,
        and one restored as lost reports its return when it beats again."""
        self._workers[scope] = _Worker(last_seen=now, liveness=liveness)

    def check(self, now: float) -> list[Decision[Liveness]]:
        """The workers lost since the last check (silent for strictly more than the
        timeout)."""
        timeout = self.config.timeout_s
        lost: list[Decision[Liveness]] = []
        for scope, worker in self._workers.items():
            age = now - worker.last_seen
            if worker.liveness is Liveness.LOST or not age > timeout:
                continue
            worker.liveness = Liveness.LOST
            lost.append(
                Decision(
                    scope=scope,
                    kind=DecisionKind.HEARTBEAT,
                    at=now,
                    previous_state=Liveness.ALIVE,
                    new_state=Liveness.LOST,
                    evidence=Evidence(
                        reason=(
                            f"no heartbeat for {age:g}s > timeout {timeout:g}s "
                            f"(last seen at {worker.last_seen:g})"
                        ),
                        window_s=timeout,
                        metrics={"heartbeat_age_s": age, "last_seen_at": worker.last_seen},
                        thresholds={"heartbeat_timeout_s": timeout},
                    ),
                )
            )
        return lost

    def forget(self, scope: str) -> None:
        """Drop a worker that left the fleet on purpose (no loss will be reported)."""
        self._workers.pop(scope, None)
