"""The worker's claims on the requests it runs, in Redis (``claims``): claiming one
before it is generated, renewing the leases of those in hand, releasing one cut short.

A lease found taken over (it ran out: the worker stalled, or Redis was away too long)
means another worker generates the request now: this worker's run of it is aborted and
its answer left to the new owner. Without Redis a request is generated unclaimed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from schemas import DispatchedRequest
from seawall_client.clock import Clock
from services.common.failures import is_infrastructure
from services.workers import metrics as m
from services.workers.claims import Busy, Claimed, Claims, Done, Held
from services.workers.engine.base import Engine
from services.workers.runs import CLAIM_MARGIN_S, InHand

log = logging.getLogger(__name__)


class Leases:
    """Claims, renews and releases the requests this worker runs."""

    def __init__(
        self,
        *,
        claims: Claims,
        engine: Engine,
        in_hand: InHand,
        lease_s: float,
        spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]],
        clock: Clock,
    ) -> None:
        self.claims = claims
        self.engine = engine
        self._in_hand = in_hand
        self._lease_s = lease_s
        self.spawn = spawn
        self.clock = clock

    async def claim(self, d: DispatchedRequest) -> Claimed | Busy | Done:
        """Claim the request; without Redis, an unclaimed generation from the local
        clock (``attempts`` 0)."""
        req = d.request
        now = self.clock.time()
        if req.deadline_at is not None:
            ttl_s = max(0.0, req.deadline_at - now) + CLAIM_MARGIN_S
        else:
            ttl_s = 3600.0
        try:
            return await self.claims.claim(req.tenant, req.request_id, ttl_s)
        except Exception as e:
            if not is_infrastructure(e):
                raise
            m.CLAIMS_UNAVAILABLE.inc()
            log.warning("claims unavailable; generating unclaimed", extra={"error": repr(e)[:200]})
            return Claimed(int(now * 1_000_000), 0)

    async def loop(self) -> None:
        """Renew the leases of the requests in hand; a lease found taken over (it ran
        out, another worker generates the request now) aborts this worker's run."""
        every = self._lease_s / 3
        while True:
            await asyncio.sleep(every)
            runs = [r for r in self._in_hand.runs.values() if r.held is not None and not r.lost]
            if not runs:
                continue
            try:
                still = await self.claims.renew([r.held for r in runs if r.held is not None])
            except Exception as e:
                if not is_infrastructure(e):
                    raise
                log.warning("could not renew leases", extra={"error": repr(e)[:200]})
                continue
            for run, ours in zip(runs, still, strict=True):
                if not ours and not run.lost:
                    run.lost = True
                    log.warning("lease lost: another worker took the request over")
                    if run.engine_request_id is not None:
                        await self.engine.abort(run.engine_request_id)

    def spawn_release(self, held: Held) -> None:
        self.spawn(self._release(held), "release")

    async def _release(self, held: Held) -> None:
        try:
            await self.claims.release(held)
        except Exception as e:  # a courtesy: the lease runs out by itself anyway
            log.info("could not release a claim", extra={"error": repr(e)[:200]})
