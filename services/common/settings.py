"""Settings shared by every service; each service extends ``CommonSettings`` with its
own fields. All come from the environment with the prefix ``SEAWALL_``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from seawall_client.kafka import (
    DEFAULT_BROKER,
    STACK_ENV_FILE,
    KafkaConfig,
    SaslMechanism,
    SecurityProtocol,
    default_instance_id,
)

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="SEAWALL_",
        extra="ignore",
        frozen=True,
        env_file=STACK_ENV_FILE,
        # A refused setting is named with pydantic's message, not echoed: a check of the
        # whole model (``_consistent``) would otherwise print every input it was given,
        # the Kafka password and the key pepper among them.
        hide_input_in_errors=True,
    )

    kafka_bootstrap: str = DEFAULT_BROKER
    kafka_idempotence: bool = True
    """On for Apache Kafka. The embedded broker (Tansu) fails ``InitProducerId``, so
    ``seawall up`` and the test harness turn it off there; request-id de-duplication
    covers the duplicates either way (DESIGN, Platform facts)."""
    kafka_security_protocol: SecurityProtocol = "PLAINTEXT"
    """How every Kafka client of this process (faust's included) reaches the broker:
    ``PLAINTEXT``, ``SSL``, ``SASL_PLAINTEXT`` or ``SASL_SSL`` (README, "Connecting to
    Kafka"). The ``kafka_*`` security fields below are checked together by
    ``KafkaConfig``: a process with settings that contradict each other does not start."""
    kafka_sasl_mechanism: SaslMechanism = "SCRAM-SHA-512"
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    """Shown as ``**********`` wherever the settings are printed or logged."""
    kafka_sasl_password_file: Path | None = None
    """A file holding the password (its first line), as compose/ and the Kubernetes
    manifests mount it (``seawall kafka-secrets``): never in an environment that ``ps``
    and crash reports can read. Not together with ``kafka_sasl_password``."""
    kafka_sasl_oauth_token: SecretStr | None = None
    """``OAUTHBEARER``: a static bearer token (``seawall_client.kafka.StaticTokenProvider``)."""
    kafka_ssl_cafile: str | None = None
    kafka_ssl_certfile: str | None = None
    kafka_ssl_keyfile: str | None = None
    topic_prefix: str = Field(default="", pattern=r"^[A-Za-z0-9._-]*$", max_length=64)
    topic_partitions: int = Field(default=3, ge=1, le=1024)
    topic_replication: int = Field(default=1, ge=1, le=16)
    pools: Annotated[tuple[str, ...], NoDecode] = ("main", "small")

    redis_url: str = Field(default=DEFAULT_REDIS_URL, repr=False)
    """Left out of the settings' ``repr``: it may hold Redis's password
    (``redis://:<password>@host``)."""
    redis_username: str | None = Field(default=None, max_length=128)
    """The Redis ACL user this process logs in as (``AUTH <user> <password>``); unset:
    Redis's ``default`` user. compose/ gives every service the ``seawall`` user, whose
    ACL reaches only keys and channels under ``redis_prefix`` (SECURITY.md)."""
    redis_password_file: Path | None = None
    """A file holding that user's password (its first line): a secret, never put in an
    environment variable or a URL where ``ps`` and crash reports can read it. Not
    together with a password in ``redis_url``."""
    redis_prefix: str = Field(default="seawall:", max_length=64)
    redis_timeout_s: float = Field(default=1.0, gt=0, le=60)
    """Connect and socket timeout of every Redis call; a Redis slower than this counts
    as unavailable."""
    redis_max_connections: int = Field(default=64, ge=2, le=10_000)
    """Connections per Redis client. A full pool makes a caller wait (up to
    ``redis_timeout_s``), it is not an outage."""
    redis_fanout: int = Field(default=16, ge=1, le=10_000)
    """At most this many records of a batch wait on Redis at once (below
    ``redis_max_connections``, so that a backlog never exhausts the pool)."""

    consumer_session_timeout_ms: int = Field(default=6_000, ge=1_000, le=300_000)
    """Consumer-group session: a member that stops heartbeating (killed) is evicted after
    this, and its partitions move; a restarted instance rejoins after about twice this
    on the embedded broker (measured: 11 s for 6 s, 7 s for 3 s)."""
    consumer_heartbeat_ms: int = Field(default=1_000, ge=100, le=60_000)
    consumer_fetch_max_wait_ms: int = Field(default=50, ge=1, le=10_000)
    """How long a fetch may wait at the broker for records (every consumer, faust's
    included). Apache Kafka answers a fetch as soon as a record arrives, so there this
    only bounds idle polling (20 fetches/s per consumer at 50 ms); the embedded broker
    answers late, and each hop then costs a share of this wait (measured: median 369 ms
    at faust's 1,500 ms, 163 ms at aiokafka's default 500, 23 ms at 100, 4 ms at 20)."""
    consumer_fetch_busy_wait_ms: int | None = Field(default=None, ge=1, le=10_000)
    """The fetch wait while records flow, for every consumer but faust's
    (``seawall_client.fetch_pacing``): ``None`` keeps ``consumer_fetch_max_wait_ms``
    throughout, right for Apache Kafka; ``seawall up`` sets it on the embedded broker,
    which does not wake a waiting fetch when a record arrives."""

    kafka_doorbell: bool = False
    """Producers ring a Redis channel per topic once the broker took a record, and
    consumers sleep between rings (``services.common.doorbell``): for the embedded
    broker, which answers a waiting fetch late (``seawall up`` turns it on there). Off
    for Apache Kafka, which answers a waiting fetch as soon as a record arrives."""

    instance_id: str = Field(default_factory=default_instance_id, max_length=128)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["logfmt", "json"] = "logfmt"
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    """Port of the service's Prometheus ``/metrics``; ``None`` serves none."""
    metrics_host: str = "127.0.0.1"
    """Address ``/metrics`` listens on: the loopback by default; ``0.0.0.0`` in a
    container or pod, for Prometheus on another host to scrape."""
    shutdown_grace_s: float = Field(default=20.0, ge=0, le=3600)
    """How long a SIGTERM'd service may spend finishing in-flight work."""

    trace_dir: str | None = None
    """Where this process writes its trace spans as JSON lines (``services.common.
    tracing``; ``seawall trace`` reads them); ``None``: no file. ``seawall up`` sets
    ``.seawall/traces``. An OTLP endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT``) exports them
    too."""
    trace_file_mb: float = Field(default=32.0, gt=0, le=4096)
    """A trace file's size before it is rotated (one old file kept per process)."""
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    """The event loop a service runs on: ``uvloop`` (libuv) halves what each socket
    read and write costs the loop (a bare uvicorn answer: 0.32 ms of CPU against 0.60
    on the stock loop, measured on the 2-core dev machine); ``auto`` takes it where it
    is installed (a dependency of seawall), ``asyncio`` the standard library's."""
    trace_sample: float = Field(default=1.0, ge=0, le=1)
    """The share of requests traced, of those that arrive without a client's
    ``traceparent`` (which decides for its own request), where a sink is set."""
    control_keys_dir: Path | None = None
    """Where the control topic's keys are (``services.common.control_signing``): the
    public keys followers trust (``trusted.pub``) and this process's private key, if it
    signs (``<role>.key``). ``seawall up`` makes them in its state directory."""
    control_signatures: Literal["required", "off"] = "required"
    """``required``: a control event is believed only if a trusted key signed it, and a
    process that follows or issues control events will not start without its keys.
    ``off``: believe any event on the topic (a throwaway stack whose broker nobody else
    can reach)."""
    sampling_secret_file: Path | None = None
    """A file holding the fleet's sampling secret (hex, 32 to 64 bytes), the key of the
    hashes that pick a request's canary side and its shadow runs (``services.common.
    sampling``): the same file for every admission replica and every worker, so that
    they decide alike. Admission and the workers refuse to start without it, since
    unkeyed, a producer choosing its ids could aim at the canary or dodge a shadow.
    ``seawall up`` makes one in its state directory."""

    @property
    def kafka(self) -> KafkaConfig:
        """What the Kafka clients are built from (``seawall_client.kafka``)."""
        return self._kafka_config(self._kafka_password())

    def _kafka_config(self, password: str | None) -> KafkaConfig:
        return KafkaConfig(
            bootstrap=self.kafka_bootstrap,
            idempotence=self.kafka_idempotence,
            topic_prefix=self.topic_prefix,
            topic_replication=self.topic_replication,
            fetch_max_wait_ms=self.consumer_fetch_max_wait_ms,
            fetch_busy_wait_ms=self.consumer_fetch_busy_wait_ms,
            instance_id=self.instance_id,
            security_protocol=self.kafka_security_protocol,
            sasl_mechanism=self.kafka_sasl_mechanism,
            sasl_username=self.kafka_sasl_username,
            sasl_password=password,
            sasl_oauth_token=_revealed(self.kafka_sasl_oauth_token),
            ssl_cafile=self.kafka_ssl_cafile,
            ssl_certfile=self.kafka_ssl_certfile,
            ssl_keyfile=self.kafka_ssl_keyfile,
        )

    def _kafka_password(self) -> str | None:
        """From ``kafka_sasl_password_file`` where set (read at each call, so a rotated
        password reaches the next client built), else ``kafka_sasl_password``."""
        if self.kafka_sasl_password_file is None:
            return _revealed(self.kafka_sasl_password)
        return _first_line(self.kafka_sasl_password_file)

    @property
    def redis_credentials(self) -> dict[str, str]:
        """The ``username`` and ``password`` keywords of every Redis client this process
        makes (none where neither is set: the URL's, if any, apply). Read from the file
        at each call: a rotated password is taken by the next client built."""
        out: dict[str, str] = {}
        if self.redis_username is not None:
            out["username"] = self.redis_username
        if self.redis_password_file is not None:
            out["password"] = _first_line(self.redis_password_file)
        return out

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.redis_password_file is not None and _url_password(self.redis_url):
            raise ValueError(
                "redis_password_file and a password in redis_url: give the password once"
            )
        if self.kafka_sasl_password_file is not None and self.kafka_sasl_password is not None:
            raise ValueError(
                "kafka_sasl_password_file and kafka_sasl_password: give the password once"
            )
        if self.redis_fanout >= self.redis_max_connections:
            raise ValueError("redis_fanout must be below redis_max_connections")
        if 3 * self.consumer_heartbeat_ms > self.consumer_session_timeout_ms:
            raise ValueError("consumer_heartbeat_ms must be at most a third of the session")
        busy = self.consumer_fetch_busy_wait_ms
        if busy is not None and busy > self.consumer_fetch_max_wait_ms:
            raise ValueError("consumer_fetch_busy_wait_ms must be at most the fetch wait")
        # KafkaConfig checks the security settings together; a password file is read when
        # a client is built, not here (it may be mounted only where the process runs).
        given = self.kafka_sasl_password_file is not None or self.kafka_sasl_password
        self._kafka_config("(given)" if given else None)
        return self

    @field_validator(
        "kafka_sasl_username",
        "kafka_sasl_password",
        "kafka_sasl_oauth_token",
        "kafka_ssl_cafile",
        "kafka_ssl_certfile",
        "kafka_ssl_keyfile",
        mode="before",
    )
    @classmethod
    def _blank_kafka_field_is_unset(cls, v: object) -> object:
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("kafka_security_protocol", "kafka_sasl_mechanism", mode="before")
    @classmethod
    def _upper(cls, v: object) -> object:
        return v.strip().upper() if isinstance(v, str) else v

    @field_validator(
        "consumer_fetch_busy_wait_ms",
        "trace_dir",
        "control_keys_dir",
        "sampling_secret_file",
        "redis_username",
        "redis_password_file",
        "kafka_sasl_password_file",
        mode="before",
    )
    @classmethod
    def _blank_is_unset(cls, v: object) -> object:
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("pools", mode="before")
    @classmethod
    def _split_pools(cls, v: object) -> object:
        return tuple(p.strip() for p in v.split(",") if p.strip()) if isinstance(v, str) else v


def _revealed(secret: SecretStr | None) -> str | None:
    return None if secret is None else secret.get_secret_value()


def _first_line(path: Path) -> str:
    lines = path.read_text().splitlines()
    if not lines or not lines[0].strip():
        raise ValueError(f"{path}: no password in it")
    return lines[0].strip()


def _url_password(url: str) -> bool:
    """Whether a Redis URL carries a password (``redis://[user]:<password>@host``)."""
    from urllib.parse import urlsplit

    _, _, rest = url.partition("://")
    return bool(rest) and urlsplit(f"redis://{rest}").password is not None
