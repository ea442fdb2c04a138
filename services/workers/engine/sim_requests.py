"""A request's state inside the simulated engine, and the waiting queues of vLLM's policies.

:class:`FcfsQueue` serves the ``fcfs`` policy (preempted requests go back to its front),
:class:`PriorityQueue` the ``priority`` one.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from services.workers.engine.base import FinishReason


@dataclass(slots=True, eq=False)
class SimRequest:
    id: str
    prompt_tokens: int
    priority: int
    arrival: float
    seq: int
    target_tokens: int
    """The output length it will reach, unless it fails first."""
    target_reason: FinishReason
    fail_at: int | None
    """Error fault: the output length at which it fails."""
    num_tokens: int
    """Prompt and output tokens so far."""
    output_tokens: int = 0
    num_computed: int = 0
    blocks: int = 0


class FcfsQueue:
    def __init__(self) -> None:
        self._items: deque[SimRequest] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def push(self, req: SimRequest) -> None:
        self._items.append(req)

    def push_preempted(self, req: SimRequest) -> None:
        self._items.appendleft(req)

    def peek(self) -> SimRequest:
        return self._items[0]

    def pop(self) -> SimRequest:
        return self._items.popleft()

    def remove(self, req: SimRequest) -> None:
        self._items.remove(req)


class PriorityQueue:
    """vLLM's priority policy: lowest ``(priority, arrival)`` first, preempted ones included."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, SimRequest]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, req: SimRequest) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival, req.seq, req))

    push_preempted = push

    def peek(self) -> SimRequest:
        return self._heap[0][3]

    def pop(self) -> SimRequest:
        return heapq.heappop(self._heap)[3]

    def remove(self, req: SimRequest) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not req]
        heapq.heapify(self._heap)
