"""The controller's faust app and what it is wired from: its topics, its table and the
worker that runs it inside our own process.

The ``route`` agent reads ``llm.telemetry`` (``telemetry``); a record not on its pool's
partition is forwarded to the app's internal topic ``<app id>-telemetry-by-pool``
(``by_pool``), keyed by pool, where the ``decide`` agent reads it. The ``decisions``
table (changelog-backed) holds the pools' and workers' records (``keys``); it is written
from the timer as well as from the agents (``use_partitioner``).

The app's Kafka clients (its worker consumer, its producer, and the producer's client
that declares its topics) are faust's own, built from ``broker_credentials``: the same
TLS context and SASL login as every other client of the process
(``seawall_client.kafka.connection_options``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import faust
from faust.types import TableT, TopicT
from faust.types.auth import CredentialsT

from seawall_client.kafka import (
    SASL_PROTOCOLS,
    KafkaConfig,
    StaticTokenProvider,
    ssl_context,
)
from services.controller.keys import partition_by_pool
from services.controller.settings import ControllerSettings
from services.controller.transport import App


def broker_credentials(config: KafkaConfig) -> CredentialsT | None:
    """faust's form of ``config``'s security (``None``: plaintext). faust hands these
    to aiokafka itself (``faust.transport.drivers.aiokafka.credentials_to_aiokafka_auth``):
    ``SASLCredentials`` carries the mechanism (PLAIN and both SCRAMs among faust's
    ``SASLMechanism``) and the login, with the TLS context for ``SASL_SSL`` and none for
    ``SASL_PLAINTEXT`` (faust picks the protocol by whether a context is there)."""
    context = ssl_context(config)
    if config.security_protocol not in SASL_PROTOCOLS:
        return None if context is None else faust.SSLCredentials(context)
    if config.sasl_mechanism == "OAUTHBEARER":
        assert config.sasl_oauth_token is not None  # KafkaConfig checked it
        return faust.OAuthCredentials(
            oauth_cb=StaticTokenProvider(config.sasl_oauth_token), ssl_context=context
        )
    return faust.SASLCredentials(
        username=config.sasl_username,
        password=config.sasl_password,
        ssl_context=context,
        mechanism=config.sasl_mechanism,
    )


def build_app(settings: ControllerSettings, datadir: Path) -> faust.App:
    """The faust app: at-least-once, in-memory tables restored from their changelogs,
    no web server, no standby replicas (a new owner restores from the changelog), our
    fetch wait (see ``transport``), and the process's TLS and SASL settings
    (``broker_credentials``)."""
    session_s = settings.controller_session_timeout_s
    return App(
        settings.app_id,
        fetch_max_wait_ms=settings.controller_fetch_max_wait_ms
        or settings.consumer_fetch_max_wait_ms,
        broker=[f"kafka://{host.strip()}" for host in settings.kafka_bootstrap.split(",")],
        broker_credentials=broker_credentials(settings.kafka),
        # Named like every other client of the fleet (``seawall-<instance>``), not
        # faust's version: broker logs, client-id quotas and audits see which process.
        broker_client_id=settings.kafka.client_id,
        store="memory://",
        processing_guarantee="at_least_once",
        topic_partitions=settings.topic_partitions,
        topic_replication_factor=settings.topic_replication,
        table_standby_replicas=0,
        web_enabled=False,
        autodiscover=False,
        datadir=datadir,
        broker_session_timeout=session_s,
        broker_rebalance_timeout=session_s,
        broker_heartbeat_interval=min(3.0, session_s / 3),
        # A controller that starts for the first time has no use for old telemetry.
        consumer_auto_offset_reset="latest",
        producer_partitioner=partition_by_pool,
    )


@dataclass(frozen=True)
class Channels:
    """The app's topics and table."""

    telemetry: TopicT
    """``llm.telemetry``, read by the ``route`` agent."""
    by_pool: TopicT
    """The internal topic, keyed by pool, read by the ``decide`` agent."""
    decisions: TableT[bytes, bytes]
    """The pools' and workers' records (``keys``)."""


def channels_of(app: faust.App, settings: ControllerSettings, telemetry: str) -> Channels:
    """Declare the app's topics and table (``telemetry``: the telemetry topic's name)."""
    return Channels(
        telemetry=app.topic(
            telemetry,
            key_type=bytes,
            value_type=bytes,
            key_serializer="raw",
            value_serializer="raw",
        ),
        by_pool=app.topic(
            f"{settings.app_id}-telemetry-by-pool",
            key_type=bytes,
            value_type=bytes,
            key_serializer="raw",
            value_serializer="raw",
            partitions=settings.topic_partitions,
            internal=True,
        ),
        decisions=app.Table(
            "decisions",
            key_type=bytes,
            value_type=bytes,
            partitions=settings.topic_partitions,
            use_partitioner=True,
        ),
    )


class InProcessWorker(faust.Worker):
    """faust's worker without its process-wide side effects: the signals belong to our
    lifecycle (``run_until_signalled``), the logging to ``services.common.logs``."""

    def __init__(self, app: faust.App) -> None:
        super().__init__(
            app, quiet=True, daemon=False, override_logging=False, redirect_stdouts=False
        )
        self.spinner = None

    def install_signal_handlers(self) -> None:
        """None: SIGTERM stops the ``Controller`` component, which stops this worker."""
