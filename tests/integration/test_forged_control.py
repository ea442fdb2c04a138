"""Forged control events on the real broker: a producer with write access to the control
topic but no trusted key cannot steer a follower (``services.common.control_signing``),
and what the operator signs still does."""

from __future__ import annotations

import time

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import REGISTRY

from schemas import Evidence, QuotaOverride
from seawall import steer
from seawall_client.serde import encode
from seawall_client.topics import Topics
from services.admission.policy.overrides import quota_override
from services.common.bus import make_producer
from services.common.control import ControlFollower
from services.common.control_signing import ControlSigner, load_signer
from services.common.control_state import ControlState
from services.common.settings import CommonSettings
from tests.fleet import until
from tests.signing import OPERATOR


def refused(reason: str) -> float:
    return REGISTRY.get_sample_value("seawall_control_refused_total", {"reason": reason}) or 0.0


def suspension(issuer: str, tenant: str = "victim") -> QuotaOverride:
    now = time.time()
    return QuotaOverride(
        scope=f"tenant:{tenant}",
        seq=int(now * 1_000_000),
        issued_at=now,
        issuer=issuer,
        evidence=Evidence(reason="forged"),
        tenant=tenant,
        burst=0.0,
        expires_at=now + 600,
        valid_for_s=600,
    )


async def test_forged_control_events_change_nothing_and_are_counted(
    settings: CommonSettings, topics: Topics
) -> None:
    assert settings.control_keys_dir is not None
    stranger = ControlSigner("controller", Ed25519PrivateKey.generate())
    worker = load_signer(settings.control_keys_dir, "worker")
    before = {r: refused(r) for r in ("unsigned", "bad_signature", "not_authorized")}
    state = ControlState()
    async with ControlFollower(settings, topics.control, state):
        producer = make_producer(settings)
        await producer.start()
        try:
            forged = [
                (suspension("controller"), None),  # unsigned
                (suspension("controller"), stranger),  # a key nobody trusts
                (suspension("operator:test-operator"), worker),  # a real key, not its to issue
            ]
            for event, signer in forged:
                value = encode(event)
                headers = None if signer is None else signer.headers(value)
                await producer.send_and_wait(
                    topics.control, value, key=event.control_key.encode(), headers=headers
                )
            # A genuine operator's command, after the forgeries: it applies.
            genuine = suspension(OPERATOR, tenant="bystander")
            await steer.publish(settings, genuine)
            await until(lambda: quota_override(state, "bystander", time.time()) is not None)
        finally:
            await producer.stop()
        assert quota_override(state, "victim", time.time()) is None
        assert refused("unsigned") - before["unsigned"] == 1
        assert refused("bad_signature") - before["bad_signature"] == 1
        assert refused("not_authorized") - before["not_authorized"] == 1

        # `seawall quota clear` lifts the genuine one.
        cleared = steer.quota_clear("bystander", reason="done", issuer=OPERATOR, now=time.time())
        await steer.publish(settings, cleared)

        def lifted() -> bool:
            o = quota_override(state, "bystander", time.time())
            return o is None or o.burst is None

        await until(lifted)


async def test_the_operator_cannot_publish_in_another_name(settings: CommonSettings) -> None:
    import pytest

    with pytest.raises(ValueError, match="signs as"):
        await steer.publish(settings, suspension("controller"))
