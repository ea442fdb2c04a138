"""The one registry of topic names, their layout, and Redis key prefixes.

Every name carries the configurable prefix (``SEAWALL_TOPIC_PREFIX``), so that several
stacks (or tests) can share a broker without meeting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from schemas.requests import Priority

DAY_MS = 24 * 3600 * 1000

CANARY_INFIX = ".canary-"
"""A canary release's workers form a pool of their own, ``<pool>.canary-<version>``
(``canary_pool``): its own dispatch topic, capacity, breakers and statistics, which the
controller compares with the pool's."""


def canary_pool(pool: str, version: str) -> str:
    """The pool the workers of ``version``'s canary release of ``pool`` serve."""
    return f"{pool}{CANARY_INFIX}{version}"


def base_pool(pool: str) -> str:
    """The pool a canary pool releases into (a version has no dot, so the last infix
    is the one); any other pool is its own base."""
    base, infix, version = pool.rpartition(CANARY_INFIX)
    return base if infix and base and version and "." not in version else pool


@dataclass(frozen=True, slots=True)
class TopicSpec:
    name: str
    partitions: int
    cleanup_policy: Literal["delete", "compact"] = "delete"
    retention_ms: int = 7 * DAY_MS

    @property
    def config(self) -> dict[str, str]:
        return {"cleanup.policy": self.cleanup_policy, "retention.ms": str(self.retention_ms)}


@dataclass(frozen=True, slots=True)
class Topics:
    prefix: str = ""
    partitions: int = 3
    pools: tuple[str, ...] = ("main", "small")

    @property
    def ingress(self) -> str:
        return f"{self.prefix}llm.ingress"

    def requests(self, priority: Priority) -> str:
        return f"{self.prefix}llm.requests.{priority.value}"

    def dispatch(self, pool: str) -> str:
        return f"{self.prefix}llm.dispatch.{pool}"

    def dispatch_spec(self, pool: str) -> TopicSpec:
        return TopicSpec(self.dispatch(pool), self.partitions)

    @property
    def telemetry(self) -> str:
        return f"{self.prefix}llm.telemetry"

    @property
    def completions(self) -> str:
        """One ``RequestCompleted`` per finished request, for admission's accounting
        (``llm.telemetry`` carries the per-interval reports the controller reads)."""
        return f"{self.prefix}llm.completions"

    @property
    def control(self) -> str:
        return f"{self.prefix}llm.control"

    @property
    def quota_hints(self) -> str:
        """Admission's ``QuotaHint``s: ingress refuses an over-quota tenant at the edge."""
        return f"{self.prefix}llm.quota.hints"

    @property
    def arrivals(self) -> str:
        """Ingress's ``RegionArrivals``: requests per client region, for hotspots."""
        return f"{self.prefix}llm.arrivals"

    @property
    def alerts(self) -> str:
        """The controller's alerts (``schemas.alerts``), keyed by fingerprint."""
        return f"{self.prefix}llm.alerts"

    @property
    def audit(self) -> str:
        return f"{self.prefix}llm.audit"

    @property
    def deadletter(self) -> str:
        return f"{self.prefix}llm.deadletter"

    def reply(self, owner: str) -> str:
        """A reply topic owned by one client or ingress instance."""
        return f"{self.prefix}llm.reply.{owner}"

    def key_replies(self, key_id: str) -> str:
        """What the reply topics of the clients of API key ``key_id`` start with: a
        record on the ingress topic may name only a reply topic of the key that signed
        it (``llm.reply.<key id>.<owner>``), so no producer can send replies into
        another's topic."""
        return self.reply(f"{key_id}.")

    def reply_spec(self, owner: str, retention_ms: int = 3600 * 1000) -> TopicSpec:
        """Reply topics keep an hour: long enough for a reconnecting client to catch up,
        short enough that abandoned ones cost little. Retention empties a topic, never
        deletes it: its owner does on close, and ingress's sweeper once it is idle
        (``seawall_client.reply_upkeep``)."""
        return TopicSpec(self.reply(owner), 1, "delete", retention_ms)

    def specs(self) -> list[TopicSpec]:
        """The fleet's shared topics, created at start by whoever starts first."""
        n = self.partitions
        shared = [
            TopicSpec(self.ingress, n),
            *(TopicSpec(self.requests(p), n) for p in Priority),
            *(self.dispatch_spec(pool) for pool in self.pools),
            TopicSpec(self.telemetry, n, retention_ms=DAY_MS),
            TopicSpec(self.completions, n, retention_ms=DAY_MS),
            TopicSpec(self.control, 1, "compact", retention_ms=-1),
            TopicSpec(self.quota_hints, 1, retention_ms=3600 * 1000),
            TopicSpec(self.arrivals, 1, retention_ms=DAY_MS),
            TopicSpec(self.alerts, 1, retention_ms=30 * DAY_MS),
            TopicSpec(self.audit, 1, retention_ms=90 * DAY_MS),
            TopicSpec(self.deadletter, 1, retention_ms=30 * DAY_MS),
        ]
        return shared


