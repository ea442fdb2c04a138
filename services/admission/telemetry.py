"""Admission's telemetry tail: what the pacing rule learns of the pools.

Every worker report (``llm.telemetry``) and completion (``llm.completions``), read
without a group from the end of both topics, feeds the pacing rule
(``policy.capacity.FleetCapacity``) and each pool's ``max_model_len``, and asks for a dispatch
round now.
"""

from __future__ import annotations

from collections.abc import Callable

from schemas.base import scoped_id
from seawall_client.clock import Clock
from seawall_client.serde import COMPLETION, TELEMETRY, decode
from services.admission.policy.capacity import FleetCapacity
from services.common.consuming import Record
from services.common.hop_signing import HopKey, lacks_mac


class TelemetryTail:
    """The capacity tail's handler: every report and completion feeds the pacing rule.
    What does not decode is skipped (nothing of it could count), and so is what lacks a
    worker's MAC (``hop``: ``hop_signing``'s ``telemetry`` hop), counted."""

    def __init__(
        self,
        capacity: FleetCapacity,
        completions_topic: str,
        clock: Clock,
        wake: Callable[[], None],
        hop: HopKey | None = None,
    ) -> None:
        self._hop = hop
        self._capacity = capacity
        self._completions_topic = completions_topic
        self._clock = clock
        self._wake = wake

    async def decide(self, record: Record) -> None:
        if lacks_mac(self._hop, record.topic, record.value, record.headers):
            return
        now, capacity = self._clock.monotonic(), self._capacity
        if record.topic == self._completions_topic:
            done = decode(COMPLETION, record.value)
            key = scoped_id(done.tenant, done.request_id)
            if done.repeat:  # a dispatch already answered: its slot only
                capacity.forget(key)
            else:
                capacity.completed(done.worker_id, key, now, done.seq)
        else:
            capacity.observe(decode(TELEMETRY, record.value), now)

    async def effect(self, record: Record, decision: None) -> None:
        self._wake()

    async def fail(self, record: Record, error: BaseException) -> None:
        return None
