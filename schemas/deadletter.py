"""Dead letters: input no service could use, kept whole with the reason."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from schemas.base import Ident, Message, ShortText, Timestamp, TopicName

_KEY_MAX = 65_536
_RAW_MAX = 4 * 1024 * 1024


def _b64_len(n: int) -> int:
    """Bytes travel as base64 text in JSON: the schema bounds the text, not the bytes."""
    return -(-n // 3) * 4


class DeadLetter(Message):
    """The raw record (bytes, base64 in JSON) and why it was refused."""

    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    type: Literal["dead_letter"] = "dead_letter"
    source_topic: TopicName
    partition: int = Field(ge=0, le=1_000_000)
    offset: int = Field(ge=0, le=2**63 - 1)
    key: bytes | None = Field(
        default=None, max_length=_KEY_MAX, json_schema_extra={"maxLength": _b64_len(_KEY_MAX)}
    )
    raw: bytes = Field(max_length=_RAW_MAX, json_schema_extra={"maxLength": _b64_len(_RAW_MAX)})
    reason: Ident
    """A stable code: ``invalid_json``, ``schema_violation``, ``unsupported_version``, …"""
    error: ShortText
    """A readable description (never a secret or a sensitive value)."""
    service: Ident
    at: Timestamp
