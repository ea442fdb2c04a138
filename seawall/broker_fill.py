"""How full the embedded broker's partitions are, and when ``seawall up`` says so.

The embedded broker (Tansu 0.6.0, memory storage) keeps every record until it stops,
and each fetch that returns records lists every batch stored in its partition: a hop
through a partition costs more the more the partition holds. Under a steady 20
requests/s its CPU grew from 0.5 to 1.3 cores in twenty minutes, and time to first
token at 10 requests/s from 165 to 989 ms at p50 (README, "Embedded defaults"); Apache
Kafka finds a fetch's offset in an index and deletes by retention.
Nothing seawall does can empty a partition there (the broker answers neither deletion
nor retention), so ``seawall up`` reads the partitions' end offsets once a
``CHECK_INTERVAL_S`` and says what to do when the fullest passes ``WARN_RECORDS``, and
again at each doubling.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiokafka import TopicPartition

from seawall.reading import partitions
from services.common.bus import make_consumer
from services.common.settings import CommonSettings

CHECK_INTERVAL_S = 60.0
"""How often ``seawall up`` reads the embedded broker's end offsets."""
WARN_RECORDS = 5_000
"""The fullest partition's records at the first warning. Measured on the embedded
broker: at 200 records/s through one partition it used 0.10 of a core with the
partition empty, 0.23 with 2,000 batches stored in it, 0.71 with 8,000 and 0.94 with
20,000. Under ``seawall load --rate 20`` the fullest partition (``llm.ingress``) held
6,647 records after about 8 minutes, when the broker's CPU had grown from 0.5 to
0.84-0.94 cores."""
READ_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Fullest:
    """The partition holding the most records, and about how many: its end offset, as
    the broker deletes nothing (Tansu's stops at the first offset of the partition's
    last batch)."""

    topic: str
    partition: int
    records: int


class FillAlarm:
    """Whether a reading of the fullest partition deserves a warning: the first time it
    reaches ``first`` records, then each time it doubles the last warned threshold
    (pure)."""

    def __init__(self, first: int = WARN_RECORDS) -> None:
        if first < 1:
            raise ValueError("the first threshold is at least 1 record")
        self._next = first

    def passed(self, records: int) -> bool:
        """Whether ``records`` reached the next threshold (which then moves past it)."""
        if records < self._next:
            return False
        while self._next <= records:
            self._next *= 2
        return True


def fullest(ends: dict[TopicPartition, int]) -> Fullest | None:
    """The partition with the highest end offset (``None`` for none), ties to the
    first in topic and partition order."""
    best: Fullest | None = None
    for tp in sorted(ends, key=lambda tp: (tp.topic, tp.partition)):
        if best is None or ends[tp] > best.records:
            best = Fullest(tp.topic, tp.partition, ends[tp])
    return best


async def read_fullest(
    settings: CommonSettings, timeout_s: float = READ_TIMEOUT_S
) -> Fullest | None:
    """The broker's fullest partition, from one metadata and one end-offsets request
    (no consumer group); raises on a broker that does not answer within ``timeout_s``."""
    consumer = make_consumer(settings, group_id=None, request_timeout_ms=int(timeout_s * 1000))
    async with asyncio.timeout(timeout_s):
        await consumer.start()
        try:
            tps = [tp for topic in await consumer.topics() for tp in partitions(consumer, topic)]
            ends: dict[TopicPartition, int] = await consumer.end_offsets(tps) if tps else {}
        finally:
            await consumer.stop()
    return fullest(ends)


def warning(found: Fullest) -> str:
    """What ``seawall up`` prints when the fullest partition passes a threshold."""
    return (
        f"the embedded broker holds about {found.records:,} records in {found.topic}"
        f"[{found.partition}]. It keeps every record until it stops, and each fetch costs "
        "more the more its partition holds, so the stack slows down as it runs. Restart "
        "`seawall up` to start afresh (API keys stay where Redis outlives the stack), or "
        "run long loads on Apache Kafka (SEAWALL_KAFKA_BOOTSTRAP, compose/)."
    )
