"""Pieces the benchmarks share: the embedded broker, the controller process, a simulated
worker's reports, summaries.

Imported by the benchmark scripts as ``_common`` (``python bench/<name>.py`` puts
``bench/`` first on ``sys.path``).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

from schemas import (
    EngineStats,
    GpuStats,
    Priority,
    RequestCompleted,
    Tier,
    WorkerHeartbeat,
)
from seawall.embedded import broker_process, free_port
from services.common.bus import wait_for_broker
from services.common.settings import CommonSettings

# The record builders come from the test support package, beside bench/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import builders

RESULTS = Path(__file__).parent / "results"
EMBEDDED_BROKER = "embedded (Tansu, memory storage)"
GPU_TOTAL_BYTES = 80 * 2**30
GPU_RESERVED = 0.9
"""The engine's ``gpu_memory_utilization``: a healthy worker uses exactly this share."""
HEALTHY_TEMP_C, HOT_TEMP_C = 60.0, 95.0


@contextmanager
def steady_clock_hand() -> Iterator[None]:
    """No cyclic garbage collection in this process while the block runs.

    The benchmark process is the load generator and the stopwatch: it holds every
    request it sends and every timestamp it takes, hundreds of thousands of objects, and
    a full collection over them stops it for 90-160 ms every few seconds (measured with
    ``gc.callbacks`` in the admission benchmark's open loop). Sends then fall behind
    their schedule and receipts are stamped late, which the latency figures would blame
    on the system measured. What exists before the block is frozen out of later
    collections and collection is off within it (reference counting still frees
    nearly everything); the services measured run with the interpreter's defaults."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


@asynccontextmanager
async def embedded_broker(workdir: Path) -> AsyncIterator[str]:
    """Tansu on a free port (log in ``workdir``), stopped on exit; yields its bootstrap."""
    port = free_port()
    broker = broker_process("127.0.0.1", port, workdir / "broker.log")
    broker.start()
    try:
        bootstrap = f"127.0.0.1:{port}"
        await wait_for_broker(bootstrap, timeout_s=30)
        yield bootstrap
    finally:
        broker.stop()


_CONTROL_KEYS: Path | None = None


def control_keys() -> Path:
    """This run's control signing keys (``services.common.control_signing``), made once
    per process in a temporary directory: the benchmarks sign and check control events
    as a deployment does."""
    global _CONTROL_KEYS
    if _CONTROL_KEYS is None:
        from services.common.control_signing import ensure_keys

        _CONTROL_KEYS = Path(tempfile.mkdtemp(prefix="seawall-bench-keys-")) / "keys"
        ensure_keys(_CONTROL_KEYS, "operator:bench")
    return _CONTROL_KEYS


def worker_mac(topic: str, value: bytes) -> list[tuple[str, bytes]]:
    """The headers a worker puts on a report or a completion (``hop_signing``, the
    ``telemetry`` hop, with this run's keys): admission and the controller skip what
    lacks them, as they would a forger's."""
    from services.common.hop_signing import load_key

    global _TELEMETRY_KEY
    if _TELEMETRY_KEY is None:
        _TELEMETRY_KEY = load_key(control_keys(), "telemetry")
    headers: list[tuple[str, bytes]] = _TELEMETRY_KEY.headers(topic, value)
    return headers


_TELEMETRY_KEY: Any = None
_SAMPLING_SECRET: Path | None = None


def sampling_secret() -> Path:
    """This run's sampling secret (``services.common.sampling``), made once per process
    in a temporary directory: admission and the workers do not start without one, and
    every process of the run shares it, as a fleet's do."""
    global _SAMPLING_SECRET
    if _SAMPLING_SECRET is None:
        from services.common.sampling import make_secret

        _SAMPLING_SECRET = Path(tempfile.mkdtemp(prefix="seawall-bench-sampling-")) / "secret"
        make_secret(_SAMPLING_SECRET)
    return _SAMPLING_SECRET


def spawn_controller(
    settings: CommonSettings,
    tick_s: float,
    time_scale: float,
    log: Path,
    *,
    instance_id: str = "bench-controller",
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """``python -m services.controller`` on ``settings``' broker and topic prefix (and
    partitions), with none of this environment's ``SEAWALL_`` variables; ``env`` adds
    more (``SEAWALL_METRICS_PORT``, say)."""
    child = {k: v for k, v in os.environ.items() if not k.startswith("SEAWALL_")}
    child.update(
        SEAWALL_ENV_FILE=os.devnull,
        SEAWALL_KAFKA_BOOTSTRAP=settings.kafka_bootstrap,
        SEAWALL_KAFKA_IDEMPOTENCE="false",
        SEAWALL_TOPIC_PREFIX=settings.topic_prefix,
        SEAWALL_TOPIC_PARTITIONS=str(settings.topic_partitions),
        SEAWALL_INSTANCE_ID=instance_id,
        SEAWALL_LOG_LEVEL="WARNING",
        SEAWALL_CONTROLLER_TICK_S=str(tick_s),
        SEAWALL_CONTROLLER_TIME_SCALE=str(time_scale),
        SEAWALL_CONTROL_KEYS_DIR=str(settings.control_keys_dir or control_keys()),
    )
    child.update(env or {})
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "services.controller"],
            env=child,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def stop_controller(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


# -- a simulated worker's reports (what services/workers/service.py sends) ----------------
def gpu_stats(
    worker: str, pool: str, at: float, temperature_c: float, memory_share: float = GPU_RESERVED
) -> GpuStats:
    """One GPU of ``GPU_TOTAL_BYTES``, ``memory_share`` of it in use."""
    return builders.gpu_stats(
        worker,
        at,
        pool,
        name="bench-gpu",
        utilization_pct=80.0,
        memory_used_bytes=int(GPU_TOTAL_BYTES * memory_share),
        memory_total_bytes=GPU_TOTAL_BYTES,
        temperature_c=temperature_c,
        power_w=400.0,
    )


def engine_stats(
    worker: str,
    pool: str,
    at: float,
    *,
    in_flight: int,
    kv_cache_usage: float,
    kv_capacity_tokens: int,
) -> EngineStats:
    """A simulated engine running ``in_flight`` requests, none waiting."""
    return builders.engine_stats(
        worker,
        at,
        pool,
        running=in_flight,
        kv_cache_usage=kv_cache_usage,
        in_flight=in_flight,
        batch_limit=64,
        limits=builders.engine_limits(
            kv_capacity_tokens=kv_capacity_tokens, gpu_memory_utilization=GPU_RESERVED
        ),
    )


def heartbeat(
    worker: str, pool: str, at: float, *, in_flight: int, started_at: float
) -> WorkerHeartbeat:
    return builders.heartbeat(
        worker, at, pool, in_flight=in_flight, batch_limit=64, started_at=started_at
    )


def completed(
    worker: str,
    pool: str,
    at: float,
    request_id: str,
    *,
    latency_ms: float,
    prompt_tokens: int,
    completion_tokens: int,
    ttft_ms: float | None = None,
) -> RequestCompleted:
    """A standard-priority request of tenant ``bench`` (pro tier), served."""
    return RequestCompleted(
        worker_id=worker,
        pool=pool,
        request_id=request_id,
        tenant="bench",
        priority=Priority.STANDARD,
        tier=Tier.PRO,
        queue_wait_ms=5.0,
        ttft_ms=ttft_ms,
        latency_ms=latency_ms,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        at=at,
    )


# -- summaries ----------------------------------------------------------------------------
def ratio(value: float | int | None, base: float | int | None) -> float | None:
    return value / base if value is not None and base else None


def midpoint(before: float | None, after: float | None) -> float | None:
    """A baseline measured on either side of a phase, at the phase's midpoint: the mean of
    the two, were the drift between them linear in time (the embedded broker slows down
    as its topics fill, and a loaded phase fills them most)."""
    return None if before is None or after is None else (before + after) / 2


def fmt(value: float | int | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def summary(values: list[float]) -> dict[str, float | int | None]:
    if len(values) < 2:
        return {"n": len(values), "p50": None, "p99": None, "max": None, "mean": None}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {
        "n": len(values),
        "p50": cuts[49],
        "p99": cuts[98],
        "max": max(values),
        "mean": statistics.fmean(values),
    }


def machine(loadavg_before: tuple[float, float, float], **extra: object) -> dict[str, object]:
    """Where a result came from, for its JSON: cores, the load average before and after
    the run (other work on the machine shows there), Python and the platform."""
    return {
        "cpus": mp.cpu_count(),
        "loadavg_before": loadavg_before,
        "loadavg_after": os.getloadavg(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        **extra,
    }


def commit() -> str:
    """The commit a benchmark ran on, read as it started (``-dirty``: with uncommitted
    changes to tracked files other than the results that benchmarks write), for its
    JSON: what is committed while a long run goes on is not what it ran."""
    return _AT_START


def _read_commit() -> str:
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    dirty = subprocess.run(
        [
            "git",
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
            ":(top)",
            ":(top,exclude)bench/results",
        ],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return head + ("-dirty" if dirty else "")


_AT_START = _read_commit()


def output_dir(name: str, quick: bool) -> Path:
    """Where a run writes its JSON and plot: ``results/``, or for a ``--quick`` trial a
    new temporary directory, so that a trial never overwrites the recorded figures."""
    if not quick:
        RESULTS.mkdir(exist_ok=True)
        return RESULTS
    return Path(tempfile.mkdtemp(prefix=f"seawall-{name}-quick-"))
