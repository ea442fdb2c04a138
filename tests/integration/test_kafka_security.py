"""TLS and SASL on real brokers: what ``KafkaConfig``'s security settings do on the
wire.

The embedded broker (Tansu 0.6.0) cannot serve TLS itself (SECURITY.md, "The embedded
broker"): its ``--cert`` and ``--key`` options refuse to be given together, and the TLS
acceptor it would build is never used. So the TLS tests put a TLS terminator in front of
a real Tansu, as a TLS-terminating load balancer would stand in front of a cluster:
Python's ``ssl`` (OpenSSL) serves the test CA's certificate for ``127.0.0.1`` and passes
the decrypted bytes on to the broker, which advertises the terminator's address, so
every connection a client makes after the bootstrap comes back through TLS too. What is
tested is the client side: that a client built from the settings speaks verified TLS,
and that clients without it, without trust in the CA, or connecting by a name the
certificate does not carry, get nowhere.

The SASL test runs Tansu with ``--authentication``, which works up to a point: no SCRAM
user can exist there (its credential store drops what it is given), so it shows the
exchange the broker answers, not a login; ``test_kafka_sasl`` shows the logins, against
a SASL front (``tests.sasl_proxy``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiokafka.conn import ScramAuthenticator
from aiokafka.errors import KafkaConnectionError

from seawall import embedded
from seawall.procs import ChildProcess
from seawall_client import SeawallClient
from seawall_client.kafka import (
    KafkaConfig,
    ensure_topics,
    new_admin,
    new_producer,
)
from seawall_client.topics import TopicSpec
from services.common.bus import wait_for_broker
from services.controller.faust_app import build_app
from services.controller.settings import ControllerSettings
from tests.pki import Pki, make_pki
from tests.relays import RelayServer, pipe, read_one, write_one

API_KEY = "sk-sw-0123456789ab_" + "S" * 43


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@contextlib.contextmanager
def tansu(work: Path, *flags: str, advertised_port: int | None = None) -> Iterator[int]:
    """A real embedded broker on a free port (its port), with ``flags`` added to its
    command line; it advertises ``advertised_port`` where one is given."""
    port = embedded.free_port()
    listener = f"tcp://127.0.0.1:{port}"
    advertised = f"tcp://127.0.0.1:{advertised_port or port}"
    argv = [
        embedded.broker_binary(),
        "broker",
        "--listener-url",
        listener,
        "--advertised-listener-url",
        advertised,
        "--storage-engine",
        "memory://tansu/",
        *flags,
    ]
    proc = ChildProcess("broker", argv, work / "broker.log", env={"CLUSTER_ID": "seawall"})
    proc.start()
    try:
        deadline = time.monotonic() + 30
        while not embedded.port_in_use("127.0.0.1", port):
            if time.monotonic() > deadline or not proc.alive:
                pytest.fail(f"the embedded broker did not start:\n{proc.tail()}")
            time.sleep(0.05)
        yield port
    finally:
        proc.stop()


class TlsTerminator(RelayServer):
    """Serves TLS on ``port`` with ``context`` and relays each connection, decrypted,
    to the broker on ``upstream``. Counts the handshakes it completed."""

    def __init__(self, port: int, upstream: int, context: ssl.SSLContext) -> None:
        super().__init__(port, context)
        self.upstream = upstream
        self.handshakes = 0

    async def relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.handshakes += 1  # the server calls back once the handshake succeeded
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


def server_context(pki: Pki, *, client_ca: Path | None = None) -> ssl.SSLContext:
    """The terminator's TLS: the test CA's server certificate; with ``client_ca``, a
    client certificate that CA signed is required too."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pki.server_cert, pki.server_key)
    if client_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(client_ca)
    return context


@contextlib.asynccontextmanager
async def tls_broker(
    work: Path, pki: Pki, *, client_ca: Path | None = None
) -> AsyncIterator[TlsTerminator]:
    """A real embedded broker reachable through TLS only on the terminator's port."""
    port = embedded.free_port()
    with tansu(work, advertised_port=port) as upstream:
        async with TlsTerminator(port, upstream, server_context(pki, client_ca=client_ca)) as t:
            yield t


