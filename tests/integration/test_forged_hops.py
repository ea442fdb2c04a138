"""Forged records past ingress on the real broker (``services.common.hop_signing``): a
producer with write access to a priority or dispatch topic but no hop secret gets
nothing admitted and nothing served, and the genuine path still works."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from schemas import Priority
from seawall_client.kafka import ensure_topics
from seawall_client.serde import encode
from seawall_client.topics import Topics
from services.admission.service import Admission
from services.common.bus import make_producer
from services.common.settings import CommonSettings
from tests.admission_helpers import (
    TopicReader,
    admission_settings,
    capacity_feed,
    inference_request,
    send_all,
    started,
)
from tests.fleet import ReplyReader, dispatched, produce, sim_worker, worker_settings
from tests.signing import headers_for


def refused(hop: str, reason: str) -> float:
    labels = {"hop": hop, "reason": reason}
    return REGISTRY.get_sample_value("seawall_hop_refused_total", labels) or 0.0


async def test_admission_admits_only_what_ingress_signed_for_its_topic(
    settings: CommonSettings, topics: Topics
) -> None:
    before = {r: refused("requests", r) for r in ("unsigned", "bad_mac")}
    vip = topics.requests(Priority.VIP)
    standard = topics.requests(Priority.STANDARD)
    await ensure_topics(settings.kafka_bootstrap, [topics.reply_spec("x")])
    async with (
        Admission(admission_settings(settings)),
        capacity_feed(settings, topics, {"main": 1_000}),
        TopicReader(settings, topics.dispatch("main")) as reader,
    ):
        producer = make_producer(settings)
        await producer.start()
        try:
            unsigned = inference_request("forged-unsigned", topics.reply("x"))
            await producer.send_and_wait(vip, encode(unsigned), key=b"a")
            # Genuinely signed for the standard topic, replayed onto the VIP one.
            moved = encode(inference_request("forged-moved", topics.reply("x")))
            await producer.send_and_wait(
                vip, moved, key=b"b", headers=headers_for(settings, standard, moved)
            )
        finally:
            await producer.stop()
        await send_all(settings, standard, [inference_request("genuine", topics.reply("x"))])
        await reader.until(topics.dispatch("main"), 1)
        await asyncio.sleep(1.0)  # the forgeries were read before the genuine one
        await reader.poll()
    ids = [d.request.request_id for d in reader.dispatched(topics.dispatch("main"))]
    assert ids == ["genuine"]
    assert refused("requests", "unsigned") - before["unsigned"] == 1
    assert refused("requests", "bad_mac") - before["bad_mac"] == 1


async def test_a_worker_serves_only_what_admission_signed(
    settings: CommonSettings, topics: Topics
) -> None:
    before = refused("dispatch", "unsigned")
    main = topics.dispatch("main")
    async with (
        started(sim_worker(worker_settings(settings))),
        ReplyReader(settings, topics) as replies,
    ):
        producer = make_producer(settings)
        await producer.start()
        try:
            forged = dispatched(1, replies.topic, max_tokens=4)
            await producer.send_and_wait(main, encode(forged), key=b"f")
        finally:
            await producer.stop()
        genuine = dispatched(2, replies.topic, max_tokens=4)
        await produce(settings, main, [genuine])
        await replies.wait_terminals(1)
        await asyncio.sleep(1.0)
        await replies.poll()
        assert list(replies.terminals) == [genuine.request.request_id]
    assert refused("dispatch", "unsigned") - before == 1
