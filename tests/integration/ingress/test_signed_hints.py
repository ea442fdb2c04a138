"""Quota hints carry admission's MAC (``services.common.hop_signing``, the ``hints``
hop): ingress refuses a tenant at the edge on a hint admission wrote, and on no other —
an unsigned hint, or one MACed with another secret, is skipped and counted, and the
tenant is still served."""

from __future__ import annotations

import os
import time

import httpx
from prometheus_client import REGISTRY

from schemas import QuotaHint, RateLimitInfo, Tier
from seawall_client.serde import encode
from services.common.bus import make_producer, topics_of
from services.common.hop_signing import HopKey
from services.common.settings import CommonSettings
from services.ingress.service import IngressService
from tests.admission_helpers import started
from tests.fleet import produce, until
from tests.integration.ingress.conftest import ingress_settings, new_key


def refused(reason: str) -> float:
    labels = {"hop": "hints", "reason": reason}
    return REGISTRY.get_sample_value("seawall_hop_refused_total", labels) or 0.0


async def test_only_a_hint_admission_signed_refuses_a_tenant_at_the_edge(
    settings: CommonSettings,
) -> None:
    ingress = IngressService(ingress_settings(settings))
    topic = topics_of(settings).quota_hints
    now = time.time()
    hint = QuotaHint(
        tenant="victim-co",
        until=now + 600,
        issued_at=now,
        rate_limit=RateLimitInfo(limit=20, remaining=0, reset_s=600.0),
    )
    value = encode(hint)
    unsigned, bad_mac = refused("unsigned"), refused("bad_mac")
    async with started(ingress):
        key = await new_key(ingress.keystore, "victim-co", Tier.BASIC)
        forger = make_producer(settings)
        await forger.start()
        try:
            await forger.send_and_wait(topic, value, key=b"victim-co")
            other = HopKey("hints", os.urandom(32))  # a secret that is not admission's
            await forger.send_and_wait(
                topic, value, key=b"victim-co", headers=other.headers(topic, value)
            )
        finally:
            await forger.stop()
        await until(lambda: refused("unsigned") > unsigned and refused("bad_mac") > bad_mac)
        assert len(ingress.pipeline.hints) == 0  # the forged hints changed nothing

        await produce(settings, topic, [hint])  # as admission signs it
        await until(lambda: len(ingress.pipeline.hints) == 1)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{ingress.port}", timeout=30
        ) as http:
            response = await http.post(
                "/v1/chat/completions",
                json={"model": "default", "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": f"Bearer {key}"},
            )
    assert response.status_code == 429  # refused at the edge, on admission's word
    assert refused("unsigned") == unsigned + 1
    assert refused("bad_mac") == bad_mac + 1
