"""The simulated engine: :class:`.sim_core.SimCore` driven in real time behind ``base.Engine``.

This is the embedded default engine (laptop, CI) and the benchmark engine. It is a
simulator, not a model: the text is random words, but the timing and the scheduling
(continuous batching over a bounded KV cache, preemption, limits) follow vLLM V1 as
calibrated in ``CALIBRATION.md``; see :mod:`.sim_core` for what that covers and its
sources.

One asyncio task runs the core: it schedules a step, sleeps for the step's simulated
duration, then hands each request's new token to that request's queue, so tokens come
out at the pace a GPU would produce them. ``sleep`` and ``clock`` can be injected to run
on virtual time.

The words follow the prompt, as a model's output does: at temperature 0 (greedy) the
same prompt gives the same text and the same length on every simulated engine, so the
output-consistency check has something true to compare. Above 0 each word is resampled
with probability ``SAMPLING_SPREAD`` × temperature, from a generator seeded by the
request's ``seed`` (else by its id): two runs with the same seed agree. ``top_p`` and
``stop`` strings do not change the simulated output. ``SimFaults.divergence`` makes a
share of the requests depart from their prompt's text from a random token on.

Faults configured in :class:`.sim_config.SimFaults` act through the core: a crash (or the
leak's out-of-memory) fails every in-flight ``generate`` with :class:`EngineError` at the
next step, and every later call (``generate``, ``snapshot``, ``gpu_reading``, ``abort``)
until ``start`` brings up a fresh engine, as restarting a vLLM worker would.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from services.common.tokenizer import count_tokens
from services.workers.engine.base import (
    EngineError,
    EngineLimits,
    EngineOutput,
    EngineRequest,
    EngineSnapshot,
    GpuReading,
    RequestRefused,
    snapshot_of,
)
from services.workers.engine.sim_config import SimConfig
from services.workers.engine.sim_core import SimCore, StepResult
from services.workers.profiling import cprofile_for

logger = logging.getLogger(__name__)

# Each word counts as exactly one token for :func:`.tokenizer.count_tokens`.
_VOCABULARY: Final = (
    "the a to of and in is it you that for on with as are be this your we can our will "
    "order ship item price help thank check time day store track note date sure happy "
    "deal size color stock box fast free new card email reply hello sorry yes now next"
)
WORDS: Final = tuple(_VOCABULARY.split())
SAMPLING_SPREAD: Final = 0.25
"""At temperature t, each word departs from the greedy one with probability 0.25 t."""


@dataclass(eq=False)
class _Stream:
    prompt_tokens: int
    greedy: random.Random
    """The prompt's own words, the same on every engine."""
    sampler: random.Random
    """What sampling (temperature above 0) and injected divergence draw from."""
    resample: float = 0.0
    """Probability that a word is resampled (``SAMPLING_SPREAD`` × temperature)."""
    diverge_at: int | None = None
    """From this token on the words depart from the prompt's (``SimFaults.divergence``)."""
    queue: asyncio.Queue[EngineOutput | EngineError] = field(default_factory=asyncio.Queue)
    completion_tokens: int = 0

    def words(self, n: int) -> str:
        first = self.completion_tokens == 0
        text = " ".join(self._word(self.completion_tokens + i) for i in range(n))
        return text if first or not text else " " + text

    def _word(self, position: int) -> str:
        greedy = self.greedy.randrange(len(WORDS))  # drawn always: the prompt's words stay aligned
        departs = self.diverge_at is not None and position >= self.diverge_at
        if departs or (self.resample and self.sampler.random() < self.resample):
            # any other word: a departure always shows
            return WORDS[(greedy + 1 + self.sampler.randrange(len(WORDS) - 1)) % len(WORDS)]
        return WORDS[greedy]


