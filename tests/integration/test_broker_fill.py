"""``seawall up``'s fill check on a real embedded broker of its own (the session's
broker holds other tests' topics, so what it holds is not this test's alone)."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from seawall import embedded
from seawall.broker_fill import Fill, FillAlarm, read_fill
from seawall.up import Stack, UpOptions
from seawall_client.kafka import ensure_topics
from seawall_client.topics import TopicSpec
from services.common.bus import make_producer, wait_for_broker
from services.common.settings import CommonSettings

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def own_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fresh embedded broker holding 30 records in ``a``[1] and 5 in ``b``[0], one
    batch each (its end offset is its last batch's first offset plus one)."""
    port = embedded.free_port()
    proc = embedded.broker_process(
        "127.0.0.1", port, tmp_path_factory.mktemp("fill") / "broker.log"
    )
    proc.start()
    bootstrap = f"127.0.0.1:{port}"
    try:
        asyncio.run(_fill(bootstrap))
        yield bootstrap
    finally:
        proc.stop()


async def _fill(bootstrap: str) -> None:
    await wait_for_broker(bootstrap, timeout_s=30)
    await ensure_topics(bootstrap, [TopicSpec("a", 2), TopicSpec("b", 1)])
    settings = CommonSettings(_env_file=None, kafka_bootstrap=bootstrap, kafka_idempotence=False)
    producer = make_producer(settings)
    await producer.start()
    try:
        for topic, partition, n in (("a", 1, 30), ("b", 0, 5)):
            for i in range(n):
                await (await producer.send(topic, b"x", key=str(i).encode(), partition=partition))
    finally:
        await producer.stop()


def test_what_the_broker_holds_is_read_from_it(own_broker: str) -> None:
    settings = CommonSettings(_env_file=None, kafka_bootstrap=own_broker)
    assert asyncio.run(read_fill(settings)) == Fill(35, "a", 1, 30)


def _stack(tmp_path: Path, bootstrap: str, external: bool) -> tuple[Stack, io.StringIO]:
    out = io.StringIO()
    options = UpOptions(state_dir=tmp_path, kafka_bootstrap=bootstrap if external else None)
    stack = Stack(options, Console(file=out, width=400, color_system=None))
    stack.bootstrap = bootstrap
    stack.fill_alarm = FillAlarm(first=20)
    return stack, out


def test_up_says_what_the_embedded_broker_holds_past_the_threshold(
    own_broker: str, tmp_path: Path
) -> None:
    stack, out = _stack(tmp_path, own_broker, external=False)
    stack.check_fill()
    assert "holds about 35 records, 30 of them in a[1]" in out.getvalue()


def test_up_leaves_an_external_broker_alone(own_broker: str, tmp_path: Path) -> None:
    stack, out = _stack(tmp_path, own_broker, external=True)
    stack.check_fill()
    assert out.getvalue() == ""
