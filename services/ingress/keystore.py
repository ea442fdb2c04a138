"""API key records and tenant policies in Redis; every change audited on ``llm.audit``.

The lifecycle rules are ``keys.py``'s; this module only keeps their state. Layout
(``<p>`` is ``SEAWALL_REDIS_PREFIX``):

| key                          | type | holds                                                   |
|------------------------------|------|---------------------------------------------------------|
| ``<p>key:<key id>``          | hash | ``tenant``, ``key_hash`` (HMAC, never the key),         |
|                              |      | ``signing_key`` (wrapped under the pepper),            |
|                              |      | ``created_at``, ``rotated_at``, ``revoked_at`` (epoch s), |
|                              |      | ``mac``                                                 |
| ``<p>tenant:{<t>}:keys``     | set  | the tenant's key ids                                    |
| ``<p>tenant:{<t>}:policy``   | hash | ``tier``, ``sensitive`` (``block`` or ``redact``),   |
|                              |      | ``region`` (optional), ``mac``                          |
| ``<p>tenants``               | set  | every tenant with a key                                 |

A key record expires (``PEXPIREAT``) when its lifecycle reaches ``purged``, so Redis
deletes it; the ids left behind in the tenant's set are dropped on the next listing.

The tier belongs to the tenant, not to a key (quotas are per tenant: two keys of one
tenant at different tiers would share one bucket under two rule sets), so a key's tier
is its tenant's tier at the time of the request.

The region, where a tenant has one, is where its Kafka requests come from: a record on
``llm.ingress`` arrives from no address ingress can trust (its ``client_ip`` is whatever
the producer wrote), so the region that regional throttles and hotspot detection see is
the one the operator gave the tenant (``seawall keys create --region``), never one the
record names. HTTP requests keep the region of their client's address (the TCP peer, or
a trusted proxy's ``X-Forwarded-For``). Like the tier, it is inside the policy's MAC.

Integrity. Key records and policies carry ``mac`` (``policy.integrity``: HMAC-SHA-256
under a subkey of the pepper over every field that decides something), checked in
constant time on every read from Redis; what the cache holds was checked when it was
read. A record whose MAC is missing or wrong is refused as if it were absent — the key
does not authenticate, the tenant has no policy (``tenant_unknown``) — logged with a
warning once per record and counted in ``seawall_ingress_record_integrity_failures_total``.
So whoever can write Redis without the pepper can break keys, never move one to
another tenant, revive a revoked one or raise a tier. The MAC does not cover freshness:
a record put back as it was earlier (a revoked key's record from a backup taken before
the revocation) verifies; Redis ACLs and the audit trail are the defence there.

Records written before records were signed have no MAC and are refused like altered
ones (a start-up step that signed whatever it found would sign an attacker's edits as
readily). ``seawall keys sign`` (``sign_unsigned``) signs them once, when upgrading: it
signs only records with no MAC at all, each only if it is still exactly as read,
audits each one, and lists them for the operator to review; a record with a wrong MAC
is never signed (it is reported; revoke the key, or give the tenant its tier again).

Writes run in an order that is safe without a transaction (the records live in
different Redis Cluster slots): sets and policy first, the key record last, so a failure
half-way leaves at worst a listed id without a record (shown as gone), never a working
key that no listing shows.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar, cast

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from pydantic import TypeAdapter, ValidationError
from redis.typing import EncodableT, FieldT

from schemas import AuditEvent, Tier
from schemas.base import Ident
from seawall_client.clock import SYSTEM_CLOCK, Clock
from seawall_client.serde import encode
from seawall_client.topics import RedisKeys
from services.common.lua import Lua
from services.common.sensitive import SensitivePolicy
from services.ingress import metrics as m
from services.ingress.policy.integrity import RecordMacs, matches
from services.ingress.policy.keys import (
    DEFAULT_POLICY,
    IssuedKey,
    KeyRecord,
    LifecyclePolicy,
    disabled_at,
    generate_key,
    rotate,
)

log = logging.getLogger(__name__)

AuditAction = Literal[
    "key_created",
    "key_rotated",
    "key_revoked",
    "key_denied",
    "policy_changed",
    "request_blocked",
    "record_signed",
]
RecordKind = Literal["key", "policy"]
_DATES = ("created_at", "rotated_at", "revoked_at")
_WARNED_MAX = 10_000
"""Records whose refusal was logged, remembered (the most recent) so that each is
logged once, not on every read: a flood on one altered key logs one line."""

SIGN_IF_UNCHANGED = """
-- KEYS[1]: a record; ARGV[1]: its MAC; ARGV[2..]: its fields and values, as read.
-- Sets the MAC only if the record has none and is still exactly as read (HSET on an
-- existing hash keeps its TTL). 1 if signed, else 0.
if redis.call('HEXISTS', KEYS[1], 'mac') == 1 then return 0 end
local now = redis.call('HGETALL', KEYS[1])
if #now == 0 or #now ~= #ARGV - 1 then return 0 end
local read = {}
for i = 2, #ARGV, 2 do read[ARGV[i]] = ARGV[i + 1] end
for i = 1, #now, 2 do
  if read[now[i]] ~= now[i + 1] then return 0 end
