"""No record, whatever its bytes, stops a service of ``seawall up``; and a backlog that
built up while ingress was down is answered in full once it is back.

Hostile records: a hypothesis-drawn corpus on every topic the services consume — the
ingress topic, the three priority topics, a dispatch topic, telemetry, completions,
quota hints, control and a client's reply topic: random bytes, truncated and deeply
nested JSON, documents drawn from the JSON Schemas with fields of the wrong type,
unsupported schema versions, values of nearly 1 MB, reply topics that do not exist or
are no reply topic, and valid records answering to the test's own reply topic. Every
record is answered there or dead-lettered (by its topic, partition and offset) — but
quota hints, which every ingress reads and skips when invalid, and what is no reply on
the client's reply topic, which the client counts and skips; every service keeps its
process; a normal request is served afterwards."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from schemas import (
    AbortRequest,
    DeadLetter,
    DispatchedRequest,
    InferenceRequest,
    Priority,
    SamplingParams,
)
from schemas.export import JSON_DIR
from seawall_client import SeawallClient, signing
from seawall_client.serde import (
    COMPLETION,
    CONTROL,
    DISPATCH,
    HINT,
    INGRESS,
    REPLY,
    REQUEST,
    TELEMETRY,
    DecodeError,
    decode,
)
from seawall_client.topics import Topics
from services.common.bus import make_consumer, make_producer, topics_of
from services.common.settings import CommonSettings
from tests.fleet import ReplyReader
from tests.signing import headers_for, hop_of
from tests.stack import Stack
from tests.strategies import from_schema

SERVICES = ("ingress", "admission", "controller", "worker-main", "worker-small")
HUGE = 900_000
"""Under the broker's 1 MB limit, over what a dead letter copying it would fit in."""


@dataclass(frozen=True)
class Hostile:
    topic: str
    value: bytes
    answer: str | None
    """The request id whose terminal reply must reach the test's reply topic; ``None``:
    a dead letter is expected, unless ``silent``."""
    silent: bool = False
    """A valid record that is only applied (telemetry, control, a stray reply)."""
    headers: tuple[tuple[str, bytes], ...] = ()
    """Its record headers (the signature of what goes to the ingress topic)."""


def _schema(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((JSON_DIR / f"{name}.schema.json").read_text())
    return doc


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)


def _requests(topics: Topics, ours: str) -> st.SearchStrategy[dict[str, Any]]:
    """Requests drawn from the schema (most of them made valid across fields: one of
    prompt and messages, a deadline after creation), answering to a name the schema
    drew, to a reply topic nobody created, to the test's own reply topic (kept short: a
    handful of tokens) or to a topic that is no reply topic (the control topic)."""
    drawn = from_schema(_schema("InferenceRequest"))

    def aim(doc: dict[str, Any], where: str) -> dict[str, Any]:
        doc = {**doc, "request_id": f"h-{uuid.uuid4().hex[:16]}"}
        if doc.get("prompt") is not None or not doc.get("messages"):
            doc["messages"] = None
            doc["prompt"] = doc.get("prompt") or "hi"
        deadline = doc.get("deadline_at")
        if deadline is not None and deadline < doc["created_at"]:
            doc["deadline_at"] = None
        if where == "nobody":
            doc["reply_to"] = topics.reply(f"nobody-{uuid.uuid4().hex[:8]}")
        elif where == "ours":
            doc["reply_to"] = ours
            doc["sampling"] = {**doc.get("sampling", {}), "max_tokens": 4}
            doc["stream"] = False
        elif where == "foreign":
            doc["reply_to"] = topics.control
        return doc

    where = st.sampled_from(["drawn", "nobody", "ours", "ours", "ours", "foreign"])
    return st.tuples(drawn, where).map(lambda t: aim(*t))


