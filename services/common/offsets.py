"""At-least-once commit bookkeeping (pure).

A consumer that works on several records of a partition at once finishes them out of
order; it may only commit up to the lowest offset not yet finished, or a crash would
lose the unfinished ones. ``OffsetTracker`` keeps, per partition, the offsets handed
out and which are done, and gives the offsets that are safe to commit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

P = TypeVar("P", bound=Hashable)


class OffsetTracker(Generic[P]):
    def __init__(self) -> None:
        # per partition: offset -> done, in the order the offsets were handed out
        self._inflight: dict[P, OrderedDict[int, bool]] = {}
        self._committable: dict[P, int] = {}

    def track(self, partition: P, offset: int) -> None:
        offsets = self._inflight.get(partition)
        if offsets is None:  # not setdefault: an OrderedDict built per record
            offsets = self._inflight[partition] = OrderedDict()
        if offsets and offset <= next(reversed(offsets)):
            raise ValueError(f"offset {offset} tracked out of order on {partition!r}")
        offsets[offset] = False

    def done(self, partition: P, offset: int) -> None:
        offsets = self._inflight.get(partition)
        if offsets is None or offset not in offsets:
            return  # revoked meanwhile: the new owner re-processes it
        offsets[offset] = True
        while offsets:
            first, finished = next(iter(offsets.items()))
            if not finished:
                break
            offsets.popitem(last=False)
            self._committable[partition] = first + 1

    def take_commits(self) -> dict[P, int]:
        """Offsets (next to read) that became safe to commit since the last call."""
        commits, self._committable = self._committable, {}
        return commits

    def restore(self, commits: dict[P, int]) -> None:
        """Put back what ``take_commits`` gave when the commit failed, so that the next
        commit carries it (unless the partition was forgotten or has moved on)."""
        for partition, offset in commits.items():
            if partition in self._inflight and partition not in self._committable:
                self._committable[partition] = offset

    def pending(self, partition: P | None = None) -> int:
        if partition is not None:
            return sum(not d for d in self._inflight.get(partition, {}).values())
        return sum(not d for offsets in self._inflight.values() for d in offsets.values())

    def forget(self, partitions: Iterable[P]) -> None:
        """Drop revoked partitions: their unfinished records go to the new owner."""
        for p in partitions:
            self._inflight.pop(p, None)
            self._committable.pop(p, None)
