"""``seawall quota`` and ``seawall region``: the commands publish on the real broker,
and a follower built as admission builds its own holds what they said, then what the
clearing commands said."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from schemas import QuotaOverride, RegionThrottle
from seawall_client.kafka import ensure_topics
from seawall_client.topics import Topics
from services.admission.policy.overrides import quota_override, region_throttle
from services.common.control import ControlFollower
from services.common.control_state import ControlState
from services.common.settings import CommonSettings
from tests.fleet import until


def seawall(settings: CommonSettings, *args: str, env: dict[str, str] | None = None) -> str:
    """Run a seawall command on the test's broker and topics (``env``: more settings)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SEAWALL_")}
    env = base | {
        "SEAWALL_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "SEAWALL_KAFKA_IDEMPOTENCE": str(settings.kafka_idempotence).lower(),
        "SEAWALL_TOPIC_PREFIX": settings.topic_prefix,
        "SEAWALL_CONTROL_KEYS_DIR": str(settings.control_keys_dir),
        "USER": "test-operator",
        **(env or {}),
    }
    done = subprocess.run(
        [sys.executable, "-m", "seawall.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


async def test_quota_and_region_commands_reach_every_follower(
    settings: CommonSettings, topics: Topics
) -> None:
    await ensure_topics(settings.kafka_bootstrap, topics.specs())
    state = ControlState()
    async with ControlFollower(settings, topics.control, state):
        out = seawall(
            settings,
            "quota",
            "set",
            "--tenant",
            "acme",
            "--rps",
            "5",
            "--tpm",
            "6000",
            "--ttl",
            "600",
            "--reason",
            "launch day",
        )
        assert "quota_override/tenant:acme" in out
        seawall(settings, "region", "throttle", "--region", "eu", "--rps", "2")
        await until(lambda: quota_override(state, "acme", time.time()) is not None)
        await until(lambda: region_throttle(state, "eu") is not None)
        override = quota_override(state, "acme", time.time())
        assert isinstance(override, QuotaOverride)
        assert (override.requests_per_s, override.tokens_per_s) == (5, 100.0)
        assert (override.issuer, override.evidence.reason) == (
            "operator:test-operator",
            "launch day",
        )
        throttle = region_throttle(state, "eu")
        assert isinstance(throttle, RegionThrottle)
        assert throttle.rate_per_s == 2
        throttles = seawall(settings, "region", "list")
        assert "region_throttle/region:eu" in throttles
        assert "operator:test-operator" in throttles
        assert "quota_override" not in throttles

        seawall(settings, "quota", "clear", "--tenant", "acme")
        seawall(settings, "region", "lift", "--region", "eu")

        def cleared() -> bool:
            o = quota_override(state, "acme", time.time())
            lifted = region_throttle(state, "eu") is None  # a lifted throttle is none
            return o is not None and o.requests_per_s is None and lifted

        await until(cleared)
        listed = seawall(settings, "quota", "list")
        assert "tenant:acme" in listed