def _garbage(template: bytes) -> st.SearchStrategy[bytes]:
    """Bytes a broken producer might send, built around a valid record ``template``."""
    doc = json.loads(template)
    return st.one_of(
        st.binary(max_size=256),
        st.integers(1, max(1, len(template) - 1)).map(lambda k: template[:k]),  # truncated
        st.integers(100, 50_000).map(lambda n: b"[" * n + b"]" * n),  # nested deeply
        st.tuples(st.sampled_from(sorted(doc)), _JSON).map(  # a field of the wrong type
            lambda kv: json.dumps({**doc, kv[0]: kv[1]}).encode()
        ),
        st.sampled_from([0, 2, 99, "1", None]).map(  # an unsupported schema version
            lambda v: json.dumps({**doc, "schema_version": v}).encode()
        ),
        _JSON.map(lambda v: json.dumps(v).encode()),
    )


class Corpus:
    """What goes to the ingress topic is signed with the key (``key``), but for a share
    left unsigned; expectations follow the ingress's rules: a record that does not prove
    its key, or whose body names another key, is dead-lettered. What goes to a priority
    or dispatch topic carries its hop's MAC (``settings``' keys: a broken producer that
    holds the secret), but for a share without: that share is skipped and counted, not
    dead-lettered (``services.common.hop_signing``)."""

    def __init__(
        self,
        topics: Topics,
        ours: str,
        sdk_topic: str,
        key: str,
        key_id: str,
        settings: CommonSettings,
    ):
        self.topics = topics
        self.ours = ours
        self.sdk_topic = sdk_topic
        self.key = key
        self.key_id = key_id
        self.records: list[Hostile] = []
        self.settings = settings
        self._hop_count = 0
        self.client_skips = 0
        """Records on the SDK's reply topic that are no reply: the client counts and
        skips them (its reply topic is its own; it writes no dead letters)."""
        self._count = 0

    def expect(self, topic: str, value: bytes, adapter: TypeAdapter[Any]) -> None:
        if topic == self.topics.quota_hints:  # every ingress reads it: skipped, counted
            self.records.append(Hostile(topic, value, None, silent=True))
            return
        headers: tuple[tuple[str, bytes], ...] = ()
        signed = False
        if hop_of(self.settings, topic) is not None:
            self._hop_count += 1
            if self._hop_count % 5 == 0:  # every fifth one without its MAC: skipped
                self.records.append(Hostile(topic, value, None, silent=True))
                return
            headers = tuple(headers_for(self.settings, topic, value) or ())
        if topic == self.topics.ingress:
            self._count += 1
            signed = self._count % 5 != 0  # every fifth one unsigned
            if signed:
                headers = tuple(signing.sign(self.key, self.key_id, value, time.time()))
        try:
            message = decode(adapter, value)
        except DecodeError:
            if topic == self.sdk_topic:
                self.client_skips += 1
                self.records.append(Hostile(topic, value, None, silent=True))
                return
            self.records.append(Hostile(topic, value, None, headers=headers))
            return
        if topic == self.topics.ingress and (not signed or message.api_key_id != self.key_id):
            self.records.append(Hostile(topic, value, None, headers=headers))
            return
        if isinstance(message, DispatchedRequest) and message.shadow_of is not None:
            # a shadow run answers nobody: its worker compares and counts it
            self.records.append(Hostile(topic, value, None, silent=True))
            return
        request = message.request if isinstance(message, DispatchedRequest) else message
        if isinstance(request, InferenceRequest):
            ours = request.reply_to == self.ours
            answer = request.request_id if ours else None
            self.records.append(Hostile(topic, value, answer, headers=headers))
        elif isinstance(request, AbortRequest):  # signed by its key: only sets a marker
            self.records.append(Hostile(topic, value, None, silent=True, headers=headers))
        else:  # telemetry, control events, replies: applied, answered by nobody
            self.records.append(Hostile(topic, value, None, silent=True, headers=headers))


