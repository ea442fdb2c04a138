"""The controller's table keys: every record of a pool lands on the pool's partition,
the partition the internal topic gives the pool, whatever the worker's name."""

from __future__ import annotations

import pytest
from aiokafka.partitioner import DefaultPartitioner
from hypothesis import given
from hypothesis import strategies as st
from pydantic import StringConstraints, TypeAdapter, ValidationError

from schemas.base import Ident
from services.controller.keys import KEY_SEPARATOR, partition_by_pool, pool_key, worker_key

pytestmark = pytest.mark.unit

(_CONSTRAINTS,) = [m for m in Ident.__metadata__ if isinstance(m, StringConstraints)]
assert _CONSTRAINTS.pattern is not None
IDENT = st.from_regex(_CONSTRAINTS.pattern, fullmatch=True).filter(lambda s: len(s) <= 128)


@given(pool=IDENT, worker=IDENT, partitions=st.integers(1, 64))
def test_a_workers_record_shares_its_pools_partition(
    pool: str, worker: str, partitions: int
) -> None:
    all_partitions = list(range(partitions))
    expected = DefaultPartitioner()(pool.encode(), all_partitions, all_partitions)
    assert partition_by_pool(pool_key(pool), all_partitions, all_partitions) == expected
    assert partition_by_pool(worker_key(pool, worker), all_partitions, all_partitions) == expected


def test_the_separator_is_never_part_of_an_ident() -> None:
    with pytest.raises(ValidationError):
        TypeAdapter(Ident).validate_python(f"main{KEY_SEPARATOR.decode()}w1")


@given(pool=IDENT, worker=IDENT)
def test_a_workers_key_splits_back_into_pool_and_worker(pool: str, worker: str) -> None:
    key = worker_key(pool, worker)
    assert key.partition(KEY_SEPARATOR) == (pool.encode(), KEY_SEPARATOR, worker.encode())
