"""The ingress service: the HTTP front (uvicorn, run in-process), the Kafka ingress and
the reply router, sharing one producer, one Redis client and one pipeline.

Start: topics, producer, reply router (its topic ``llm.reply.ingress-<instance id>`` is
created then, kept alive by a heartbeat and deleted at stop; one a killed instance left
behind is swept), the reply-topic sweeper (``reply_sweeper``), the quota hint feed
(admission's "over quota until T", refused here without a hop), Kafka ingress, then the
HTTP listener, last, so that nothing is accepted before it can be answered.

Stop (SIGTERM): the listener first — uvicorn stops accepting and lets in-flight
requests finish within the grace period while the router still delivers their
replies — then the Kafka ingress (finishes and commits its batch), the sweeper, the
router (which deletes its topic), the producer, Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

from seawall_client.clock import SYSTEM_CLOCK, Clock
from seawall_client.kafka import close, ensure_topics
from seawall_client.topics import RedisKeys
from services.common.bus import make_producer, topics_of
from services.common.deadletters import DeadLetters
from services.common.delivery import Replies, TopicDirectory
from services.common.lifecycle import Component
from services.common.redisclient import make_redis
from services.ingress.arrivals import ArrivalReporter
from services.ingress.denials import DenialAudit, FailureLimiter
from services.ingress.hint_feed import HintFeed
from services.ingress.http import create_app
from services.ingress.kafka_ingress import KafkaIngress
from services.ingress.keystore import AuditLog, KeyStore
from services.ingress.pipeline import IngressPipeline
from services.ingress.replies import ReplyRouter
from services.ingress.reply_sweeper import ReplyTopicSweeper
from services.ingress.settings import IngressSettings, safe_name
from services.ingress.websocket import WebSocketSessions

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: ``run_until_signalled`` owns the
    signals, and stops the server through ``IngressService.stop``."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class IngressService(Component):
    name = "ingress"

    def __init__(self, settings: IngressSettings, clock: Clock = SYSTEM_CLOCK) -> None:
        super().__init__()
        self.settings = settings
        self.topics = topics_of(settings)
        instance = safe_name(settings.instance_id)
        self._producer = make_producer(settings)
        self._redis = make_redis(settings)
        dead_letters = DeadLetters(
            self._producer, self.topics.deadletter, f"ingress:{instance}", clock
        )
        self.router = ReplyRouter(
            settings,
            f"ingress-{instance}",
            dead_letters=dead_letters,
            clock=clock,
            producer=self._producer,
            heartbeat_s=settings.reply_heartbeat_s,
            reply_due_s=settings.default_deadline_s + settings.reply_margin_s,
            delete_timeout_s=settings.reply_delete_timeout_s,
        )
        self.sweeper = (
            ReplyTopicSweeper(
                settings.kafka,
                self.topics,
                RedisKeys(settings.redis_prefix),
                self._redis,
                holder=instance,
                every_s=settings.reply_sweep_s,
                idle_s=settings.reply_idle_s,
                max_deletions=settings.reply_sweep_max_deletions,
                keep=(self.router.topic,),
                delete_timeout_s=settings.reply_delete_timeout_s,
                clock=clock,
            )
            if settings.reply_sweep
            else None
        )
        actor = f"ingress:{instance}"
        self.keystore = KeyStore(
            self._redis,
            RedisKeys(settings.redis_prefix),
            settings.pepper,
            AuditLog(self._producer, self.topics.audit, actor, clock),
            default_sensitive=settings.default_sensitive_policy,
            clock=clock,
            cache_s=settings.key_cache_s,
        )
        self.denials = DenialAudit(
            self._producer,
            self.topics.audit,
            actor,
            FailureLimiter(settings.denial_audit_per_s, settings.denial_audit_burst),
            clock,
        )
        self.pipeline = IngressPipeline(
            settings, self.keystore, self.denials, self._producer, self.topics, self._redis, clock
        )
        replies = Replies(self._producer, self.topics, TopicDirectory(self._producer, clock=clock))
        # Built only where it runs: its consumer is made with it, and one never started
        # is never closed.
        self.kafka = (
            KafkaIngress(settings, self.pipeline, replies, dead_letters, self.topics, clock)
            if settings.kafka_ingress
            else None
        )
        self.hint_feed = HintFeed(settings, self.topics.quota_hints, self.pipeline.hints, clock)
        self.arrivals = ArrivalReporter(
            self.pipeline.arrivals, self._producer, self.topics.arrivals, instance
        )
        self.websockets = WebSocketSessions(self.pipeline, self.router, self._redis, clock)
        self.app = create_app(
            self.pipeline, self.router, self._ready, clock, websocket=self.websockets.serve
        )
        self._server: _Server | None = None
        self._http: asyncio.Task[Any] | None = None
        self._socket: socket.socket | None = None

    def _ready(self) -> bool:
        return self.running and self.router.running and (self.kafka is None or self.kafka.running)

    @property
    def port(self) -> int:
        """The port HTTP listens on (the one picked when configured as 0)."""
        if self._socket is None:
            raise RuntimeError("the service is not started")
        port: int = self._socket.getsockname()[1]
        return port

    async def on_start(self) -> None:
        s = self.settings
        if s.dev_pepper:
            log.warning("SEAWALL_DEV_MODE without a pepper: using the development pepper")
        await ensure_topics(s.kafka, self.topics.specs())
        await self.pipeline.screener.start()
        await self._producer.start()
        await self.denials.start()
        await self.router.start()
        self.spawn(self._watch(self.router), "watch:router")
        if self.sweeper is not None:
            await self.sweeper.start()  # not watched: ingress serves without it
        await self.hint_feed.start()
        self.spawn(self._watch(self.hint_feed), "watch:hints")
        await self.arrivals.start()
        self.spawn(self._watch(self.arrivals), "watch:arrivals")
        if self.kafka is not None:
            await self.kafka.start()
            self.spawn(self._watch(self.kafka), "watch:kafka")
        self._socket = socket.create_server((s.ingress_host, s.ingress_port))
        config = uvicorn.Config(
            self.app,
            host=s.ingress_host,
            port=self.port,
            log_config=None,
            access_log=False,
            lifespan="off",
            # uvicorn would otherwise replace the TCP peer with X-Forwarded-For's last
            # entry whenever the peer is in FORWARDED_ALLOW_IPS (127.0.0.1 and ::1 by
            # default, anything an environment sets): a second, count-based trust that
            # lets a local client forge its address. The peer stays the peer; only
            # SEAWALL_TRUSTED_PROXIES decides whom X-Forwarded-For is believed from
            # (``admit.source_of``).
            proxy_headers=False,
            timeout_graceful_shutdown=math.ceil(s.shutdown_grace_s),
            timeout_keep_alive=math.ceil(s.http_keep_alive_s),
            ws_ping_interval=s.ws_ping_s,
            ws_ping_timeout=s.ws_ping_s,
            # A frame is one request: one over the limit is answered with an error
            # frame (``websocket``); one past four times the limit closes the socket.
            ws_max_size=4 * s.max_request_bytes,
        )
        server = self._server = _Server(config)
        http = self._http = self.spawn(server.serve(sockets=[self._socket]), "http")
        while not server.started:
            if http.done():
                raise RuntimeError("the HTTP server did not start") from http.exception()
            await asyncio.sleep(0.01)
        log.info(
            "ingress serving",
            extra={
                "http": f"{s.ingress_host}:{self.port}",
                "reply_topic": self.router.topic,
                "kafka_ingress": s.kafka_ingress,
            },
        )

    @staticmethod
    async def _watch(part: Component) -> None:
        """Fail with a part: the process exits and its supervisor restarts it."""
        await part.failed.wait()
        raise RuntimeError(f"{part.name} failed") from part.failure

    async def on_stop(self) -> None:
        try:
            if self._server is not None and self._http is not None:
                self._server.should_exit = True
                await asyncio.wait({self._http}, timeout=self.settings.shutdown_grace_s + 5)
            if self.kafka is not None:
                await self.kafka.stop()
            await self.arrivals.stop()
            await self.hint_feed.stop()
            if self.sweeper is not None:
                await self.sweeper.stop()
            await self.router.stop()
            await self.denials.stop()
        finally:
            await self.pipeline.screener.close()
            await close(self._producer)
            await self._redis.aclose()
            if self._socket is not None:
                self._socket.close()
