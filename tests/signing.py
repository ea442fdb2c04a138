"""Signing the control events tests produce, as their issuer would
(``services.common.control_signing``): the controller's decisions with the controller's
key, a worker's answers with the workers', an operator's commands with the operator's.
The test session's keys are made once (``tests/conftest.py``, ``control_keys``)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer

from schemas import Priority
from schemas.base import Message
from seawall_client.serde import CONTROL, DecodeError, decode, encode
from services.common.bus import topics_of
from services.common.control_signing import ControlSigner, Role, load_signer
from services.common.hop_signing import Hop, HopKey, load_key
from services.common.settings import CommonSettings

OPERATOR = "operator:test-operator"
"""The test session's operator (its CLI runs as the login ``test-operator``)."""


@cache
def _signer(keys_dir: Path, role: Role) -> ControlSigner:
    return load_signer(keys_dir, role)


def control_headers(settings: CommonSettings, value: bytes) -> list[tuple[str, bytes]] | None:
    """The headers that sign ``value`` as its issuer would; none where signatures are off
    or ``value`` is not a control event (a hostile record stays unsigned)."""
    if settings.control_keys_dir is None or settings.control_signatures == "off":
        return None
    try:
        event = decode(CONTROL, value)
    except DecodeError:
        return None
    role: Role = (
        "controller"
        if event.issuer == "controller"
        else "worker"
        if event.issuer.startswith("worker:")
        else "operator"
    )
    return _signer(settings.control_keys_dir, role).headers(value)


@cache
def _hop(keys_dir: Path, hop: Hop) -> HopKey:
    return load_key(keys_dir, hop)


def hop_of(settings: CommonSettings, topic: str) -> Hop | None:
    """Which signed hop ``topic`` is (a priority, a dispatch, the quota-hint, the
    telemetry or the completions topic), if any."""
    topics = topics_of(settings)
    if topic in {topics.requests(p) for p in Priority}:
        return "requests"
    if topic.startswith(topics.dispatch("")):
        return "dispatch"
    if topic == topics.quota_hints:
        return "hints"
    if topic in (topics.telemetry, topics.completions):
        return "telemetry"
    return None


def headers_for(
    settings: CommonSettings, topic: str, value: bytes | None
) -> list[tuple[str, bytes]] | None:
    """The headers its producer would sign a record on ``topic`` with: a control event
    as its issuer, a request on a priority topic as ingress, a dispatch or a quota hint
    as admission, a report or a completion as a worker; none on any other topic, or
    where signatures are off."""
    if settings.control_keys_dir is None or settings.control_signatures == "off":
        return None
    if topic == topics_of(settings).control:
        return None if value is None else control_headers(settings, value)
    hop = hop_of(settings, topic)
    if hop is None:
        return None
    # A tombstone too: its MAC is over no bytes (what the consumer checks it against).
    return _hop(settings.control_keys_dir, hop).headers(topic, value or b"")


async def send_signed(
    producer: AIOKafkaProducer, settings: CommonSettings, topic: str, event: Message
) -> Any:
    """Produce ``event`` on the control topic ``topic``, signed as its issuer would."""
    value = encode(event)
    key = getattr(event, "control_key")  # noqa: B009  (every control event has one)
    return await producer.send_and_wait(
        topic, value, key=str(key).encode(), headers=control_headers(settings, value)
    )
