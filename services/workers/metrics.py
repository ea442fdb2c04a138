"""The worker's Prometheus metrics. Every series carries the worker's ``pool`` (the
dashboards and the recording rules aggregate by it); request latencies also the
request's class (``priority``)."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram

from services.workers.engine.base import GpuReading
from services.workers.gpu import CLOCK_EVENT_REASONS

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 8, 13, 20, 30, 60)

IN_FLIGHT = Gauge("seawall_worker_in_flight_requests", "Requests the worker holds now", ["pool"])
BATCH_LIMIT = Gauge("seawall_worker_batch_limit", "The worker's in-flight cap in force", ["pool"])
STEPPED_ASIDE = Gauge(
    "seawall_worker_stepped_aside",
    "1 while its breaker isolates it and it left its group",
    ["pool"],
)
REQUESTS = Counter(
    "seawall_worker_requests_total",
    "Dispatched records handled, by outcome: the terminal reply's status, or dead_letter, "
    "joined (a redelivery of a request in hand), already_answered, taken_over (its lease "
    "ran out), refused (by the engine), too_many_attempts; by the request's class (unknown: "
    "a record that did not decode)",
    ["pool", "priority", "status"],
)
CLAIMS_UNAVAILABLE = Counter(
    "seawall_worker_claims_unavailable_total",
    "Requests generated without a claim because Redis was unavailable",
)
TELEMETRY_DROPPED = Counter(
    "seawall_worker_telemetry_dropped_total",
    "Telemetry records not sent because the broker was unavailable",
)
CONSISTENCY = Counter(
    "seawall_worker_consistency_checks_total",
    "Shadow runs of the output-consistency check, by outcome: agree, differ, or why one "
    "was not compared (same_worker, stale, refused, incomplete, failed), or not_sent "
    "(counted by the original's worker: the broker was unavailable)",
    ["pool", "outcome"],
)
CONSISTENCY_SIMILARITY = Histogram(
    "seawall_worker_consistency_similarity",
    "Similarity of a shadow run's output to its original's (MinHash of word bigrams, 0-1)",
    ["pool"],
    buckets=(0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0),
)
CHUNKS = Counter("seawall_worker_reply_chunks_total", "Streamed reply chunks sent")
LATENCY = Histogram(
    "seawall_worker_request_duration_seconds",
    "Start of work to terminal reply",
    ["pool", "priority"],
    buckets=LATENCY_BUCKETS,
)
TTFT = Histogram(
    "seawall_worker_time_to_first_token_seconds",
    "Start of work to first token",
    ["pool", "priority"],
    buckets=LATENCY_BUCKETS,
)
ENGINE_RUNNING = Gauge(
    "seawall_engine_running_requests", "Requests the engine is running", ["pool"]
)
ENGINE_WAITING = Gauge(
    "seawall_engine_waiting_requests", "Requests waiting in the engine", ["pool"]
)
KV_USAGE = Gauge("seawall_engine_kv_cache_usage_ratio", "KV cache in use, 0-1", ["pool"])
ENGINE_STALLED = Gauge(
    "seawall_engine_stalled_seconds",
    "How long the engine has produced no token while holding requests (0: idle or producing)",
    ["pool"],
)
PREEMPTED = Gauge("seawall_engine_preemptions", "Preemptions since the engine started", ["pool"])
# GPU gauges, one series per GPU the worker reads (its own: ``gpu.visible_devices``),
# named after the DCGM exporter's fields so dashboards map one to one.
GPU_MEMORY = Gauge(
    "seawall_gpu_memory_used_bytes", "GPU memory in use (DCGM FB_USED)", ["pool", "gpu"]
)
GPU_TEMPERATURE = Gauge(
    "seawall_gpu_temperature_celsius", "GPU temperature (DCGM GPU_TEMP)", ["pool", "gpu"]
)
GPU_UTILIZATION = Gauge(
    "seawall_gpu_utilization_ratio",
    "Share of time a kernel ran (DCGM GPU_UTIL / 100)",
    ["pool", "gpu"],
)
GPU_MEMORY_COPY = Gauge(
    "seawall_gpu_memory_copy_utilization_ratio",
    "Share of time memory was read or written: memory bandwidth in use (DCGM MEM_COPY_UTIL)",
    ["pool", "gpu"],
)
GPU_POWER = Gauge("seawall_gpu_power_watts", "Power draw (DCGM POWER_USAGE)", ["pool", "gpu"])
GPU_POWER_LIMIT = Gauge(
    "seawall_gpu_enforced_power_limit_watts",
    "The power cap in force (DCGM ENFORCED_POWER_LIMIT)",
    ["pool", "gpu"],
)
GPU_PCIE = Gauge(
    "seawall_gpu_pcie_bytes_per_second",
    "PCIe throughput by direction, tx or rx (DCGM PCIE_TX/RX_BYTES)",
    ["pool", "gpu", "direction"],
)
GPU_ECC = Gauge(
    "seawall_gpu_ecc_errors",
    "Volatile ECC error counts since the driver loaded, corrected or uncorrected "
    "(DCGM ECC_SBE/DBE_VOL_TOTAL)",
    ["pool", "gpu", "type"],
)
GPU_CLOCK_EVENT = Gauge(
    "seawall_gpu_clock_event_active",
    "1 while a reason holds the clocks down (power cap, thermal slowdown, ...), else 0 "
    "(DCGM CLOCK_THROTTLE_REASONS, one series per reason)",
    ["pool", "gpu", "reason"],
)


def export_gpu(pool: str, g: GpuReading) -> None:
    """One GPU reading into the gauges."""
    gpu = str(g.index)
    pct = 100.0
    for gauge, value, scale in (
        (GPU_MEMORY, g.memory_used_bytes, 1.0),
        (GPU_TEMPERATURE, g.temperature_c, 1.0),
        (GPU_UTILIZATION, g.utilization_pct, pct),
        (GPU_MEMORY_COPY, g.memory_utilization_pct, pct),
        (GPU_POWER, g.power_w, 1.0),
        (GPU_POWER_LIMIT, g.power_limit_w, 1.0),
    ):
        if value is not None:
            gauge.labels(pool, gpu).set(value / scale)
        else:  # not reported by the device: no series, rather than a false 0
            with contextlib.suppress(KeyError):
                gauge.remove(pool, gpu)
    GPU_PCIE.labels(pool, gpu, "tx").set(g.pcie_tx_kbps * 1000.0)
    GPU_PCIE.labels(pool, gpu, "rx").set(g.pcie_rx_kbps * 1000.0)
    GPU_ECC.labels(pool, gpu, "corrected").set(g.ecc_corrected)
    GPU_ECC.labels(pool, gpu, "uncorrected").set(g.ecc_uncorrected)
    active = set(g.clock_event_reasons)
    for _, reason in CLOCK_EVENT_REASONS:
        GPU_CLOCK_EVENT.labels(pool, gpu, reason).set(1 if reason in active else 0)
