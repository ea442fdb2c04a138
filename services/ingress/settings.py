"""Ingress settings (``SEAWALL_`` environment variables).

Lists take commas (``SEAWALL_USER_AGENT_BLACKLIST=sqlmap,nikto``); mappings take JSON
(``SEAWALL_REGION_TABLE='{"10.0.0.0/8": "cn-east"}'``,
``SEAWALL_MODELS='{"llama-3-8b": "main", "llama-3-1b": "small"}'``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import Field, PrivateAttr, SecretStr, TypeAdapter, field_validator, model_validator
from pydantic_settings import NoDecode

from schemas.base import Ident
from services.common.settings import CommonSettings
from services.ingress.policy.filters.body import DEFAULT_MAX_BODY_BYTES
from services.ingress.policy.filters.geo import RegionTable, TrustedProxies
from services.ingress.policy.filters.useragent import DEFAULT_SUBSTRINGS

DEV_PEPPER = "seawall-development-pepper"
"""The pepper of ``SEAWALL_DEV_MODE``: fine on a laptop, never in production (the CLI and
ingress warn). Ingress and ``seawall keys`` must share one pepper."""
MISSING_PEPPER = (
    "no key pepper: set SEAWALL_KEY_PEPPER (or SEAWALL_KEY_PEPPER_FILE, a file holding it) "
    "to a random secret of at least 16 characters that ingress and `seawall keys` share "
    "(e.g. `python3 -c 'import secrets; print(secrets.token_hex(32))'`); `seawall up` makes "
    "one in its state directory. On a laptop, SEAWALL_DEV_MODE=true uses a fixed "
    "development pepper instead."
)

TRUSTED_PROXIES_IS_A_COUNT = (
    "SEAWALL_TRUSTED_PROXIES lists the networks of the proxies in front of ingress as "
    "CIDRs (e.g. 10.0.0.0/8,127.0.0.1/32), no longer a count of hops: a count trusted "
    "X-Forwarded-For whoever connected, so any client could forge its address. List the "
    "networks your load balancers and proxies connect from; leave it empty to trust no "
    "proxy (the TCP peer is then the client)."
)

#: The schema's ceiling for ``max_tokens`` (``SamplingParams``).
MAX_TOKENS_CEILING = 32_768


def safe_name(text: str) -> str:
    """``text`` fit for a topic name and an identifier (instance ids, user names)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:100] or "_"


CommaList = Annotated[tuple[str, ...], NoDecode]
_IDENT: TypeAdapter[str] = TypeAdapter(Ident)


