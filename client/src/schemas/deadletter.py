"""Dead letters: records no service could use, with the reason, kept bounded.

A dead letter never copies its record whole: a record may be as large as the broker
allows (the letter would then be too large to produce, and the service would crash on
it) and may hold a prompt or a secret. It keeps an excerpt of the first bytes, the
original size and a SHA-256 of the whole value, enough to recognise the record and to
find it on its source topic (``source_topic``, ``partition``, ``offset``) while the
topic still holds it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, StringConstraints

from schemas.base import Count, Ident, Message, ShortText, Timestamp, TopicName

EXCERPT_BYTES = 4096
"""At most this much of a record's value is kept."""
KEY_EXCERPT_BYTES = 256
"""At most this much of a record's key is kept."""


def _b64_len(n: int) -> int:
    """Bytes travel as base64 text in JSON: the schema bounds the text, not the bytes."""
    return -(-n // 3) * 4


class DeadLetter(Message):
    """Where a refused record is, what it began with (bytes, base64 in JSON), and why."""

    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    type: Literal["dead_letter"] = "dead_letter"
    source_topic: TopicName
    partition: int = Field(ge=0, le=1_000_000)
    offset: int = Field(ge=0, le=2**63 - 1)
    key: bytes | None = Field(
        default=None,
        max_length=KEY_EXCERPT_BYTES,
        json_schema_extra={"maxLength": _b64_len(KEY_EXCERPT_BYTES)},
    )
    """The record's key, cut to ``KEY_EXCERPT_BYTES``."""
    excerpt: bytes = Field(
        max_length=EXCERPT_BYTES, json_schema_extra={"maxLength": _b64_len(EXCERPT_BYTES)}
    )
    """The first bytes of the record's value (at most ``EXCERPT_BYTES``), with any
    sensitive data the excerpt shows redacted."""
    size: Count
    """The size of the whole value in bytes (0 for a record without one)."""
    sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] | None = None
    """The SHA-256 of the whole value, hex; ``None`` for a record without one."""
    reason: Ident
    """A stable code: ``invalid_json``, ``schema_violation``, ``unsupported_version``,
    ``reply_topic_unreachable``, ``processing_error``, …"""
    error: ShortText
    """A readable description (never a secret or a sensitive value)."""
    service: Ident
    at: Timestamp
