"""Inference requests: as producers post them, and as admission dispatches them."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal, Self

from pydantic import ConfigDict, Field, StringConstraints, model_validator

from schemas.base import (
    Fraction,
    Ident,
    LongText,
    Message,
    ShortText,
    Timestamp,
    TopicName,
    Wire,
    scoped_id,
)
from schemas.signed import RECORD_HEADERS


class Priority(StrEnum):
    """Priority class; each has its own topic (``llm.requests.<class>``)."""

    VIP = "vip"
    STANDARD = "standard"
    BULK = "bulk"


class Tier(StrEnum):
    """Tenant tier (DESIGN, "Tiers and priority")."""

    BASIC = "basic"
    PRO = "pro"
    ENTERPRISE = "enterprise"


#: Each tier's priority class.
TIER_PRIORITY: dict[Tier, Priority] = {
    Tier.BASIC: Priority.BULK,
    Tier.PRO: Priority.STANDARD,
    Tier.ENTERPRISE: Priority.VIP,
}


class ChatMessage(Wire):
    role: Literal["system", "user", "assistant", "tool"]
    content: LongText


StopString = Annotated[str, StringConstraints(min_length=1, max_length=64)]


class SamplingParams(Wire):
    """OpenAI-style sampling parameters, bounded to what an engine can honour."""

    max_tokens: int = Field(default=256, ge=1, le=32_768)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stop: tuple[StopString, ...] = Field(default=(), max_length=4)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)


class ClientMeta(Wire):
    """Where the request came from, as ingress saw it."""

    user_agent: ShortText = ""
    client_ip: Annotated[str, StringConstraints(max_length=45)] = ""
    region: Annotated[str, StringConstraints(max_length=64)] = ""


class InferenceRequest(Message):
    """One inference request. On the ingress topic it is signed (``RECORD_HEADERS``).

    Exactly one of ``prompt`` (completions) and ``messages`` (chat) is set. The API key
    itself never travels: only its non-secret id. ``request_id`` is the producer's, and
    must be unique for its tenant while the request can still be redelivered (its
    deadline plus a minute, an hour without one): the stages that charge quota and run
    the GPU recognise a redelivery by it, and answer it only once.
    """

    model_config = ConfigDict(json_schema_extra=RECORD_HEADERS)

    type: Literal["inference_request"] = "inference_request"
    request_id: Ident
    tenant: Ident
    api_key_id: Ident | None = None
    priority: Priority = Priority.STANDARD
    tier: Tier = Tier.PRO
    pool: Ident = "main"
    model: Ident = "default"
    prompt: LongText | None = None
    messages: tuple[ChatMessage, ...] | None = Field(default=None, min_length=1, max_length=256)
    sampling: SamplingParams = SamplingParams()
    stream: bool = False
    reply_to: TopicName
    created_at: Timestamp
    deadline_at: Timestamp | None = None
    session_id: Ident | None = None
    client: ClientMeta = ClientMeta()
    prompt_tokens: int | None = Field(default=None, ge=0, le=256 * 65_536)
    """The prompt's length in tokens as ingress counted it (``common.tokenizer``), so
    that admission does not count it again; ingress sets it whatever a producer wrote
    on the ingress topic. ``None``: admission counts."""

    @model_validator(mode="after")
    def _one_input(self) -> Self:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of 'prompt' and 'messages' must be given")
        if self.deadline_at is not None and self.deadline_at < self.created_at:
            raise ValueError("'deadline_at' is before 'created_at'")
        return self

    @property
    def partition_key(self) -> str:
        """The key on the ingress and priority topics: its session, else its tenant (a
        tenant's records batch together; the backlog drain measured twice as fast as
        with one key per request)."""
        return self.session_id or self.tenant

    @property
    def dispatch_key(self) -> str:
        """The key on a pool's dispatch topic, whose partition picks its worker where
        admission does not place it itself: its session (affinity where a session asks
        for it), else its request id, so that session-less work spreads over the pool —
        keyed by tenant, a large tenant's whole load would land on one worker."""
        return self.session_id or self.request_id

    @property
    def scoped_id(self) -> str:
        """Its id unique across tenants (``base.scoped_id``)."""
        return scoped_id(self.tenant, self.request_id)

    def expired(self, now: float) -> bool:
        """Past its deadline at ``now`` (the deadline itself counts as past): the one
        rule admission and workers both apply."""
        return self.deadline_at is not None and now >= self.deadline_at


