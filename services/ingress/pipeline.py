"""The one path from a raw request to the priority topic, shared by HTTP and Kafka.

Each transport turns its input into an ``InferenceRequest`` its own way (OpenAI JSON;
a record on ``llm.ingress``) and then goes through the ``IngressPipeline``, in this
order (cheap checks first, nothing parsed before its size is known):

1. ``check_size``: the raw bytes against the limit (HTTP before parsing);
2. ``check_user_agent``: the blacklist;
3. ``authenticate`` (HTTP: the full key, verified in constant time) or
   ``verify_signed`` (Kafka: the record's signature by its key, ``services.common.
   signing``), then ``principal``: the key must exist and be in a phase that allows
   inference;
4. ``prepare``: a tenant that admission found over its request quota is refused until
   its bucket refills (``policy.hints``, published by admission: the quota pre-check at the
   edge); the tenant, tier and priority from the key's tenant (whatever the
   request claimed), the model's pool, the deadline, the region (HTTP: the client
   address's; Kafka: the tenant's, never the record's ``client_ip``), the
   ``max_tokens`` cap, the tenant's sensitive-data policy (block or redact) and the
   prompt-length metrics;
5. ``publish``: onto ``llm.requests.<priority>``, keyed by session id (else tenant).

A refusal is a ``Refusal`` (``refusals.py``). Infrastructure failures (Redis, Kafka)
are exceptions, not refusals: the request was not judged.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any, cast

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from pydantic import ValidationError

from schemas import ChatMessage, InferenceRequest, ReasonCode
from schemas.requests import TIER_PRIORITY
from seawall_client import signing, tracecontext
from seawall_client.clock import SYSTEM_CLOCK, Clock
from seawall_client.serde import DecodeError, describe, encode
from seawall_client.signing import key_id_of
from seawall_client.topics import RedisKeys, Topics
from seawall_client.tracecontext import TraceContext
from services.common.hop_signing import hop_key_for, mac_headers
from services.common.screening import Screener
from services.common.sensitive import MAX_FINDINGS, Finding, summary
from services.ingress import metrics as m
from services.ingress.arrivals import ArrivalCounter
from services.ingress.denials import DenialAudit, FailureLimiter
from services.ingress.keystore import KeyStore, TenantPolicy
from services.ingress.policy.filters.body import check_body
from services.ingress.policy.filters.geo import RegionTable, parse_ip
from services.ingress.policy.filters.useragent import UserAgentBlacklist
from services.ingress.policy.hints import QuotaHints
from services.ingress.policy.keys import Action, KeyDecision, KeyRecord, check, verify
from services.ingress.refusals import Refusal, body_too_large, invalid, over_quota, param_of
from services.ingress.settings import IngressSettings

log = logging.getLogger(__name__)

ABORT_MARKER_MARGIN_S = 60
ABORT_CAUSES = frozenset({"client_abort", "timeout", "disconnect", "shutdown"})
"""The causes ingress and the SDK give an abort (what ``seawall_ingress_aborts_total``
counts by name)."""
_KEY_ID = re.compile(r"[0-9a-f]{12}")


_KEY_MESSAGES = {
    "missing_api_key": "You didn't provide an API key: send 'Authorization: Bearer <key>'.",
    "missing_api_key_id": "The request has no api_key_id.",
    "invalid_api_key": "Incorrect API key provided.",
    "key_retired": "This API key has been retired: use a current key.",
    "key_purged": "Incorrect API key provided.",
    "key_revoked": "This API key has been revoked.",
    "key_read_only": "This API key is in its grace period: it may only read.",
    "too_many_failures": "Too many failed authentications from this address: try later.",
}


def _unauthenticated(code: str) -> Refusal:
    return Refusal(ReasonCode.UNAUTHENTICATED, code, _KEY_MESSAGES[code])


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is from, as the key store says (never as the request says)."""

    tenant: str
    key_id: str
    policy: TenantPolicy
    key: KeyDecision
    deprecated_at: float | None = None
    """When the key's grace period began; ``None`` for an active key."""

    @property
    def deprecation_headers(self) -> dict[str, str]:
        """``Deprecation`` (RFC 9745) and ``Sunset`` (RFC 8594) for a key in its grace
        period; nothing for an active key."""
        if self.deprecated_at is None:
            return {}
        return {
            "Deprecation": f"@{int(self.deprecated_at)}",
            "Sunset": formatdate(self.key.disabled_at, usegmt=True),
        }


