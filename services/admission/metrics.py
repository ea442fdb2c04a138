"""Admission's Prometheus metrics. The control state's age is
``seawall_control_state_age_seconds`` (``services.common.control``)."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

from schemas import InferenceRequest, Priority

DECISIONS = Counter(
    "seawall_admission_decisions_total",
    "Final decisions per request: admitted, degraded, rejected, expired, dead_letter",
    ["outcome", "reason", "priority", "tier"],
)
TENANT_DECISIONS = Counter(
    "seawall_admission_tenant_decisions_total",
    "Final decisions per tenant (the per-tenant dashboard): one series per tenant and "
    "outcome, so as many tenants as the fleet serves",
    ["tenant", "tier", "outcome"],
)


def _count(outcome: str, reason: str, priority: str, tier: str, tenant: str | None, n: int) -> None:
    DECISIONS.labels(outcome, reason, priority, tier).inc(n)
    if tenant is not None:
        TENANT_DECISIONS.labels(tenant, tier, outcome).inc(n)


def decided(
    outcome: str, reason: str, priority: Priority, request: InferenceRequest | None
) -> None:
    """Count one record's final decision (``request``: ``None`` for one that did not
    decode: tier ``unknown``, no tenant)."""
    if request is None:
        _count(outcome, reason, priority.value, "unknown", None, 1)
    else:
        _count(outcome, reason, priority.value, request.tier.value, request.tenant, 1)


def dispatched(
    admitted: Iterable[tuple[str, str, Priority, InferenceRequest, str, Priority]],
) -> None:
    """Count a round's dispatches — (outcome, reason, source class, request, pool, class
    it waited in) each — once per distinct set of labels: a round releases thousands, and
    a labelled increment costs microseconds."""
    tally = Tally(
        (outcome, reason, source.value, request.tier.value, request.tenant, pool, cls.value)
        for outcome, reason, source, request, pool, cls in admitted
    )
    for (outcome, reason, source, tier, tenant, pool, cls), n in tally.items():
        _count(outcome, reason, source, tier, tenant, n)
        DISPATCHES.labels(pool, cls).inc(n)


DISPATCHES = Counter(
    "seawall_admission_dispatches_total", "Requests dispatched, by pool", ["pool", "priority"]
)
BACKLOG = Gauge(
    "seawall_admission_backlog_requests",
    "Accepted requests waiting for a dispatch slot, by the class they wait in (or the "
    "scavenger lane: over-quota requests waiting for idle capacity)",
    ["priority"],
)
POOL_FREE = Gauge(
    "seawall_admission_pool_free_slots", "Free dispatch slots per pool (the pacing rule)", ["pool"]
)
POOL_SLOTS = Gauge(
    "seawall_admission_pool_slots", "Batch slots of the pool's live workers, paced", ["pool"]
)
POOL_TOKENS = Gauge(
    "seawall_admission_pool_tokens",
    "The pacing rule's token dimensions per pool: KV (reserved prompt + max_tokens) and "
    "prefill (prompt tokens before their first token), budget and in the pool",
    ["pool", "dimension", "figure"],
)
QUOTA_LATENCY = Histogram(
    "seawall_admission_quota_seconds",
    "One round trip of pipelined quota decisions",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0),
)
QUOTA_STORE_ERRORS = Counter(
    "seawall_admission_quota_store_errors_total",
    "Quota-store calls that failed (the per-tier Redis-down policy decided instead)",
    ["operation"],
)
CORRECTIONS = Counter(
    "seawall_admission_token_corrections_total",
    "Token reservations settled: corrected at completion, refunded, not refunded (a copy "
    "was sent: its completion settles it), or not found",
    ["outcome"],
)

QUOTA_HINTS = Counter(
    "seawall_admission_quota_hints_total",
    "Quota hints published for ingress (a tenant's requests bucket found empty)",
)