@dataclass(frozen=True, slots=True)
class RedisKeys:
    """Redis key builder. Per-tenant keys carry a hash tag (``{tenant}``) so that a
    tenant's keys live in one Redis Cluster slot and one Lua script may touch them all."""

    prefix: str = "seawall:"

    def api_key(self, key_id: str) -> str:
        return f"{self.prefix}key:{key_id}"

    def tenant_keys(self, tenant: str) -> str:
        return f"{self.prefix}tenant:{{{tenant}}}:keys"

    def quota(self, tenant: str, dimension: str) -> str:
        return f"{self.prefix}quota:{{{tenant}}}:{dimension}"

    def region_quota(self, region: str, dimension: str) -> str:
        """A region's bucket: its own namespace, never a tenant's."""
        return f"{self.prefix}region:{{{region}}}:{dimension}"

    def admitted(self, tenant: str, request_id: str) -> str:
        """Set by admission's quota script when it charges a request: a redelivered
        request is not charged again (``admission.quota``)."""
        return f"{self.prefix}admitted:{{{tenant}}}:{request_id}"

    def work(self, tenant: str, request_id: str) -> str:
        """A request's generation at the workers: who runs it, until when, which
        generation, whether it is done (``workers.claims``)."""
        return f"{self.prefix}work:{{{tenant}}}:{request_id}"

    def session(self, session_id: str) -> str:
        """A WebSocket session's record (tenant, when it started, replies pending)."""
        return f"{self.prefix}session:{{{session_id}}}"

    def session_owed(self, session_id: str) -> str:
        """The final frames a WebSocket session's socket was gone for, oldest first."""
        return f"{self.prefix}session:{{{session_id}}}:owed"

    def key_sessions(self, key_id: str) -> str:
        """The WebSocket sessions an API key started that have not ended yet (a sorted
        set: session id by when it ends), which caps how many one key may hold."""
        return f"{self.prefix}key_sessions:{{{key_id}}}"

    def reservation(self, tenant: str, request_id: str) -> str:
        """Tokens admission reserved for a request, until its completion corrects them."""
        return f"{self.prefix}reservation:{{{tenant}}}:{request_id}"

    def abort(self, tenant: str, request_id: str) -> str:
        """Set (with a TTL) by ingress when a request's client went away; admission
        checks it before dispatching and answers the request as ``cancelled``. Scoped by
        tenant: nobody can abort another tenant's request by naming its id."""
        return f"{self.prefix}abort:{{{tenant}}}:{request_id}"

    def reply_topics_seen(self) -> str:
        """The reply-topic sweeper's memory (a hash, ``services.ingress.reply_sweeper``):
        per reply topic, its end offset, since when it has not moved, and when that was
        last checked."""
        return f"{self.prefix}reply_topics:seen"

    def reply_sweep_lease(self) -> str:
        """Held by the ingress replica sweeping reply topics this round."""
        return f"{self.prefix}reply_topics:lease"

    def seen(self, tenant: str, request_id: str) -> str:
        """Where the Kafka ingress records which record first carried a signed request
        id (its topic, partition and offset): another record with the same id is a
        replay; the same record again is a redelivery."""
        return f"{self.prefix}seen:{{{tenant}}}:{request_id}"
