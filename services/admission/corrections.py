"""Admission's corrections: each tenant's tokens bucket set right once its request ends.

A request's charge writes its reservation (the tokens taken, ``RedisKeys.reservation``)
beside its charge marker (``RedisKeys.admitted``: a later copy of the request replays
the charge and pays nothing). From there, ``settle.lua`` keeps one rule — *a charge is
made once, corrected once, and refunded only when the request will never run*:

- *sent*: once the broker has taken a request's dispatch, its reservation is marked
  sent; from then on only its completion settles it.
- *corrected*: ``RequestCompleted`` (``llm.completions``, read with the group
  ``<prefix>seawall.admission.completions``, so once per fleet) takes the reservation
  and corrects the tenant's bucket by ``actual − reserved``; a redelivered completion
  finds nothing to take.
- *refunded*: a request refused after it was charged (expired, cancelled, breaker,
  revoked key) gets its tokens back — unless a copy of it was already sent (produced
  twice, or redelivered after a crash): then it will run, and its completion settles
  it. The request count is not refunded. The reservation stays, marked refunded: a
  copy that replays the charge later and runs is charged what it used at completion.
- *neither*: a waiting request dropped because its partition was revoked or the service
  stops is not committed; its next owner replays its charge and it goes on as if never
  dropped. Refunding it (as this did before) left the marker behind: the replay paid
  nothing, the completion found no reservation, and the tokens were never charged.

Whatever the order, the tokens charged come to what the requests served used
(``tests/integration/admission/test_settlement.py``). Left open: a request refunded,
then run from another copy, holds no tokens between its dispatch and its completion;
a completion later than ``reservation_ttl_s`` finds nothing to correct (the
reservation stays charged).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from importlib import resources
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
from services.common.hop_signing import HopKey, lacks_mac
from services.common.lua import Lua
from services.common.redisclient import by_slot

log = logging.getLogger(__name__)

STORE_ERRORS = (redis.exceptions.RedisError, OSError)
"""What a Redis call raises when the store is unavailable."""

SCRIPT = resources.files("services.admission").joinpath("settle.lua").read_text(encoding="utf-8")


def _reserved(value: bytes | str) -> tuple[float, bool]:
    """A reservation's tokens, and whether they were refunded (``settle.lua``)."""
    text = value.decode() if isinstance(value, bytes) else value
    return float(text.rstrip("dr")), text.endswith("r")


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
        self._script = Lua(redis, SCRIPT)

    def refund(self, w: Waiting) -> None:
        """``w`` was refused after its charge: give its tokens back, in the background,
        unless a copy of it was sent (module notes)."""
        if w.accepted.reserved_tokens > 0:
            self._finish(self.settle_refund(w))

    async def settle_refund(self, w: Waiting) -> None:
        tenant, rid = w.request.tenant, w.request.request_id
        try:
            reserved = await self._script([self._keys.reservation(tenant, rid)], ["refund"])
            if reserved is None:
                m.CORRECTIONS.labels("not_refunded").inc()
                return
            await self._adjust(tenant, w.request.tier, -_reserved(reserved)[0], "refunded")
        except (QuotaUnavailable, *STORE_ERRORS) as e:
            m.QUOTA_STORE_ERRORS.labels("correct").inc()
            log.warning("token refund lost", extra={"error": str(e)})

    def sent(self, sent: Sequence[Waiting]) -> None:
        """The broker took these requests' dispatches: mark their reservations sent, in
        the background (one script call per Redis Cluster slot)."""
        keys = [
            self._keys.reservation(w.request.tenant, w.request.request_id)
            for w in sent
            if w.accepted.reserved_tokens > 0
        ]
        if keys:
            self._finish(self._mark_sent(keys))

    async def _mark_sent(self, keys: list[str]) -> None:
        try:
            await self._script.many([(group, ["sent"]) for group in by_slot(self._redis, keys)])
        except STORE_ERRORS as e:
            m.QUOTA_STORE_ERRORS.labels("mark_sent").inc()
            log.warning("reservations not marked sent", extra={"error": str(e)})

    async def settle(self, tenant: str, tier: Tier, request_id: str, actual: float) -> None:
        """Take a request's reservation and correct its tenant's tokens bucket. Raises
        when Redis is unavailable (the corrections loop tries again)."""
        reserved = await self._script([self._keys.reservation(tenant, request_id)], ["take"])
        if reserved is None:
            m.CORRECTIONS.labels("not_found").inc()
            return
        tokens, refunded = _reserved(reserved)
        await self._adjust(tenant, tier, actual if refunded else actual - tokens, "corrected")

    async def _adjust(self, tenant: str, tier: Tier, delta: float, outcome: str) -> None:
        """Correct a tenant's tokens bucket by ``delta`` (its reservation is taken)."""
        config = self._policy.tenant_config(tenant, tier, self._control, self._clock.time())
        try:
            await self._quota.adjust(tenant, config or self._tiers[tier], delta)
        except QuotaUnavailable as e:
            # The reservation is taken: trying again would find nothing to correct.
            m.QUOTA_STORE_ERRORS.labels("correct").inc()
            log.warning("token correction lost", extra={"error": str(e)})
            return
        m.CORRECTIONS.labels(outcome).inc()


class CompletionsHandler:
    """The corrections' handler: each ``RequestCompleted`` settles its reservation;
    what is not one is dead-lettered; what lacks a worker's MAC (``hop``:
    ``hop_signing``'s ``telemetry`` hop) is skipped and counted, since a forged
    completion would refund a tenant's tokens."""

    def __init__(
        self, corrections: Corrections, dead_letters: DeadLetters, hop: HopKey | None = None
    ) -> None:
        self._corrections = corrections
        self._dead_letters = dead_letters
        self._hop = hop

    async def decide(self, record: Record) -> None:
        if lacks_mac(self._hop, record.topic, record.value, record.headers):
            return
        event = decode(COMPLETION, record.value)
        if event.repeat:  # not a completion: the request's own settles its reservation
            return
        actual = event.prompt_tokens + event.completion_tokens
        await self._corrections.settle(event.tenant, event.tier, event.request_id, actual)

    async def effect(self, record: Record, decision: None) -> None:
        return None

    async def fail(self, record: Record, error: BaseException) -> None:
        """A completion that does not decode is dead-lettered here: admission's group
        is the fleet's one reader of ``llm.completions`` that commits."""
        await self._dead_letters.record(record, error)
