"""Reading topics up to where they end now, with no consumer group: what the CLI's
views (``status``, ``canary``, ``profile``) and ``record`` share.

Tansu, the embedded broker, reports a partition's end offset as the first offset of its
last record batch plus one; reading up to it fetches whole batches, so the last batch
comes whole too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from seawall_client.kafka import Consumer
from services.common.bus import make_consumer
from services.common.settings import CommonSettings


def catch_up_consumer(settings: CommonSettings) -> Consumer:
    """A groupless consumer for a reader catching up to an end, not an idle follower: it
    fetches until it gets there, never dormant between doorbell rings (a fetch answered
    late under load would put it to sleep for a peek's 5 s with the backlog unread)."""
    return make_consumer(settings, group_id=None, rung=False)


def partitions(consumer: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
    """The topic's partitions as the started consumer's metadata knows them."""
    return [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]


async def seek_since(consumer: AIOKafkaConsumer, tps: list[TopicPartition], since_ms: int) -> None:
    """Position each partition at its first record stamped at or after ``since_ms``, or
    at its end when there is none (Kafka answers ``None``, Tansu offset 0 with timestamp
    -1)."""
    starts = await consumer.offsets_for_times(dict.fromkeys(tps, since_ms))
    ends = await consumer.end_offsets(tps)
    for tp in tps:
        found = starts.get(tp)
        recent = found is not None and found.timestamp >= since_ms
        consumer.seek(tp, found.offset if found is not None and recent else ends[tp])


async def read_to_end(
    consumer: AIOKafkaConsumer, tps: Iterable[TopicPartition]
) -> AsyncIterator[tuple[TopicPartition, ConsumerRecord[bytes, bytes]]]:
    """Every record from each partition's position to its end as it is now."""
    ends: dict[TopicPartition, int] = await consumer.end_offsets(list(tps))
    while True:
        pending = [tp for tp in ends if await consumer.position(tp) < ends[tp]]
        if not pending:
            return
        batches = await consumer.getmany(*pending, timeout_ms=200)
        for tp, records in batches.items():
            for record in records:
                yield tp, record
