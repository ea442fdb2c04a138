"""Kafka plumbing the client and the services share: how to reach the broker (its
address, TLS and SASL), the producer, topic creation, reading a topic from its end, and
a bounded close.

Every Kafka client of the fleet is built from a ``KafkaConfig`` through
``connection_options``, so TLS and SASL are set in one place and no client can be left
on plaintext by a call that forgot them.

Producers use ``acks=all``; idempotence follows ``KafkaConfig.idempotence`` (off on the
embedded broker, which cannot give producer ids; request-id de-duplication covers the
duplicates either way).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, cast, get_args

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.abc import AbstractTokenProvider
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.client import AIOKafkaClient, ConnectionGroup
from aiokafka.cluster import ClusterMetadata
from aiokafka.errors import (
    KafkaError,
    TopicAlreadyExistsError,
    UnknownTopicOrPartitionError,
    for_code,
)
from aiokafka.helpers import create_ssl_context
from aiokafka.protocol.metadata import MetadataRequest

from seawall_client.fetch_pacing import Dormancy, FetchPacing
from seawall_client.topics import TopicSpec

log = logging.getLogger(__name__)

DEFAULT_BROKER: Final = "127.0.0.1:9092"
STACK_ENV_FILE: Final = os.environ.get("SEAWALL_ENV_FILE", ".seawall/stack.env")
"""Written by ``seawall up`` while it runs: how to reach its stack. Clients and commands
run beside it read it; the environment wins over it."""
CLOSE_TIMEOUT_S: Final = 15.0
"""How long a Kafka client may take to close before it is abandoned."""
DELETE_TIMEOUT_S: Final = 5.0
"""How long ``delete_topics`` may wait for the broker before it gives up."""
UNTRACK_MISSING_S: Final = 30.0
"""A topic the broker no longer has is dropped from a producer's metadata once nothing
was sent to it for this long (above the 15 s request timeout, so that a send waiting for
a topic still being created keeps it)."""
VANISHED_RECHECK_S: Final = 1.0
"""How often a producer looks again whether a topic it saw deleted was made again."""
UNTRACK_IDLE_S: Final = 600.0
"""A topic nothing was sent to for this long is dropped from a producer's metadata: a
later send adds it back (one metadata round trip), and the metadata requests stay as
small as the topics in use, not every reply topic ever written to."""
_PREFIX = re.compile(r"^[A-Za-z0-9._-]{0,64}$")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
"""Kafka's ``security.protocol``: whether the connection is encrypted (``SSL``) and
whether the client authenticates over SASL."""
SaslMechanism = Literal["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN", "OAUTHBEARER"]
"""What aiokafka can authenticate with, GSSAPI (Kerberos) aside. SCRAM first: the
password never crosses the wire; PLAIN sends it, so it belongs on ``SASL_SSL`` only."""
SECURITY_PROTOCOLS: Final[tuple[SecurityProtocol, ...]] = get_args(SecurityProtocol)
SASL_MECHANISMS: Final[tuple[SaslMechanism, ...]] = get_args(SaslMechanism)
TLS_PROTOCOLS: Final = frozenset({"SSL", "SASL_SSL"})
SASL_PROTOCOLS: Final = frozenset({"SASL_PLAINTEXT", "SASL_SSL"})


def default_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True, slots=True)
class KafkaConfig:
    """How to reach the fleet's broker and name its topics. The services build theirs
    from their settings (``CommonSettings.kafka``); a client reads the same
    ``SEAWALL_*`` variables with ``from_env``."""

    bootstrap: str = DEFAULT_BROKER
    idempotence: bool = True
    """On for Apache Kafka; off for the embedded broker (Tansu), which fails
    ``InitProducerId``."""
    topic_prefix: str = ""
    topic_replication: int = 1
    """Replication of the topics this process creates (a client: its reply topic)."""
    fetch_max_wait_ms: int = 50
    """How long a fetch may wait at the broker for records: the embedded broker answers
    a fetch late, and each hop then costs a share of this wait."""
    fetch_busy_wait_ms: int | None = None
    """The fetch wait while records flow (``fetch_pacing``); ``None``: always
    ``fetch_max_wait_ms``. ``seawall up`` sets it on the embedded broker."""
    instance_id: str = ""
    """Names this process to the broker (``seawall-<instance_id>``); empty: host-pid."""
    security_protocol: SecurityProtocol = "PLAINTEXT"
    """``PLAINTEXT`` (the embedded broker), ``SSL``, ``SASL_PLAINTEXT`` or ``SASL_SSL``
    (what a shared Apache Kafka cluster should ask for)."""
    sasl_mechanism: SaslMechanism = "SCRAM-SHA-512"
    """Used with the ``SASL_*`` protocols only."""
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    """Never in ``repr`` (nor, so, in a log line or a traceback that shows the config)."""
    sasl_oauth_token: str | None = field(default=None, repr=False)
    """``OAUTHBEARER``: a static bearer token, sent as it is at every connection; a
    token that expires needs a provider of its own (``new_producer(config,
    sasl_oauth_token_provider=...)``; aiokafka's ``AbstractTokenProvider``)."""
    ssl_cafile: str | None = None
    """The CA bundle (PEM) the broker's certificate must chain to; ``None``: the
    system's trust store."""
    ssl_certfile: str | None = None
    """A client certificate (PEM), for a broker that authenticates clients by TLS."""
    ssl_keyfile: str | None = None
    """The client certificate's private key, if not in ``ssl_certfile``."""

    def __post_init__(self) -> None:
        if not _PREFIX.match(self.topic_prefix):
            raise ValueError("topic_prefix: up to 64 of A-Z a-z 0-9 . _ -")
        if not 1 <= self.topic_replication <= 16:
            raise ValueError("topic_replication must be within 1..16")
        if not 1 <= self.fetch_max_wait_ms <= 10_000:
            raise ValueError("fetch_max_wait_ms must be within 1..10000")
        if self.fetch_busy_wait_ms is not None:
            FetchPacing(idle_ms=self.fetch_max_wait_ms, busy_ms=self.fetch_busy_wait_ms)
        self._check_security()

    def _check_security(self) -> None:
        """Refuse settings that would not do what they say: SASL without what it needs,
        or credentials and certificates set beside a protocol that would not use them
        (a typo in the protocol must not quietly connect in the clear)."""
        protocol, mechanism = self.security_protocol, self.sasl_mechanism
        if protocol not in SECURITY_PROTOCOLS:
            raise ValueError(f"security_protocol must be one of {', '.join(SECURITY_PROTOCOLS)}")
        if mechanism not in SASL_MECHANISMS:
            raise ValueError(f"sasl_mechanism must be one of {', '.join(SASL_MECHANISMS)}")
        credentials = [
            name
            for name, value in (
                ("sasl_username", self.sasl_username),
                ("sasl_password", self.sasl_password),
                ("sasl_oauth_token", self.sasl_oauth_token),
            )
            if value
        ]
        if protocol not in SASL_PROTOCOLS:
            if credentials:
                raise ValueError(
                    f"{', '.join(credentials)} set, but security_protocol {protocol} sends no "
                    "credentials: use SASL_SSL (or SASL_PLAINTEXT)"
                )
        elif mechanism == "OAUTHBEARER":
            if not self.sasl_oauth_token:
                raise ValueError(f"{protocol} with OAUTHBEARER needs sasl_oauth_token")
            if self.sasl_username or self.sasl_password:
                raise ValueError("OAUTHBEARER takes sasl_oauth_token, not a username/password")
        else:
            if not (self.sasl_username and self.sasl_password):
                raise ValueError(
                    f"{protocol} with {mechanism} needs sasl_username and sasl_password"
                )
            if self.sasl_oauth_token:
                raise ValueError(f"sasl_oauth_token is for OAUTHBEARER, not {mechanism}")
        files = [
            name
            for name, value in (
                ("ssl_cafile", self.ssl_cafile),
                ("ssl_certfile", self.ssl_certfile),
                ("ssl_keyfile", self.ssl_keyfile),
            )
            if value
        ]
        if files and protocol not in TLS_PROTOCOLS:
            raise ValueError(
                f"{', '.join(files)} set, but security_protocol {protocol} uses no TLS: "
                "use SSL or SASL_SSL"
            )
        if self.ssl_keyfile and not self.ssl_certfile:
            raise ValueError("ssl_keyfile needs ssl_certfile (the certificate it belongs to)")

    @property
    def client_id(self) -> str:
        return f"seawall-{self.instance_id or default_instance_id()}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> KafkaConfig:
        """From ``SEAWALL_KAFKA_BOOTSTRAP``, ``SEAWALL_KAFKA_IDEMPOTENCE``,
        ``SEAWALL_TOPIC_PREFIX``, ``SEAWALL_TOPIC_REPLICATION``,
        ``SEAWALL_CONSUMER_FETCH_MAX_WAIT_MS``, ``SEAWALL_CONSUMER_FETCH_BUSY_WAIT_MS``,
        ``SEAWALL_INSTANCE_ID``, ``SEAWALL_KAFKA_SECURITY_PROTOCOL``,
        ``SEAWALL_KAFKA_SASL_MECHANISM``, ``SEAWALL_KAFKA_SASL_USERNAME``,
        ``SEAWALL_KAFKA_SASL_PASSWORD``, ``SEAWALL_KAFKA_SASL_OAUTH_TOKEN``,
        ``SEAWALL_KAFKA_SSL_CAFILE``, ``SEAWALL_KAFKA_SSL_CERTFILE`` and
        ``SEAWALL_KAFKA_SSL_KEYFILE`` (the names the services read), in ``env``
        (default: the environment over ``STACK_ENV_FILE``, as the services read them);
        what is unset or blank keeps its default; the protocol and mechanism may be in
        either case."""
        e = {**_env_file(Path(STACK_ENV_FILE)), **os.environ} if env is None else env
        d = cls()
        protocol = _optional_str(e.get("SEAWALL_KAFKA_SECURITY_PROTOCOL"))
        mechanism = _optional_str(e.get("SEAWALL_KAFKA_SASL_MECHANISM"))
        return cls(
            bootstrap=e.get("SEAWALL_KAFKA_BOOTSTRAP", d.bootstrap),
            idempotence=_flag(e, "SEAWALL_KAFKA_IDEMPOTENCE", d.idempotence),
            topic_prefix=e.get("SEAWALL_TOPIC_PREFIX", d.topic_prefix),
            topic_replication=int(e.get("SEAWALL_TOPIC_REPLICATION", d.topic_replication)),
            fetch_max_wait_ms=int(e.get("SEAWALL_CONSUMER_FETCH_MAX_WAIT_MS", d.fetch_max_wait_ms)),
            fetch_busy_wait_ms=_optional_int(e.get("SEAWALL_CONSUMER_FETCH_BUSY_WAIT_MS")),
            instance_id=e.get("SEAWALL_INSTANCE_ID", d.instance_id),
            # Checked against the allowed values in __post_init__.
            security_protocol=cast(
                SecurityProtocol, protocol.upper() if protocol else d.security_protocol
            ),
            sasl_mechanism=cast(
                SaslMechanism, mechanism.upper() if mechanism else d.sasl_mechanism
            ),
            sasl_username=_optional_str(e.get("SEAWALL_KAFKA_SASL_USERNAME")),
            sasl_password=_optional_str(e.get("SEAWALL_KAFKA_SASL_PASSWORD"), strip=False),
            sasl_oauth_token=_optional_str(e.get("SEAWALL_KAFKA_SASL_OAUTH_TOKEN")),
            ssl_cafile=_optional_str(e.get("SEAWALL_KAFKA_SSL_CAFILE")),
            ssl_certfile=_optional_str(e.get("SEAWALL_KAFKA_SSL_CERTFILE")),
            ssl_keyfile=_optional_str(e.get("SEAWALL_KAFKA_SSL_KEYFILE")),
        )


def _env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines (as ``seawall up`` writes them); none if there is no file."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return {}
    pairs = (line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def _optional_int(raw: str | None) -> int | None:
    return None if raw is None or not raw.strip() else int(raw)


def _optional_str(raw: str | None, *, strip: bool = True) -> str | None:
    """``None`` for unset or blank; stripped unless ``strip`` is off (a password may
    begin or end with a space)."""
    if raw is None or not raw.strip():
        return None
    return raw.strip() if strip else raw


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None:
        return default
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise ValueError(f"{name} must be true or false, not {raw!r}")


class StaticTokenProvider(AbstractTokenProvider):  # type: ignore[misc]
    """An ``OAUTHBEARER`` token that does not change (``KafkaConfig.sasl_oauth_token``).
    aiokafka asks for a token at every connection; a provider that fetches and renews
    one is the caller's to pass where tokens expire."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def token(self) -> str:
        return self._token

    def __repr__(self) -> str:
        return f"{type(self).__name__}(<hidden>)"


def ssl_context(config: KafkaConfig) -> ssl.SSLContext | None:
    """The TLS context of ``config``'s protocol (``None`` without TLS): aiokafka's
    ``create_ssl_context``, which verifies the broker's certificate against
    ``ssl_cafile`` (else the system's trust store) and checks that it names the host
    connected to; with ``ssl_certfile``, it presents that client certificate. Verification
    cannot be turned off here: a broker with a private CA is trusted by naming the CA."""
    if config.security_protocol not in TLS_PROTOCOLS:
        return None
    context: ssl.SSLContext = create_ssl_context(
        cafile=config.ssl_cafile, certfile=config.ssl_certfile, keyfile=config.ssl_keyfile
    )
    return context


def connection_options(config: KafkaConfig) -> dict[str, Any]:
    """aiokafka's keyword arguments for reaching the broker as ``config`` says: its
    address, this process's client id, and the protocol with its TLS context and SASL
    credentials. Every producer, consumer and admin client is built from these (the
    controller's faust app from the same ``KafkaConfig``), so one setting secures them
    all. The result holds the credentials: hand it to aiokafka, never to a log."""
    options: dict[str, Any] = {
        "bootstrap_servers": config.bootstrap,
        "client_id": config.client_id,
        "security_protocol": config.security_protocol,
    }
    context = ssl_context(config)
    if context is not None:
        options["ssl_context"] = context
    if config.security_protocol in SASL_PROTOCOLS:
        options["sasl_mechanism"] = config.sasl_mechanism
        if config.sasl_mechanism == "OAUTHBEARER":
            assert config.sasl_oauth_token is not None  # KafkaConfig checked it
            options["sasl_oauth_token_provider"] = StaticTokenProvider(config.sasl_oauth_token)
        else:
            options["sasl_plain_username"] = config.sasl_username
            options["sasl_plain_password"] = config.sasl_password
    return options


def _unknown_topics(metadata: Any) -> set[str]:
    """The topics a metadata response says the broker does not have. Only that answer
    means deleted: a topic left out for any other error (no leader yet, the broker
    busy) is still there."""
    return {str(t[1]) for t in metadata.topics if t[0] == UnknownTopicOrPartitionError.errno}


class _NoAutoCreateClient(AIOKafkaClient):  # type: ignore[misc]
    """An aiokafka client whose metadata requests never create a topic; a producer's
    also drops from them the topics it no longer writes to (``untrack``).

    aiokafka asks for metadata with ``allow_auto_topic_creation`` on. A producer asks
    again, at every refresh, for every topic it ever wrote to; so a reply topic deleted
    by its owner (``reply_upkeep``) came straight back, created by the next refresh of
    any service that had replied to it — on the embedded broker at once, on an Apache
    Kafka with ``auto.create.topics.enable`` (its default) too, with the broker's
    defaults and no owner to read or delete it. The fleet creates its topics
    explicitly (``ensure_topics``) and a reply topic only by its owner."""

    untrack: Callable[[ClusterMetadata, set[str], set[str]], None] | None = None
    """Called after each metadata update with the topics asked for and those the broker
    answered it does not have (``UNKNOWN_TOPIC_OR_PARTITION``); may discard some."""

    async def _metadata_update(self, cluster_metadata: ClusterMetadata, topics: Any) -> bool:
        # aiokafka's own (0.11 to 0.14), but for allow_auto_topic_creation=False; the
        # test that a deleted reply topic stays deleted (tests/integration/client)
        # fails if an upgrade stops calling it.
        request = MetadataRequest(list(topics) if topics else None, allow_auto_topic_creation=False)
        nodeids: list[Any] = [b.nodeId for b in self.cluster.brokers()]
        bootstrap_id = ("bootstrap", ConnectionGroup.DEFAULT)
        if bootstrap_id in self._conns:
            nodeids.append("bootstrap")
        random.shuffle(nodeids)
        for node_id in nodeids:
            conn = await self._get_conn(node_id)
            if conn is None:
                continue
            try:
                metadata = await conn.send(request)
            except (TimeoutError, KafkaError) as err:
                log.warning(
                    "unable to request metadata from a broker",
                    extra={"node": str(node_id), "error": repr(err)},
                )
                continue
            if not metadata.brokers:
                return False
            cluster_metadata.update_metadata(metadata)
            if bootstrap_id in self._conns and len(self.cluster.brokers()):
                self._conns.pop(bootstrap_id).close()
            break
        else:
            log.error("unable to update metadata from any broker", extra={"nodes": nodeids})
            cluster_metadata.failed_update(None)
            return False
        if self.untrack is not None and topics:
            self.untrack(cluster_metadata, topics, _unknown_topics(metadata))
        return True


class Producer(AIOKafkaProducer):  # type: ignore[misc]
    """aiokafka's producer, keeping the topics it writes to in its metadata, and only
    those; its metadata requests never create a topic (``_NoAutoCreateClient``).

    aiokafka refreshes metadata only for the topics its client tracks, and tracks a
    topic only if it was missing from the metadata when first written to. A topic known
    from the start-up metadata (a dispatch topic, say) is then dropped by the first
    refresh made for a new topic (a client's new reply topic), and batches waiting for
    it stall until they expire with ``NotLeaderForPartitionError``. So every topic
    written to is tracked; one not written to for ``UNTRACK_IDLE_S``, or gone from the
    broker (deleted by its owner) and not written to for ``UNTRACK_MISSING_S``, is
    dropped again, so that the metadata asked for stays that of the topics in use (a
    service replies to thousands of clients' reply topics over its life) and a deleted
    topic is not asked for (aiokafka logs an error each time it is missing).

    A topic that was there and is gone (``_vanished``) fails a send, or a look-up of its
    partitions, with ``UnknownTopicOrPartitionError`` at once (after one listing of the
    broker's topics, at most every ``VANISHED_RECHECK_S``, in case it was made again),
    rather than after aiokafka's wait for its metadata, the whole request timeout: a
    reply to a client that deleted its topic must not hold its sender for 15 s.
    """

    def __init__(self, *, delivered: Callable[[str], None] | None = None, **options: Any) -> None:
        super().__init__(**options)
        self.client.__class__ = _NoAutoCreateClient
        self.client.untrack = self._untrack
        self._tracked: dict[str, float] = {}
        """Topic → when it was last written to (``time.monotonic``)."""
        self._present: set[str] = set()
        """Tracked topics the last metadata update found."""
        self._vanished: dict[str, float] = {}
        """Topics found once and missing since → when that was last checked."""
        self._delivered = delivered
        """Told each topic a send to it was acknowledged on (a doorbell rings it)."""

    def _track(self, topic: str) -> None:
        known = topic in self._tracked
        self._tracked[topic] = time.monotonic()
        if not known:
            self.client.add_topic(topic)

    def _untrack(self, cluster: ClusterMetadata, asked: set[str], unknown: set[str]) -> None:
        now = time.monotonic()
        for topic in list(self._tracked):
            idle_s = now - self._tracked[topic]
            gone = topic in unknown
            if gone and topic in self._present:
                self._vanished[topic] = now
                self._present.discard(topic)
            elif not gone and topic in asked:
                self._present.add(topic)
            if idle_s >= UNTRACK_IDLE_S or (gone and idle_s >= UNTRACK_MISSING_S):
                del self._tracked[topic]
                self._present.discard(topic)
                self.client._topics.discard(topic)  # in place: aiokafka compares the set
        for topic, checked in list(self._vanished.items()):
            if now - checked >= UNTRACK_IDLE_S:
                del self._vanished[topic]

    async def _refuse_vanished(self, topic: str) -> None:
        checked = self._vanished.get(topic)
        if checked is None:
            return
        now = time.monotonic()
        if now - checked >= VANISHED_RECHECK_S:
            self._vanished[topic] = now
            cluster = await self.client.fetch_all_metadata()
            if cluster.partitions_for_topic(topic) is not None:
                del self._vanished[topic]
                return
        raise UnknownTopicOrPartitionError(f"the topic {topic!r} was deleted")

    def _on_ack(self, topic: str, ack: asyncio.Future[Any]) -> None:
        if self._delivered is not None:
            delivered = self._delivered
            ack.add_done_callback(
                lambda f: None if f.cancelled() or f.exception() else delivered(topic)
            )

    async def partitions_for(self, topic: str) -> Any:
        await self._refuse_vanished(topic)
        return await super().partitions_for(topic)

    async def send(self, topic: str, *args: Any, **kwargs: Any) -> Any:
        await self._refuse_vanished(topic)
        self._track(topic)
        ack = await super().send(topic, *args, **kwargs)
        self._on_ack(topic, ack)
        return ack

    async def send_batch(self, batch: Any, topic: str, *, partition: int) -> Any:
        await self._refuse_vanished(topic)
        self._track(topic)
        ack = await super().send_batch(batch, topic, partition=partition)
        self._on_ack(topic, ack)
        return ack


MAX_BATCH_BYTES = 256 * 1024
"""A producer's record batch per partition, at most (aiokafka's default: 16 KiB).

aiokafka keeps one produce request in flight per broker, and a partition's batch, once
full, makes the next record (``send``) or batch (``send_batch``) for that partition wait
until the sender has taken it. At 16 KiB a batch held about 15 dispatch records, so a
dispatch round of a couple of hundred waited for two or three broker round trips: the
admission benchmark spent two thirds of its dispatch rounds there, and rose from about
9,000 to 12,500 decisions/s at this size. Far below the broker's per-batch limit
(Apache Kafka's ``message.max.bytes``, 1 MB by default); a batch's buffer grows with
what it holds, so a quiet producer allocates no more."""


def new_producer(config: KafkaConfig, **overrides: Any) -> AIOKafkaProducer:
    options: dict[str, Any] = {
        **connection_options(config),
        "acks": "all",
        "enable_idempotence": config.idempotence,
        # No linger: a record goes out at once, and those queued while a request is
        # with the broker share the next one. 1 ms cost a hop 1.2 ms at its median
        # on the embedded broker (a send acknowledged in 2.27 ms against 1.08).
        "linger_ms": 0,
        "request_timeout_ms": 15_000,
        "max_batch_size": MAX_BATCH_BYTES,
    }
    options.update(overrides)
    return Producer(**options)


async def topic_activity(
    config: KafkaConfig, prefix: str, timeout_s: float = 15.0
) -> dict[str, int]:
    """Every topic whose name starts with ``prefix``, with the sum of its partitions'
    end offsets: a figure that moves whenever anything is written to it (and falls back
    to zero if it was deleted and made again). Creates no topic, even one deleted while
    it is looked at (which is then missing, or fails the call with ``KafkaTimeoutError``
    within ``timeout_s``)."""
    consumer = new_consumer(config, request_timeout_ms=int(timeout_s * 1000))
    consumer._client.__class__ = _NoAutoCreateClient
    try:
        await consumer.start()
        names = [t for t in await consumer.topics() if t.startswith(prefix)]
        if not names:
            return {}
        await consumer._client.set_topics(names)  # their partitions, in one request
        tps = [TopicPartition(t, p) for t in names for p in consumer.partitions_for_topic(t) or ()]
        ends: dict[TopicPartition, int] = await consumer.end_offsets(tps) if tps else {}
    finally:
        await close(consumer)
    totals: dict[str, int] = {}
    for tp, end in ends.items():
        totals[tp.topic] = totals.get(tp.topic, 0) + end
    return totals


class Consumer(AIOKafkaConsumer):  # type: ignore[misc]
    """aiokafka's consumer, its fetching paced by what its reads bring: its fetch wait
    (``FetchPacing``), or, where a doorbell wakes it, whether it fetches at all
    (``Dormancy``: dormant, its partitions are paused, so no fetch waits at the broker;
    ``wake`` resumes them).

    aiokafka's fetcher builds each fetch request from its ``_fetch_max_wait_ms`` (it
    has no public setter); after every ``getmany`` the wait the pacing picks is set
    there, so the fetches from then on carry it. The owner's own pauses (back-pressure)
    are kept apart from dormancy's: waking never resumes what the owner paused."""

    def __init__(
        self,
        *topics: str,
        pacing: FetchPacing | None = None,
        dormancy: Dormancy | None = None,
        **options: Any,
    ) -> None:
        if dormancy is not None:
            options["fetch_max_wait_ms"] = dormancy.awake_ms
            pacing = None
        super().__init__(*topics, **options)
        self._pacing = pacing
        self._dormancy = dormancy
        self._held: set[TopicPartition] = set()
        """What the owner paused."""
        self._asleep = False
        self._look: asyncio.TimerHandle | None = None
        """When dormancy is looked at next (not only when the owner reads: its reads
        may wait far longer than the linger)."""
        self.on_topics: Callable[[frozenset[str]], None] | None = None
        """Told the topics this consumer reads whenever they change (its doorbell)."""
        self.on_stopped: Callable[[Consumer], None] | None = None

    async def stop(self) -> None:
        if self._look is not None:
            self._look.cancel()
            self._look = None
        try:
            await super().stop()
        finally:
            if self.on_stopped is not None:
                self.on_stopped(self)

    @property
    def topics_read(self) -> frozenset[str]:
        subscribed = self.subscription() or set()
        return frozenset(subscribed) | {tp.topic for tp in self.assignment()}

    def subscribe(self, *args: Any, **kwargs: Any) -> None:
        super().subscribe(*args, **kwargs)
        self._topics_changed()

    def assign(self, partitions: Any) -> None:
        super().assign(partitions)
        self._topics_changed()

    def _topics_changed(self) -> None:
        if self.on_topics is not None:
            self.on_topics(self.topics_read)

    def pause(self, *partitions: TopicPartition) -> None:
        self._held.update(partitions)
        super().pause(*partitions)

    def resume(self, *partitions: TopicPartition) -> None:
        self._held.difference_update(partitions)
        if not self._asleep:
            super().resume(*partitions)

    def wake(self) -> None:
        """Records are waiting (a doorbell rang): fetch them now."""
        if self._dormancy is None:
            return
        self._dormancy.woken(time.monotonic())
        self._doze(True)

    def _doze(self, awake: bool) -> None:
        """Resume (awake) or pause (dormant) the partitions, and look again when the
        dormancy may change its answer.

        aiokafka returns no records of a paused partition (it drops them, to be fetched
        again): pausing while fetched records wait to be read, or while a fetch that
        may bring some is out, would lose them to every pause (a fetch slower than the
        linger, a 900 KB record, say, forever). So a consumer due to sleep with records
        waiting looks again a fetch wait later, and one with a fetch out pauses when
        that fetch comes back empty, before the fetcher sends the next."""
        assert self._dormancy is not None
        fetcher = self._fetcher
        if fetcher is None:
            # Not started (a doorbell can ring, or subscribe, before): nothing to pause
            # or resume yet, and its first getmany decides.
            return
        look_at = self._dormancy.next_look()
        if awake:
            if self._asleep:
                self._asleep = False
                super().resume(*(tp for tp in self.assignment() if tp not in self._held))
        elif fetcher._records:
            look_at = time.monotonic() + self._dormancy.awake_ms / 1000
        elif fetcher._in_flight:
            for task in fetcher._pending_tasks:
                if not task.done():
                    task.add_done_callback(self._fetched)
        else:
            self._sleep()
        if self._look is not None:
            self._look.cancel()
        # The event loop's clock is time.monotonic(), as Dormancy's is.
        self._look = asyncio.get_running_loop().call_at(look_at, self._look_again)

    def _fetched(self, task: asyncio.Task[Any]) -> None:
        """A fetch that was out when the consumer was due to sleep came back: sleep now
        if it brought nothing (this runs before the fetcher sends its next fetch)."""
        brought = not task.cancelled() and task.exception() is None and bool(task.result())
        if brought or self._dormancy is None or self._closed:
            return
        if not self._dormancy.awake(False, time.monotonic()) and not self._fetcher._records:
            self._sleep()

    def _sleep(self) -> None:
        # Every time, not once: a rebalance resumes what it assigns.
        self._asleep = True
        super().pause(*self.assignment())

    def _look_again(self) -> None:
        self._look = None
        if self._dormancy is not None and not self._closed:
            self._doze(self._dormancy.awake(False, time.monotonic()))

    async def getmany(
        self, *partitions: TopicPartition, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[TopicPartition, list[Any]]:
        batches: dict[TopicPartition, list[Any]] = await super().getmany(
            *partitions, timeout_ms=timeout_ms, max_records=max_records
        )
        got = any(batches.values())
        if self._dormancy is not None:
            self._doze(self._dormancy.awake(got, time.monotonic()))
        elif self._pacing is not None:
            self._fetcher._fetch_max_wait_ms = self._pacing.wait_ms(got, time.monotonic())
        return batches


def new_consumer(
    config: KafkaConfig, *topics: str, dormancy: Dormancy | None = None, **overrides: Any
) -> Consumer:
    """Every consumer: no auto-commit (an offset is committed only after its effect is
    durable), from the earliest record when there is no committed offset, its fetch
    wait paced where ``config`` sets a busy wait (idle: the consumer's
    ``fetch_max_wait_ms``, an override's included), or dormant between rings where a
    doorbell wakes it (``dormancy``)."""
    options: dict[str, Any] = {
        **connection_options(config),
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "fetch_max_wait_ms": config.fetch_max_wait_ms,
    }
    options.update(overrides)
    pacing = None
    if config.fetch_busy_wait_ms is not None:
        idle = options["fetch_max_wait_ms"]
        pacing = FetchPacing(idle_ms=idle, busy_ms=min(config.fetch_busy_wait_ms, idle))
    return Consumer(*topics, pacing=pacing, dormancy=dormancy, **options)


def as_config(broker: KafkaConfig | str) -> KafkaConfig:
    """``broker`` as a ``KafkaConfig``: a bare bootstrap string (benchmarks and tests on
    the embedded broker) is that address in plaintext, every other setting its default."""
    return KafkaConfig(bootstrap=broker) if isinstance(broker, str) else broker


def new_admin(config: KafkaConfig, **overrides: Any) -> AIOKafkaAdminClient:
    """An admin client (not started) reaching the broker as ``config`` says."""
    options: dict[str, Any] = {**connection_options(config), "request_timeout_ms": 15_000}
    options.update(overrides)
    return AIOKafkaAdminClient(**options)


async def ensure_topics(
    config: KafkaConfig | str, specs: Iterable[TopicSpec], replication: int | None = None
) -> list[str]:
    """Create the topics that do not exist yet, with their partitions, retention and
    ``replication`` (never left to a broker's auto-creation, which production Kafka
    turns off and which would pick its own defaults); ``None``: the config's
    ``topic_replication``, which services take from their settings: whichever starts
    first creates the fleet's topics, so each must ask for the same. A bare bootstrap
    string (benchmarks and tests on the embedded broker) connects in plaintext with
    replication 1. Returns the names created."""
    config = as_config(config)
    if replication is None:
        replication = config.topic_replication
    admin = new_admin(config)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [s for s in specs if s.name not in existing]
        if missing:
            response = await admin.create_topics(
                [
                    NewTopic(s.name, s.partitions, replication, topic_configs=s.config)
                    for s in missing
                ]
            )
            raise_creation_failures(response.topic_errors)
        return [s.name for s in missing]
    finally:
        await admin.close()


def raise_creation_failures(topic_errors: Iterable[tuple[Any, ...]]) -> None:
    """Raise the first error a ``CreateTopics`` answer gives a topic (aiokafka returns
    the answer as it came, errors and all): not allowed to (an ACL), an invalid
    setting... A topic that exists already is no failure: another process may have
    created it meanwhile."""
    for topic, code, *message in topic_errors:
        if code in (0, TopicAlreadyExistsError.errno):
            continue
        error = for_code(code)
        detail = f": {message[0]}" if message and message[0] else ""
        raise error(f"topic {topic} was not created ({error.__name__}{detail})")


async def delete_topics(
    config: KafkaConfig | str, names: Iterable[str], timeout_s: float = DELETE_TIMEOUT_S
) -> list[str]:
    """Delete the topics ``names``, waiting at most ``timeout_s`` for the broker
    (``TimeoutError`` past it; a ``KafkaError`` where it cannot be reached). Returns the
    names that are gone: deleted, or absent already. A topic the broker refused to
    delete (no ``DELETE`` permission, say) is logged and left out. Both the embedded
    broker (Tansu 0.6) and Apache Kafka answer DeleteTopics."""
    config = as_config(config)
    wanted = list(dict.fromkeys(names))
    if not wanted:
        return []
    admin = new_admin(config, request_timeout_ms=max(1, int(timeout_s * 1000)))
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
            response = await admin.delete_topics(wanted, timeout_ms=int(timeout_s * 1000))
    finally:
        with contextlib.suppress(Exception):
            await admin.close()
    gone: list[str] = []
    for topic, code, *_ in response.topic_error_codes:
        if code in (0, UnknownTopicOrPartitionError.errno):  # deleted, or gone already
            gone.append(topic)
        else:
            log.warning(
                "the broker did not delete a topic",
                extra={"topic": topic, "error": for_code(code).__name__},
            )
    return gone


async def start_tail(consumer: AIOKafkaConsumer, *topics: str) -> None:
    """Start a groupless consumer on every partition of ``topics``, from their end:
    for readers of what happens from now on (replies, reports, hints), not of history.
    Positions are resolved before this returns: a lazy one would be taken at the first
    fetch, after a fast reply to an early request could already have landed."""
    await consumer.start()
    await consumer.topics()  # loads the metadata: the topics' partitions
    tps = [
        TopicPartition(topic, p)
        for topic in topics
        for p in sorted(consumer.partitions_for_topic(topic) or {0})
    ]
    consumer.assign(tps)
    await consumer.seek_to_end(*tps)
    for tp in tps:
        await consumer.position(tp)


async def close(client: AIOKafkaConsumer | AIOKafkaProducer) -> None:
    """Stop ``client`` within ``CLOSE_TIMEOUT_S``, else abandon it. A consumer's stop
    waits, with no bound, for its group coordination to finish — a join the broker is
    slow to answer, say (aio-libs/aiokafka#773) — and a stop must not hang with it. An
    abandoned consumer leaves its group by the session timeout, as a killed one does; a
    producer is closed only after every effect it carried was acknowledged (services
    commit nothing earlier), so abandoning it loses nothing committed."""
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await client.stop()
    except TimeoutError:
        log.warning(
            "kafka client did not close in time; abandoned",
            extra={"client": type(client).__name__, "timeout_s": CLOSE_TIMEOUT_S},
        )