def ssl_env(port: int, pki: Pki) -> dict[str, str]:
    return {
        "SEAWALL_KAFKA_BOOTSTRAP": f"127.0.0.1:{port}",
        "SEAWALL_KAFKA_IDEMPOTENCE": "false",  # the embedded broker has no producer ids
        "SEAWALL_KAFKA_SECURITY_PROTOCOL": "SSL",
        "SEAWALL_KAFKA_SSL_CAFILE": str(pki.ca),
    }


async def refused_start(config: KafkaConfig) -> None:
    """Start a producer from ``config``: it must fail to bootstrap."""
    producer = new_producer(config, request_timeout_ms=5_000)
    try:
        with pytest.raises(KafkaConnectionError, match="Unable to bootstrap"):
            await producer.start()
    finally:
        await producer.stop()


async def test_tls_settings_from_env_carry_a_record_through_a_verified_tls_connection(
    tmp_path: Path, pki: Pki
) -> None:
    async with tls_broker(tmp_path, pki) as terminator:
        config = KafkaConfig.from_env(ssl_env(terminator.port, pki))
        await wait_for_broker(config, timeout_s=30)
        topic = f"secure-{uuid.uuid4().hex[:8]}"
        assert await ensure_topics(config, [TopicSpec(topic, 1)]) == [topic]
        await write_one(config, topic, b"over tls", b"k")
        record = await read_one(config, topic)
        assert (record.key, record.value) == (b"k", b"over tls")
        assert terminator.handshakes >= 2  # every client came through TLS


async def test_a_client_without_tls_gets_nowhere(tmp_path: Path, pki: Pki) -> None:
    async with tls_broker(tmp_path, pki) as terminator:
        await refused_start(KafkaConfig(bootstrap=f"127.0.0.1:{terminator.port}"))
        assert terminator.handshakes == 0


