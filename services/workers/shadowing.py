"""The worker's I/O side of shadow runs (``shadows`` decides what a shadow is).

Once a request that admission ordered a shadow for is answered, ``send`` puts the
shadow on the order's pool; a shadow taken off this worker's dispatch topic is run by
``run``, and how it compared is counted (metrics and the report's summary). Neither
answers anybody, and neither failing fails a request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiokafka import AIOKafkaProducer, TopicPartition

from schemas import DispatchedRequest, InferenceReply
from seawall_client.clock import Clock
from seawall_client.serde import encode
from seawall_client.topics import Topics
from services.common.failures import is_infrastructure
from services.common.hop_signing import hop_key_for, mac_headers
from services.common.sampling import sampling_secret
from services.workers import metrics as m
from services.workers.engine.base import Engine, EngineError
from services.workers.policy.consistency import Comparison
from services.workers.policy.summary import RequestSummarizer
from services.workers.settings import WorkerSettings
from services.workers.shadows import run_shadow, shadow_for, shadow_key, shadow_partition

log = logging.getLogger(__name__)


class Shadowing:
    """Sends the shadows ordered for this worker's answers; runs those it is sent."""

    def __init__(
        self,
        *,
        settings: WorkerSettings,
        engine: Engine,
        producer: AIOKafkaProducer,
        topics: Topics,
        summary: RequestSummarizer,
        partitions: Callable[[], frozenset[TopicPartition]],
        clock: Clock,
    ) -> None:
        self.settings = settings
        self.worker_id = settings.instance_id
        self.engine = engine
        self._producer = producer
        self._hop = hop_key_for(settings, "dispatch")
        self._secret = sampling_secret(settings)
        """Keys where a shadow goes (``shadows.shadow_partition``)."""
        self.topics = topics
        self._summary = summary
        self._partitions = partitions
        self.clock = clock

    async def run(self, d: DispatchedRequest) -> None:
        """Run a shadow of the output-consistency check and count how it compared; a
        shadow's own failure is counted, never answered (it answers nobody)."""
        pool = self.settings.pool
        try:
            outcome = await run_shadow(self.engine, d, self.worker_id, self.clock.time())
        except EngineError:
            raise
        except Exception as e:
            log.warning("a shadow run failed", extra={"error": repr(e)[:200]})
            m.CONSISTENCY.labels(pool, "failed").inc()
            return
        if isinstance(outcome, Comparison):
            self._summary.add_consistency(outcome.agrees, outcome.similarity)
            m.CONSISTENCY.labels(pool, "agree" if outcome.agrees else "differ").inc()
            m.CONSISTENCY_SIMILARITY.labels(pool).observe(outcome.similarity)
        else:
            m.CONSISTENCY.labels(pool, outcome).inc()

    async def send(self, d: DispatchedRequest, reply: InferenceReply) -> None:
        """Send the shadow admission ordered for ``d``, if it did (not awaited: a lost
        shadow is one comparison fewer)."""
        shadow = shadow_for(d, reply, self.worker_id, self.clock.time())
        if shadow is None:
            return
        topic = self.topics.dispatch(shadow.pool)
        try:
            partition = None
            if shadow.pool == self.settings.pool:
                partition = shadow_partition(
                    shadow,
                    await self._producer.partitions_for(topic),
                    (tp.partition for tp in self._partitions()),
                    self._secret,
                )
            value = encode(shadow)
            await self._producer.send(
                topic,
                value,
                key=shadow_key(shadow, self._secret),
                partition=partition,
                headers=mac_headers(self._hop, topic, value),
            )
        except Exception as e:
            if not is_infrastructure(e):
                raise
            m.CONSISTENCY.labels(self.settings.pool, "not_sent").inc()
