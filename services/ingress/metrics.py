"""Ingress's Prometheus metrics, and the rolling long-prompt share behind one of them."""

from __future__ import annotations

import math
from collections import deque

from prometheus_client import Counter, Gauge, Histogram

from seawall_client.clock import SYSTEM_CLOCK, Clock
from services.ingress.policy.filters.prompt_length import PROMPT_TOKEN_BUCKETS, is_long

WAIT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 8, 13, 20, 30, 60, 120)

REQUESTS = Counter(
    "seawall_ingress_requests_total",
    "Requests taken in, by source (http, kafka) and outcome "
    "(published, refused, dead_letter, unavailable)",
    ["source", "outcome"],
)
REFUSALS = Counter(
    "seawall_ingress_refusals_total",
    "Requests refused by ingress itself, by source and stable code",
    ["source", "code"],
)
HTTP_RESPONSES = Counter(
    "seawall_ingress_http_responses_total",
    "HTTP responses, by endpoint and status code",
    ["endpoint", "status"],
)
PROMPT_TOKENS = Histogram(
    "seawall_ingress_prompt_tokens",
    "Estimated prompt tokens of authenticated requests",
    buckets=PROMPT_TOKEN_BUCKETS,
)
LONG_PROMPT_SHARE = Gauge(
    "seawall_ingress_long_prompt_share",
    "Share of prompts over 4096 tokens in the last window (alert above 0.3)",
)
SENSITIVE_FINDINGS = Counter(
    "seawall_ingress_sensitive_findings_total",
    "Sensitive values found in prompts, by kind and the action taken",
    ["kind", "action"],
)
REPLY_WAIT = Histogram(
    "seawall_ingress_reply_wait_seconds",
    "From publishing an HTTP request to its terminal reply",
    buckets=WAIT_BUCKETS,
)
WAITING = Gauge("seawall_ingress_waiting_requests", "HTTP requests awaiting their reply now")
ABORTS = Counter(
    "seawall_ingress_aborts_total",
    "Abort markers set for requests nobody waits for any more, by cause",
    ["cause"],
)
ABORTS_REFUSED = Counter(
    "seawall_ingress_aborts_refused_total",
    "Signed abort records refused, no marker set: their key's abort budget on this "
    "ingress replica was spent (SEAWALL_KAFKA_ABORTS_PER_KEY_PER_S, _BURST)",
)


class LongPromptShare:
    """The share of prompts over ``LONG_PROMPT_TOKENS`` among those seen in the last
    ``window_s`` seconds (what the histogram's PromQL gives over that window, readable
    without a Prometheus server). Counts are kept per ``resolution_s`` slot, so memory
    follows the window, not the request rate; a slot leaves the window whole. Pure:
    time from the injected clock."""

    def __init__(
        self, window_s: float = 300.0, resolution_s: float = 1.0, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        if window_s <= 0 or resolution_s <= 0:
            raise ValueError("window_s and resolution_s must be positive")
        self._window_s = window_s
        self._resolution_s = resolution_s
        self._clock = clock
        self._slots: deque[list[int]] = deque()
        """``[slot number, prompts, long prompts]``, oldest first."""
        self._total = 0
        self._long = 0

    def observe(self, tokens: int) -> float:
        """Count one prompt; the share now."""
        now = self._clock.monotonic()
        slot = math.floor(now / self._resolution_s)
        if not self._slots or self._slots[-1][0] != slot:
            self._slots.append([slot, 0, 0])
        long = int(is_long(tokens))
        self._slots[-1][1] += 1
        self._slots[-1][2] += long
        self._total += 1
        self._long += long
        return self.share(now)

    def reading(self) -> float:
        """The share now, changing nothing: what the gauge reads at each scrape, from
        the metrics server's thread (so it decays when traffic stops)."""
        horizon = self._clock.monotonic() - self._window_s
        total = long = 0
        for slot, prompts, longs in list(self._slots):  # a snapshot, taken under the GIL
            if (slot + 1) * self._resolution_s > horizon:
                total += prompts
                long += longs
        return long / total if total else 0.0

    def share(self, now: float | None = None) -> float:
        now = self._clock.monotonic() if now is None else now
        while self._slots and (self._slots[0][0] + 1) * self._resolution_s <= now - self._window_s:
            _, total, long = self._slots.popleft()
            self._total -= total
            self._long -= long
        return self._long / self._total if self._total else 0.0


QUOTA_HINTS = Gauge(
    "seawall_ingress_quota_hints",
    "Tenants refused at the edge now: admission found their requests bucket empty",
)
INVALID_HINTS = Counter(
    "seawall_ingress_invalid_quota_hints_total",
    "Records on the quota hint topic that are not a hint (skipped)",
)
RECORD_INTEGRITY = Counter(
    "seawall_ingress_record_integrity_failures_total",
    "Reads of key records (record=key) and tenant policies (record=policy) from Redis "
    "refused for their MAC: unsigned (written before records were signed: run "
    "`seawall keys sign`) or mismatch (altered in Redis, or written under another pepper)",
    ["record", "reason"],
)
