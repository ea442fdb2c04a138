"""Admission's quota hints for ingress, published (what they say: ``policy.hints``, pure).

A rejection because a tenant's requests bucket is empty publishes a ``QuotaHint`` on
``llm.quota.hints`` (``policy.hints``: at most about one per tenant per refill), so that
ingress refuses the tenant's next requests itself until the bucket can pay again: an
abusive tenant costs no Kafka hop, no Redis call and no decision here. When a tenant's
override comes, goes or changes, a clearing hint tells ingress to drop the last one.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from aiokafka import AIOKafkaProducer

from schemas import QuotaHint
from seawall_client.clock import Clock
from seawall_client.serde import encode
from services.admission import metrics as m
from services.admission.policy.bucket import QuotaDecision
from services.admission.policy.hints import HintThrottle, clear_hint, hint_for
from services.admission.policy.overrides import override_terms, quota_override
from services.common.control_state import ControlState
from services.common.failures import is_infrastructure
from services.common.hop_signing import HopKey, mac_headers


class HintPublisher:
    """Publishes the hints of rejections and of changed overrides on one topic."""

    def __init__(
        self,
        producer: AIOKafkaProducer,
        topic: str,
        control: ControlState,
        clock: Clock,
        finish: Callable[[Coroutine[Any, Any, Any]], None],
        hop: HopKey | None = None,
    ) -> None:
        """``hop``: MACs each hint for ingress (``hop_signing``, the ``hints`` hop)."""
        self._producer = producer
        self._hop = hop
        self._topic = topic
        self._control = control
        self._clock = clock
        self._finish = finish
        self._hints = HintThrottle()
        self._overrides: dict[str, tuple[float | None, ...]] = {}
        """Tenant → the terms of its override in force (see ``quota_changed``)."""

    def quota_changed(self, tenant: str) -> None:
        """A tenant's override came, went or changed (not a mere re-publication):
        ingress drops the tenant's hint, which may no longer hold."""
        current = quota_override(self._control, tenant, self._clock.time())
        terms = None if current is None else override_terms(current)
        if self._overrides.get(tenant) == terms:
            return
        if terms is None:
            self._overrides.pop(tenant, None)
        else:
            self._overrides[tenant] = terms
        self._hints.forget(tenant)
        self._finish(self._send(clear_hint(tenant, self._clock.time())))

    async def _send(self, hint: QuotaHint) -> bool:
        """Queue a hint (not awaited for its ack; skipped while the broker is
        unavailable: a lost hint only sends the tenant's next requests here)."""
        try:
            value = encode(hint)
            await self._producer.send(
                self._topic,
                value,
                key=hint.tenant.encode(),
                headers=mac_headers(self._hop, self._topic, value),
            )
        except Exception as e:
            if not is_infrastructure(e):
                raise
            return False
        m.QUOTA_HINTS.inc()
        return True

    async def hint(self, tenant: str, decision: QuotaDecision) -> None:
        """Tell ingress when a tenant's requests bucket is empty (``policy.hints``); not
        awaited for its ack, and skipped while the broker is unavailable: a lost hint
        only sends the tenant's next requests here."""
        hint = hint_for(tenant, decision)
        if hint is not None and self._hints.admit(hint):
            await self._send(hint)