class SimulatedEngine:
    """``base.Engine`` over :class:`SimCore`; ``gpu_reading`` feeds the simulated GPU probe."""

    name = "sim"

    def __init__(
        self,
        config: SimConfig | None = None,
        *,
        seed: int = 0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock`` gives monotonic seconds; ``sleep`` must let that much of it pass."""
        self._config = config or SimConfig()
        self._seed = seed
        self._sleep = sleep
        self._clock = clock
        self._core = SimCore(self._config, seed, start_time=clock())
        self._task: asyncio.Task[None] | None = None
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._failure: EngineError | None = None

    async def start(self) -> None:
        """Start (or, after ``stop`` or a crash, restart with an empty engine)."""
        if self._task is not None and not self._task.done():
            return
        self._core = SimCore(self._config, self._seed, start_time=self._clock())
        self._failure = None
        self._task = asyncio.create_task(self._run(), name="simulated-engine")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
        self._fail_streams(EngineError("the simulated engine stopped"))

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        if self._task is None or self._task.done():
            raise self._failure or EngineError("the simulated engine is not running")
        request_id = request.request_id
        if request_id in self._streams:
            raise RequestRefused(f"request {request_id!r} is already in the engine")
        core = self._core
        digest = hashlib.blake2b(request.prompt.encode(), digest_size=16).hexdigest()
        stream = self._stream(request, digest)
        if request.temperature == 0:
            content_key: str | None = digest  # greedy: the prompt alone decides
        elif request.seed is not None:
            content_key = f"{digest}:{request.seed}"
        else:
            content_key = None
        try:
            core.add(
                request_id,
                stream.prompt_tokens,
                request.max_tokens,
                now=self._clock(),
                priority=request.priority,
                content_key=content_key,
            )
        except ValueError as exc:
            raise RequestRefused(f"request {request_id!r} refused: {exc}") from exc
        self._streams[request_id] = stream
        self._wake.set()
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, EngineError):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if self._streams.get(request_id) is stream:  # the consumer left early
                del self._streams[request_id]
                with contextlib.suppress(EngineError):  # a crashed core holds nothing
                    core.abort(request_id)

    def _stream(self, request: EngineRequest, digest: str) -> _Stream:
        seed = request.seed if request.seed is not None else f"{self._seed}:{request.request_id}"
        stream = _Stream(
            prompt_tokens=request.prompt_tokens or count_tokens(request.prompt),
            greedy=random.Random(f"text:{digest}"),
            sampler=random.Random(seed),
            resample=min(1.0, SAMPLING_SPREAD * request.temperature),
        )
        faults = random.Random(f"{self._seed}:{request.request_id}:divergence")
        if faults.random() < self._config.faults.divergence:
            stream.diverge_at = faults.randrange(max(1, request.max_tokens // 2))
        return stream

    async def abort(self, request_id: str) -> None:
        self._core.abort(request_id)  # first: if it raises, the run loop fails the stream
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.queue.put_nowait(
                EngineOutput(
                    request_id=request_id,
                    text="",
                    new_tokens=0,
                    finished=True,
                    finish_reason="abort",
                    prompt_tokens=stream.prompt_tokens,
                    completion_tokens=stream.completion_tokens,
                )
            )

    async def profile(self, seconds: float, path: Path) -> str:
        """``cProfile`` of the worker's event loop: the simulated engine runs in it, so
        the trace shows where the worker's own time goes."""
        return await cprofile_for(seconds, path)

    def snapshot(self) -> EngineSnapshot:
        """Raises :class:`EngineError` once the simulated engine has crashed."""
        stats = self._core.stats(self._clock())
        return snapshot_of(
            stats,
            self.limits,
            {
                "kv_blocks_used": float(stats.kv_blocks_used),
                "kv_blocks_total": float(stats.kv_blocks_total),
            },
        )

    @property
    def limits(self) -> EngineLimits:
        return self._config.limits()

    def gpu_reading(self) -> GpuReading:
        """The simulated GPU (``simulated=True``); raises :class:`EngineError` after a crash."""
        return self._core.gpu_reading(self._clock())

    async def _run(self) -> None:
        core = self._core
        try:
            while True:
                result = core.step(self._clock())
                if result.idle:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await self._sleep(result.duration_ms / 1000.0)
                self._deliver(result)
        except EngineError as exc:
            self._failure = exc
            self._fail_streams(exc)
        except Exception as exc:  # a bug must not leave callers waiting forever
            logger.exception("the simulated engine failed")
            self._failure = EngineError(f"the simulated engine failed: {exc!r}")
            self._fail_streams(self._failure)

    def _deliver(self, result: StepResult) -> None:
        ended = [rid for rid in result.finished if rid not in result.new_tokens]
        for request_id in [*result.new_tokens, *ended]:
            stream = self._streams.get(request_id)
            if stream is None:
                continue  # aborted while the step ran
            n = result.new_tokens.get(request_id, 0)
            text = stream.words(n)
            stream.completion_tokens += n
            reason = result.finished.get(request_id)
            if reason is not None:
                del self._streams[request_id]
            stream.queue.put_nowait(
                EngineOutput(
                    request_id=request_id,
                    text=text,
                    new_tokens=n,
                    finished=reason is not None,
                    finish_reason=reason,
                    prompt_tokens=stream.prompt_tokens,
                    completion_tokens=stream.completion_tokens,
                    error="simulated request failure" if reason == "error" else None,
                )
            )

    def _fail_streams(self, error: EngineError) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.queue.put_nowait(error)