@dataclass(frozen=True, slots=True)
class Forged:
    """A record on the ingress topic that does not prove who sent it, or tries what its
    key may not: dead-lettered, never answered (its ``reply_to`` is not known to reach
    the producer, and answering a replay would tell its victim a lie). ``reason``:
    ``unsigned``, ``unknown_key``, ``bad_signature``, ``stale_timestamp`` (the
    signature's window passed), ``key_mismatch`` (the body names another key),
    ``foreign_reply_to`` (a reply topic of another key), ``replayed``."""

    reason: str

    def error(self) -> DecodeError:
        return DecodeError(self.reason, f"unauthenticated: {self.reason.replace('_', ' ')}")


class IngressPipeline:
    """The steps above, from a transport's request to its priority topic (and the abort
    marker of a published request given up on)."""

    def __init__(
        self,
        settings: IngressSettings,
        keystore: KeyStore,
        denials: DenialAudit,
        producer: AIOKafkaProducer,
        topics: Topics,
        redis: aioredis.Redis,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.settings = settings
        self._redis = redis
        self._redis_keys = RedisKeys(settings.redis_prefix)
        self._keystore = keystore
        self._denials = denials
        self._sources = FailureLimiter(
            settings.failed_auth_per_source_per_s, settings.failed_auth_per_source_burst
        )
        self._producer = producer
        self._topics = topics
        self._hop = hop_key_for(settings, "requests")
        """MACs what goes onto the priority topics (``services.common.hop_signing``)."""
        self._clock = clock
        self._user_agents = UserAgentBlacklist.from_config(
            settings.user_agent_blacklist,
            settings.user_agent_patterns,
            block_missing=settings.block_missing_user_agent,
        )
        self._regions = RegionTable(settings.region_table)
        self._long_share = m.LongPromptShare(clock=clock)
        m.LONG_PROMPT_SHARE.set_function(self._long_share.reading)
        self.screener = Screener(
            settings.screen_workers, settings.screen_offload_chars, settings.instance_id
        )
        """Counts and screens each prompt, long ones off the event loop; the service
        starts and closes it."""
        self.hints = QuotaHints(settings.quota_hint_tenants)
        self.arrivals = ArrivalCounter(clock)
        """Fed by the service's hint follower (``llm.quota.hints``)."""

    # -- cheap filters -----------------------------------------------------------
    @staticmethod
    def check_size(body: bytes | bytearray, limit: int) -> Refusal | None:
        return None if check_body(body, limit).allowed else body_too_large(limit)

    def check_user_agent(self, user_agent: str | None) -> Refusal | None:
        verdict = self._user_agents.check(user_agent)
        if verdict.allowed:
            return None
        code = verdict.reason or "user_agent_blocked"
        return Refusal(ReasonCode.FORBIDDEN, code, "Requests from this client are not accepted.")

    def region(self, client_ip: str) -> str:
        return self._regions.lookup(parse_ip(client_ip) if client_ip else None) or ""

    # -- keys --------------------------------------------------------------------
    async def authenticate(
        self, presented: str | None, action: Action = "inference", source: str = ""
    ) -> Principal | Refusal:
        """The full key of an HTTP request. Its existence and phase are only revealed
        to whoever holds the right secret.

        Failures are counted per (``source``, key id): past its budget that pair is
        refused 429 (``denials``). A right key is never refused that way — its check is
        a cached lookup and an HMAC — so a stranger's failures, even sent under a
        victim's forwarded address or naming the victim's key id, cannot lock the
        victim out (29 bad keys under a victim's address got its valid key 429 in 11
        tries of 12, when failures were counted per address and checked first)."""
        checked = await self._check_key(presented)
        if not isinstance(checked, Refusal):
            return await self.principal(checked, action)
        if source:
            now = self._clock.monotonic()
            who = f"{source}|{(key_id_of(presented) if presented else None) or '-'}"
            wait_s = self._sources.exhausted(who, now)
            if wait_s > 0:
                m.REFUSALS.labels("http", "too_many_failures").inc()
                return Refusal(
                    ReasonCode.UNAUTHENTICATED,
                    "too_many_failures",
                    _KEY_MESSAGES["too_many_failures"],
                    retry_after_s=wait_s,
                )
            self._sources.fail(who, now)
        return checked

    async def _check_key(self, presented: str | None) -> KeyRecord | Refusal:
        if not presented:
            return _unauthenticated("missing_api_key")
        key_id = key_id_of(presented)
        record = await self._keystore.get(key_id) if key_id is not None else None
        if record is None:
            return _unauthenticated("invalid_api_key")
        if not verify(presented, record, self.settings.pepper):
            self._denials.note(record.tenant, record.key_id, {"reason": "bad_secret"})
            return _unauthenticated("invalid_api_key")
        return record

    async def verify_signed(
        self, headers: Sequence[tuple[str, bytes]] | None, value: bytes
    ) -> KeyRecord | Forged:
        """The key that signed a record on the ingress topic (``seawall_client.signing``),
        or why the record proves nothing. Bad signatures for a known key are audited,
        sparingly (``denials``)."""
        claim = signing.claimed(headers)
        if claim is None or not _KEY_ID.fullmatch(claim.key_id):
            return Forged("unsigned")
        record = await self._keystore.get(claim.key_id)
        if record is None or not record.signing_key:
            return Forged("unknown_key")
        key = signing.unwrap(record.signing_key, self.settings.pepper, record.key_id)
        refusal = signing.verify(
            claim, value, key, self._clock.time(), self.settings.signature_window_s
        )
        if refusal is not None:
            self._denials.note(record.tenant, record.key_id, {"reason": refusal})
            return Forged(refusal)
        return record

    async def first_sighting(self, tenant: str, request_id: str, position: str) -> bool:
        """Whether the record at ``position`` (topic/partition/offset) is the first to
        carry this signed request id: a redelivery of that same record is; any other
        record with the id is a replay. Remembered for twice the signature window,
        past which a replay fails its timestamp anyway."""
        key = self._redis_keys.seen(tenant, request_id)
        ttl_ms = int(2 * self.settings.signature_window_s * 1000)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(key, position, nx=True, px=ttl_ms)
            pipe.get(key)
            _, first = await pipe.execute()
        return bool(first is not None and first.decode() == position)

    async def principal(self, record: KeyRecord, action: Action) -> Principal | Refusal:
        """Who a verified key speaks for, if its phase allows ``action`` now."""
        decision = check(record, action, self._clock.time(), self._keystore.lifecycle)
        if not decision.allowed:
            self._denials.note(
                record.tenant, record.key_id, {"reason": decision.reason, "action": action}
            )
            if decision.reason == "key_read_only":
                return Refusal(
                    ReasonCode.FORBIDDEN, decision.reason, _KEY_MESSAGES[decision.reason]
                )
            return _unauthenticated(decision.reason)
        policy = await self._keystore.policy(record.tenant)
        if policy is None:
            return Refusal(
                ReasonCode.FORBIDDEN, "tenant_unknown", "The key's tenant has no policy."
            )
        grace_began = decision.disabled_at - self._keystore.lifecycle.grace_s
        return Principal(
            record.tenant,
            record.key_id,
            policy,
            decision,
            grace_began if decision.reason == "key_in_grace" else None,
        )

    # -- the request -------------------------------------------------------------
    def arrive(self, principal: Principal, client_ip: str) -> tuple[str, Refusal | None]:
        """A request of ``principal``'s from ``client_ip`` arrives: counted for its
        region (hotspot detection, refused or not), and refused at once if admission
        found its tenant's requests bucket empty, until it refills (``policy.hints``):
        no hop, no Redis call, and nothing parsed (HTTP calls this before reading the
        body's JSON). Returns the region and the refusal, if any."""
        return self.arrive_in(principal, self.region(client_ip))

    def arrive_in(self, principal: Principal, region: str) -> tuple[str, Refusal | None]:
        """``arrive``, for a request whose region is already known: a Kafka record's is
        its tenant's (``TenantPolicy.region``, from the policy the keystore caches),
        never one derived from what the record says."""
        now = self._clock.time()
        self.arrivals.count(region)
        hint = self.hints.covering(principal.tenant, now)
        return region, None if hint is None else over_quota(hint, now)

    async def prepare(
        self, request: InferenceRequest, principal: Principal, region: str | None = None
    ) -> InferenceRequest | Refusal:
        """The request as it goes onto the priority topic, or why it may not;
        ``region``: where ``arrive`` placed it (``None``: it has not arrived yet, and
        does now)."""
        s = self.settings
        now = self._clock.time()
        if region is None:
            region, refusal = self.arrive(principal, request.client.client_ip)
            if refusal is not None:
                return refusal
        pool = s.models.get(request.model)
        if pool is None:
            return invalid(
                "model_not_found", f"The model '{request.model}' does not exist.", "model"
            )
        if request.sampling.max_tokens > s.max_output_tokens:
            return invalid(
                "max_tokens_too_large",
                f"max_tokens is at most {s.max_output_tokens}.",
                "max_tokens",
            )
        texts = _texts(request)
        analysis = await self.screener.analyse(texts, principal.policy.sensitive)
        tokens, screenings = analysis.tokens, analysis.screenings
        m.PROMPT_TOKENS.observe(tokens)
        self._long_share.observe(tokens)

        findings = [f for sc in screenings for f in sc.findings]
        if findings:
            flooded = any(sc.flooded for sc in screenings) or len(findings) > MAX_FINDINGS
            refusal = await self._sensitive(principal, request.request_id, findings, flooded)
            if refusal is not None:
                return refusal
        deadline = now + s.default_deadline_s
        if request.deadline_at is not None:
            deadline = min(deadline, request.deadline_at)
        data: dict[str, Any] = request.model_dump()
        data.update(
            tenant=principal.tenant,
            api_key_id=principal.key_id,
            tier=principal.policy.tier,
            priority=TIER_PRIORITY[principal.policy.tier],
            pool=pool,
            deadline_at=deadline,
            client={**data["client"], "region": region},
        )
        redacted = [sc.text for sc in screenings]
        data["prompt_tokens"] = analysis.redacted_tokens  # what the engine will read
        if request.prompt is not None:
            data["prompt"] = redacted[0]
        else:
            data["messages"] = [
                {**msg, "content": text}
                for msg, text in zip(data["messages"], redacted, strict=True)
            ]
        try:
            return InferenceRequest.model_validate(data)
        except ValidationError as e:
            return invalid("schema_violation", describe(e), param_of(e))

    async def _sensitive(
        self, principal: Principal, request_id: str, findings: list[Finding], flooded: bool
    ) -> Refusal | None:
        """Count (per kind, never the values), audit a block; the refusal if blocked —
        always when ``flooded`` (more findings than any request may hold)."""
        action = "block" if flooded else principal.policy.sensitive
        counts = summary(findings)
        for kind, n in counts.items():
            m.SENSITIVE_FINDINGS.labels(kind, action).inc(n)
        shown = ", ".join(f"{kind}: {n}" for kind, n in sorted(counts.items()))
        log.info(
            "sensitive data in a prompt",
            extra={"tenant": principal.tenant, "request_id": request_id, "action": action}
            | {f"found_{kind}": n for kind, n in counts.items()},
        )
        if action == "redact":
            return None
        self._denials.note(
            principal.tenant,
            principal.key_id,
            {"request_id": request_id} | {kind: str(n) for kind, n in counts.items()},
            action="request_blocked",
        )
        if flooded:
            return Refusal(
                ReasonCode.SENSITIVE_DATA,
                "too_much_sensitive_data",
                f"The prompt holds more than {MAX_FINDINGS} pieces of sensitive data; it is "
                "refused whatever the tenant's policy.",
            )
        return Refusal(
            ReasonCode.SENSITIVE_DATA,
            "sensitive_data",
            f"The prompt contains sensitive data ({shown}); this tenant's policy refuses it.",
        )

    async def publish(
        self, request: InferenceRequest, trace: TraceContext | None = None
    ) -> asyncio.Future[Any]:
        """Queue the request on its priority topic, with ``trace`` as its
        ``traceparent``; await the result for the broker's ack. Queued in call order, so
        one caller's requests keep their order."""
        topic = self._topics.requests(request.priority)
        value = encode(request)
        headers = tracecontext.header(trace)
        fut: asyncio.Future[Any] = await self._producer.send(
            topic,
            value,
            key=request.partition_key.encode(),
            headers=mac_headers(self._hop, topic, value, headers),
        )
        return fut

    async def abort(
        self, tenant: str, request_id: str, deadline_at: float | None, cause: str
    ) -> None:
        """Mark a published request as unwanted: admission answers it ``cancelled``
        instead of dispatching it. The marker outlives the request's deadline (after
        which admission expires it anyway) by ``ABORT_MARKER_MARGIN_S`` — and no request
        lives longer than ``default_deadline_s`` (ingress caps every deadline to it), so
        neither does a marker, whatever deadline an abort record claims (one of 73 years
        was kept 73 years). ``cause`` counts under its name only if it is one of
        ``ABORT_CAUSES`` (``other`` else): a producer cannot mint metric series."""
        now = self._clock.time()
        deadline = deadline_at if deadline_at is not None else now
        life_s = min(max(1.0, deadline - now), self.settings.default_deadline_s)
        ttl = math.ceil(life_s) + ABORT_MARKER_MARGIN_S
        key = self._redis_keys.abort(tenant, request_id)
        await cast(Any, self._redis.set(key, cause, ex=ttl))
        m.ABORTS.labels(cause if cause in ABORT_CAUSES else "other").inc()


def _texts(request: InferenceRequest) -> list[str]:
    if request.prompt is not None:
        return [request.prompt]
    messages: tuple[ChatMessage, ...] = request.messages or ()
    return [msg.content for msg in messages]
