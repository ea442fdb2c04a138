"""The simulated inference engine's core: a pure, deterministic model of vLLM V1's scheduler.

No asyncio, no clock reads: every call that depends on time takes ``now`` (seconds on
any monotonic origin), and randomness comes from generators seeded per request, so a
run is a function of its configuration (:mod:`.sim_config`), seed and inputs. :mod:`.sim`
drives it in real time for the worker; :func:`.sim_open_loop.run_open_loop` drives it on
a virtual clock for tests and benchmarks.

Calibration (``CALIBRATION.md`` in the shared design folder, and its sources):

- Scheduling follows vLLM V1's ``Scheduler.schedule`` (vllm ``v1/core/sched``): running
  requests first, in order, each taking the tokens it still needs (one for a decode, a
  chunk for a prefill) from the step's ``max_num_batched_tokens`` budget; then waiting
  requests, FCFS (or by ``(priority, arrival)`` under the priority policy), while the
  budget lasts and fewer than ``max_num_seqs`` run, chunking the last prefill to fit.
  KV blocks of ``block_size`` tokens are allocated as a request's computed tokens grow.
  When a running request cannot get a block, the newest running request is preempted
  (under the priority policy: the lowest priority, latest arrival): its blocks are
  freed, its computed tokens reset to 0, it goes to the front of the waiting queue and
  is later recomputed, prompt and generated tokens, as one prefill. A step that
  preempted admits no waiting request. Defaults are vLLM's on A100 (``engine/arg_utils.py``):
  ``max_num_seqs`` 256, ``max_num_batched_tokens`` 2048, ``block_size`` 16.
- KV capacity comes from :mod:`.profiles` (7,449 blocks for Llama-2-7B on an A100 80GB
  at 0.9, FlightLLM's log).
- Step time is CALIBRATION's model: :mod:`.sim_timing`.
- Saturation, and the seed incident's load: :mod:`.sim_open_loop`.

Not modelled: prefix caching, speculative decoding, CUDA graphs' batch-size padding,
sampling cost, and the text itself (only token counts; :mod:`.sim` makes the words).
Every request generates ``max_tokens`` tokens (capped by ``max_model_len``) unless a
configured per-token EOS probability ends it earlier, so benchmarks control lengths.

Faults (:class:`.sim_config.SimFaults`) are injected by configuration, for chaos tests:
failing requests, slow steps, a hang, a crash, over-temperature and a memory leak that
ends in an out-of-memory crash. The simulated GPU readings (:meth:`SimCore.gpu_reading`,
:mod:`.sim_gpu`) derive from the core's load and carry ``simulated=True``.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from services.workers.engine.base import EngineError, FinishReason, GpuReading
from services.workers.engine.sim_config import SimConfig
from services.workers.engine.sim_gpu import (
    UTILIZATION_WINDOW_S,
    busy_fraction,
    memory_used_bytes,
    simulated_gpu_reading,
)
from services.workers.engine.sim_requests import FcfsQueue, PriorityQueue, SimRequest
from services.workers.engine.sim_timing import step_time_ms


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one engine step did; its outputs exist at ``now + duration_ms``."""

    duration_ms: float
    new_tokens: Mapping[str, int]
    """Request id → tokens generated this step (only requests that generated)."""
    finished: Mapping[str, FinishReason]
    preempted: tuple[str, ...]
    first_token: tuple[str, ...]
    """Requests whose first output token came in this step."""
    scheduled_tokens: int
    scheduled_requests: int
    running: int
    """Requests running in this step, as scheduled (before its finishes)."""

    @property
    def idle(self) -> bool:
        """Nothing was scheduled or preempted: the core waits for a request (or is hung)."""
        return self.scheduled_requests == 0 and not self.preempted


@dataclass(frozen=True, slots=True)
class SimStats:
    running: int
    waiting: int
    kv_cache_usage: float
    kv_blocks_used: int
    kv_blocks_total: int
    preempted_total: int
    prompt_tokens_total: int
    """Prompt tokens of requests that got their first token (recomputation not counted)."""
    generation_tokens_total: int


