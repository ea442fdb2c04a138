"""The async client SDK: post requests onto the ingress topic, await them on your own
reply topic.

    async with SeawallClient(api_key="sk-sw-…") as client:
        reply = await client.complete("Summarise this ticket: …", max_tokens=64)
        async for item in client.stream("Tell me a story", max_tokens=200):
            ...  # ReplyChunk items, then the terminal InferenceReply

- **Reply topic**: one per client instance, ``llm.reply.<key id>.<owner>``, created on
  start with one partition and one hour's retention (``Topics.reply_spec``); ingress
  sends replies only to reply topics of the key that signed the request. The client
  reads it from its end, so start the client before sending. While it runs, the client
  writes a heartbeat record to it every ``heartbeat_s``; ``stop`` (or leaving the
  ``async with`` block) deletes it, within ``delete_timeout_s``, unless a reply may
  still be on its way (a call was given up on within its deadline): a topic left
  behind — that one, or a killed client's — is deleted by ingress once nothing was
  written to it for hours (``seawall_client.reply_upkeep``). ``owner`` must be unique
  among the clients running at once: closing one deletes the topic under the others.
- **Identity**: every record is signed with the API key (``seawall_client.signing``:
  an HMAC in the record's headers; the key itself never travels) and names the key by
  its id; ingress takes the tenant, tier and priority from the key's record.
- **Exactly one terminal reply** per call: replies are matched by request id; chunks
  seen before and any record after the terminal reply (at-least-once upstream) are
  dropped and counted in ``stats.duplicates``.
- **Retries** (``seawall_client.retry``): retryable rejections are sent again as a new attempt
  with the id ``<request_id>.<n>`` (so that a late copy of an earlier attempt's
  rejection is never taken for the new attempt's answer), after backoff with full jitter
  on top of ``Retry-After``, within the retry budget and the request's deadline. A
  streamed request is not retried once a chunk reached the caller.
- **Timeouts and cancellation**: ``timeout_s`` bounds the whole call, retries included,
  and is sent as the request's deadline; the client waits ``reply_margin_s`` beyond it
  for the fleet's own ``expired`` answer. A call that times out (``TimeoutError``), is
  cancelled, or whose stream the caller abandons sends an ``AbortRequest``: admission
  answers the request ``cancelled`` instead of dispatching it, if it is still queued.
- ``SyncSeawallClient`` is the same for scripts, without ``async``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import uuid
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError

from schemas import (
    AbortRequest,
    ChatMessage,
    InferenceReply,
    InferenceRequest,
    SamplingParams,
)
from schemas.base import MAX_REQUEST_BYTES
from seawall_client import signing, tracecontext
from seawall_client.clock import SYSTEM_CLOCK, Clock
from seawall_client.kafka import (
    DELETE_TIMEOUT_S,
    KafkaConfig,
    close,
    ensure_topics,
    new_consumer,
    new_producer,
    start_tail,
)
from seawall_client.reply_upkeep import HEARTBEAT_S, beat, delete_own, is_heartbeat, keep_alive
from seawall_client.retry import RetryBudget, RetryPolicy, attempt_id, retry_after_s, retryable
from seawall_client.serde import REPLY, DecodeError, decode, encode
from seawall_client.streams import ReplyItem, ReplyRouterClosed, ReplyRoutes
from seawall_client.topics import Topics
from seawall_client.tracecontext import TraceContext

log = logging.getLogger(__name__)

T = TypeVar("T")
Messages = Sequence[ChatMessage | Mapping[str, str]]
READ_BACKOFF_CAP_S = 5.0


class RequestTooLarge(ValueError):
    """The request, encoded, is larger than the fleet accepts on any edge
    (``schemas.base.MAX_REQUEST_BYTES``): refused here rather than dead-lettered there,
    where its producer would never hear of it."""


@dataclass(slots=True)
class ClientStats:
    submitted: int = 0
    """Calls of ``complete``/``stream``: logical requests."""
    attempts: int = 0
    """Requests put on the ingress topic, retries included."""
    retries: int = 0
    terminal_replies: int = 0
    """Terminal replies handed to the caller: one per call that did not time out."""
    timeouts: int = 0
    aborted: int = 0
    """Abort requests sent (timeouts, cancellations, abandoned streams)."""
    duplicates: int = 0
    """Reply records dropped as repeats of what was already delivered."""
    undecodable: int = 0
    """Records on the reply topic that are not replies: skipped (and logged)."""


class SeawallClient:
    def __init__(
        self,
        *,
        api_key: str,
        kafka: KafkaConfig | None = None,
        owner: str | None = None,
        retry: RetryPolicy | None = None,
        timeout_s: float = 60.0,
        reply_margin_s: float = 2.0,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        rng: random.Random | None = None,
        clock: Clock = SYSTEM_CLOCK,
        heartbeat_s: float = HEARTBEAT_S,
        delete_reply_topic: bool = True,
        delete_timeout_s: float = DELETE_TIMEOUT_S,
    ) -> None:
        if heartbeat_s <= 0 or delete_timeout_s <= 0:
            raise ValueError("heartbeat_s and delete_timeout_s must be positive")
        self._kafka = kafka or KafkaConfig.from_env()
        self._topics = Topics(self._kafka.topic_prefix)
        key_id = signing.key_id_of(api_key)
        if key_id is None:
            raise ValueError("api_key is not a seawall API key (sk-sw-<key id>_<secret>)")
        self._key = api_key
        self._key_id = key_id
        self._owner = f"{key_id}.{owner or f'sdk-{uuid.uuid4().hex[:12]}'}"
        self._policy = retry or RetryPolicy()
        self._budget = RetryBudget(self._policy)
        self._timeout_s = timeout_s
        self._margin_s = reply_margin_s
        self._max_request_bytes = max_request_bytes
        self._rng = rng or random.Random()
        self._clock = clock
        self._stats = ClientStats()
        self._routes = ReplyRoutes(clock)
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._reader: asyncio.Task[None] | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._heartbeat_s = heartbeat_s
        self._delete_reply_topic = delete_reply_topic
        self._delete_timeout_s = delete_timeout_s
        self._topic_made = False
        """The reply topic was created (or found) by ``start``: ``stop`` deletes it."""
        self._longest_wait_s = timeout_s + reply_margin_s
        """The longest a call of this client waited (its timeout and the margin): how
        long after a call given up on its reply may still come."""

    @property
    def reply_topic(self) -> str:
        return self._topics.reply(self._owner)

    @property
    def running(self) -> bool:
        """Started, not stopped, and its reply topic still read."""
        return self._reader is not None and not self._reader.done()

    @property
    def stats(self) -> ClientStats:
        self._stats.duplicates = self._routes.counts["duplicate"]
        self._stats.undecodable = self._routes.counts["undecodable"]
        return self._stats

    async def start(self) -> None:
        """Create the reply topic, read it from its end, open the producer, write the
        first heartbeat. Idempotent."""
        if self._reader is not None:
            return
        k = self._kafka
        spec = self._topics.reply_spec(self._owner)
        try:
            await ensure_topics(k, [spec])
            self._topic_made = True
            self._consumer = new_consumer(k)
            await start_tail(self._consumer, spec.name)
            self._producer = new_producer(k)
            await self._producer.start()
            await beat(self._producer, spec.name)
        except BaseException:
            await self.stop()
            raise
        self._reader = asyncio.create_task(self._read(self._consumer), name="seawall-replies")
        self._keeper = asyncio.create_task(
            keep_alive(self._producer, spec.name, self._heartbeat_s), name="seawall-heartbeat"
        )

    async def stop(self) -> None:
        """Stop reading (open calls raise ``ReplyRouterClosed``), flush what is queued
        (aborts included), close, and delete the reply topic unless a reply may still
        come (module notes). Idempotent."""
        settled = self._routes.settled(self._longest_wait_s)
        reader, self._reader = self._reader, None
        keeper, self._keeper = self._keeper, None
        for task in (keeper, reader):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._routes.close_all("the client stopped")
        consumer, self._consumer = self._consumer, None
        producer, self._producer = self._producer, None
        if consumer is not None:
            await close(consumer)
        if producer is not None:
            await close(producer)
        made, self._topic_made = self._topic_made, False
        if made and self._delete_reply_topic:
            if settled:
                await delete_own(self._kafka, self.reply_topic, self._delete_timeout_s)
            else:
                log.info(
                    "reply topic kept: a reply may still come; the sweeper deletes it",
                    extra={"topic": self.reply_topic},
                )

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def _read(self, consumer: AIOKafkaConsumer) -> None:
        """Route every record of the reply topic; a record that is not a reply is
        skipped, a broker that is away is waited for (aiokafka reconnects)."""
        backoff_s = 0.1
        try:
            while True:
                try:
                    batches = await consumer.getmany(timeout_ms=1_000)
                except KafkaError as e:
                    log.warning("reply topic unreadable; retrying", extra={"error": repr(e)})
                    await asyncio.sleep(backoff_s)
                    backoff_s = min(2 * backoff_s, READ_BACKOFF_CAP_S)
                    continue
                backoff_s = 0.1
                for records in batches.values():
                    for record in records:
                        if not is_heartbeat(record.headers):
                            self._route(record.value, record.offset)
        except Exception:
            log.exception("the reply reader failed")
            self._routes.close_all("the client's reply reader failed")
            raise

    def _route(self, value: bytes | None, offset: int) -> None:
        try:
            item = decode(REPLY, value)
        except DecodeError as e:
            self._routes.counts["undecodable"] += 1
            log.warning(
                "unusable reply record skipped",
                extra={"topic": self.reply_topic, "offset": offset, "reason": e.reason},
            )
            return
        self._routes.route(item)

    async def complete(
        self, prompt: str | None = None, *, messages: Messages | None = None, **options: Any
    ) -> InferenceReply:
        """Send a request and return its terminal reply, whatever its status (a
        ``rejected`` one has used up its retries or is not retryable). Options: as
        ``stream``."""
        async for item in self._call(prompt, messages, stream=False, **options):
            if isinstance(item, InferenceReply):
                return item
        raise AssertionError("a call ends with its terminal reply")

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: Messages | None = None,
        **options: Any,
    ) -> AsyncIterator[ReplyItem]:
        """Send a streamed request: its ``ReplyChunk``s as they come, then its terminal
        ``InferenceReply``. Options: ``max_tokens``, ``temperature``, ``top_p``, ``stop``,
        ``seed``, ``session_id``, ``request_id``, ``timeout_s``, ``model``, ``pool``,
        ``traceparent`` (a ``tracecontext.TraceContext``: the servers record the
        request's stages under it, where they trace; every attempt carries it)."""
        return self._call(prompt, messages, stream=True, **options)

    async def _call(
        self,
        prompt: str | None,
        messages: Messages | None,
        *,
        stream: bool,
        request_id: str | None = None,
        timeout_s: float | None = None,
        session_id: str | None = None,
        model: str = "default",
        pool: str = "main",
        traceparent: TraceContext | None = None,
        **sampling: Any,
    ) -> AsyncIterator[ReplyItem]:
        producer = self._producer
        if producer is None or not self.running:
            raise ReplyRouterClosed("the client is not started")
        loop = asyncio.get_running_loop()
        timeout = self._timeout_s if timeout_s is None else timeout_s
        self._longest_wait_s = max(self._longest_wait_s, timeout + self._margin_s)
        deadline = loop.time() + timeout
        # The fleet answers a request it could not serve in time 'expired': wait a little
        # past the deadline for that answer rather than guess it.
        give_up_at = deadline + self._margin_s
        created = self._clock.time()
        base_id = request_id or uuid.uuid4().hex
        template = InferenceRequest(
            request_id=base_id,
            # Ingress replaces it with the key's tenant; the key id stands in until then.
            tenant=self._key_id,
            api_key_id=self._key_id,
            model=model,
            pool=pool,
            prompt=prompt,
            messages=None if messages is None else tuple(_message(m) for m in messages),
            sampling=SamplingParams(**sampling),
            stream=stream,
            reply_to=self.reply_topic,
            created_at=created,
            deadline_at=created + timeout,
            session_id=session_id,
        )
        first = template.model_copy(update={"request_id": attempt_id(base_id, 1)})
        if (size := len(encode(first))) > self._max_request_bytes:
            raise RequestTooLarge(
                f"the request is {size} bytes encoded, above the limit of {self._max_request_bytes}"
            )
        self._stats.submitted += 1
        self._budget.deposit()
        attempt = 1
        while True:
            request = template.model_copy(update={"request_id": attempt_id(base_id, attempt)})
            replies = self._routes.register(request.request_id)
            delivered = False
            finished = False
            try:
                await producer.send_and_wait(
                    self._topics.ingress,
                    value := encode(request),
                    key=request.partition_key.encode(),
                    headers=self._sign(value) + tracecontext.header(traceparent),
                )
                self._stats.attempts += 1
                while True:
                    async with asyncio.timeout_at(give_up_at):
                        item = await replies.next()
                    if isinstance(item, InferenceReply):
                        terminal = item
                        break
                    delivered = True
                    yield item
                finished = True
            except TimeoutError:
                self._stats.timeouts += 1
                raise
            finally:
                self._routes.unregister(request.request_id)
                if not finished:
                    # Timed out, cancelled, abandoned by the caller or the client stopped.
                    await self._abort(request)
            wait = self._policy.backoff_s(attempt, retry_after_s(terminal), self._rng)
            if (
                not delivered
                and retryable(terminal)
                and attempt < self._policy.max_attempts
                and loop.time() + wait < deadline
                and self._budget.withdraw(loop.time())
            ):
                self._stats.retries += 1
                attempt += 1
                await asyncio.sleep(wait)
                continue
            self._stats.terminal_replies += 1
            yield terminal
            return

    async def _abort(self, request: InferenceRequest) -> None:
        if self._producer is None or not self.running:
            return
        abort = AbortRequest(
            request_id=request.request_id,
            api_key_id=self._key_id,
            created_at=self._clock.time(),
            deadline_at=request.deadline_at,
        )
        # Queued, not awaited to the broker's ack: this may run while the caller is
        # being cancelled. Stopping the client flushes it.
        with contextlib.suppress(KafkaError):
            await self._producer.send(
                self._topics.ingress,
                value := encode(abort),
                key=request.partition_key.encode(),
                headers=self._sign(value),
            )
            self._stats.aborted += 1

    def _sign(self, value: bytes) -> list[tuple[str, bytes]]:
        return signing.sign(self._key, self._key_id, value, self._clock.time())


def _message(m: ChatMessage | Mapping[str, str]) -> ChatMessage:
    return m if isinstance(m, ChatMessage) else ChatMessage.model_validate(m)


class SyncSeawallClient:
    """``SeawallClient`` for scripts: blocking calls, the client's event loop on a
    thread of its own."""

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._client: SeawallClient | None = None

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _make(self) -> SeawallClient:
        return SeawallClient(**self._options)

    def start(self) -> None:
        if self._client is not None:
            return
        self._thread.start()
        self._client = self._run(self._make())
        self._run(self._client.start())

    def stop(self) -> None:
        if self._client is None or self._loop.is_closed():
            return
        try:
            self._run(self._client.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def complete(
        self, prompt: str | None = None, *, messages: Messages | None = None, **options: Any
    ) -> InferenceReply:
        assert self._client is not None, "start the client first (or use it in a with block)"
        return self._run(self._client.complete(prompt, messages=messages, **options))

    @property
    def stats(self) -> ClientStats:
        assert self._client is not None
        return self._client.stats

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
