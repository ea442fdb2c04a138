"""How full the embedded broker is, and when ``seawall up`` says so.

The embedded broker (Tansu 0.6.0, memory storage) keeps every record until it stops,
and each fetch that returns records lists every batch stored in its partition: a hop
through a partition costs more the more the partition holds. Under a steady 20
requests/s its CPU grew from 0.5 to 1.3 cores in twenty minutes, and time to first
token at 10 requests/s from 165 to 989 ms at p50 (README, "Embedded defaults"); Apache
Kafka finds a fetch's offset in an index and deletes by retention.
Nothing seawall does can empty a partition there (the broker answers neither deletion
nor retention), so ``seawall up`` reads the partitions' end offsets once a
``CHECK_INTERVAL_S`` and says what to do when the records held pass ``WARN_RECORDS``,
and again at each doubling.

What the broker spends grows with every busy partition's size, and a stack's records
spread over many (the replies, the completions, the priority and dispatch topics, the
control topic that every service follows), so the alarm counts the records of all of
them; the warning names the fullest too.
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
WARN_RECORDS = 50_000
"""The records held at the first warning. Measured on the embedded broker: under
``seawall load --rate 20`` it held about 75,000 after 8 minutes, when its CPU had grown
from 0.5 to 0.84-0.94 cores; an idle stack adds about 7 records a second (its
telemetry 4, the control topic's decisions 2.8), so it passes 50,000 after about two
hours. One partition alone at 200 records/s: the broker used 0.10 of a core with the
partition empty, 0.23 with 2,000 batches stored in it, 0.71 with 8,000 and 0.94 with
20,000."""
READ_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Fill:
    """What the broker holds: records in all (about: each partition's end offset, as
    the broker deletes nothing, and Tansu's stops at the first offset of a partition's
    last batch), and the partition holding the most."""

    records: int
    topic: str
    partition: int
    partition_records: int


class FillAlarm:
    """Whether a reading of the records held deserves a warning: the first time it
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


def fill_of(ends: dict[TopicPartition, int]) -> Fill | None:
    """The records of all partitions and the fullest (ties to the first in topic and
    partition order); ``None`` for no partition."""
    if not ends:
        return None
    fullest = min(ends, key=lambda tp: (-ends[tp], tp.topic, tp.partition))
    return Fill(sum(ends.values()), fullest.topic, fullest.partition, ends[fullest])


async def read_fill(settings: CommonSettings, timeout_s: float = READ_TIMEOUT_S) -> Fill | None:
    """What the broker holds, from one metadata and one end-offsets request (no
    consumer group); raises on a broker that does not answer within ``timeout_s``."""
    consumer = make_consumer(settings, group_id=None, request_timeout_ms=int(timeout_s * 1000))
    async with asyncio.timeout(timeout_s):
        await consumer.start()
        try:
            tps = [tp for topic in await consumer.topics() for tp in partitions(consumer, topic)]
            ends: dict[TopicPartition, int] = await consumer.end_offsets(tps) if tps else {}
        finally:
            await consumer.stop()
    return fill_of(ends)


def warning(fill: Fill) -> str:
    """What ``seawall up`` prints when the records held pass a threshold."""
    return (
        f"the embedded broker holds about {fill.records:,} records, {fill.partition_records:,} "
        f"of them in {fill.topic}[{fill.partition}]. It keeps every record until it stops, "
        "and each fetch costs more the more its partition holds, so the stack slows down "
        "as it runs. Restart "
        "`seawall up` to start afresh (API keys stay where Redis outlives the stack), or "
        "run long loads on Apache Kafka (SEAWALL_KAFKA_BOOTSTRAP, compose/)."
    )
