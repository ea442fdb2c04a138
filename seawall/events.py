"""``seawall events``: the controller's decisions, for operators.

Reads the control topic from the beginning with no consumer group (it changes nothing
on the broker), applies the rule every consumer applies (per ``<kind>/<scope>`` the
highest ``seq`` wins, see ``services.common.control_state``) and prints each decision as it
was made, with its evidence. Re-publications of a decision already in force (same
decision, higher ``seq``) and stale duplicates are not printed again. Once caught up it
shows the decisions in force; ``follow`` keeps printing new decisions until Ctrl-C.
"""

from __future__ import annotations

import asyncio
import fnmatch
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Protocol, get_args

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from schemas import (
    BatchLimit,
    BreakerState,
    CanaryRelease,
    ControlEvent,
    DegradationLevel,
    Evidence,
    Profile,
    QuotaOverride,
    RegionThrottle,
    TrafficSplit,
)
from seawall.reading import catch_up_consumer
from seawall_client.serde import CONTROL, DecodeError, decode
from services.common.bus import topics_of
from services.common.control_signing import ControlKeysMissing, ControlVerifier, verifier_for
from services.common.control_state import ControlState, in_force
from services.common.settings import CommonSettings

_KIND_TYPES: tuple[type[ControlEvent], ...] = get_args(get_args(ControlEvent)[0])
KINDS: tuple[str, ...] = tuple(str(t.model_fields["kind"].default) for t in _KIND_TYPES)
_REPUBLICATION_FIELDS = {"seq", "valid_for_s"}


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _number(value: float) -> str:
    return f"{value:.4g}"


def _rate(value: float | None) -> str:
    return "-" if value is None else _number(value)


def describe(event: ControlEvent) -> str:
    """The decided state in a few words."""
    text: str
    if isinstance(event, BreakerState):
        text = event.state
        if event.state != "closed" or event.level:
            text += f" level={event.level.name}"
        if event.tripped:
            text += f" tripped={','.join(event.tripped)}"
        if event.state == "half_open":
            text += f" probes={event.probe_requests}"
        return text
    if isinstance(event, DegradationLevel):
        text = f"level {event.level}"
        if event.small_pool is not None:
            text += f" small_pool={event.small_pool}"
        if event.max_tokens_cap is not None:
            text += f" max_tokens_cap={event.max_tokens_cap}"
        return text
    if isinstance(event, BatchLimit):
        return f"limit {event.limit}"
    if isinstance(event, TrafficSplit):
        weights = " ".join(f"{v}={_number(w)}" for v, w in sorted(event.weights.items()))
        if event.phase is None:
            return f"pool {event.pool}: {weights}"
        step = f" step {event.step + 1}" if event.phase == "ramping" else ""
        return f"pool {event.pool}: canary {event.version} {event.phase}{step}, {weights}"
    if isinstance(event, CanaryRelease):
        steps = ",".join(_number(100 * s) for s in event.steps)
        return (
            f"pool {event.pool}: {event.action} canary {event.version} (release "
            f"{event.release}, steps {steps} %, hold {_number(event.hold_s)} s)"
        )
    if isinstance(event, Profile):
        where = f": {event.path}" if event.path else ""
        return f"profile {event.worker_id} for {_number(event.seconds)} s {event.status}{where}"
    if isinstance(event, RegionThrottle):
        if event.rate_per_s is None:
            return f"region {event.region}: lifted"
        return f"region {event.region}: {_number(event.rate_per_s)}/s"
    assert isinstance(event, QuotaOverride)
    text = (
        f"tenant {event.tenant}: requests/s {_rate(event.requests_per_s)}, "
        f"tokens/s {_rate(event.tokens_per_s)}, burst {_rate(event.burst)}"
    )
    if event.expires_at is not None:
        text += f", until {_when(event.expires_at)}"
    return text


def _numbers(values: dict[str, float]) -> str:
    return " ".join(f"{k}={_number(v)}" for k, v in values.items())


def evidence_text(evidence: Evidence) -> str:
    """Everything the evidence says after its reason, on one line."""
    parts = [f"window {_number(evidence.window_s)}s"]
    if evidence.hold_s is not None:
        parts.append(f"held {_number(evidence.hold_s)}s")
    if evidence.metrics:
        parts.append(f"metrics {_numbers(evidence.metrics)}")
    if evidence.thresholds:
        parts.append(f"thresholds {_numbers(evidence.thresholds)}")
    if evidence.previous is not None:
        parts.append(f"was {evidence.previous}")
    return " · ".join(parts)


def expired(event: ControlEvent, now: float) -> bool:
    """Past its ``valid_for_s`` without a re-publication: the controller may be gone,
    and the services have dropped it (``services.common.control_state``)."""
    return not in_force(event, now)


def format_event(event: ControlEvent) -> str:
    """A decision as two lines of rich markup: what and when, then the evidence."""
    head = (
        f"[dim]{_when(event.issued_at)}[/] [bold]{escape(event.control_key)}[/] "
        f"{escape(describe(event))} [dim]seq={event.seq} by {escape(event.issuer)}[/]"
    )
    reason = escape(event.evidence.reason or "(no reason given)")
    return f"{head}\n    {reason} [dim]({escape(evidence_text(event.evidence))})[/]"


