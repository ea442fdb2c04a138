"""What every wire message shares: frozen, strict, versioned, bounded.

Services share nothing but these models on the wire. Each top-level message carries
``schema_version``; a consumer that meets a version it does not know rejects the record
to the dead-letter topic with that reason instead of guessing.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

SCHEMA_VERSION: Literal[1] = 1

#: Epoch seconds (UTC). Bounded so that a typo (milliseconds, nanoseconds) is caught.
Timestamp = Annotated[float, Field(ge=0, le=4_102_444_800)]  # < year 2100
#: A duration in seconds, at most a day.
Seconds = Annotated[float, Field(ge=0, le=86_400)]
Milliseconds = Annotated[float, Field(ge=0, le=86_400_000)]
Fraction = Annotated[float, Field(ge=0, le=1)]
Percent = Annotated[float, Field(ge=0, le=100)]
Count = Annotated[int, Field(ge=0, le=2**53)]
TokenCount = Annotated[int, Field(ge=0, le=1_048_576)]

#: Identifiers: printable, no whitespace, safe as Kafka keys and Redis key parts.
Ident = Annotated[
    str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:@/-]+$")
]


def scoped_id(tenant: str, request_id: str) -> str:
    """A request id unique across tenants: a producer's ``request_id`` is unique for
    its tenant only, so whatever holds requests of several tenants side by side (a
    worker's runs, an engine, admission's ledger of dispatches) keys them by this.
    ``|`` is not an ``Ident`` character: no two (tenant, id) pairs give the same key."""
    return f"{tenant}|{request_id}"


MAX_REQUEST_BYTES = 16 * 1024
"""The one size limit of a request, whatever edge it comes in by — an HTTP body, a
WebSocket frame, a record's value on the ingress topic — checked on its raw bytes
before anything parses it (ingress's ``SEAWALL_MAX_REQUEST_BYTES``). The SDK refuses
to send a larger one (``RequestTooLarge``)."""

#: A Kafka topic name (Kafka's own rule: [a-zA-Z0-9._-], at most 249 characters).
TopicName = Annotated[
    str, StringConstraints(min_length=1, max_length=249, pattern=r"^[A-Za-z0-9._-]+$")
]
ShortText = Annotated[str, StringConstraints(max_length=512)]
#: Prompt and reply text: 64 KiB of characters is far above what ingress admits (16 KiB
#: bodies) but bounds what a direct Kafka producer can push.
LongText = Annotated[str, StringConstraints(max_length=65_536)]


class Wire(BaseModel):
    """Base of every wire model: immutable, unknown fields rejected (a typo by a producer
    in another language fails loudly instead of being silently dropped)."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False
    )


class Message(Wire):
    """A top-level message: what a record's value holds."""

    schema_version: Literal[1] = SCHEMA_VERSION
