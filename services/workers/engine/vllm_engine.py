"""The in-process vLLM engine (extra ``vllm``): ``AsyncLLM`` driven through ``base.Engine``.

vLLM is imported inside :meth:`VllmEngine.start` and :meth:`VllmEngine.generate` only, so
importing this module never needs vLLM or a GPU. Scheduler statistics reach
:class:`SchedulerStatsSink` through a ``StatLoggerBase`` subclass that vLLM calls after
every engine step, from the ``AsyncLLM`` output handler on this event loop.

Checked against vLLM's v1 sources: ``AsyncLLM.from_engine_args(engine_args,
stat_loggers=[...])`` takes ``StatLoggerFactory = Callable[[VllmConfig, int],
StatLoggerBase]``; ``StatLoggerBase.record(scheduler_stats, iteration_stats,
mm_cache_stats=None, engine_idx=0)`` is called with keywords; ``abort`` makes the
request's ``generate`` stream end with a final output whose finish reason is ``abort``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from services.workers.engine.base import (
    EngineError,
    EngineLimits,
    EngineOutput,
    EngineRequest,
    EngineSnapshot,
    FinishReason,
    RequestRefused,
    snapshot_of,
)

logger = logging.getLogger(__name__)

# vLLM's RequestOutput finish reasons (vllm.v1.engine.FINISH_REASON_STRINGS) mapped to
# ours; "repetition" is vLLM stopping a degenerate loop, which ends the text normally.
_FINISH_REASONS: Mapping[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "error": "error",
    "repetition": "stop",
}


def map_finish_reason(reason: str | None) -> FinishReason:
    """Map a vLLM (or vLLM-served OpenAI) finish reason; ``None`` and unknown ones are errors.

    A finished request always carries a reason, so a missing or unfamiliar one means
    something went wrong that the caller should not mistake for a clean stop.
    """
    if reason is None:
        return "error"
    return _FINISH_REASONS.get(reason, "error")


@dataclass(frozen=True, slots=True)
class VllmEngineConfig:
    model: str
    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    gpu_memory_utilization: float = 0.85
    tensor_parallel_size: int = 1
    scheduling_policy: Literal["fcfs", "priority"] = "priority"
    """``priority`` lets ``EngineRequest.priority`` reorder the queue; under ``fcfs``
    vLLM rejects any request whose priority is not 0."""
    kv_capacity_tokens: int | None = None
    """Declared KV capacity, used only while the engine's own figure is unknown."""
    extra_args: Mapping[str, Any] = field(default_factory=dict)
    """Further ``AsyncEngineArgs`` fields (``dtype``, ``enforce_eager``, ...)."""


def engine_args_kwargs(config: VllmEngineConfig) -> dict[str, Any]:
    """The ``AsyncEngineArgs`` keyword arguments for ``config``.

    Stats stay on (``disable_log_stats=False``): older vLLM does not call stat loggers
    otherwise, and the snapshot would never move.
    """
    kwargs: dict[str, Any] = {
        "model": config.model,
        "max_model_len": config.max_model_len,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "block_size": config.block_size,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "tensor_parallel_size": config.tensor_parallel_size,
        "scheduling_policy": config.scheduling_policy,
        "disable_log_stats": False,
    }
    if clash := sorted(kwargs.keys() & config.extra_args.keys()):
        raise ValueError(f"extra_args may not override the typed settings: {clash}")
    return {**kwargs, **config.extra_args}


class SchedulerStatsSink:
    """The latest scheduler figures vLLM reported, plus running totals.

    ``record`` takes vLLM's ``SchedulerStats`` and ``IterationStats`` (either may be
    ``None``): gauges come from the former, preemptions and token counts accumulate
    from the latter, which covers one engine step.
    """

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.preempted_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def record(self, scheduler_stats: Any | None, iteration_stats: Any | None) -> None:
        if scheduler_stats is not None:
            self.running = int(scheduler_stats.num_running_reqs)
            self.waiting = int(scheduler_stats.num_waiting_reqs)
            # vLLM renamed gpu_cache_usage to kv_cache_usage (0.10); accept both.
            usage = getattr(scheduler_stats, "kv_cache_usage", None)
            if usage is None:
                usage = scheduler_stats.gpu_cache_usage
            self.kv_cache_usage = float(usage)
        if iteration_stats is not None:
            self.preempted_total += int(getattr(iteration_stats, "num_preempted_reqs", 0))
            self.prompt_tokens_total += int(iteration_stats.num_prompt_tokens)
            self.generation_tokens_total += int(iteration_stats.num_generation_tokens)


