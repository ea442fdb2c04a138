"""The worker's Prometheus metrics. Every series carries the worker's ``pool`` (the
dashboards and the recording rules aggregate by it); request latencies also the
request's class (``priority``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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
    "ran out), refused (by the engine), too_many_attempts",
    ["pool", "status"],
)
CLAIMS_UNAVAILABLE = Counter(
    "seawall_worker_claims_unavailable_total",
    "Requests generated without a claim because Redis was unavailable",
)
TELEMETRY_DROPPED = Counter(
    "seawall_worker_telemetry_dropped_total",
    "Telemetry records not sent because the broker was unavailable",
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
PREEMPTED = Gauge("seawall_engine_preemptions", "Preemptions since the engine started", ["pool"])
GPU_MEMORY = Gauge("seawall_gpu_memory_used_bytes", "GPU memory in use", ["pool", "gpu"])
GPU_TEMPERATURE = Gauge("seawall_gpu_temperature_celsius", "GPU temperature", ["pool", "gpu"])
