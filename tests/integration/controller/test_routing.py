"""Which controller path a telemetry record takes: on its pool's partition (as workers
key it) it is decided where it was read; on any other partition (another producer's
key) it goes through the internal topic keyed by pool. Both end in a decision."""

from __future__ import annotations

import asyncio
import time

from aiokafka.partitioner import DefaultPartitioner

from seawall_client.serde import TELEMETRY, decode, encode
from seawall_client.topics import Topics
from services.common.bus import make_producer
from services.common.settings import CommonSettings
from services.controller.settings import ControllerSettings
from tests.admission_helpers import TopicReader, heartbeat
from tests.integration.controller.test_controller import CONTROLLER, control_log, controller
from tests.signing import headers_for


def partition_of(key: str, partitions: int) -> int:
    every = list(range(partitions))
    partition: int = DefaultPartitioner()(key.encode(), every, every)
    return partition


async def test_records_on_their_pools_partition_skip_the_internal_topic(
    settings: CommonSettings, topics: Topics
) -> None:
    n = settings.topic_partitions
    # a key away from the pool's partition, as another producer keying by worker may use
    stray = next(
        f"w-{i}" for i in range(1000) if partition_of(f"w-{i}", n) != partition_of("main", n)
    )
    keys = {"by-pool": "main", stray: stray}
    internal = ControllerSettings(**(settings.model_dump() | CONTROLLER)).app_id
    internal_topic = f"{internal}-telemetry-by-pool"
    producer = make_producer(settings)
    await producer.start()
    try:
        async with control_log(settings, topics) as control, controller(settings):
            # the controller starts from the latest offsets: beat until both are decided
            deadline = time.monotonic() + 60
            while any(control.latest(f"breaker/worker:{w}") is None for w in keys):
                assert time.monotonic() < deadline, "no decision for a worker"
                for worker, key in keys.items():
                    record = encode(heartbeat(worker))
                    await producer.send_and_wait(
                        topics.telemetry,
                        record,
                        key=key.encode(),
                        headers=headers_for(settings, topics.telemetry, record),
                    )
                await asyncio.sleep(0.5)
    finally:
        await producer.stop()
    async with TopicReader(settings, internal_topic) as reader:
        await reader.until(internal_topic, 1)
        await reader.poll(500)
    forwarded = {decode(TELEMETRY, raw).worker_id for raw in reader.raw[internal_topic]}
    assert forwarded == {stray}
