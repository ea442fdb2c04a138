"""What survives a restart of the decider: a ``PoolRecord`` per pool (its own decisions
and the sequence) and a ``WorkerRecord`` per worker (its decisions and its engine's
``max_num_seqs``), so that a change costs one small record whatever the size of the
pool; ``Records`` is what there is to persist at a time."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import Field

from schemas import ControlEvent
from schemas.base import Ident, Wire

Seq = Annotated[int, Field(ge=0, le=2**62)]


class PoolRecord(Wire):
    """What survives a restart of a pool's own state."""

    pool: Ident
    seq: Seq
    """The sequence when written: a restarted decider continues above every record's."""
    events: tuple[ControlEvent, ...] = ()
    """The pool's decisions in force, as last published."""
    degradation_triggered: tuple[str, ...] = ()
    """The ladder's triggered rungs (the event carries only the level)."""


class WorkerRecord(Wire):
    """What survives a restart of one worker's state in its pool."""

    pool: Ident
    worker_id: Ident
    seq: Seq
    max_num_seqs: Annotated[int, Field(ge=1)] | None = None
    """Its engine's ``max_num_seqs`` (``None``: not known yet)."""
    events: tuple[ControlEvent, ...] = ()
    """The worker's decisions in force, as last published."""
    clock_anchor: tuple[float, float] | None = None
    """Its reports' freshness anchor (``policy.freshness``): the worker's ``at`` and the
    controller's time it was read."""


@dataclass(frozen=True)
class Records:
    """Records to persist: the pool's, and per worker id its record or ``None`` for a
    worker forgotten (its record is to be deleted)."""

    pool: PoolRecord | None = None
    workers: Mapping[str, WorkerRecord | None] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.pool is not None or bool(self.workers)
