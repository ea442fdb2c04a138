"""Admission's corrections: each tenant's tokens bucket set right once its request ends.

``RequestCompleted`` (``llm.completions``) is read with the group
``<prefix>seawall.admission.completions`` (so once per fleet): the tokens reserved at
admission (kept in Redis per request, see ``RedisKeys.reservation``) are taken and the
tenant's bucket corrected by ``actual − reserved``. Taking the reservation
(GET+DEL in one transaction) makes a redelivered completion correct nothing twice.
A request refused after it was charged (expired, cancelled, breaker, revoked) has its
tokens refunded the same way (the request count is not refunded).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

from schemas import Tier
from seawall_client.clock import Clock
from seawall_client.serde import COMPLETION, decode
from seawall_client.topics import RedisKeys
from services.admission import metrics as m
from services.admission.backlog import Waiting
from services.admission.policy.bucket import TierConfig
from services.admission.policy.decisions import AdmissionPolicy
from services.admission.quota import QuotaUnavailable, RedisQuota
from services.common.consuming import Record
from services.common.control_state import ControlState
from services.common.deadletters import DeadLetters

log = logging.getLogger(__name__)

STORE_ERRORS = (redis.exceptions.RedisError, OSError)
"""What a Redis call raises when the store is unavailable."""


class Corrections:
    """Settles reservations: a completion's correction, a refused request's refund."""

    def __init__(
        self,
        redis: aioredis.Redis,
        quota: RedisQuota,
        keys: RedisKeys,
        policy: AdmissionPolicy,
        control: ControlState,
        tiers: Mapping[Tier, TierConfig],
        clock: Clock,
        finish: Callable[[Coroutine[Any, Any, Any]], None],
    ) -> None:
        self._redis = redis
        self._quota = quota
        self._keys = keys
        self._policy = policy
        self._control = control
        self._tiers = tiers
        self._clock = clock
        self._finish = finish

    def refund(self, w: Waiting) -> None:
        if w.accepted.reserved_tokens > 0 and not w.replayed:
            self._finish(self.settle_refund(w))

    async def settle_refund(self, w: Waiting) -> None:
        try:
            await self.settle(w.request.tenant, w.request.tier, w.request.request_id, 0)
        except (QuotaUnavailable, *STORE_ERRORS) as e:
            m.QUOTA_STORE_ERRORS.labels("correct").inc()
            log.warning("token refund lost", extra={"error": str(e)})

    async def settle(self, tenant: str, tier: Tier, request_id: str, actual: float) -> None:
        """Take a request's reservation and correct its tenant's tokens bucket. Raises
        when Redis is unavailable (the corrections loop tries again)."""
        key = self._keys.reservation(tenant, request_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.get(key)
            pipe.delete(key)
            reserved, _ = await pipe.execute()
        if reserved is None:
            m.CORRECTIONS.labels("not_found").inc()
            return
        config = self._policy.tenant_config(tenant, tier, self._control, self._clock.time())
        try:
            await self._quota.adjust(tenant, config or self._tiers[tier], actual - float(reserved))
        except QuotaUnavailable as e:
            # The reservation is taken: trying again would find nothing to correct.
            m.QUOTA_STORE_ERRORS.labels("correct").inc()
            log.warning("token correction lost", extra={"error": str(e)})
            return
        m.CORRECTIONS.labels("corrected" if actual else "refunded").inc()


class CompletionsHandler:
    """The corrections' handler: each ``RequestCompleted`` settles its reservation;
    what is not one is dead-lettered."""

    def __init__(self, corrections: Corrections, dead_letters: DeadLetters) -> None:
        self._corrections = corrections
        self._dead_letters = dead_letters

    async def decide(self, record: Record) -> None:
        event = decode(COMPLETION, record.value)
        actual = event.prompt_tokens + event.completion_tokens
        await self._corrections.settle(event.tenant, event.tier, event.request_id, actual)

    async def effect(self, record: Record, decision: None) -> None:
        return None

    async def fail(self, record: Record, error: BaseException) -> None:
        """A completion that does not decode is dead-lettered here: admission's group
        is the fleet's one reader of ``llm.completions`` that commits."""
        await self._dead_letters.record(record, error)
