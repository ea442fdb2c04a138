"""faust's aiokafka transport with the fetch wait taken from our settings.

faust-streaming builds its worker consumer with ``fetch_max_wait_ms=1500`` written into
the call (``faust/transport/drivers/aiokafka.py``, ``_create_worker_consumer``), not
read from its configuration. Against Apache Kafka that is harmless: a fetch is answered
as soon as a record arrives. The embedded broker answers a waiting fetch late, so each
telemetry record reached the controller a share of those 1.5 s after it was produced,
which was most of the controller's reaction time (``bench/reaction.py``).

aiokafka reads the wait when the consumer starts (it builds its fetcher then), so the
consumer faust built is given ``consumer_fetch_max_wait_ms`` before faust starts it.
Everything else stays faust's own.
"""

from __future__ import annotations

from typing import Any, cast

import aiokafka
import faust
from faust.transport.drivers import aiokafka as faust_aiokafka


class _ConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport: Any) -> aiokafka.AIOKafkaConsumer:
        consumer = super()._create_worker_consumer(transport)
        consumer._fetch_max_wait_ms = cast(App, self.app).fetch_max_wait_ms
        return consumer


class _Consumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> faust_aiokafka.AIOKafkaConsumerThread:
        return _ConsumerThread(self, loop=self.loop, beacon=self.beacon)


class _Transport(faust_aiokafka.Transport):
    Consumer = _Consumer


class App(faust.App):
    """A faust app whose worker consumer waits at most ``fetch_max_wait_ms`` per fetch."""

    def __init__(self, *args: Any, fetch_max_wait_ms: int, **kwargs: Any) -> None:
        self.fetch_max_wait_ms = fetch_max_wait_ms
        super().__init__(*args, **kwargs)

    def _new_transport(self) -> Any:
        return _Transport(self.conf.broker_consumer, self)
