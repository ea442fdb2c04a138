"""Work claims: a request is generated once, by one worker at a time, and each start of
it is a new *generation* (``claims.lua``, atomic in Redis).

At-least-once delivery hands a dispatched request to a worker again when the one that
had it died, when a rebalance moved its partition, or when it was produced twice. The
claim says what to do with it:

- ``Claimed``: nobody runs it — generate it, as generation ``generation`` (higher than
  every earlier one: the server's microseconds, or one more than the last), holding a
  lease that the worker renews while it runs; ``attempts`` counts the claims, so that a
  request that has already taken several workers down with it is answered instead of
  taking the next one.
- ``Busy``: another worker holds a live lease (it is alive and running it, the partition
  merely moved): wait, then claim again — a lease that is not renewed (its worker was
  killed) runs out after ``lease_s``, and the request is taken over.
- ``Done``: its terminal reply was delivered: nothing to generate, the record is only
  committed.

Replies carry the generation, so a reader tells a superseded generation's chunks from
the current one's (``services.ingress.replies``). The hash lives in the tenant's Redis
Cluster slot (``RedisKeys.work``) and expires past the request's deadline. If Redis is
unavailable the worker generates without a claim (a generation from its own clock):
duplicates are then possible, and readers drop them by generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis.asyncio as aioredis

from seawall_client.topics import RedisKeys
from services.common.lua import Lua

SCRIPT = resources.files("services.workers").joinpath("claims.lua").read_text(encoding="utf-8")


@dataclass(frozen=True, slots=True)
class Claimed:
    generation: int
    attempts: int


@dataclass(frozen=True, slots=True)
class Busy:
    owner: str
    retry_in_s: float
    """When its lease runs out, unless renewed."""


@dataclass(frozen=True, slots=True)
class Done:
    generation: int


Claim = Claimed | Busy | Done


@dataclass(frozen=True, slots=True)
class Held:
    """A claim a worker holds: what ``renew``, ``done`` and ``release`` name."""

    tenant: str
    request_id: str
    generation: int


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Claims:
    """One worker's claims (``worker_id``), with leases of ``lease_s``."""

    def __init__(
        self, redis: aioredis.Redis, keys: RedisKeys, worker_id: str, lease_s: float
    ) -> None:
        self._redis = redis
        self._keys = keys
        self.worker_id = worker_id
        self.lease_s = lease_s
        self._script = Lua(redis, SCRIPT)

    def _args(self, op: str, ttl_s: float = 0.0, generation: int = 0) -> list[str | int]:
        return [op, self.worker_id, int(self.lease_s * 1000), max(1, int(ttl_s * 1000)), generation]

    async def claim(self, tenant: str, request_id: str, ttl_s: float) -> Claim:
        """Take the request (see the module notes); ``ttl_s``: how long the record of it
        is kept, at least until the request's deadline."""
        key = self._keys.work(tenant, request_id)
        reply = await self._script([key], self._args("claim", ttl_s))
        kind = _text(reply[0])
        if kind == "claimed":
            return Claimed(int(_text(reply[1])), int(reply[2]))
        if kind == "busy":
            return Busy(_text(reply[1]), max(0.0, int(reply[2]) / 1000))
        if kind == "done":
            return Done(int(_text(reply[1])))
        raise RuntimeError(f"unexpected claim reply {kind!r}")

    async def renew(self, held: Sequence[Held]) -> list[bool]:
        """Extend the leases in one round trip; ``False`` where the lease is no longer
        the caller's (it ran out and another worker took the request over)."""
        if not held:
            return []
        replies = await self._script.many(
            [
                ([self._keys.work(h.tenant, h.request_id)], self._args("renew", 0, h.generation))
                for h in held
            ]
        )
        return [int(r) == 1 for r in replies]

    async def done(self, held: Held, ttl_s: float) -> None:
        """The terminal reply of ``held`` is delivered: nobody generates it again."""
        key = self._keys.work(held.tenant, held.request_id)
        await self._script([key], self._args("done", ttl_s, held.generation))

    async def release(self, held: Held) -> None:
        """Give the lease up early, so that whoever gets the request next need not wait."""
        key = self._keys.work(held.tenant, held.request_id)
        await self._script([key], self._args("release", 0, held.generation))