def _stat_logger_class(sink: SchedulerStatsSink) -> Callable[[Any, int], Any]:
    """A ``StatLoggerBase`` subclass bound to ``sink``; the class is vLLM's factory."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SeawallStatLogger(StatLoggerBase):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any | None,
            iteration_stats: Any | None,
            mm_cache_stats: Any | None = None,
            engine_idx: int = 0,
        ) -> None:
            sink.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            logger.info("vLLM engine %d initialized", self.engine_index)

    return SeawallStatLogger


class VllmEngine:
    """``base.Engine`` over an in-process ``vllm.v1.engine.async_llm.AsyncLLM``."""

    name = "vllm"

    def __init__(self, config: VllmEngineConfig) -> None:
        self._config = config
        self._llm: Any | None = None
        self._stats = SchedulerStatsSink()

    async def start(self) -> None:
        if self._llm is not None:
            return
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**engine_args_kwargs(self._config))
        try:
            self._llm = AsyncLLM.from_engine_args(
                args, stat_loggers=[_stat_logger_class(self._stats)]
            )
        except Exception as exc:
            raise EngineError(f"vLLM failed to start {self._config.model!r}: {exc}") from exc

    async def stop(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        llm = self._started()
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=1,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            stop=list(request.stop),
            seed=request.seed,
            output_kind=RequestOutputKind.DELTA,
        )
        completion_tokens = 0
        try:
            async for out in llm.generate(
                request.prompt, params, request.request_id, priority=request.priority
            ):
                completion = out.outputs[0]
                new_tokens = len(completion.token_ids)
                completion_tokens += new_tokens
                yield EngineOutput(
                    request_id=request.request_id,
                    text=completion.text,
                    new_tokens=new_tokens,
                    finished=out.finished,
                    finish_reason=map_finish_reason(completion.finish_reason)
                    if out.finished
                    else None,
                    prompt_tokens=len(out.prompt_token_ids or ()) or request.prompt_tokens,
                    completion_tokens=completion_tokens,
                )
        except ValueError as exc:
            # A request vLLM refuses (a prompt longer than max_model_len, a priority
            # under the fcfs policy): this request's failure, not the engine's.
            raise RequestRefused(f"vLLM refused request {request.request_id}: {exc}") from exc
        except Exception as exc:
            # EngineDeadError, EngineGenerateError: the engine is gone or broken.
            raise EngineError(f"vLLM request {request.request_id} failed: {exc!r}") from exc

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    async def profile(self, seconds: float, path: Path) -> str:
        """vLLM's torch profiler (``AsyncLLM.start_profile``/``stop_profile``): it writes
        to ``VLLM_TORCH_PROFILER_DIR``, which must be set when the engine starts."""
        llm = self._started()
        where = os.environ.get("VLLM_TORCH_PROFILER_DIR")
        if not where:
            raise EngineError("vLLM profiles only with VLLM_TORCH_PROFILER_DIR set at start")
        await llm.start_profile()
        try:
            await asyncio.sleep(seconds)
        finally:
            await llm.stop_profile()
        return where

    def snapshot(self) -> EngineSnapshot:
        stats = self._stats
        return snapshot_of(stats, self.limits)

    @property
    def limits(self) -> EngineLimits:
        """From the running engine's config where vLLM filled it in, else the settings.

        Before the engine reports its KV blocks, capacity falls back to the declared
        ``kv_capacity_tokens``, else to one full-length request: vLLM refuses to start
        with less, so that is the floor it guarantees.
        """
        config = self._config
        vllm_config = getattr(self._llm, "vllm_config", None)
        cache = getattr(vllm_config, "cache_config", None)
        num_gpu_blocks = getattr(cache, "num_gpu_blocks", None)
        block_size = int(getattr(cache, "block_size", None) or config.block_size)
        if num_gpu_blocks:
            kv_capacity = int(num_gpu_blocks) * block_size
        else:
            kv_capacity = config.kv_capacity_tokens or config.max_model_len
        model_config = getattr(vllm_config, "model_config", None)
        max_model_len = int(getattr(model_config, "max_model_len", None) or config.max_model_len)
        return EngineLimits(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=block_size,
            gpu_memory_utilization=config.gpu_memory_utilization,
            kv_capacity_tokens=kv_capacity,
            max_model_len=max_model_len,
        )

    def _started(self) -> Any:
        if self._llm is None:
            raise EngineError("the vLLM engine is not started")
        return self._llm