end
redis.call('HSET', KEYS[1], 'mac', ARGV[1])
return 1
"""


REGION_PATTERN = re.compile(r"[A-Za-z0-9._:@/-]{1,64}")
"""A tenant's region: what a ``RegionThrottle`` can name (at most 64 characters), and a
Redis hash tag (no braces: ``admission.quota``)."""


def check_region(region: str) -> str:
    """``region`` if it can be a tenant's region; ``ValueError`` otherwise."""
    if not REGION_PATTERN.fullmatch(region):
        raise ValueError(
            f"region {region!r}: 1 to 64 letters, digits and ._:@/- (or '' to clear it)"
        )
    return region


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    tier: Tier
    sensitive: SensitivePolicy
    region: str | None = None
    """Where the tenant's Kafka requests come from (``None``: no region); HTTP requests
    come from their client address's region instead."""


@dataclass(frozen=True, slots=True)
class KeyListing:
    record: KeyRecord
    policy: TenantPolicy | None


class KeyNotFound(LookupError):
    """No record for this key id (never existed, or purged)."""


class KeyRecordRefused(KeyNotFound):
    """A record for this key id that fails its integrity check (no MAC, or a wrong
    one): to every caller that only asks whether the key exists, it does not."""


@dataclass(frozen=True, slots=True)
class SignReport:
    """What ``KeyStore.sign_unsigned`` found: the records it signed (or would sign),
    and those it left refused."""

    keys: list[KeyRecord]
    policies: list[tuple[str, TenantPolicy]]
    altered: list[tuple[RecordKind, str]]
    """Records with a MAC that does not match: never signed."""
    damaged: list[tuple[RecordKind, str]]
    """Records with no MAC that cannot be read (missing or unparsable fields)."""
    changed: list[tuple[RecordKind, str]]
    """Records that changed between being read and being signed: left unsigned (run
    the command again)."""


def key_record_fields(record: KeyRecord, macs: RecordMacs) -> dict[FieldT, EncodableT]:
    """A key record's hash fields as the store writes them, its MAC included."""
    fields: dict[FieldT, EncodableT] = {"tenant": record.tenant, "key_hash": record.key_hash}
    if record.signing_key:
        fields["signing_key"] = record.signing_key
    fields |= {name: repr(value) for name in _DATES if (value := getattr(record, name)) is not None}
    fields["mac"] = macs.key_record(record)
    return fields


def policy_fields(tenant: str, policy: TenantPolicy, macs: RecordMacs) -> dict[FieldT, EncodableT]:
    """A tenant policy's hash fields as the store writes them, its MAC included."""
    fields: dict[FieldT, EncodableT] = {"tier": policy.tier.value, "sensitive": policy.sensitive}
    if policy.region is not None:
        fields["region"] = policy.region
    fields["mac"] = macs.policy(tenant, policy.tier.value, policy.sensitive, policy.region)
    return fields


