"""The pools this controller instance owns: their deciders, restored from the
``decisions`` table when a pool is first decided here, and their records written back.

A pool is owned by the instance assigned its partition of the internal topic; the
partitions are the faust producer's (``keys.partition_by_pool``). On each full tick the
instance drops the deciders of the pools that moved away and adopts those of its
partitions the table holds (``adopt_owned_pools``); a decider is restored from its
pool's record and its workers' (a record that cannot be read is left out: its scope
starts afresh). A change is written to the table *before* its control event is handed
to the ``Outbox``, which flushes the changelog before it publishes, so a restarted
controller never restores a state older than one it published.
"""

from __future__ import annotations

import logging
from typing import TypeVar

import faust
from faust.types import TableT, TopicT
from pydantic import ValidationError

from seawall_client.serde import encode
from services.controller.decider.config import DeciderConfig
from services.controller.decider.pool import Output, PoolDecider
from services.controller.decider.records import PoolRecord, WorkerRecord
from services.controller.keys import (
    FLEET_KEY,
    KEY_SEPARATOR,
    partition_by_pool,
    pool_key,
    worker_key,
)
from services.controller.outbox import Outbox

log = logging.getLogger(__name__)

R = TypeVar("R", PoolRecord, WorkerRecord)


class Pools:
    """The deciders of the pools this instance owns, the ``decisions`` table behind
    them, and which partitions (so which pools) faust assigned this instance."""

    def __init__(
        self,
        app: faust.App,
        decisions: TableT[bytes, bytes],
        by_pool: TopicT,
        config: DeciderConfig,
        topic_partitions: int,
        outbox: Outbox,
    ) -> None:
        self.app = app
        self.config = config
        self.deciders: dict[str, PoolDecider] = {}
        """The pools this instance owns now."""
        self._decisions = decisions
        self._by_pool = by_pool
        self._topic_partitions = topic_partitions
        self._outbox = outbox
        self._pool_partitions: dict[str, int] = {}

    @property
    def ready(self) -> bool:
        """Recovered and not rebalancing: the table holds what this instance owns."""
        app = self.app
        recovery = app.tables.recovery  # type: ignore[attr-defined]
        return bool(recovery.completed.is_set()) and not app.rebalancing and not app.in_recovery

    def partition(self, pool: str) -> int:
        """The partition of a pool, as the producer's partitioner picks it for the
        internal topic and the changelog alike (remembered: ``route`` asks per record)."""
        partition = self._pool_partitions.get(pool)
        if partition is None:
            partitions = list(range(self._topic_partitions))
            partition = partition_by_pool(pool_key(pool), partitions, partitions)
            self._pool_partitions[pool] = partition
        return partition

    def _owned_partitions(self) -> set[int]:
        topic = self._by_pool.get_topic_name()
        return {tp.partition for tp in self.app.assignor.assigned_actives() if tp.topic == topic}

    def owns_pool(self, pool: str) -> bool:
        """Whether this instance decides for ``pool`` (and its canaries') now."""
        return self.ready and self.partition(pool) in self._owned_partitions()

    def owns_fleet(self) -> bool:
        """Whether this instance makes the fleet-wide decisions (hotspot throttles):
        the one that owns the partition of the key ``#fleet`` (never a pool's name)."""
        return self.owns_pool(FLEET_KEY)

    def adopt_owned_pools(self, now: float) -> None:
        owned = self._owned_partitions()
        for pool in [p for p in self.deciders if self.partition(p) not in owned]:
            log.info("pool moved to another controller instance", extra={"pool": pool})
            del self.deciders[pool]
        for key in list(self._decisions):
            if KEY_SEPARATOR in key:
                continue  # a worker's record: restored with its pool's
            pool = key.decode()
            if pool not in self.deciders and self.partition(pool) in owned:
                self.decider(pool, now)

    def decider(self, pool: str, now: float) -> PoolDecider:
        decider = self.deciders.get(pool)
        if decider is not None:
            return decider
        record = self._restored(PoolRecord, pool_key(pool))
        workers: list[WorkerRecord] = []
        if record is not None:
            prefix = pool_key(pool) + KEY_SEPARATOR
            for key in [k for k in self._decisions if k.startswith(prefix)]:
                worker = self._restored(WorkerRecord, key)
                if worker is not None:
                    workers.append(worker)
        decider = self.deciders[pool] = PoolDecider(pool, self.config, now, record, workers)
        log.info(
            "pool restored" if record is not None else "pool first seen",
            extra={"pool": pool, "workers": len(workers), "decisions": len(decider.in_force)},
        )
        return decider

    def _restored(self, kind: type[R], key: bytes) -> R | None:
        """The record under ``key``, if there is one and it can be read (one that cannot
        is logged and left out: its scope starts afresh)."""
        raw = self._decisions.get(key)
        if raw is None:
            return None
        try:
            return kind.model_validate_json(raw)
        except ValidationError as e:
            log.error(
                "unreadable record: its scope starts afresh",
                extra={"key": key.decode(errors="replace"), "error": str(e)[:500]},
            )
            return None

    async def publish(self, decider: PoolDecider, output: Output) -> None:
        records = decider.take_records()
        if records.pool is not None:
            self._decisions[pool_key(decider.pool)] = encode(records.pool)
        for worker_id, worker in records.workers.items():
            key = worker_key(decider.pool, worker_id)
            if worker is not None:
                self._decisions[key] = encode(worker)
            elif key in self._decisions:
                del self._decisions[key]  # a tombstone in the changelog
        for event in output.changes:
            log.info(
                "decision",
                extra={
                    "key": event.control_key,
                    "seq": event.seq,
                    "reason": event.evidence.reason,
                },
            )
        # Published once the changelog holds their records (a change always writes its
        # scope's record): a restart must never restore a state older than one already
        # published. The outbox shares that flush among the decisions pending together.
        await self._outbox.put(output.events, flush_first=bool(output.changes))