class EventView:
    """The tail's state, without I/O: feed it records, print what it returns."""

    def __init__(
        self,
        scope: str | None = None,
        kind: str | None = None,
        verifier: ControlVerifier | None = None,
    ) -> None:
        """``kind``: one kind, or several separated by commas; ``verifier``: what the
        followers check signatures with (``None``: signatures off)."""
        self.scope = scope
        self.verifier = verifier
        self.kinds = None if kind is None else frozenset(kind.split(","))
        self.state = ControlState(in_force_only=False)
        self.invalid = 0
        self.refused = 0

    def matches(self, event: ControlEvent) -> bool:
        if self.kinds is not None and event.kind not in self.kinds:
            return False
        return self.scope is None or fnmatch.fnmatchcase(event.scope, self.scope)

    def feed(
        self, raw: bytes | None, headers: Sequence[tuple[str, bytes]] | None = None
    ) -> str | None:
        """The markup to print for a record: a new decision that passes the filters, or
        one the followers refuse (its signature); ``None`` for re-publications, stale
        duplicates and filtered-out events."""
        try:
            event = decode(CONTROL, raw)
        except DecodeError as e:
            self.invalid += 1
            return f"[yellow]skipped a record that is not a control event ({escape(e.reason)})[/]"
        refusal = None if self.verifier is None else self.verifier.check(raw or b"", headers, event)
        if refusal is not None:
            self.refused += 1
            if not self.matches(event):
                return None
            return (
                f"[red]refused {escape(event.control_key)} claiming issuer "
                f"{escape(event.issuer)} ({refusal}): the followers ignore it[/]"
            )
        current = self.state.get(type(event), event.scope)
        if not self.state.apply(event):
            return None
        if current is not None and current.model_dump(
            exclude=_REPUBLICATION_FIELDS
        ) == event.model_dump(exclude=_REPUBLICATION_FIELDS):
            return None
        return format_event(event) if self.matches(event) else None

    def summary(self, now: float) -> Table:
        """The decisions in force."""
        events = sorted(
            (e for kind in _KIND_TYPES for e in self.state.all(kind) if self.matches(e)),
            key=lambda e: e.control_key,
        )
        table = Table(title=f"decisions in force ({len(events)})", title_justify="left")
        for column in ("key", "state", "decided", "valid until", "reason"):
            table.add_column(column, overflow="fold")
        for e in events:
            until = _when(e.issued_at + e.valid_for_s)
            valid = f"[red]{until} (expired)[/]" if expired(e, now) else until
            table.add_row(
                escape(e.control_key),
                escape(describe(e)),
                _when(e.issued_at),
                valid,
                escape(e.evidence.reason),
            )
        return table


class TopicView(Protocol):
    def feed(
        self, raw: bytes | None, headers: Sequence[tuple[str, bytes]] | None = None
    ) -> str | None: ...

    def summary(self, now: float) -> Table: ...


async def tail(
    settings: CommonSettings, topic: str, view: TopicView, follow: bool, console: Console
) -> int:
    """Feed ``view`` every record of ``topic`` from its start, print what it returns, and
    its summary once caught up; with ``follow``, go on until interrupted. The exit status:
    0 done, 1 no broker or no such topic."""
    consumer = catch_up_consumer(settings)
    try:
        await consumer.start()
    except KafkaError as e:
        console.print(f"[red]no broker at {escape(settings.kafka_bootstrap)}[/]: {escape(str(e))}")
        return 1
    try:
        if topic not in await consumer.topics():
            console.print(
                f"[red]no topic {escape(topic)}[/] on {escape(settings.kafka_bootstrap)} "
                "(is the stack up? check SEAWALL_KAFKA_BOOTSTRAP and SEAWALL_TOPIC_PREFIX)"
            )
            return 1
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        caught_up = False
        while True:
            batches = await consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for record in records:
                    line = view.feed(record.value, record.headers)
                    if line is not None:
                        console.print(line, highlight=False)
            positions = [await consumer.position(tp) for tp in tps]
            if not caught_up and all(p >= end[tp] for p, tp in zip(positions, tps, strict=True)):
                caught_up = True
                console.print(view.summary(time.time()))
                if not follow:
                    return 0
    finally:
        await consumer.stop()


def run_events(
    settings: CommonSettings, scope: str | None, kind: str | None, follow: bool, console: Console
) -> int:
    """Print the control topic's decisions (``scope`` may be a glob such as
    ``worker:*``); the exit status: 0 done, 1 no broker or no control topic, 2 an
    unknown kind."""
    unknown = [k for k in (kind or "").split(",") if kind is not None and k not in KINDS]
    if unknown:
        console.print(f"[red]unknown kind {escape(unknown[0])!r}[/]; kinds: {', '.join(KINDS)}")
        return 2
    try:
        topic = topics_of(settings).control
        try:
            view = EventView(scope, kind, verifier_for(settings))
        except ControlKeysMissing as e:
            console.print(f"[red]{escape(str(e))}[/]")
            return 1
        return asyncio.run(tail(settings, topic, view, follow, console))
    except KeyboardInterrupt:
        return 0
