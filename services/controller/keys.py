"""The keys of the controller's ``decisions`` table and the partitioner that places them.

Each pool's ``PoolRecord`` is under the key ``<pool>`` and each of its workers'
``WorkerRecord`` under ``<pool>#<worker>``. Every key is partitioned by its pool alone
(``partition_by_pool``, the faust producer's partitioner), so a pool's records share the
partition of the pool on the internal topic.
"""

from __future__ import annotations

from aiokafka.partitioner import DefaultPartitioner

from seawall_client.topics import base_pool

FLEET_KEY = "#fleet"
KEY_SEPARATOR = b"#"
"""Between the pool and the worker in a worker record's key (never in an ``Ident``)."""
_PARTITIONER = DefaultPartitioner()


def pool_key(pool: str) -> bytes:
    return pool.encode()


def worker_key(pool: str, worker_id: str) -> bytes:
    return pool_key(pool) + KEY_SEPARATOR + worker_id.encode()


def partition_by_pool(key: bytes | None, all_partitions: list[int], available: list[int]) -> int:
    """The faust producer's partitioner: a record's partition is its pool's, so the
    internal topic and every record of a pool in the changelog share one partition. A
    canary's pool shares its base pool's, so one instance holds both arms of the
    comparison."""
    pool = None
    if key is not None:
        name = key.partition(KEY_SEPARATOR)[0].decode(errors="surrogateescape")
        pool = base_pool(name).encode(errors="surrogateescape")
    partition: int = _PARTITIONER(pool, all_partitions, available)
    return partition