class SimCore:
    """vLLM V1's continuous batching over a KV block pool, one :meth:`step` at a time."""

    def __init__(self, config: SimConfig | None = None, seed: int = 0, start_time: float = 0.0):
        self.config = config or SimConfig()
        self._seed = seed
        self._start = start_time
        self._coef = self.config.coefficients
        self._blocks_total = self.config.kv_blocks
        self._blocks_free = self._blocks_total
        self._requests: dict[str, SimRequest] = {}
        self._running: list[SimRequest] = []
        self._waiting: FcfsQueue | PriorityQueue = (
            PriorityQueue() if self.config.scheduling_policy == "priority" else FcfsQueue()
        )
        self._seq = 0
        self._busy: deque[tuple[float, float]] = deque()
        self._crash: str | None = None
        self.preempted_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # -- requests ---------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        *,
        now: float,
        priority: int = 0,
        arrival: float | None = None,
        content_key: str | None = None,
    ) -> None:
        """Queue a request. Raises ``ValueError`` for one vLLM would refuse.

        ``content_key`` names what fixes the output (a greedy request's prompt): where
        the request stops then follows from it, not from the request id, so the same
        prompt stops at the same token on every engine, as greedy decoding does."""
        self._check_alive(now)
        model_len = self.config.model_len
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already in the engine")
        if not 0 < prompt_tokens < model_len or max_tokens < 1:
            raise ValueError(
                f"prompt of {prompt_tokens} tokens or max_tokens {max_tokens} out of range "
                f"for max_model_len {model_len}"
            )
        rng = random.Random(f"{self._seed}:{request_id}")
        length_cap = min(max_tokens, model_len - prompt_tokens)
        length_rng = rng if content_key is None else random.Random(f"length:{content_key}")
        eos_at = _geometric(length_rng, self.config.eos_probability)
        target: int = length_cap
        reason: FinishReason = "length"
        if eos_at is not None and eos_at < length_cap:
            target, reason = eos_at, "stop"
        error_rate = self.config.faults.error_rate
        fail_at = rng.randrange(target) if error_rate and rng.random() < error_rate else None
        req = SimRequest(
            id=request_id,
            prompt_tokens=prompt_tokens,
            priority=priority,
            arrival=now if arrival is None else arrival,
            seq=self._seq,
            target_tokens=target,
            target_reason=reason,
            fail_at=fail_at,
            num_tokens=prompt_tokens,
        )
        self._seq += 1
        self._requests[request_id] = req
        self._waiting.push(req)

    def abort(self, request_id: str) -> bool:
        """Remove a request wherever it is; ``False`` if the engine does not hold it."""
        self._raise_if_crashed()
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if req in self._running:
            self._running.remove(req)
            self._free(req)
        else:
            self._waiting.remove(req)
        return True

    # -- the step ---------------------------------------------------------------------

    def step(self, now: float) -> StepResult:
        """Schedule one step at ``now`` and apply its outcome."""
        self._check_alive(now)
        hang = self.config.faults.hang_after_s
        if hang is not None and now - self._start >= hang:
            return _idle(len(self._running))
        scheduled, preempted = self._schedule()
        running = len(self._running)
        if not scheduled:
            # A step that only preempted ran no forward pass, but it freed blocks: the
            # next step can schedule again, so it must not read as idle.
            return _idle(running, tuple(preempted))
        duration_ms = step_time_ms(
            self._coef,
            scheduled,
            step_time_scale=self.config.step_time_scale,
            slowdown=self.config.faults.slowdown,
        )
        self._busy.append((now, now + duration_ms / 1000.0))
        while self._busy and self._busy[0][1] < now - UTILIZATION_WINDOW_S:
            self._busy.popleft()

        new_tokens: dict[str, int] = {}
        finished: dict[str, FinishReason] = {}
        first: list[str] = []
        for req, n in scheduled:
            req.num_computed += n
            if req.num_computed < req.num_tokens:
                continue  # a prefill chunk: no token yet
            if req.output_tokens == req.fail_at:
                finished[req.id] = "error"
                continue
            req.output_tokens += 1
            req.num_tokens += 1
            new_tokens[req.id] = 1
            self.generation_tokens_total += 1
            if req.output_tokens == 1:
                first.append(req.id)
                self.prompt_tokens_total += req.prompt_tokens
            if req.output_tokens == req.target_tokens:
                finished[req.id] = req.target_reason
        if finished:
            for request_id in finished:
                self._free(self._requests.pop(request_id))
            self._running = [r for r in self._running if r.id not in finished]
        return StepResult(
            duration_ms=duration_ms,
            new_tokens=new_tokens,
            finished=finished,
            preempted=tuple(preempted),
            first_token=tuple(first),
            scheduled_tokens=sum(n for _, n in scheduled),
            scheduled_requests=len(scheduled),
            running=running,
        )

    def _schedule(self) -> tuple[list[tuple[SimRequest, int]], list[str]]:
        """The requests to run this step with their token counts, and the preempted."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        preempted: list[str] = []
        running = self._running
        block_size = self.config.block_size
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            # Most decodes stay inside their last block: skip the allocator for them.
            while req.num_computed + n > req.blocks * block_size and not self._allocate(req, n):
                victim_index = self._victim_index()
                victim = running.pop(victim_index)
                if victim_index < i:  # scheduled earlier in this step: give its tokens back
                    budget += next(k for r, k in scheduled if r is victim)
                    scheduled = [(r, k) for r, k in scheduled if r is not victim]
                    i -= 1
                self._preempt(victim)
                preempted.append(victim.id)
                if victim is req:
                    return scheduled, preempted
            scheduled.append((req, n))
            budget -= n
            i += 1
        if preempted:
            return scheduled, preempted
        waiting = self._waiting
        while waiting and budget > 0 and len(running) < self.config.max_num_seqs:
            req = waiting.peek()
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._allocate(req, n):
                break
            waiting.pop()
            running.append(req)
            scheduled.append((req, n))
            budget -= n
        return scheduled, preempted

    def _victim_index(self) -> int:
        if self.config.scheduling_policy == "fcfs":
            return len(self._running) - 1
        keys = [(r.priority, r.arrival, r.seq) for r in self._running]
        return keys.index(max(keys))

    # -- KV blocks --------------------------------------------------------------------

    def _allocate(self, req: SimRequest, new_tokens: int) -> bool:
        needed = -(-(req.num_computed + new_tokens) // self.config.block_size) - req.blocks
        if needed > self._blocks_free:
            return False
        if needed > 0:
            req.blocks += needed
            self._blocks_free -= needed
        return True

    def _free(self, req: SimRequest) -> None:
        self._blocks_free += req.blocks
        req.blocks = 0

    def _preempt(self, req: SimRequest) -> None:
        self._free(req)
        req.num_computed = 0
        self.preempted_total += 1
        self._waiting.push_preempted(req)

    # -- state ------------------------------------------------------------------------

    def stats(self, now: float) -> SimStats:
        self._check_alive(now)
        used = self._blocks_total - self._blocks_free
        return SimStats(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_cache_usage=used / self._blocks_total,
            kv_blocks_used=used,
            kv_blocks_total=self._blocks_total,
            preempted_total=self.preempted_total,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
        )

    def gpu_reading(self, now: float, index: int = 0) -> GpuReading:
        """The GPU as the load would show it on NVML; see :mod:`.sim_gpu`."""
        self._check_alive(now)
        return simulated_gpu_reading(
            self.config,
            index=index,
            utilization=busy_fraction(self._busy, now),
            elapsed_s=now - self._start,
            memory_used=self._memory_used(now),
        )

    def _memory_used(self, now: float) -> int:
        return memory_used_bytes(self.config, self._blocks_total, now - self._start)

    def _check_alive(self, now: float) -> None:
        """Latch the crash faults once their time has come, then raise if crashed."""
        if self._crash is None:
            faults = self.config.faults
            if faults.crash_after_s is not None and now - self._start >= faults.crash_after_s:
                self._crash = "simulated engine crash"
            elif self._memory_used(now) > self.config.gpu.memory_bytes:
                self._crash = "simulated CUDA out of memory (memory leak)"
        self._raise_if_crashed()

    def _raise_if_crashed(self) -> None:
        if self._crash is not None:
            raise EngineError(self._crash)


def _idle(running: int, preempted: tuple[str, ...] = ()) -> StepResult:
    return StepResult(0.0, {}, {}, preempted, (), 0, 0, running)


def _geometric(rng: random.Random, p: float) -> int | None:
    """Tokens up to and including the first EOS when each token is EOS with chance ``p``."""
    if p <= 0.0:
        return None
    if p >= 1.0:
        return 1
    return 1 + math.floor(math.log(1.0 - rng.random()) / math.log(1.0 - p))
