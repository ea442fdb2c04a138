"""Audit trail on ``llm.audit``: key lifecycle and policy changes, keyed by tenant."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from schemas.base import Ident, Message, ShortText, Timestamp


class AuditEvent(Message):
    """Never carries a secret: keys appear by id only."""

    type: Literal["audit"] = "audit"
    tenant: Ident
    actor: Ident
    action: Literal[
        "key_created",
        "key_rotated",
        "key_revoked",
        "key_denied",
        "policy_changed",
        "request_blocked",
        # a record written before records carried a MAC, signed by `seawall keys sign`
        "record_signed",
    ]
    outcome: Literal["ok", "denied"] = "ok"
    key_id: Ident | None = None
    detail: dict[Annotated[str, StringConstraints(max_length=64)], ShortText] = Field(
        default_factory=dict, max_length=16
    )
    at: Timestamp
