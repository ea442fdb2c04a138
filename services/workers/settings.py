"""Worker settings (``SEAWALL_`` environment variables)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from seawall_client.topics import CANARY_INFIX, canary_pool
from services.common.settings import CommonSettings


class WorkerSettings(CommonSettings):
    pool: str = Field(default="main", pattern=r"^[A-Za-z0-9._-]+$")
    """The pool served. With ``canary_version``, that version's canary pool of it."""
    canary_version: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    """This worker runs a canary release of its pool (``seawall canary``): it serves the
    pool ``<pool>.canary-<version>``, which takes the share of the pool's traffic the
    controller gives the release."""
    engine: Literal["sim", "vllm", "openai-http"] = "sim"
    batch_limit: int = Field(default=32, ge=1, le=1024)
    """Initial in-flight cap; then set by ``BatchLimit`` control events, never above the
    engine's ``max_num_seqs``."""
    chunk_max_tokens: int = Field(default=16, ge=1, le=4096)
    chunk_max_interval_s: float = Field(default=0.1, ge=0, le=10)
    telemetry_interval_s: float = Field(default=1.0, gt=0, le=60)
    commit_interval_s: float = Field(default=0.2, gt=0, le=10)
    leave_group_when_isolated: bool = True
    """Leave the consumer group while this worker's breaker isolates it, so that its
    partitions go to the rest of the pool. Off: it keeps serving its partitions (for a
    pool of one, where leaving stops the pool until the breaker's half-open probes)."""
    static_reply: str = "The service is under heavy load; please try again shortly."
    """Degradation level 3's canned reply."""
    consumer_session_timeout_ms: int = Field(default=3_000, ge=1_000, le=300_000)
    """Shorter for workers than for the other services: a SIGKILLed worker's partitions
    move to the rest of the pool after about 1.5 times this (measured on the embedded
    broker: 5 s for 3 s), which bounds how long its queued requests wait."""
    consumer_heartbeat_ms: int = Field(default=500, ge=100, le=60_000)
    claim_lease_s: float = Field(default=3.0, gt=0.1, le=300)
    """A running request's lease (``claims``), renewed every third of it: a killed
    worker's requests are taken over once their leases run out."""
    engine_stall_s: float = Field(default=30.0, gt=0, le=3600)
    """The engine produced no token for any of its requests for this long while it held
    some: it is hung, and the worker fails (its supervisor restarts it with a fresh
    engine; its requests, uncommitted, go to the next owner)."""
    request_stall_s: float = Field(default=120.0, gt=0, le=3600)
    """One request with no output for this long (queued in the engine included) is
    given up: aborted in the engine and answered ``error`` (``no_progress``)."""
    max_attempts: int = Field(default=3, ge=1, le=100)
    """Claims of one request after which it is answered ``error`` instead of being
    generated again: a request that took that many workers down with it takes no more."""

    # engine limits, for every engine (vLLM fixes them at start; for `openai-http` they
    # must repeat what the server was started with)
    engine_max_num_seqs: int = Field(default=64, ge=1, le=4096)
    engine_max_num_batched_tokens: int = Field(default=8192, ge=1, le=1_000_000)
    engine_block_size: int = Field(default=16, ge=1, le=256)
    engine_gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    engine_max_model_len: int = Field(default=4096, ge=16, le=1_048_576)
    engine_scheduling_policy: Literal["fcfs", "priority"] = "priority"
    """vLLM's ``--scheduling-policy`` (and the simulator's): ``priority`` orders the
    engine's waiting queue by the request's class, VIP first; running requests are only
    preempted when KV blocks run out, as in vLLM V1."""

    # the simulated engine (a simulator of vLLM; see services/workers/engine/sim_core.py)
    profile_dir: Path = Path(tempfile.gettempdir()) / "seawall-profiles"
    """Where ``seawall profile`` writes this worker's traces (``cProfile``'s ``pstats``)."""
    gpu_devices: str | None = None
    """The GPUs this worker reads through NVML, as ``CUDA_VISIBLE_DEVICES`` names them
    (indices or UUIDs); unset: ``CUDA_VISIBLE_DEVICES`` itself, and without it every GPU
    of the host."""

    sim_model: str = "llama-2-7b"
    sim_gpu: str = "a100-80g"
    sim_time_scale: float = Field(default=1.0, gt=0, le=1000)
    """Multiplies every simulated step time (below 1: a faster fleet for demos and tests)."""
    sim_seed: int = 0
    sim_error_rate: float = Field(default=0.0, ge=0, le=1)
    sim_slowdown: float = Field(default=1.0, gt=0, le=1000)
    sim_hang_after_s: float | None = Field(default=None, ge=0)
    sim_crash_after_s: float | None = Field(default=None, ge=0)
    sim_over_temperature: bool = False
    sim_memory_leak_mb_per_s: float = Field(default=0.0, ge=0)
    sim_divergence: float = Field(default=0.0, ge=0, le=1)
    """Share of requests whose text departs from the prompt's usual output (SimFaults)."""

    # vLLM in process (extra `vllm`)
    vllm_model: str = ""

    # a separately running `vllm serve` (or `seawall sim-serve`)
    openai_base_url: str = "http://127.0.0.1:8000"
    openai_model: str = ""

    @model_validator(mode="before")
    @classmethod
    def _canary(cls, data: object) -> object:
        """A canary's worker serves its version's canary pool (``pool`` is resolved
        here, once: the settings are frozen)."""
        if isinstance(data, dict) and data.get("canary_version"):
            pool = str(data.get("pool") or cls.model_fields["pool"].default)
            if CANARY_INFIX not in pool:
                data = {**data, "pool": canary_pool(pool, str(data["canary_version"]))}
        return data
