"""The simulated inference engine's core: a pure, deterministic model of vLLM V1's scheduler.

No asyncio, no clock reads: every call that depends on time takes ``now`` (seconds on
any monotonic origin), and randomness comes from generators seeded per request, so a
run is a function of its configuration, seed and inputs. :mod:`.sim` drives it in real
time for the worker; :func:`run_open_loop` drives it on a virtual clock for tests and
benchmarks.

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
- Step time is CALIBRATION's model, coefficients from :func:`.profiles.step_coefficients`:
  ``t = c0 + sqrt(F² + (s·N)²) + k_kv·Σ decode contexts + k_pf·Σ c_j·(p_j + c_j/2)``.
  On Llama-2-7B / A100 it gives a 10.96 ms decode step at batch 1 (FlightLLM measured
  11.2–11.5 ms), 22.2 ms at 64 and 35.0 ms at 128 sequences of 512 tokens, and a 36.7 ms
  prefill of 512 tokens (measured TTFT 40.4 ms).
- Saturation: with ShareGPT-like lengths (:func:`sharegpt_like_arrivals`) the defaults
  sustain ≈ 17.8 req/s (3,000 requests offline; 19.1 req/s with every request 230 in /
  200 out), above the 15.6 offline / 13.2 online req/s of vllm PR #5046 (mid-2024,
  before the V1 engine). CALIBRATION suggests raising c0 or k_kv to close the gap; that
  would move the per-step figures above away from their measurements, so the defaults
  keep them and leave the gap to ``SimConfig.step_time_scale``: 1.14 gives 15.6 req/s
  offline, 1.35 gives 13.2.

Not modelled: prefix caching, speculative decoding, CUDA graphs' batch-size padding,
sampling cost, and the text itself (only token counts; :mod:`.sim` makes the words).
Every request generates ``max_tokens`` tokens (capped by ``max_model_len``) unless a
configured per-token EOS probability ends it earlier, so benchmarks control lengths.

Faults (:class:`SimFaults`) are injected by configuration, for chaos tests: failing
requests, slow steps, a hang, a crash, over-temperature and a memory leak that ends in
an out-of-memory crash. The simulated GPU readings (:meth:`SimCore.gpu_reading`) derive
from the core's load and carry ``simulated=True``.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from services.workers.engine.base import EngineError, EngineLimits, FinishReason, GpuReading
from services.workers.engine.profiles import (
    GPUS,
    MODELS,
    RUNTIME_RESERVE_BYTES,
    GpuProfile,
    ModelProfile,
    StepCoefficients,
    kv_bytes_per_token,
    kv_capacity_blocks,
    step_coefficients,
)

SchedulingPolicy = Literal["fcfs", "priority"]

MIB: Final = 1024**2
UTILIZATION_WINDOW_S: Final = 1.0
"""NVML's utilization is the busy share of its last sample period (up to a second)."""
OVERHEAT_C_PER_S: Final = 1.0
OVERHEAT_MAX_C: Final = 97.0
THERMAL_SLOWDOWN_C: Final = 90.0
"""From here the simulated board reports ``sw_thermal_slowdown`` among its clock events."""


