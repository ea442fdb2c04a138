"""Controller settings (``SEAWALL_`` environment variables, ``SEAWALL_CONTROLLER_*``).

``controller_time_scale`` multiplies every window and hold of the policies (breaker
matrix, degradation ladder, the batch limit's minimum interval between changes, the
half-open probe retry) so that tests and benchmarks see hours of policy in seconds;
thresholds and sample counts are not scaled. The heartbeat timeout is not a policy
window: it follows the workers' telemetry interval, so it has its own setting.
"""

from __future__ import annotations

from typing import Literal, Self
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, model_validator

from services.common.settings import CommonSettings
from services.controller.decider.config import DeciderConfig, scaled_config
from services.controller.policy.alerts import AlertConfig
from services.controller.policy.hotspots import HotspotConfig


class ControllerSettings(CommonSettings):
    controller_time_scale: float = Field(default=1.0, gt=0, le=100)
    controller_tick_s: float = Field(default=1.0, gt=0, le=60)
    """How often every scope is evaluated (hold timers advance without telemetry too)."""
    controller_worker_signals: bool = False
    """Export each worker's policy inputs as ``seawall_controller_signal`` series (about
    eight a worker; the pools' are always exported). Off by default: at a thousand
    workers they are most of the controller's series and of its scrape time, and every
    worker decision's event carries the numbers behind it anyway."""
    controller_react_s: float = Field(default=0.02, gt=0, le=60)
    """A pool that got telemetry is evaluated at once, not at the next tick, but at most
    once per this (so a stream of records costs at most 1 / react_s evaluations a
    second, not one per record), or per four times the last evaluation's duration when
    that is longer (``ticks.EVALUATION_REST``)."""
    controller_fetch_max_wait_ms: int | None = Field(default=None, ge=1, le=10_000)
    """The fetch wait of the faust consumer that reads telemetry (faust's own, so no
    doorbell wakes it); ``None``: ``consumer_fetch_max_wait_ms``. On the embedded broker
    a report waits up to half of it for the controller's next look, and an idle
    consumer polls 1000 / it times a second (``seawall.embedded.
    CONTROLLER_FETCH_WAIT_MS`` says what was measured)."""
    controller_republish_s: float = Field(default=5.0, gt=0, le=3600)
    """How often the decisions in force are re-published (level-triggered)."""
    controller_valid_for_s: float = Field(default=60.0, gt=0, le=86_400)
    """How long a consumer may trust a decision past its last re-publication."""
    controller_heartbeat_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    controller_canary_check_timeout_s: float = Field(default=120.0, gt=0, le=86_400)
    """A canary release whose workers have not reported this long after its start is
    rolled back (its check waits at least the release's ``check_s``)."""
    controller_forget_after_s: float = Field(default=600.0, gt=0, le=86_400)
    """A worker lost this long leaves the fleet: its decisions are no longer re-published
    (consumers drop them once ``valid_for_s`` has passed)."""
    controller_max_telemetry_age_s: float = Field(default=30.0, gt=0, le=86_400)
    """A worker's report read this much later than its least delayed one is skipped (a
    backlog after downtime must not be counted as what happens now); judged without
    comparing the worker's clock with the controller's (``policy.freshness``)."""
    controller_batch_sla_ms: float = Field(default=1500.0, gt=0, le=600_000)
    controller_ttft_slo_ms: float | None = Field(default=None, gt=0, le=600_000)
    """The batch controller shrinks a worker's limit while its time-to-first-token EWMA
    is above this (``None``: not watched)."""
    controller_itl_slo_ms: float | None = Field(default=None, gt=0, le=600_000)
    """... or its inter-token latency EWMA is above this: the step time every running
    request pays, which a burst of long prompts stretches (``None``: not watched)."""
    controller_latency_trip_ms: float = Field(default=2000.0, gt=0, le=600_000)
    """The breaker's latency row: trips when P99 exceeds this (DESIGN: 2000 ms) ..."""
    controller_latency_recover_ms: float = Field(default=800.0, gt=0, le=600_000)
    """... and recovers once P99 stayed below this for its hold (DESIGN: 800 ms). Set it
    above the pool's normal P99, or an open breaker never closes."""
    controller_error_rate_trip: float = Field(default=0.30, gt=0, le=1)
    """The breaker's error-rate row: trips when the window's error rate exceeds this
    (DESIGN: 30 %) on at least 20 requests ..."""
    controller_error_rate_recover: float = Field(default=0.05, ge=0, le=1)
    """... and recovers once it stayed below this for its hold (DESIGN: 5 %). Early in a
    window the rate is noisy: engines that fail a steady 20 % of requests pass 30 % on
    their first 20 about one time in eleven, and somewhere between the 20th and the 60th
    about one time in five; the worker is then isolated for the window and the hold."""
    controller_small_pool: str = Field(default="small", pattern=r"^[A-Za-z0-9._-]+$")
    """Degradation level 1: where a pool's non-VIP work is diverted."""
    controller_max_tokens_cap: int = Field(default=512, ge=1, le=32_768)
    """Degradation level 2: the ``max_tokens`` cap of long requests."""
    controller_output_mismatch_rate: float = Field(default=0.10, gt=0, le=1)
    """The output-consistency alert: on when more of a pool's shadow runs than this
    share disagree with their original in five minutes, off below half of it. vLLM's
    greedy output is not bitwise batch-invariant: measure a healthy pool's rate
    (``seawall_worker_consistency_checks_total``) before lowering it."""
    controller_host_cpu_breaker: bool = True
    """Feed heartbeats' host CPU to the breaker matrix (off where workers share a host,
    as in ``seawall up``'s simulated fleet)."""
    controller_session_timeout_s: float = Field(default=10.0, ge=3, le=300)
    """Consumer-group session: how soon a crashed controller's partitions move on."""

    # -- alerts (``policy.alerts``, ``notify``) -------------------------------------
    alert_group_wait_s: float = Field(default=10.0, ge=0, le=3600)
    """How long the first notification of a (rule, pool) waits for others to join it."""
    alert_renotify_s: float = Field(default=3600.0, ge=0, le=7 * 86_400)
    """A firing alert is notified again after this long, and a flapping one not sooner."""
    alert_republish_s: float = Field(default=30.0, gt=0, le=3600)
    alert_valid_for_s: float = Field(default=120.0, gt=0, le=86_400)
    alert_webhook_url: SecretStr | None = None
    """Where notifications are POSTed (none: no webhook). A secret: Slack's URL, and
    most others', carries the token that lets anyone post; it is never logged, shown
    or echoed in an error (logs name its scheme, host and port: ``notify.Webhook``)."""
    alert_webhook_format: Literal["json", "slack"] = "json"
    alert_smtp_host: str | None = None
    """The SMTP server for e-mail notifications (none: no e-mail)."""
    alert_smtp_port: int = Field(default=25, ge=1, le=65_535)
    alert_smtp_starttls: bool = False
    alert_smtp_user: str | None = None
    alert_smtp_password: SecretStr | None = None
    """Never logged or shown; sent only over STARTTLS (``alert_smtp_starttls``)."""
    alert_email_from: str = "seawall@localhost"
    alert_email_to: str = ""
    """Comma-separated recipients."""
    alert_notify_timeout_s: float = Field(default=5.0, gt=0, le=120)
    alert_notify_attempts: int = Field(default=5, ge=1, le=100)
    alert_notify_retry_s: float = Field(default=1.0, gt=0, le=60)
    """The first retry's backoff ceiling (doubling per attempt, at most 60 s)."""

    @model_validator(mode="after")
    def _consistent_policy(self) -> Self:
        self.decider_config()  # raises ValueError, e.g. if decisions would expire between
        self.alert_config()  # two re-publications
        url = self.alert_webhook_url
        if url is not None and url.get_secret_value().strip():
            parsed = urlsplit(url.get_secret_value().strip())
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                # The URL is not repeated: it holds the webhook's token.
                raise ValueError("SEAWALL_ALERT_WEBHOOK_URL must be an http(s) URL with a host")
        if self.alert_smtp_host and not self.alert_email_recipients:
            raise ValueError("SEAWALL_ALERT_SMTP_HOST needs SEAWALL_ALERT_EMAIL_TO")
        if self.alert_smtp_user and not self.alert_smtp_starttls:
            raise ValueError(
                "SEAWALL_ALERT_SMTP_USER needs SEAWALL_ALERT_SMTP_STARTTLS=true: SMTP "
                "credentials are never sent in clear"
            )
        return self

    def hotspot_config(self) -> HotspotConfig:
        """Hotspot detection's windows and holds, on the policies' time scale."""
        return HotspotConfig().scaled(self.controller_time_scale)

    def alert_config(self) -> AlertConfig:
        return AlertConfig(
            group_wait_s=self.alert_group_wait_s,
            renotify_s=self.alert_renotify_s,
            republish_s=self.alert_republish_s,
            valid_for_s=self.alert_valid_for_s,
        )

    @property
    def alert_email_recipients(self) -> tuple[str, ...]:
        return tuple(a.strip() for a in self.alert_email_to.split(",") if a.strip())

    @property
    def app_id(self) -> str:
        """The faust app id (consumer group, changelog and internal topic names); it
        carries the topic prefix so that stacks sharing a broker never meet."""
        return f"{self.topic_prefix}seawall-controller"

    def decider_config(self) -> DeciderConfig:
        return scaled_config(
            self.controller_time_scale,
            batch_sla_ms=self.controller_batch_sla_ms,
            heartbeat_timeout_s=self.controller_heartbeat_timeout_s,
            republish_s=self.controller_republish_s,
            valid_for_s=self.controller_valid_for_s,
            forget_after_s=self.controller_forget_after_s,
            max_telemetry_age_s=self.controller_max_telemetry_age_s,
            small_pool=self.controller_small_pool,
            max_tokens_cap=self.controller_max_tokens_cap,
            host_cpu_breaker=self.controller_host_cpu_breaker,
            error_rate_trip=self.controller_error_rate_trip,
            error_rate_recover=self.controller_error_rate_recover,
            latency_trip_ms=self.controller_latency_trip_ms,
            latency_recover_ms=self.controller_latency_recover_ms,
            ttft_slo_ms=self.controller_ttft_slo_ms,
            itl_slo_ms=self.controller_itl_slo_ms,
            output_mismatch_rate=self.controller_output_mismatch_rate,
        )