class Degradation(Wire):
    """What admission changed about a request before dispatch (DESIGN, degradation ladder)."""

    level: int = Field(default=0, ge=0, le=3)
    diverted_from: Ident | None = None
    """Level 1: the pool the request was meant for, before it went to the small pool."""
    max_tokens_cap: int | None = Field(default=None, ge=1, le=32_768)
    """Level 2: output truncated to this many tokens."""
    static_reply: bool = False
    """Level 3: answer with the canned reply, no GPU time."""
    quota_degraded: bool = False
    """A pro tenant above its baseline rate: admitted, served at lower priority."""
    scavenged: bool = False
    """Over its tenant's quota, served from idle capacity (admission's scavenger class)."""


MINHASH_SIZE = 32
"""How many minimums an ``OutputFingerprint``'s MinHash keeps."""
MINHASH_PRIME = 2**61 - 1
"""The MinHash's universal hashes are taken modulo this (Mersenne) prime."""


class OutputFingerprint(Wire):
    """A one-way summary of an output's text, for the output-consistency check: its
    digest (equal texts, equal digests) and a MinHash of its word bigrams (the share of
    equal minimums estimates how many bigrams two texts share). Neither gives the text
    back; both are a few hundred bytes whatever its length."""

    digest: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
    minhash: tuple[Annotated[int, Field(ge=0, lt=MINHASH_PRIME)], ...] = Field(
        default=(), max_length=MINHASH_SIZE
    )


class ShadowOrder(Wire):
    """On a dispatch admission sampled for the output-consistency check: once its
    answer is sent, the worker that ran it re-runs it as a shadow on ``pool``."""

    pool: Ident
    """The request's own pool, or, while a canary of it runs, the canary's."""
    min_similarity: Fraction
    """A sampled (not greedy) request's shadow agrees when the texts' similarity is at
    least this; a greedy one's only when the texts are equal."""


class ShadowOf(Wire):
    """On a shadow run: the output it must reproduce. A shadow is answered to nobody:
    its worker compares, and counts the result in its report."""

    worker_id: Ident
    """The original's worker: the shadow is run by any other, never by it."""
    fingerprint: OutputFingerprint
    exact: bool
    """Greedy (temperature 0): equal texts only; else ``min_similarity``."""
    min_similarity: Fraction


class DispatchedRequest(Message):
    """An admitted request on its pool's dispatch topic."""

    type: Literal["dispatched_request"] = "dispatched_request"
    request: InferenceRequest
    pool: Ident
    degradation: Degradation = Degradation()
    attempt: int = Field(default=1, ge=1, le=100)
    admitted_at: Timestamp
    shadow: ShadowOrder | None = None
    shadow_of: ShadowOf | None = None

    @model_validator(mode="after")
    def _original_or_shadow(self) -> Self:
        if self.shadow is not None and self.shadow_of is not None:
            raise ValueError("a shadow run orders no shadow of its own")
        return self


class AbortRequest(Message):
    """A producer on the ingress topic no longer wants ``request_id`` answered (it timed
    out or was cancelled). Ingress marks it aborted; admission then answers it
    ``cancelled`` instead of dispatching it, if it has not been dispatched yet.

    Signed like a request (``RECORD_HEADERS``), by a live key; it marks the request id
    of the key's own tenant only, so nobody aborts another tenant's request.
    """

    model_config = ConfigDict(json_schema_extra=RECORD_HEADERS)

    type: Literal["abort_request"] = "abort_request"
    request_id: Ident
    api_key_id: Ident
    created_at: Timestamp
    deadline_at: Timestamp | None = None
    """The request's deadline: the abort marker outlives it, then expires."""
    cause: Annotated[str, StringConstraints(max_length=64, pattern=r"^[a-z_]*$")] = "client_abort"