def build_corpus(
    topics: Topics, ours: str, sdk_topic: str, key: str, key_id: str, settings: CommonSettings
) -> Corpus:
    corpus = Corpus(topics, ours, sdk_topic, key, key_id, settings)
    now = time.time()
    template = InferenceRequest(
        request_id="t",
        tenant="t",
        api_key_id=key_id,
        prompt="hello",
        sampling=SamplingParams(max_tokens=4),
        reply_to=ours,
        created_at=now,
    )
    request_bytes = template.model_dump_json().encode()
    dispatch_bytes = (
        DispatchedRequest(request=template, pool="main", admitted_at=now).model_dump_json().encode()
    )
    targets: list[tuple[str, TypeAdapter[Any], st.SearchStrategy[bytes]]] = []
    requests = _requests(topics, ours)
    ingress_docs = requests.map(lambda d: {**d, "api_key_id": key_id, "deadline_at": None})
    # aborts from a drawn key id (dead-lettered: no live key) or from the live one
    aborts = st.tuples(from_schema(_schema("AbortRequest")), st.booleans()).map(
        lambda t: {**t[0], "api_key_id": key_id} if t[1] else t[0]
    )
    targets.append(
        (
            topics.ingress,
            INGRESS,
            st.one_of(
                _garbage(request_bytes),
                ingress_docs.map(lambda d: json.dumps(d).encode()),
                aborts.map(lambda d: json.dumps(d).encode()),
            ),
        )
    )
    for p in Priority:
        targets.append(
            (
                topics.requests(p),
                REQUEST,
                st.one_of(_garbage(request_bytes), requests.map(lambda d: json.dumps(d).encode())),
            )
        )
    dispatched = st.tuples(from_schema(_schema("DispatchedRequest")), requests).map(
        lambda t: json.dumps({**t[0], "request": t[1]}).encode()
    )
    targets.append(
        (topics.dispatch("main"), DISPATCH, st.one_of(_garbage(dispatch_bytes), dispatched))
    )
    telemetry = st.one_of(
        *(
            from_schema(_schema(n)).map(lambda d: {**d, "pool": f"hostile-{d.get('pool', 'x')}"})
            for n in ("EngineStats", "GpuStats", "WorkerHeartbeat", "WorkerReport")
        )
    ).map(lambda d: json.dumps(d).encode())
    targets.append((topics.telemetry, TELEMETRY, st.one_of(_garbage(request_bytes), telemetry)))
    hints = from_schema(_schema("QuotaHint")).map(lambda d: json.dumps(d).encode())
    targets.append((topics.quota_hints, HINT, st.one_of(_garbage(request_bytes), hints)))
    completions = from_schema(_schema("RequestCompleted")).map(lambda d: json.dumps(d).encode())
    targets.append(
        (topics.completions, COMPLETION, st.one_of(_garbage(request_bytes), completions))
    )
    control = st.one_of(
        *(
            from_schema(_schema(n)).map(
                lambda d: {**d, "scope": f"pool:hostile-{uuid.uuid4().hex}"}
            )
            for n in ("BreakerState", "DegradationLevel", "TrafficSplit")
        )
    ).map(lambda d: json.dumps(d).encode())
    targets.append((topics.control, CONTROL, st.one_of(_garbage(request_bytes), control)))
    replies = st.one_of(*(from_schema(_schema(n)) for n in ("ReplyChunk", "InferenceReply"))).map(
        lambda d: json.dumps(d).encode()
    )
    targets.append((sdk_topic, REPLY, st.one_of(_garbage(request_bytes), replies)))

    for topic, adapter, strategy in targets:
        draw_into(corpus, topic, adapter, strategy)
        huge_string = json.loads(request_bytes)
        huge_string["prompt"] = "x" * HUGE  # far over the schema's 64 KiB of text
        corpus.expect(topic, json.dumps(huge_string).encode(), adapter)
        corpus.expect(topic, random.randbytes(HUGE), adapter)
    return corpus


