"""Following the controller: tail the control topic into a ``ControlState``
(``services.common.control_state``), tell the service what changed and what expired, and
count and log both.

Admission and workers both read the control topic from the beginning with no consumer
group (every instance needs every decision). A decision that expires without a
re-publication is counted (``seawall_control_expired_total``) and logged: at warning when
the controller's (it has stopped), at info when an operator's (its time ran out).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from aiokafka import TopicPartition
from prometheus_client import Counter, Gauge

from schemas import ControlEvent
from seawall_client.kafka import close
from seawall_client.serde import CONTROL, decode
from services.common.bus import make_consumer
from services.common.consuming import ConsumerLoop, Record
from services.common.control_signing import verifier_for
from services.common.control_state import ControlState
from services.common.deadletters import DeadLetters, failure_of
from services.common.lifecycle import Component
from services.common.settings import CommonSettings

log = logging.getLogger(__name__)

CONTROL_EVENTS = Counter(
    "seawall_control_events_total", "Control events read, by outcome", ["kind", "outcome"]
)
CONTROL_EXPIRED = Counter(
    "seawall_control_expired_total",
    "Control decisions dropped because valid_for_s passed without a re-publication",
    ["kind"],
)
CONTROL_REFUSED = Counter(
    "seawall_control_refused_total",
    "Control events not believed: unsigned, by an unknown signer, a bad signature, or "
    "not the signer's to issue (services.common.control_signing)",
    ["reason"],
)
REFUSAL_LOG_EVERY_S = 10.0
"""A refused event is logged at most this often per reason (the counter has them all):
a flood of forged records must not become a flood of log lines."""
CONTROL_AGE = Gauge(
    "seawall_control_state_age_seconds", "Seconds since the last control event was read"
)


def report_expired(event: ControlEvent) -> None:
    """Count and log a decision that ran out without a re-publication."""
    CONTROL_EXPIRED.labels(event.kind).inc()
    # The controller re-publishes what it decided: one of its decisions running
    # out means it stopped. An operator's (``seawall quota``, ``seawall region``)
    # runs out at the end of the time it was given.
    by_controller = event.issuer == "controller"
    log.log(
        logging.WARNING if by_controller else logging.INFO,
        "a control decision expired without a re-publication; back to the default"
        if by_controller
        else "an operator's decision ran out; back to the default",
        extra={
            "key": event.control_key,
            "seq": event.seq,
            "issued_at": event.issued_at,
            "valid_for_s": event.valid_for_s,
        },
    )


class ControlFollower(Component):
    """Tails the control topic into a ``ControlState``; calls ``on_change`` for each
    event that changed the state, and ``on_expire`` for each decision that expired
    (checked after every fetch, at least every half second). A record that is not a
    control event is dead-lettered when ``dead_letters`` is given (one follower per
    fleet should: admission's), else counted and logged; either way the follower
    carries on (``services.common.consuming``). Where signatures are required (the
    default), an event no trusted key signed, or that its signer may not issue, changes
    nothing: it is counted (``seawall_control_refused_total``) and skipped, not
    dead-lettered (a forged flood costs its sender more than it costs us)."""

    name = "control-follower"

    def __init__(
        self,
        settings: CommonSettings,
        topic: str,
        state: ControlState,
        on_change: Callable[[ControlEvent], None] | None = None,
        *,
        on_expire: Callable[[ControlEvent], None] | None = None,
        dead_letters: DeadLetters | None = None,
    ) -> None:
        super().__init__()
        self._settings = settings
        self._topic = topic
        self.state = state
        self._on_change = on_change
        self._on_expire = on_expire
        self._dead_letters = dead_letters
        self._verifier = verifier_for(settings)
        self._logged_refusal: dict[str, float] = {}
        self._consumer = make_consumer(settings, group_id=None)
        self._loop: ConsumerLoop[ControlEvent | None] = ConsumerLoop(
            self._consumer,
            self,
            dead_letters,
            name=self.name,
            commit=False,
            concurrency=1,
            fetch_timeout_ms=500,
            start_consumer=False,
            after_fetch=self._expire,
        )

    async def on_start(self) -> None:
        await self._consumer.start()
        partitions = self._consumer.partitions_for_topic(self._topic) or {0}
        tps = [TopicPartition(self._topic, p) for p in sorted(partitions)]
        self._consumer.assign(tps)
        await self._consumer.seek_to_beginning(*tps)
        await self._loop.start()
        self.spawn(self._watch(), "watch")

    async def _watch(self) -> None:
        await self._loop.failed.wait()
        raise RuntimeError("the control follower's loop failed") from self._loop.failure

    async def on_stop(self) -> None:
        await self._loop.stop()
        await close(self._consumer)

    def _expire(self) -> None:
        for event in self.state.expire():
            report_expired(event)
            if self._on_expire is not None:
                self._on_expire(event)
        age = self.state.age_s()
        if age is not None:
            CONTROL_AGE.set(age)

    # -- the handler (services.common.consuming.Handler) ---------------------------
    async def decide(self, record: Record) -> ControlEvent | None:
        event = decode(CONTROL, record.value)
        if self._verifier is None:
            return event
        refusal = self._verifier.check(record.value, record.headers, event)
        if refusal is None:
            return event
        CONTROL_REFUSED.labels(refusal).inc()
        now = time.monotonic()
        if now - self._logged_refusal.get(refusal, -REFUSAL_LOG_EVERY_S) >= REFUSAL_LOG_EVERY_S:
            self._logged_refusal[refusal] = now
            log.warning(
                "a control event was refused; it changes nothing",
                extra={"reason": refusal, "key": event.control_key, "issuer": event.issuer},
            )
        return None

    async def effect(self, record: Record, decision: ControlEvent | None) -> None:
        if decision is None:
            return
        changed = self.state.apply(decision)
        CONTROL_EVENTS.labels(decision.kind, "applied" if changed else "stale").inc()
        if changed and self._on_change is not None:
            self._on_change(decision)

    async def fail(self, record: Record, error: BaseException) -> None:
        CONTROL_EVENTS.labels("unknown", "invalid").inc()
        if self._dead_letters is not None:
            await self._dead_letters.record(record, error)
            return
        reason, _ = failure_of(error)
        log.warning("skipped an invalid control event", extra={"reason": reason})