class IngressSettings(CommonSettings):
    _pepper: bytes = PrivateAttr(default=b"")
    _proxies: TrustedProxies = PrivateAttr(default_factory=TrustedProxies)

    ingress_host: str = "127.0.0.1"
    ingress_port: int = Field(default=8080, ge=0, le=65535)
    """0 picks a free port (tests)."""
    http_keep_alive_s: float = Field(default=75.0, gt=0, le=3600)
    """How long an idle HTTP/1.1 connection is kept open (uvicorn's default is 5 s). A
    load balancer reuses its idle connections to the backend until its own idle timeout
    (AWS ALB 60 s, nginx's upstream keepalive_timeout 60 s): the backend must keep them
    longer, or it closes one just as the balancer sends on it and the client gets a
    reset or a 502. Behind Google Cloud's load balancer, set it above 600 s."""

    max_request_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, ge=1, le=4 * 1024 * 1024)
    """One limit for a request on every edge, on its raw bytes, before it is parsed
    (``schemas.base.MAX_REQUEST_BYTES``): an HTTP body above it is refused (413), a
    WebSocket frame answered with an error frame, a record on the ingress topic
    dead-lettered (``too_large``)."""
    screen_workers: int = Field(default=1, ge=0, le=64)
    """Processes that count and screen long prompts off the event loop
    (``services.common.screening``): a 16 KiB prompt built to make the screen work
    hardest costs 2-3 ms, during which the loop would answer no one. 0: inline."""
    screen_offload_chars: int = Field(default=4096, ge=0)
    """Prompts of at least this many characters (all texts together) go to a screening
    worker; shorter ones are screened inline, where handing over would cost more."""

    user_agent_blacklist: CommaList = DEFAULT_SUBSTRINGS
    """Case-insensitive substrings."""
    user_agent_patterns: CommaList = ()
    """Regular expressions (case-insensitive)."""
    block_missing_user_agent: bool = False

    trusted_proxies: CommaList = ()
    """CIDRs of the proxies in front of ingress that append to ``X-Forwarded-For``
    (``10.0.0.0/8,127.0.0.1/32``); empty trusts none: the TCP peer is the client. The
    client is the rightmost address outside these networks, walking from the peer
    (``policy.filters.geo.client_address``); a peer outside them is the client,
    whatever it sends. The old form, a count of hops, is refused at start-up."""
    region_table: dict[str, str] = Field(default_factory=dict)
    """CIDR → region; the longest prefix wins."""

    models: dict[str, str] = Field(default_factory=lambda: {"default": "main"})
    """The model names clients may ask for (``/v1/models``), each with its pool. A
    request that names no model gets the first."""

    default_deadline_s: float = Field(default=120.0, gt=0, le=86_400)
    """Every request's deadline, unless the client asks for less."""
    reply_margin_s: float = Field(default=2.0, ge=0, le=60)
    """How long past the deadline HTTP waits for the fleet's own ``expired`` reply
    before answering 504 itself."""
    # -- reply topics (``seawall_client.reply_upkeep``, ``reply_sweeper``) --------------
    reply_heartbeat_s: float = Field(default=300.0, gt=0, le=86_400)
    """This instance writes a heartbeat to its own reply topic this often (the SDK's
    clients by default as often): the sweeper takes a topic nothing was written to for
    ``reply_idle_s`` for one whose owner is gone."""
    reply_delete_timeout_s: float = Field(default=5.0, gt=0, le=120)
    """How long deleting this instance's reply topic at stop may take (past it the
    topic is left to the sweeper)."""
    reply_sweep: bool = True
    """Sweep reply topics left behind by owners that were killed (off: none is deleted
    but by its own owner)."""
    reply_sweep_s: float = Field(default=300.0, gt=0, le=86_400)
    """How often the sweep runs (one ingress replica sweeps per round: a Redis lease)."""
    reply_idle_s: float = Field(default=3 * 3600.0, gt=0, le=30 * 86_400)
    """A reply topic whose end offset has not moved for this long — no reply, no
    heartbeat — is deleted. At least three heartbeats (``reply_heartbeat_s``, and the
    SDK's ``heartbeat_s``, five minutes by default) must fit in it."""
    reply_sweep_max_deletions: int = Field(default=100, ge=1, le=10_000)
    """Reply topics deleted in one sweep, at most (the oldest idle first): a sweep after
    a long outage, or a flood of abandoned topics, goes at a pace the broker takes."""

    # -- WebSocket sessions (``/v1/ws``, ``services.ingress.websocket``) -----------------
    ws_ping_s: float = Field(default=30.0, gt=0, le=3600)
    """Protocol pings this often (a client that does not answer within as long is gone)."""
    ws_idle_timeout_s: float = Field(default=300.0, gt=0, le=86_400)
    """A socket with nothing in flight that sends nothing this long is closed (4001)."""
    ws_max_age_s: float = Field(default=3600.0, gt=0, le=86_400)
    """A session ends this long after it started, however busy (4002); its owed replies
    are kept as long."""
    ws_max_in_flight: int = Field(default=16, ge=1, le=1024)
    """Requests one socket may have in flight; more are refused (``too_many_in_flight``)."""
    ws_poll_s: float = Field(default=0.5, gt=0, le=60)
    """How often a resumed session looks for replies still owed to it."""
    ws_max_sockets_per_key: int = Field(default=16, ge=1, le=100_000)
    """Sockets one API key may hold open at once on this ingress replica (counted in
    process: the fleet's bound is this times the replicas); one more is refused with
    close code 4005 (``too_many_sockets``)."""
    ws_max_sessions_per_key: int = Field(default=100, ge=1, le=1_000_000)
    """Sessions one API key may hold at once, fleet-wide (in Redis): a session lasts
    ``ws_max_age_s`` from its start whether or not a socket is open on it, so this also
    bounds how many new sessions a key may start per ``ws_max_age_s``; one more is
    refused with close code 4006 (``too_many_sessions``). Resuming one is not a new one."""
    max_output_tokens: int = Field(default=MAX_TOKENS_CEILING, ge=1, le=MAX_TOKENS_CEILING)
    """``max_tokens`` above this is refused (400), not silently lowered."""
    retry_after_s: float = Field(default=1.0, ge=0, le=3600)
    """``Retry-After`` of a 503 whose reply carries no rate-limit figures."""

    key_pepper: SecretStr | None = None
    """The server secret keyed into API-key hashes and wrapping the record-signing keys;
    ingress and the CLI must agree. Required (or ``key_pepper_file``), unless
    ``dev_mode``: a service without one refuses to start and says what to set."""
    key_pepper_file: Path | None = None
    """A file holding the pepper (``seawall up`` keeps one in its state directory)."""
    dev_mode: bool = False
    """Development only: without a pepper, use a fixed one (a warning says so)."""
    default_sensitive_policy: Literal["block", "redact"] = "redact"
    """A new tenant's policy for sensitive data in prompts."""

    quota_hint_tenants: int = Field(default=100_000, ge=0, le=10_000_000)
    """How many tenants' quota hints ingress holds at most (0: none, every request goes
    to admission): each refuses an over-quota tenant at the edge until its bucket
    refills."""
    key_cache_s: float = Field(default=2.0, ge=0, le=300)
    """How long ingress keeps a key record it read (0: not at all): a revoked key stops
    working within this; floods of records for one key cost one Redis read each time."""
    signature_window_s: float = Field(default=300.0, gt=0, le=86_400)
    """How far a signed record's timestamp may lie from ingress's clock (either way)."""
    denial_audit_per_s: float = Field(default=0.2, gt=0, le=1000)
    denial_audit_burst: int = Field(default=5, ge=1, le=10_000)
    """Denials audited per key id: ``burst``, then one per ``1/denial_audit_per_s``
    seconds, the rest counted into the next."""
    failed_auth_per_source_per_s: float = Field(default=1.0, gt=0, le=10_000)
    failed_auth_per_source_burst: int = Field(default=20, ge=1, le=1_000_000)
    """Failed HTTP authentications a (client address, key id) may make (``burst``,
    refilled at the rate) before its failures are answered 429; a right key is never
    refused for them (``IngressPipeline.authenticate``)."""

    anonymous_dead_letters_per_s: float = Field(default=1.0, gt=0, le=10_000)
    anonymous_dead_letters_burst: int = Field(default=20, ge=1, le=1_000_000)
    """Dead letters kept for ingress records that prove no key (unsigned, an unknown
    key, a bad signature, too large): ``burst``, then this many a second; the rest are
    counted (``seawall_ingress_requests_total{outcome="dead_letter_sampled_out"}``,
    refusals by reason) and dropped — each letter is a record kept for days. Aborts past
    their key's budget (``kafka_aborts_per_key_*``) are sampled alike, apart."""

    kafka_ingress: bool = True
    """Consume ``llm.ingress``; off for HTTP-only instances (a group has no use for
    more members than the topic has partitions)."""
    kafka_max_batch: int = Field(default=200, ge=1, le=10_000)
    """Records the Kafka ingress takes per batch; it commits after each batch."""
    kafka_aborts_per_key_per_s: float = Field(default=20.0, gt=0, le=100_000)
    kafka_aborts_per_key_burst: int = Field(default=200, ge=1, le=1_000_000)
    """Signed ``AbortRequest`` records a key may send on ``llm.ingress`` (``burst``,
    refilled at the rate) before its aborts are refused: counted
    (``seawall_ingress_aborts_refused_total``) and dead-lettered (``too_many_aborts``,
    sampled like ``anonymous_dead_letters_*``, in a bucket of their own), no marker set.
    Each abort sets a Redis marker that lives up to ``default_deadline_s`` (plus a
    margin) for one Redis write; a genuine client aborts at most the requests it sent
    (the SDK, those it gives up on), so the burst covers a client stopping with many in
    flight. Per ingress replica (in process, ``denials.FailureLimiter``): a key's aborts
    spread over the topic's partitions, so the fleet's bound is the replicas consuming
    them times this; the markers one key holds are at most about that rate times the
    marker's life."""

    @field_validator(
        "user_agent_blacklist", "user_agent_patterns", "trusted_proxies", mode="before"
    )
    @classmethod
    def _split(cls, v: object) -> object:
        return tuple(p.strip() for p in v.split(",") if p.strip()) if isinstance(v, str) else v

    @field_validator("trusted_proxies", mode="before")
    @classmethod
    def _not_a_count(cls, v: object) -> object:
        # The old form, a count of hops, is refused rather than reinterpreted: no guess
        # at the networks a count meant is safe. (Digits in the environment are caught
        # after the split, below.)
        if isinstance(v, int):
            raise ValueError(TRUSTED_PROXIES_IS_A_COUNT)
        return v

    @field_validator("trusted_proxies")
    @classmethod
    def _valid_proxy_cidrs(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(cidr.isdigit() for cidr in v):
            raise ValueError(TRUSTED_PROXIES_IS_A_COUNT)
        TrustedProxies(v)  # a bad CIDR fails at start, not per request
        return v

    @field_validator("region_table")
    @classmethod
    def _valid_cidrs(cls, v: dict[str, str]) -> dict[str, str]:
        RegionTable(v)  # a bad CIDR fails at start, not per request
        return v

    @field_validator("models")
    @classmethod
    def _valid_models(cls, v: dict[str, str]) -> dict[str, str]:
        if not v:
            raise ValueError("at least one model is needed")
        for name, pool in v.items():
            _IDENT.validate_python(name)
            _IDENT.validate_python(pool)
        return v

    @model_validator(mode="after")
    def _pepper_given(self) -> Self:
        if self.key_pepper is not None:
            pepper = self.key_pepper.get_secret_value()
        elif self.key_pepper_file is not None:
            try:
                pepper = self.key_pepper_file.read_text().strip()
            except OSError as e:
                raise ValueError(f"cannot read SEAWALL_KEY_PEPPER_FILE: {e.strerror}") from None
        elif self.dev_mode:
            pepper = DEV_PEPPER
        else:
            raise ValueError(MISSING_PEPPER)
        if len(pepper) < 16 and not self.dev_mode:
            raise ValueError("the key pepper is shorter than 16 characters")
        self._pepper = pepper.encode()
        return self

    @model_validator(mode="after")
    def _reply_idle_outlasts_heartbeats(self) -> Self:
        if self.reply_idle_s < 3 * self.reply_heartbeat_s:
            raise ValueError(
                "reply_idle_s must be at least three reply_heartbeat_s: a live owner's "
                "topic would be swept after a missed heartbeat or two"
            )
        return self

    @model_validator(mode="after")
    def _compile_proxies(self) -> Self:
        self._proxies = TrustedProxies(self.trusted_proxies)
        return self

    @property
    def proxies(self) -> TrustedProxies:
        """``trusted_proxies``, compiled once for every request's address."""
        return self._proxies

    @property
    def pepper(self) -> bytes:
        return self._pepper

    @property
    def dev_pepper(self) -> bool:
        """Whether the pepper is the development one (``dev_mode`` without a pepper)."""
        return self._pepper == DEV_PEPPER.encode()