async def test_a_client_that_does_not_trust_the_ca_refuses_the_broker(
    tmp_path: Path, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """Neither a client trusting another CA nor one trusting only the system's store
    accepts the broker's certificate; aiokafka logs OpenSSL's reason."""
    caplog.set_level(logging.ERROR, logger="aiokafka")
    async with tls_broker(tmp_path, pki) as terminator:
        env = ssl_env(terminator.port, pki)
        for cafile in (str(pki.other_ca), ""):
            caplog.clear()
            await refused_start(KafkaConfig.from_env({**env, "SEAWALL_KAFKA_SSL_CAFILE": cafile}))
            assert "certificate verify failed: unable to get local issuer" in caplog.text
        assert terminator.handshakes == 0


async def test_a_broker_reached_by_a_name_its_certificate_lacks_is_refused(
    tmp_path: Path, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """The certificate names 127.0.0.1 only: reached as ``localhost``, the hostname
    check fails although the CA is trusted."""
    caplog.set_level(logging.ERROR, logger="aiokafka")
    async with tls_broker(tmp_path, pki) as terminator:
        env = ssl_env(terminator.port, pki)
        await refused_start(
            KafkaConfig.from_env({**env, "SEAWALL_KAFKA_BOOTSTRAP": f"localhost:{terminator.port}"})
        )
        assert "IP address mismatch" in caplog.text or "Hostname mismatch" in caplog.text


async def test_a_client_certificate_is_presented_where_the_broker_requires_one(
    tmp_path: Path, pki: Pki
) -> None:
    async with tls_broker(tmp_path, pki, client_ca=pki.ca) as terminator:
        env = ssl_env(terminator.port, pki)
        with_cert = KafkaConfig.from_env(
            {
                **env,
                "SEAWALL_KAFKA_SSL_CERTFILE": str(pki.client_cert),
                "SEAWALL_KAFKA_SSL_KEYFILE": str(pki.client_key),
            }
        )
        admin = new_admin(with_cert)
        try:
            await admin.start()
            assert isinstance(await admin.list_topics(), list)
        finally:
            await admin.close()
        await refused_start(KafkaConfig.from_env(env))


async def test_the_sdk_reads_the_tls_settings_from_its_environment(
    tmp_path: Path, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SeawallClient`` with no ``KafkaConfig`` of its own: its reply topic is created,
    read and written to through TLS, as the environment says."""
    async with tls_broker(tmp_path, pki) as terminator:
        env = ssl_env(terminator.port, pki)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("SEAWALL_TOPIC_PREFIX", f"t{uuid.uuid4().hex[:8]}.")
        client = SeawallClient(api_key=API_KEY)
        await client.start()
        try:
            assert client.running
            config = KafkaConfig.from_env(env)
            admin = new_admin(config)
            try:
                await admin.start()
                assert client.reply_topic in await admin.list_topics()
            finally:
                await admin.close()
        finally:
            await client.stop()
        assert terminator.handshakes >= 3  # the admin, the reader, the producer


async def test_the_controllers_faust_producer_writes_through_tls(tmp_path: Path, pki: Pki) -> None:
    """faust builds its own aiokafka clients; given ``broker_credentials`` from the same
    settings (``faust_app.build_app``), its producer speaks verified TLS too."""
    async with tls_broker(tmp_path, pki) as terminator:
        env = ssl_env(terminator.port, pki)
        settings = ControllerSettings(
            kafka_bootstrap=env["SEAWALL_KAFKA_BOOTSTRAP"],
            kafka_idempotence=False,
            kafka_security_protocol="SSL",
            kafka_ssl_cafile=str(pki.ca),
            topic_prefix=f"t{uuid.uuid4().hex[:8]}.",
        )
        topic = f"{settings.topic_prefix}faust"
        await ensure_topics(settings.kafka, [TopicSpec(topic, 1)])
        app = build_app(settings, tmp_path / "faust")
        await app.producer.start()
        try:
            await app.producer.send_and_wait(topic, b"k", b"from faust", None, None, None)
        finally:
            await app.producer.stop()
        record = await read_one(settings.kafka, topic)
        assert record.value == b"from faust"


async def test_scram_is_answered_by_the_embedded_broker_but_finds_no_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``--authentication``, Tansu 0.6.0 drops a client that does not authenticate,
    and runs the SCRAM-SHA-512 exchange with one configured for SASL_PLAINTEXT: it sends
    its salt and iteration count, then ends the exchange with RFC 5802's
    ``e=unknown-user``, because its credential store (dynostore) keeps no SCRAM user.
    aiokafka 0.14 has no branch for a server error there and raises ``KeyError('v')``
    while looking for the server's signature. So this shows that the settings drive a
    real SCRAM exchange, not that a login succeeds: none can on this broker."""
    server_messages: list[str] = []
    first, final = (
        ScramAuthenticator.process_server_first_message,
        ScramAuthenticator.process_server_final_message,
    )

    def on_first(self: ScramAuthenticator, message: str) -> None:
        server_messages.append(message)
        first(self, message)

    def on_final(self: ScramAuthenticator, message: str) -> None:
        server_messages.append(message)
        final(self, message)

    monkeypatch.setattr(ScramAuthenticator, "process_server_first_message", on_first)
    monkeypatch.setattr(ScramAuthenticator, "process_server_final_message", on_final)
    with tansu(tmp_path, "--authentication") as port:
        await refused_start(KafkaConfig(bootstrap=f"127.0.0.1:{port}"))
        assert server_messages == []

        config = KafkaConfig.from_env(
            {
                "SEAWALL_KAFKA_BOOTSTRAP": f"127.0.0.1:{port}",
                "SEAWALL_KAFKA_IDEMPOTENCE": "false",
                "SEAWALL_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
                "SEAWALL_KAFKA_SASL_USERNAME": "svc-seawall",
                "SEAWALL_KAFKA_SASL_PASSWORD": "pw",
            }
        )
        assert config.sasl_mechanism == "SCRAM-SHA-512"
        producer = new_producer(config, request_timeout_ms=5_000)
        try:
            with pytest.raises(KeyError, match="'v'"):
                await producer.start()
        finally:
            await producer.stop()
    server_first, server_final = server_messages
    fields = dict(pair.split("=", 1) for pair in server_first.split(","))
    assert set(fields) == {"r", "s", "i"}  # nonce, salt, iterations
    assert int(fields["i"]) >= 4096
    assert server_final == "e=unknown-user"