@dataclass(frozen=True, slots=True)
class SimFaults:
    """Faults to inject; times are engine time, seconds since the core's ``start_time``."""

    error_rate: float = 0.0
    """Share of requests that fail (finish reason ``error``) at a random point of their output."""
    slowdown: float = 1.0
    """Step-time multiplier."""
    hang_after_s: float | None = None
    """From then on no step makes progress (requests stay put, nothing is generated)."""
    crash_after_s: float | None = None
    """From then on every call raises :class:`EngineError`."""
    over_temperature: bool = False
    """The GPU temperature climbs 1 °C/s past 90 °C, to 97 °C."""
    memory_leak_mb_per_s: float = 0.0
    """GPU memory in use grows by this many MiB per second; at full memory the engine
    crashes with an out-of-memory error, as a CUDA allocation would fail."""
    divergence: float = 0.0
    """Share of requests whose text departs from what their prompt gives everywhere
    else, from a random token on — as a model whose numerics changed would answer: what
    the output-consistency check must catch (:mod:`.sim` makes the words)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.error_rate <= 1.0 or not 0.0 <= self.divergence <= 1.0:
            raise ValueError("error_rate and divergence must be within [0, 1]")
        if self.slowdown <= 0 or self.memory_leak_mb_per_s < 0:
            raise ValueError("slowdown must be positive and memory_leak_mb_per_s not negative")


@dataclass(frozen=True, slots=True)
class SimConfig:
    model: ModelProfile = MODELS["llama-2-7b"]
    gpu: GpuProfile = GPUS["a100-80g"]
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    """``None``: the model's."""
    scheduling_policy: SchedulingPolicy = "fcfs"
    step: StepCoefficients | None = None
    """``None``: :func:`.profiles.step_coefficients` for the model and GPU."""
    step_time_scale: float = 1.0
    """Multiplies every step time (calibration knob, e.g. for a slower software stack)."""
    eos_probability: float = 0.0
    """Chance that each generated token ends the request (finish reason ``stop``)."""
    faults: SimFaults = field(default_factory=SimFaults)

    def __post_init__(self) -> None:
        # The checks vLLM makes when it starts (with chunked prefill on).
        if self.max_num_seqs < 1 or self.block_size < 1:
            raise ValueError("max_num_seqs and block_size must be at least 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be within (0, 1]")
        if self.step_time_scale <= 0 or not 0.0 <= self.eos_probability <= 1.0:
            raise ValueError("step_time_scale must be positive, eos_probability within [0, 1]")
        if self.kv_blocks * self.block_size < self.model_len:
            raise ValueError(
                f"max_model_len {self.model_len} exceeds the KV cache "
                f"({self.kv_blocks * self.block_size} tokens) on {self.gpu.name}"
            )

    @property
    def model_len(self) -> int:
        return self.max_model_len or self.model.max_model_len

    @property
    def kv_blocks(self) -> int:
        return kv_capacity_blocks(
            self.model, self.gpu, self.gpu_memory_utilization, self.block_size
        )

    @property
    def coefficients(self) -> StepCoefficients:
        return self.step or step_coefficients(self.model, self.gpu)

    def limits(self) -> EngineLimits:
        return EngineLimits(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_capacity_tokens=self.kv_blocks * self.block_size,
            max_model_len=self.model_len,
        )


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


@dataclass(slots=True, eq=False)
class _Request:
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


class _FcfsQueue:
    def __init__(self) -> None:
        self._items: deque[_Request] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def push(self, req: _Request) -> None:
        self._items.append(req)

    def push_preempted(self, req: _Request) -> None:
        self._items.appendleft(req)

    def peek(self) -> _Request:
        return self._items[0]

    def pop(self) -> _Request:
        return self._items.popleft()

    def remove(self, req: _Request) -> None:
        self._items.remove(req)


