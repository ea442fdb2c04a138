"""The shell of ``seawall status``: ``collect`` reads the whole control topic and the
telemetry topic from ``window_s`` ago, with no consumer group (it changes nothing on the
broker), up to the end offsets seen when it started, so that it returns promptly on
empty and busy topics alike; then the committed offsets of the fleet's consumer groups;
all within ``timeout_s``. ``run_status`` prints the result.
"""

from __future__ import annotations

import asyncio
import time

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from rich.console import Console
from rich.markup import escape

from seawall.reading import catch_up_consumer, partitions, read_to_end, seek_since
from seawall.status.fold import GROUP_STEM, STALE_AFTER_S, FleetStatus, StatusFold, lags
from seawall.status.render import render
from seawall_client.kafka import new_admin
from seawall_client.topics import Topics
from services.common.bus import topics_of
from services.common.control_signing import ControlKeysMissing, ControlVerifier, verifier_for
from services.common.settings import CommonSettings


class StatusError(Exception):
    """The fleet could not be read; the message tells the operator why."""


async def _read_topics(
    consumer: AIOKafkaConsumer,
    topics: Topics,
    fold: StatusFold,
    since: float,
    verifier: ControlVerifier | None = None,
) -> None:
    """Feed ``fold`` the whole control topic and the telemetry from ``since`` on, up to
    the end offsets of now (``seawall.reading``)."""
    control = partitions(consumer, topics.control)
    telemetry = partitions(consumer, topics.telemetry)
    consumer.assign([*control, *telemetry])
    await consumer.seek_to_beginning(*control)
    await seek_since(consumer, telemetry, int(since * 1000))
    async for tp, record in read_to_end(consumer, [*control, *telemetry]):
        if tp.topic == topics.control:
            fold.feed_control(record.value, record.headers, verifier)
        else:
            fold.feed_telemetry(record.value)


async def _committed(
    settings: CommonSettings, partitions: list[TopicPartition]
) -> dict[str, dict[TopicPartition, int]]:
    """The fleet's consumer groups (``<prefix>seawall…``) and their committed offsets
    among ``partitions``."""
    admin = new_admin(settings.kafka)
    await admin.start()
    try:
        stem = f"{settings.topic_prefix}{GROUP_STEM}"
        groups = sorted(g for g, *_ in await admin.list_consumer_groups() if g.startswith(stem))
        committed: dict[str, dict[TopicPartition, int]] = {}
        for group in groups:
            # Named partitions: Tansu answers a request for "all of them" with a response
            # aiokafka cannot parse.
            offsets = await admin.list_consumer_group_offsets(group, partitions=partitions)
            committed[group] = {tp: o.offset for tp, o in offsets.items() if o.offset >= 0}
        return committed
    finally:
        await admin.close()


async def _collect(settings: CommonSettings, window_s: float, stale_after_s: float) -> FleetStatus:
    topics = topics_of(settings)
    consumer = catch_up_consumer(settings)
    try:
        try:
            await consumer.start()
        except KafkaError as e:
            raise StatusError(f"no broker answered at {settings.kafka_bootstrap}: {e}") from None
        existing = await consumer.topics()
        missing = [t for t in (topics.telemetry, topics.control) if t not in existing]
        if missing:
            raise StatusError(
                f"no topic {', '.join(missing)} on {settings.kafka_bootstrap} (is the stack "
                "up? check SEAWALL_KAFKA_BOOTSTRAP and SEAWALL_TOPIC_PREFIX)"
            )
        # Before ``assign``: from then on the metadata holds only the assigned topics. The
        # telemetry and control topics carry the prefix: never an empty list.
        ours = [
            tp
            for topic in sorted(existing)
            if topic.startswith(settings.topic_prefix) and not topic.startswith("__")
            for tp in partitions(consumer, topic)
        ]
        fold = StatusFold(stale_after_s)
        try:
            verifier = verifier_for(settings)
        except ControlKeysMissing as e:
            raise StatusError(str(e)) from None
        await _read_topics(consumer, topics, fold, time.time() - window_s, verifier)
        committed = await _committed(settings, ours)
        held = sorted({tp for offsets in committed.values() for tp in offsets})
        ends = await consumer.end_offsets(held) if held else {}
        groups = list(committed)
        return fold.result(time.time(), window_s, settings.pools, groups, lags(committed, ends))
    finally:
        await consumer.stop()


async def collect(
    settings: CommonSettings,
    window_s: float,
    timeout_s: float,
    stale_after_s: float = STALE_AFTER_S,
) -> FleetStatus:
    """Read the fleet's status from the broker; ``StatusError`` if it cannot be read
    within ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _collect(settings, window_s, stale_after_s)
    except TimeoutError:
        raise StatusError(
            f"the broker at {settings.kafka_bootstrap} did not give the fleet's status "
            f"within {timeout_s:g}s"
        ) from None
    except KafkaError as e:
        raise StatusError(f"the broker at {settings.kafka_bootstrap} failed: {e}") from None


def run_status(
    settings: CommonSettings,
    window_s: float,
    as_json: bool,
    timeout_s: float,
    console: Console,
) -> int:
    """Print the fleet's status as tables or one JSON document; the exit status: 0 done,
    1 no broker, no fleet topics, or no answer in time."""
    try:
        status = asyncio.run(collect(settings, window_s, timeout_s))
    except StatusError as e:
        console.print(f"[red]{escape(str(e))}[/]", highlight=False)
        return 1
    if as_json:
        console.out(status.to_json(), highlight=False)
    else:
        render(status, console)
    return 0