def draw_into(
    corpus: Corpus, topic: str, adapter: TypeAdapter[Any], strategy: st.SearchStrategy[bytes]
) -> None:
    """Let hypothesis draw a topic's share of the corpus (a test run that collects)."""

    @settings(
        max_examples=18, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(strategy)
    def draw(value: bytes) -> None:
        corpus.expect(topic, value, adapter)

    draw()


async def produce_all(producer: AIOKafkaProducer, records: list[Hostile]) -> list[tuple[int, int]]:
    """Produce every record (in order per topic); their (partition, offset)."""
    futures = [
        await producer.send(r.topic, r.value, key=f"h{i % 7}".encode(), headers=list(r.headers))
        for i, r in enumerate(records)
    ]
    placed = await asyncio.gather(*futures)
    return [(m.partition, m.offset) for m in placed]


class LetterReader:
    """Every dead letter, by where its record was (topic, partition, offset)."""

    def __init__(self, stack: Stack) -> None:
        self._consumer = make_consumer(
            stack.settings, topics_of(stack.settings).deadletter, group_id=None
        )
        self.letters: dict[tuple[str, int, int], DeadLetter] = {}

    async def __aenter__(self) -> LetterReader:
        await self._consumer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._consumer.stop()

    async def poll(self, timeout_ms: int = 200) -> None:
        for records in (await self._consumer.getmany(timeout_ms=timeout_ms)).values():
            for r in records:
                letter = DeadLetter.model_validate_json(r.value)
                self.letters[(letter.source_topic, letter.partition, letter.offset)] = letter


async def controller_consuming(stack: Stack, reader: LetterReader, timeout_s: float = 60) -> None:
    """Wait until the controller reads telemetry: a group that starts for the first time
    begins at the end of the topic once it has its partitions (old telemetry is of no
    use to it), so what is produced before that is never read."""
    topics = topics_of(stack.settings)
    producer = make_producer(stack.settings)
    await producer.start()
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            placed = await producer.send_and_wait(
                topics.telemetry,
                b"probe",
                key=b"main",
                headers=headers_for(stack.settings, topics.telemetry, b"probe"),
            )
            for _ in range(5):
                await reader.poll(200)
                if (topics.telemetry, placed.partition, placed.offset) in reader.letters:
                    return
        raise AssertionError("the controller does not read telemetry")
    finally:
        await producer.stop()


def pids(stack: Stack) -> dict[str, int]:
    found = {}
    for name in SERVICES:
        found[name] = stack.service(name).pid
    return found


async def test_hostile_records_on_every_topic_are_answered_or_dead_lettered(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    topics = topics_of(stack.settings)
    key = stack.key("hostile-co", "enterprise")
    before = pids(stack)
    async with (
        # a reply topic of the key: the only kind a signed record may name
        ReplyReader(stack.settings, topics, f"{key['key_id']}.hostile-answers") as answers,
        SeawallClient(api_key=key["key"], kafka=stack.settings.kafka) as client,
        LetterReader(stack) as reader,
    ):
        await controller_consuming(stack, reader)
        corpus = build_corpus(
            topics, answers.topic, client.reply_topic, key["key"], key["key_id"], stack.settings
        )
        producer = make_producer(stack.settings, max_request_size=1_048_576)
        await producer.start()
        try:
            placed = await produce_all(producer, corpus.records)
        finally:
            await producer.stop()
        want_letters = {
            (r.topic, p, o)
            for r, (p, o) in zip(corpus.records, placed, strict=True)
            if r.answer is None and not r.silent
        }
        want_answers = {r.answer for r in corpus.records if r.answer is not None}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
            want_letters <= set(reader.letters)
            and want_answers <= set(answers.terminals)
            and client.stats.undecodable >= corpus.client_skips
        ):
            await reader.poll(100)
            await answers.poll(100)
        letters = reader.letters
        missing_letters = want_letters - set(letters)
        missing_answers = want_answers - set(answers.terminals)
        client_skipped = client.stats.undecodable
        # A normal request after all that.
        reply = await client.complete("still serving?", max_tokens=8, timeout_s=60)

    report = {
        "records": len(corpus.records),
        "by_topic": dict(Counter(r.topic.split(".", 1)[1] for r in corpus.records)),
        "dead_lettered": len(want_letters & set(letters)),
        "answered": len(want_answers & set(answers.terminals)),
        "applied_silently": sum(r.silent for r in corpus.records),
        "skipped_by_the_client": client_skipped,
        "letter_reasons": dict(Counter(lt.reason for lt in letters.values())),
        "largest_letter_excerpt": max((len(lt.excerpt) for lt in letters.values()), default=0),
    }
    with capsys.disabled():
        print("\nhostile records:", json.dumps(report))
    assert not missing_letters, (
        f"{len(missing_letters)} not dead-lettered: {sorted(missing_letters)[:5]}"
    )
    assert not missing_answers, (
        f"{len(missing_answers)} not answered: {sorted(missing_answers)[:5]}"
    )
    assert client_skipped == corpus.client_skips
    assert all(len(lt.excerpt) <= 4096 for lt in letters.values())
    assert pids(stack) == before, "a service restarted"
    assert reply.status.value == "ok"


BACKLOG = 10_000
"""Every one served (its tenant's contract holds them all): 20,000 took 80 s here,
twice what a suite under 15 minutes can spend on one test."""


async def test_a_backlog_built_while_ingress_was_down_is_answered_in_full(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    topics = topics_of(stack.settings)
    key = stack.key("backlog-co", "basic")
    # A contract the backlog fits in: the answers are the requests served, not a quota's
    # refusals (a basic tenant's bucket holds 20 requests).
    stack.cli(
        "quota", "set", "--tenant", "backlog-co", "--rps", "1000", "--burst", str(BACKLOG),
        "--tpm", "100000000", "--ttl", "3600", "--reason", "backlog test",
    )  # fmt: skip
    ingress = stack.service("ingress")
    async with ReplyReader(stack.settings, topics, f"{key['key_id']}.backlog") as answers:
        ingress.send_signal(signal.SIGSTOP)  # down: no heartbeat, no progress
        now = time.time()
        producer = make_producer(stack.settings, linger_ms=20)
        await producer.start()
        try:
            sends = []
            for i in range(BACKLOG):
                value = (
                    InferenceRequest(
                        request_id=f"bk-{i:05d}",
                        tenant="claimed",
                        api_key_id=key["key_id"],
                        prompt=f"backlog {i}",
                        sampling=SamplingParams(max_tokens=2),
                        reply_to=answers.topic,
                        created_at=now,
                        deadline_at=now + 600,
                    )
                    .model_dump_json()
                    .encode()
                )
                headers = signing.sign(key["key"], key["key_id"], value, now)
                sends.append(
                    await producer.send(
                        topics.ingress, value, key=f"s{i % 97}".encode(), headers=headers
                    )
                )
            await asyncio.gather(*sends)
        finally:
            await producer.stop()
        queued_at = time.monotonic()
        ingress.send_signal(signal.SIGKILL)  # and started again by `seawall up`
        ingress.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 240
        while len(answers.terminals) < BACKLOG and time.monotonic() < deadline:
            await answers.poll(500)
        took = time.monotonic() - queued_at
    outcomes = Counter(
        f"{t[0].status.value}/{t[0].reason.value}" for t in answers.terminals.values()
    )
    with capsys.disabled():
        print(
            f"\nbacklog: {BACKLOG} queued while ingress was down, "
            f"{len(answers.terminals)} answered {took:.0f} s after it was restarted: "
            f"{dict(outcomes)}"
        )
    assert set(answers.terminals) == {f"bk-{i:05d}" for i in range(BACKLOG)}
    assert outcomes["ok/none"] == BACKLOG, outcomes  # every one served, none refused
    assert stack.service("ingress").pid != ingress.pid