class _PriorityQueue:
    """vLLM's priority policy: lowest ``(priority, arrival)`` first, preempted ones included."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, _Request]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, req: _Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival, req.seq, req))

    push_preempted = push

    def peek(self) -> _Request:
        return self._heap[0][3]

    def pop(self) -> _Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, req: _Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not req]
        heapq.heapify(self._heap)


class SimCore:
    """vLLM V1's continuous batching over a KV block pool, one :meth:`step` at a time."""

    def __init__(self, config: SimConfig | None = None, seed: int = 0, start_time: float = 0.0):
        self.config = config or SimConfig()
        self._seed = seed
        self._start = start_time
        self._coef = self.config.coefficients
        self._blocks_total = self.config.kv_blocks
        self._blocks_free = self._blocks_total
        self._requests: dict[str, _Request] = {}
        self._running: list[_Request] = []
        self._waiting: _FcfsQueue | _PriorityQueue = (
            _PriorityQueue() if self.config.scheduling_policy == "priority" else _FcfsQueue()
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
        req = _Request(
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
        duration_ms = self._step_time_ms(scheduled)
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

    def _schedule(self) -> tuple[list[tuple[_Request, int]], list[str]]:
        """The requests to run this step with their token counts, and the preempted."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[_Request, int]] = []
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

    def _step_time_ms(self, scheduled: list[tuple[_Request, int]]) -> float:
        c = self._coef
        tokens = 0
        decode_context = 0
        prefill_work = 0.0
        for req, n in scheduled:
            tokens += n
            if n == 1 and req.output_tokens and req.num_computed == req.num_tokens - 1:
                decode_context += req.num_tokens
            else:
                prefill_work += n * (req.num_computed + n / 2)
        t = (
            c.c0_ms
            + math.hypot(c.F_ms, c.s_ms_per_token * tokens)
            + c.k_kv_ms_per_token * decode_context
            + c.k_pf_ms * prefill_work
        )
        return t * self.config.step_time_scale * self.config.faults.slowdown

    # -- KV blocks --------------------------------------------------------------------

    def _allocate(self, req: _Request, new_tokens: int) -> bool:
        needed = -(-(req.num_computed + new_tokens) // self.config.block_size) - req.blocks
        if needed > self._blocks_free:
            return False
        if needed > 0:
            req.blocks += needed
            self._blocks_free -= needed
        return True

    def _free(self, req: _Request) -> None:
        self._blocks_free += req.blocks
        req.blocks = 0

    def _preempt(self, req: _Request) -> None:
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
        """The GPU as the load would show it on NVML; see the module docstring.

        Memory is what vLLM holds: the weights, the runtime reserve and the whole KV pool,
        all allocated at start (so a healthy engine shows ``gpu_memory_utilization`` of
        the board), plus any leak; utilization is the busy share of the last second of
        steps; temperature and power rise linearly with utilization.
        """
        self._check_alive(now)
        gpu = self.config.gpu
        utilization = self._busy_fraction(now)
        temperature = gpu.idle_temperature_c + utilization * (
            gpu.loaded_temperature_c - gpu.idle_temperature_c
        )
        if self.config.faults.over_temperature:
            temperature = min(
                OVERHEAT_MAX_C, temperature + OVERHEAT_C_PER_S * max(0.0, now - self._start)
            )
        reasons: tuple[str, ...] = ()
        if temperature >= THERMAL_SLOWDOWN_C:
            reasons = ("sw_thermal_slowdown",)
        elif utilization == 0.0:
            reasons = ("gpu_idle",)
        return GpuReading(
            index=index,
            name=gpu.display_name,
            utilization_pct=100.0 * utilization,
            memory_used_bytes=min(self._memory_used(now), gpu.memory_bytes),
            memory_total_bytes=gpu.memory_bytes,
            temperature_c=temperature,
            power_w=gpu.idle_power_w + utilization * (gpu.power_limit_w - gpu.idle_power_w),
            power_limit_w=gpu.power_limit_w,
            clock_event_reasons=reasons,
            simulated=True,
        )

    def _busy_fraction(self, now: float) -> float:
        since = now - UTILIZATION_WINDOW_S
        busy = sum(max(0.0, min(end, now) - max(start, since)) for start, end in self._busy)
        return min(1.0, busy / UTILIZATION_WINDOW_S)

    def _memory_used(self, now: float) -> int:
        config = self.config
        kv_pool = self._blocks_total * config.block_size
        leak = config.faults.memory_leak_mb_per_s * MIB * max(0.0, now - self._start)
        return int(
            config.model.weight_bytes
            + RUNTIME_RESERVE_BYTES
            + kv_pool * kv_bytes_per_token(config.model)
            + leak
        )

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


# -- the seed incident, calibrated -----------------------------------------------------

INCIDENT_WINDOW_S: Final = 120.0
INCIDENT_SEED: Final = 0
INCIDENT_STEADY_RATE: Final = 18.4
"""Requests/s that give the seed incident's steady P99 of ≈ 1.2 s on one simulated GPU.

Measured with the defaults (Llama-2-7B, A100 80GB, vLLM's default limits)::

    arrivals = sharegpt_like_arrivals(rate, INCIDENT_WINDOW_S, seed=INCIDENT_SEED)
    records = run_open_loop(SimCore(SimConfig()), arrivals)
    # P99 of record.ttft over all records

The P99 is of time to first token: with ~200 output tokens a request takes at least
200 decode steps of ≥ 11 ms, so no end-to-end latency can be 1.2 s (the end-to-end P99
is ≈ 52 s here, the heavy tail of long outputs). Measured (2026-12): 18.4 req/s → P99 TTFT
1.25 s (median 0.10 s); 19.1 req/s → 3.92 s (:data:`INCIDENT_BURST_RATE`). No request is
preempted: 256 sequences of ~430 tokens fit the 119,184-token KV cache, so
``max_num_seqs`` is the binding limit and the excess waits in the queue.

This is the knee of the curve: the sustained capacity is ≈ 17.8 req/s (offline, 3,000
requests), so the steady load already runs at capacity and 4% more traffic triples the
P99. There the tail depends on chance: the same rates with seeds 1–5 give P99s of
0.16–2.0 s (18.4) and 0.18–4.8 s (19.1); over 600 s windows every rate from 18 req/s
up grows a queue without bound. Use the seed and window given.
"""
INCIDENT_BURST_RATE: Final = 19.1
"""Requests/s that bring the P99 TTFT to ≈ 3.8 s; see :data:`INCIDENT_STEADY_RATE`."""


# -- virtual-time driver --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request of an open-loop run; times on the run's virtual clock (seconds)."""

    request_id: str
    arrival: float
    prompt_tokens: int
    max_tokens: int
    output_tokens: int
    first_token_time: float | None
    finish_time: float | None
    finish_reason: FinishReason | None
    preemptions: int

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival


Arrival = tuple[float, int, int]
"""(arrival time in seconds, prompt tokens, max tokens)."""


def run_open_loop(core: SimCore, arrivals: Sequence[Arrival]) -> list[RequestRecord]:
    """Drive ``core`` on a virtual clock until every request finishes or nothing can move.

    Request ``i`` of ``arrivals`` gets id ``f"r{i}"`` and joins at the first step
    boundary at or after its arrival time (as a request arriving mid-step would in
    vLLM); its latencies count from its arrival. Requests that never finish (a hang)
    keep ``finish_time=None``. Returns the records in the order of ``arrivals``.
    A crash fault propagates as :class:`EngineError`.
    """
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    first_token: dict[str, float] = {}
    finish: dict[str, tuple[float, FinishReason]] = {}
    outputs: dict[str, int] = {}
    preemptions: dict[str, int] = {}
    now = arrivals[order[0]][0] if arrivals else 0.0
    nxt = 0
    while True:
        while nxt < len(order) and arrivals[order[nxt]][0] <= now:
            i = order[nxt]
            at, prompt, max_tokens = arrivals[i]
            core.add(f"r{i}", prompt, max_tokens, now=now, arrival=at)
            nxt += 1
        result = core.step(now)
        if result.idle:
            if nxt == len(order):
                break
            now = max(now, arrivals[order[nxt]][0])
            continue
        now += result.duration_ms / 1000.0
        for request_id in result.first_token:
            first_token[request_id] = now
        for request_id, n in result.new_tokens.items():
            outputs[request_id] = outputs.get(request_id, 0) + n
        for request_id in result.preempted:
            preemptions[request_id] = preemptions.get(request_id, 0) + 1
        for request_id, reason in result.finished.items():
            finish[request_id] = (now, reason)
    records = []
    for i, (at, prompt, max_tokens) in enumerate(arrivals):
        request_id = f"r{i}"
        done = finish.get(request_id)
        records.append(
            RequestRecord(
                request_id=request_id,
                arrival=at,
                prompt_tokens=prompt,
                max_tokens=max_tokens,
                output_tokens=outputs.get(request_id, 0),
                first_token_time=first_token.get(request_id),
                finish_time=None if done is None else done[0],
                finish_reason=None if done is None else done[1],
                preemptions=preemptions.get(request_id, 0),
            )
        )
    return records


def sharegpt_like_arrivals(
    rate_per_s: float,
    duration_s: float,
    *,
    seed: int = 0,
    mean_prompt_tokens: float = 230.0,
    mean_output_tokens: float = 200.0,
) -> list[Arrival]:
    """Poisson arrivals over ``[0, duration_s)`` with ShareGPT-like token lengths.

    Lengths are log-normal (σ = 0.8, heavy-tailed like ShareGPT's) around the given
    means, clipped to [4, 1024] as vLLM's ShareGPT benchmark filters them
    (CALIBRATION: ~230 in / ~200 out tokens).
    """
    rng = random.Random(seed)
    sigma = 0.8

    def length(mean: float) -> int:
        mu = math.log(mean) - sigma * sigma / 2
        return min(1024, max(4, round(rng.lognormvariate(mu, sigma))))

    arrivals: list[Arrival] = []
    t = rng.expovariate(rate_per_s)
    while t < duration_s:
        arrivals.append((t, length(mean_prompt_tokens), length(mean_output_tokens)))
        t += rng.expovariate(rate_per_s)
    return arrivals