class AuditLog:
    """Produces ``AuditEvent``s keyed by tenant, waiting for the broker's ack."""

    def __init__(
        self, producer: AIOKafkaProducer, topic: str, actor: str, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self._producer = producer
        self._topic = topic
        self._actor = actor
        self._clock = clock

    async def record(
        self,
        tenant: str,
        action: AuditAction,
        *,
        key_id: str | None = None,
        outcome: Literal["ok", "denied"] = "ok",
        detail: dict[str, str] | None = None,
    ) -> None:
        event = AuditEvent(
            tenant=tenant,
            actor=self._actor,
            action=action,
            outcome=outcome,
            key_id=key_id,
            detail=detail or {},
            at=self._clock.time(),
        )
        await self._producer.send_and_wait(self._topic, encode(event), key=tenant.encode())


T = TypeVar("T")
_IDENT: TypeAdapter[str] = TypeAdapter(Ident)


def _is_ident(text: str) -> bool:
    try:
        _IDENT.validate_python(text)
    except ValidationError:
        return False
    return True


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class KeyStore:
    def __init__(
        self,
        redis: aioredis.Redis,
        redis_keys: RedisKeys,
        pepper: bytes,
        audit: AuditLog,
        *,
        default_sensitive: SensitivePolicy = "redact",
        lifecycle: LifecyclePolicy = DEFAULT_POLICY,
        clock: Clock = SYSTEM_CLOCK,
        cache_s: float = 0.0,
        cache_size: int = 10_000,
    ) -> None:
        self._redis = redis
        self._keys = redis_keys
        self._pepper = pepper
        self._macs = RecordMacs.from_pepper(pepper)
        self._warned: OrderedDict[tuple[RecordKind, str], None] = OrderedDict()
        self._audit = audit
        self._default_sensitive: SensitivePolicy = default_sensitive
        self.lifecycle = lifecycle
        self._clock = clock
        self._cache_s = cache_s
        self._cache_size = cache_size
        self._cache: OrderedDict[str, tuple[float, KeyRecord | None]] = OrderedDict()
        self._absent: OrderedDict[str, tuple[float, KeyRecord | None]] = OrderedDict()
        """Key ids read and found absent, apart from the real keys: a stream of made-up
        key ids fills this one and never evicts a real key from ``_cache``."""
        self._policies: OrderedDict[str, tuple[float, TenantPolicy | None]] = OrderedDict()

    # -- layout ------------------------------------------------------------------
    def _policy_key(self, tenant: str) -> str:
        return f"{self._keys.prefix}tenant:{{{tenant}}}:policy"

    @property
    def _tenants_key(self) -> str:
        return f"{self._keys.prefix}tenants"

    # -- reads -------------------------------------------------------------------
    async def get(self, key_id: str) -> KeyRecord | None:
        """The key's record; ``None`` if there is none, or none that can be trusted (a
        damaged record, or one whose MAC is missing or wrong, is logged and treated as
        absent: the key does not work, and no request can crash ingress with it).

        With ``cache_s``, what was read (absent records too) is kept that long, for at
        most ``cache_size`` key ids: a stream of records, or of bad signatures, for
        one key costs one Redis read per ``cache_s``; a key revoked elsewhere stops
        working here within ``cache_s``. Absent ids are kept apart (``_absent``), so
        that made-up ids cannot push real keys out. Only what ``_read`` returned is
        cached, so a cached record passed its MAC check when it was read."""
        return await self._cached(self._cache, key_id, self._read, self._absent)

    async def _cached(
        self,
        cache: OrderedDict[str, tuple[float, T | None]],
        key: str,
        read: Callable[[str], Awaitable[T | None]],
        absent: OrderedDict[str, tuple[float, T | None]] | None = None,
    ) -> T | None:
        """``read(key)``, kept ``cache_s`` in ``cache`` (at most ``cache_size`` keys) —
        in ``absent`` instead, if given, when there is nothing to read."""
        if self._cache_s <= 0:
            return await read(key)
        now = self._clock.monotonic()
        stores = (cache,) if absent is None else (cache, absent)
        for store in stores:
            hit = store.get(key)
            if hit is not None and now - hit[0] < self._cache_s:
                return hit[1]
        value = await read(key)
        target = absent if value is None and absent is not None else cache
        for store in stores:
            if store is not target:
                store.pop(key, None)
        target[key] = (now, value)
        target.move_to_end(key)
        while len(target) > self._cache_size:
            target.popitem(last=False)
        return value

    async def _read(self, key_id: str) -> KeyRecord | None:
        fields = await self._hash(self._keys.api_key(key_id))
        if not fields:
            return None
        record = self._parse(key_id, fields)
        if record is None:
            log.error("damaged key record", extra={"key_id": key_id})
            return None
        if not self._verified("key", key_id, self._macs.key_record(record), fields):
            return None
        return record

    @staticmethod
    def _parse(key_id: str, fields: dict[str, str]) -> KeyRecord | None:
        try:
            dates = {name: float(fields[name]) if name in fields else None for name in _DATES}
            return KeyRecord(
                key_id=key_id,
                tenant=fields["tenant"],
                key_hash=fields["key_hash"],
                created_at=float(fields["created_at"]),
                rotated_at=dates["rotated_at"],
                revoked_at=dates["revoked_at"],
                signing_key=fields.get("signing_key", ""),
            )
        except (KeyError, ValueError, TypeError):
            return None

    def _verified(self, kind: RecordKind, name: str, expected: str, fields: dict[str, str]) -> bool:
        """Whether the record's stored MAC is ``expected``; if not, the refusal is
        counted, and logged the first time for this record."""
        stored = fields.get("mac")
        if matches(expected, stored):
            return True
        reason = "unsigned" if stored is None else "mismatch"
        m.RECORD_INTEGRITY.labels(kind, reason).inc()
        if (kind, name) not in self._warned:
            self._warned[(kind, name)] = None
            while len(self._warned) > _WARNED_MAX:
                self._warned.popitem(last=False)
            log.warning(
                "a %s record failed its integrity check (%s): refused%s",
                kind,
                reason,
                " (written before records were signed: run `seawall keys sign`)"
                if reason == "unsigned"
                else " (altered in Redis, or written under another pepper)",
                extra={"record": kind, ("key_id" if kind == "key" else "tenant"): name},
            )
        return False

    async def policy(self, tenant: str) -> TenantPolicy | None:
        """The tenant's policy; ``None`` if there is none or it is damaged (logged).
        Kept ``cache_s`` like key records (a request would otherwise cost a Redis read
        for it): a changed tier applies here within ``cache_s``."""
        return await self._cached(self._policies, tenant, self._read_policy)

    async def _read_policy(self, tenant: str) -> TenantPolicy | None:
        return (await self._policy_state(tenant))[0]

    async def _policy_state(self, tenant: str) -> tuple[TenantPolicy | None, bool]:
        """The tenant's policy if it can be trusted, and whether there is a record at
        all (one that is damaged or fails its MAC is not trusted, but exists)."""
        fields = await self._hash(self._policy_key(tenant))
        if not fields:
            return None, False
        policy = self._parse_policy(fields)
        if policy is None:
            log.error("damaged tenant policy", extra={"tenant": tenant})
            return None, True
        if not self._verified("policy", tenant, self._policy_mac(tenant, fields), fields):
            return None, True
        return policy, True

    def _policy_mac(self, tenant: str, fields: dict[str, str]) -> str:
        """The MAC a policy record with these fields should carry."""
        return self._macs.policy(
            tenant, fields["tier"], fields.get("sensitive"), fields.get("region")
        )

    def _parse_policy(self, fields: dict[str, str]) -> TenantPolicy | None:
        sensitive = fields.get("sensitive", self._default_sensitive)
        tier = fields.get("tier")
        region = fields.get("region")
        if sensitive not in ("block", "redact") or tier not in set(Tier):
            return None
        if region is not None and not REGION_PATTERN.fullmatch(region):
            return None
        return TenantPolicy(Tier(tier), cast(SensitivePolicy, sensitive), region)

    async def _hash(self, key: str) -> dict[str, str]:
        raw = await cast(Any, self._redis.hgetall(key))
        return {_text(k): _text(v) for k, v in raw.items()}

    async def tenants(self) -> list[str]:
        members = await cast(Any, self._redis.smembers(self._tenants_key))
        return sorted(_text(m) for m in members)

    async def list_keys(self, tenant: str | None = None) -> list[KeyListing]:
        """Every key of ``tenant`` (of every tenant when ``None``), oldest first."""
        listings: list[KeyListing] = []
        for t in [tenant] if tenant is not None else await self.tenants():
            policy = await self.policy(t)
            ids = await cast(Any, self._redis.smembers(self._keys.tenant_keys(t)))
            for key_id in sorted(_text(i) for i in ids):
                record = await self.get(key_id)
                if record is None:
                    # purged by its expiry: forgotten; refused (damaged, no MAC or a
                    # wrong one): kept listed, for ``sign_unsigned`` and the operator
                    if not await self._redis.exists(self._keys.api_key(key_id)):
                        await cast(Any, self._redis.srem(self._keys.tenant_keys(t), key_id))
                    continue
                listings.append(KeyListing(record, policy))
        return sorted(listings, key=lambda item: (item.record.created_at, item.record.key_id))

    # -- writes ------------------------------------------------------------------
    async def set_policy(
        self,
        tenant: str,
        *,
        tier: Tier | None = None,
        sensitive: SensitivePolicy | None = None,
        region: str | None = None,
    ) -> TenantPolicy:
        """Create or change a tenant's policy; a new tenant needs a ``tier``, and so
        does one whose policy fails its integrity check (it is written anew, signed).
        ``None`` keeps a field as it is; ``region=""`` clears the region."""
        if region:
            check_region(region)
        # never a cached copy: it may change
        current, exists = await self._policy_state(tenant)
        if current is None:
            if tier is None:
                if exists:
                    raise ValueError(
                        f"tenant {tenant!r}'s policy fails its integrity check (unsigned: "
                        "run `seawall keys sign`; or altered): give it a tier to set it anew"
                    )
                raise ValueError(f"tenant {tenant!r} is new: give it a tier")
            new = TenantPolicy(tier, sensitive or self._default_sensitive, region or None)
        else:
            new = TenantPolicy(
                tier or current.tier,
                sensitive or current.sensitive,
                current.region if region is None else region or None,
            )
        if new == current:
            return new
        await cast(Any, self._redis.sadd(self._tenants_key, tenant))
        self._policies.pop(tenant, None)
        # Written whole (DEL first, in one transaction): a cleared region leaves no
        # field behind that the MAC does not cover.
        key = self._policy_key(tenant)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=policy_fields(tenant, new, self._macs))
            await pipe.execute()
        detail = {"tier": new.tier.value, "sensitive": new.sensitive}
        if new.region is not None:
            detail["region"] = new.region
        if current is not None:
            detail |= {"previous_tier": current.tier.value, "previous_sensitive": current.sensitive}
            if current.region is not None:
                detail["previous_region"] = current.region
        await self._audit.record(tenant, "policy_changed", detail=detail)
        return new

    async def create(
        self,
        tenant: str,
        *,
        tier: Tier | None = None,
        sensitive: SensitivePolicy | None = None,
        region: str | None = None,
    ) -> tuple[IssuedKey, TenantPolicy]:
        """A new key for ``tenant`` (setting its policy first if given or new)."""
        policy = await self.set_policy(tenant, tier=tier, sensitive=sensitive, region=region)
        issued = generate_key(tenant, self._clock.time(), self._pepper)
        await self._store(issued.record)
        await self._audit.record(
            tenant, "key_created", key_id=issued.record.key_id, detail={"tier": policy.tier.value}
        )
        return issued, policy

    async def revoke(self, key_id: str) -> KeyRecord:
        """Disable a key now (an operator's act: allowed in any phase). Revoking a
        revoked key changes nothing and audits nothing."""
        record = await self._require(key_id)
        if record.revoked_at is not None:
            return record
        revoked = replace(record, revoked_at=self._clock.time())
        await self._store(revoked)
        await self._audit.record(record.tenant, "key_revoked", key_id=key_id)
        return revoked

    async def rotate(self, key_id: str) -> tuple[KeyRecord, IssuedKey]:
        """Replace an active key: the new key is returned once, the old one enters its
        grace period now. ``PermissionError`` (with ``keys.py``'s reason) otherwise."""
        record = await self._require(key_id)
        old, issued = rotate(record, self._clock.time(), self._pepper, self.lifecycle)
        await self._store(issued.record)
        await self._store(old)
        await self._audit.record(
            record.tenant,
            "key_rotated",
            key_id=key_id,
            detail={"new_key_id": issued.record.key_id},
        )
        return old, issued

    async def _require(self, key_id: str) -> KeyRecord:
        # never a cached copy: it is about to change
        if not await self._redis.exists(self._keys.api_key(key_id)):
            raise KeyNotFound(key_id)
        record = await self._read(key_id)
        if record is None:
            raise KeyRecordRefused(key_id)
        return record

    async def _store(self, record: KeyRecord) -> None:
        self._cache.pop(record.key_id, None)
        self._absent.pop(record.key_id, None)
        await cast(Any, self._redis.sadd(self._keys.tenant_keys(record.tenant), record.key_id))
        key = self._keys.api_key(record.key_id)
        purge_at_ms = int((disabled_at(record, self.lifecycle) + self.lifecycle.retired_s) * 1000)
        # The hash is written whole (DEL first): what is stored is exactly what its MAC
        # covers, no field of an earlier version left beside it.
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=key_record_fields(record, self._macs))
            pipe.pexpireat(key, purge_at_ms)
            await pipe.execute()

    # -- upgrading -----------------------------------------------------------------
    async def sign_unsigned(self, *, dry_run: bool = False) -> SignReport:
        """Sign the key records and policies written before records carried a MAC
        (``seawall keys sign``, once, when upgrading): every tenant's policy and every
        listed key record that has no MAC at all, each only if it is still exactly as
        read (a Lua compare-and-set), each audited (``record_signed``). Records with a
        wrong MAC, or damaged, are reported, never signed. ``dry_run``: report only.

        Whatever a record holds when it is signed is what ingress trusts from then on:
        the caller shows the operator what was signed, to compare with what was meant.
        """
        report = SignReport([], [], [], [], [])
        cas = Lua(self._redis, SIGN_IF_UNCHANGED)

        async def sign(key: str, mac: str, fields: dict[str, str]) -> bool:
            if dry_run:
                return True
            pairs = [item for pair in fields.items() for item in pair]
            return bool(await cas([key], [mac, *pairs]))

        for tenant in await self.tenants():
            key = self._policy_key(tenant)
            fields = await self._hash(key)
            policy = self._parse_policy(fields) if fields else None
            if not fields:
                pass
            elif policy is None:
                report.damaged.append(("policy", tenant))
            elif "mac" in fields:
                if not matches(self._policy_mac(tenant, fields), fields["mac"]):
                    report.altered.append(("policy", tenant))
            elif await sign(key, self._policy_mac(tenant, fields), fields):
                report.policies.append((tenant, policy))
                self._policies.pop(tenant, None)
                if not dry_run:
                    detail = {"record": "policy", "tier": policy.tier.value}
                    await self._audit.record(tenant, "record_signed", detail=detail)
            else:
                report.changed.append(("policy", tenant))
            ids = await cast(Any, self._redis.smembers(self._keys.tenant_keys(tenant)))
            for key_id in sorted(_text(i) for i in ids):
                key = self._keys.api_key(key_id)
                fields = await self._hash(key)
                record = self._parse(key_id, fields) if fields else None
                if not fields:
                    continue  # purged
                if record is None or not _is_ident(record.tenant):  # not even auditable
                    report.damaged.append(("key", key_id))
                elif "mac" in fields:
                    if not matches(self._macs.key_record(record), fields["mac"]):
                        report.altered.append(("key", key_id))
                elif await sign(key, self._macs.key_record(record), fields):
                    report.keys.append(record)
                    self._cache.pop(key_id, None)
                    self._absent.pop(key_id, None)
                    if not dry_run:
                        detail = {"record": "key"}
                        await self._audit.record(
                            record.tenant, "record_signed", key_id=key_id, detail=detail
                        )
                else:
                    report.changed.append(("key", key_id))
        return report
