"""Dead letters, bounded and screened: what every service does with a record it cannot
use and cannot answer.

A letter keeps where the record is, its size, the SHA-256 of its value and an excerpt
of at most ``EXCERPT_BYTES`` with sensitive data redacted (the detector ingress screens
prompts with) — never the whole value, which may be as large as the broker allows (the
letter would then be too large to produce) and may hold a prompt or a secret. So a
letter is always small enough to send, and sending it can only fail when the broker
does: ``DeadLetters.send`` then waits and tries again (the caller's loop pauses, as
for any broker outage) and returns once the broker acknowledged it, so that the caller
may commit the record's offset afterwards.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import ProducerClosed
from aiokafka.structs import ConsumerRecord
from prometheus_client import Counter

from schemas import DeadLetter
from schemas.deadletter import EXCERPT_BYTES, KEY_EXCERPT_BYTES
from seawall_client.clock import SYSTEM_CLOCK, Clock
from seawall_client.serde import DecodeError, encode
from services.common.failures import Backoff
from services.common.sensitive import detect, redact

log = logging.getLogger(__name__)

LOG_PER_S = 10
"""Dead letters logged per reason and second; the metric counts every one."""
DEAD_LETTERS = Counter(
    "seawall_dead_letters_total",
    "Records dead-lettered, by the service that refused them and the reason",
    ["service", "reason"],
)


def screened_excerpt(value: bytes, limit: int = EXCERPT_BYTES) -> bytes:
    """The first ``limit`` bytes of ``value`` with sensitive spans redacted. Bytes that
    are not UTF-8 pass through unchanged (surrogate escapes), so the excerpt still shows
    what a binary record began with; the redaction markers may lengthen the text, so
    the result is cut to ``limit`` again."""
    text = value[:limit].decode("utf-8", errors="surrogateescape")
    findings = detect(text)
    if findings:
        text = redact(text, findings)
    return text.encode("utf-8", errors="surrogateescape")[:limit]


def letter(
    *,
    source_topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    reason: str,
    error: str,
    service: str,
    at: float,
) -> DeadLetter:
    """A bounded letter for one record (pure)."""
    return DeadLetter(
        source_topic=source_topic,
        partition=partition,
        offset=offset,
        key=None if key is None else screened_excerpt(key, KEY_EXCERPT_BYTES),
        excerpt=b"" if value is None else screened_excerpt(value),
        size=0 if value is None else len(value),
        sha256=None if value is None else hashlib.sha256(value).hexdigest(),
        reason=reason,
        error=error[:512],
        service=service,
        at=at,
    )


def failure_of(error: BaseException) -> tuple[str, str]:
    """The ``(reason, message)`` of a letter for a record-level failure. A
    ``DecodeError`` (and its subclasses) carries both, written never to echo the input;
    any other exception is named by its type alone, since its message might quote the
    record."""
    if isinstance(error, DecodeError):
        return error.reason, error.message
    return "processing_error", f"{type(error).__name__} while processing the record"


class DeadLetters:
    """Sends letters for one service; see the module notes."""

    def __init__(
        self,
        producer: AIOKafkaProducer,
        topic: str,
        service: str,
        clock: Clock = SYSTEM_CLOCK,
        backoff: Backoff | None = None,
    ) -> None:
        self._producer = producer
        self._topic = topic
        self.service = service
        self._clock = clock
        self._backoff = backoff or Backoff()
        self._logged: dict[str, tuple[int, int, int]] = {}
        """Per reason: the second, lines logged in it, letters not logged since."""

    async def record(self, record: ConsumerRecord[bytes, bytes], error: BaseException) -> None:
        """Dead-letter a consumed record for ``error`` (see ``failure_of``), and wait for
        the broker's ack (again, after a backoff, while it does not come)."""
        reason, message = failure_of(error)
        await self.send(**_where(record), reason=reason, error=message)

    async def queue(
        self, record: ConsumerRecord[bytes, bytes], error: BaseException
    ) -> asyncio.Future[Any]:
        """Queue a consumed record's letter without waiting for the broker: the future
        of its ack, for a caller that awaits many together (a ``ConsumerLoop`` effect;
        an ack that fails is then the caller's to try again)."""
        reason, message = failure_of(error)
        item = self._letter(**_where(record), reason=reason, error=message)
        future: asyncio.Future[Any] = await self._producer.send(
            self._topic, encode(item), key=record.topic.encode()
        )

        def acknowledged(f: asyncio.Future[Any]) -> None:
            if not f.cancelled() and f.exception() is None:
                self._sent(item)

        future.add_done_callback(acknowledged)
        return future

    async def send(
        self,
        *,
        source_topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        reason: str,
        error: str,
    ) -> None:
        item = self._letter(
            source_topic=source_topic,
            partition=partition,
            offset=offset,
            key=key,
            value=value,
            reason=reason,
            error=error,
        )
        payload = encode(item)
        while True:
            try:
                await self._producer.send_and_wait(self._topic, payload, key=source_topic.encode())
                break
            except ProducerClosed:
                raise  # the service is stopping: the record stays uncommitted
            except Exception as e:  # a bounded letter fails only with the broker
                log.warning(
                    "dead letter not acknowledged; trying again",
                    extra={"error": type(e).__name__, "source": source_topic},
                )
                await self._backoff.wait()
        self._backoff.reset()
        self._sent(item)

    def _letter(self, **where: Any) -> DeadLetter:
        return letter(**where, service=self.service, at=self._clock.time())

    def _sent(self, item: DeadLetter) -> None:
        """Count it; log it, unless ``LOG_PER_S`` lines for its reason were written in
        the last second (a flood logs a sample and how many it left out)."""
        DEAD_LETTERS.labels(self.service.split(":")[0], item.reason).inc()
        second = int(self._clock.monotonic())
        start, logged, skipped = self._logged.get(item.reason, (second, 0, 0))
        if start != second:
            start, logged = second, 0
        if logged >= LOG_PER_S:
            self._logged[item.reason] = (start, logged, skipped + 1)
            return
        self._logged[item.reason] = (start, logged + 1, 0)
        log.warning(
            "dead-lettered a record",
            extra={
                "source": item.source_topic,
                "partition": item.partition,
                "offset": item.offset,
                "reason": item.reason,
                "size": item.size,
            }
            | ({"not_logged_before": skipped} if skipped else {}),
        )


def _where(record: ConsumerRecord[bytes, bytes]) -> dict[str, Any]:
    return {
        "source_topic": record.topic,
        "partition": record.partition,
        "offset": record.offset,
        "key": record.key,
        "value": record.value,
    }
