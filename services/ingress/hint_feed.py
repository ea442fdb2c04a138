"""Tails ``llm.quota.hints`` into the pipeline's ``QuotaHints`` (the imperative shell of
``services.ingress.policy.hints``).

Groupless, from the end of the topic: every ingress instance needs every hint, and a
hint older than a start is of no use (admission publishes a fresh one at the tenant's
next rejection). A record that is not a hint is skipped and counted: admission owns the
topic, and a lost hint only sends requests on to admission, the authority. A record
without admission's MAC (``hop_signing``, the ``hints`` hop) is skipped and counted
too: whoever can write the topic must not refuse a tenant at the edge.
"""

from __future__ import annotations

import logging

from seawall_client.clock import SYSTEM_CLOCK, Clock
from seawall_client.kafka import close, start_tail
from seawall_client.serde import HINT, decode
from services.common.bus import make_consumer
from services.common.consuming import ConsumerLoop, Record
from services.common.deadletters import failure_of
from services.common.hop_signing import hop_key_for, lacks_mac
from services.common.lifecycle import Component
from services.common.settings import CommonSettings
from services.ingress import metrics as m
from services.ingress.policy.hints import QuotaHints

log = logging.getLogger(__name__)


class HintFeed(Component):
    name = "quota-hints"

    def __init__(
        self, settings: CommonSettings, topic: str, hints: QuotaHints, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        super().__init__()
        self._topic = topic
        self._hints = hints
        self._clock = clock
        self._hop = hop_key_for(settings, "hints")
        self._consumer = make_consumer(settings, group_id=None)
        self._loop: ConsumerLoop[None] = ConsumerLoop(
            self._consumer,
            self,
            None,
            name=self.name,
            commit=False,
            concurrency=1,
            start_consumer=False,
        )

    async def on_start(self) -> None:
        await start_tail(self._consumer, self._topic)
        await self._loop.start()

    async def on_stop(self) -> None:
        try:
            await self._loop.stop()
        finally:
            await close(self._consumer)

    async def decide(self, record: Record) -> None:
        if lacks_mac(self._hop, record.topic, record.value, record.headers):
            return  # counted and logged by the check
        self._hints.observe(decode(HINT, record.value), self._clock.time())
        m.QUOTA_HINTS.set(len(self._hints))

    async def effect(self, record: Record, decision: None) -> None:
        return None

    async def fail(self, record: Record, error: BaseException) -> None:
        reason, _ = failure_of(error)
        m.INVALID_HINTS.inc()
        log.warning("skipped a record that is not a quota hint", extra={"reason": reason})
