"""Recorded runs: the fleet's telemetry, the control decisions and the per-request
outcomes of a time range, read from their topics into one JSON-lines file
(``seawall record``), for ``seawall replay`` to feed through the controller's core.

The format, version 1 — one JSON object per line:

- the first line, the header: ``{"seawall_recording": 1, "created_at", "since",
  "until", "topic_prefix", "topics": {kind: topic}}``;
- then one line per record, in the order of the broker's timestamps: ``{"t": <the
  record's timestamp, seconds>, "kind": "telemetry" | "control" | "completion",
  "value": <the record, as on the wire>}``;
- the last line, the footer: ``{"end": true, "records": {kind: n}, "skipped":
  {kind: n}, "truncated": bool}``.

What is recorded is what those topics carry: readings, decisions with their evidence,
and per request its timings, status, class, tenant, pool and worker — never a prompt or
a reply's text (none of these topics holds any). A record that does not decode is
skipped and counted. The file is bounded (``max_bytes``): past it, recording stops and
the footer says ``truncated``.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from pydantic import TypeAdapter

from schemas import ControlEvent, RequestCompleted, TelemetryEvent
from seawall.reading import catch_up_consumer, partitions, read_to_end, seek_since
from seawall_client.serde import COMPLETION, CONTROL, TELEMETRY, DecodeError, decode
from services.common.bus import topics_of
from services.common.settings import CommonSettings

FORMAT_VERSION = 1
Kind = Literal["telemetry", "control", "completion"]
KINDS: tuple[Kind, ...] = ("telemetry", "control", "completion")
_ADAPTERS: dict[Kind, TypeAdapter[Any]] = {
    "telemetry": TELEMETRY,
    "control": CONTROL,
    "completion": COMPLETION,
}


@dataclass(frozen=True)
class Entry:
    t: float
    kind: Kind
    value: TelemetryEvent | ControlEvent | RequestCompleted


@dataclass
class Recording:
    header: dict[str, Any]
    entries: list[Entry] = field(default_factory=list)
    footer: dict[str, Any] = field(default_factory=dict)

    def of(self, kind: Kind) -> Iterator[Entry]:
        return (e for e in self.entries if e.kind == kind)


def read_recording(path: Path) -> Recording:
    """A recording file, every record decoded with the wire models. Raises ``ValueError``
    naming the line for anything else (``OSError`` for a file that cannot be read)."""
    with path.open(encoding="utf-8") as f:
        number = 1
        try:
            header = json.loads(f.readline())
            if not isinstance(header, dict) or header.get("seawall_recording") != FORMAT_VERSION:
                raise ValueError(f"not a seawall recording of version {FORMAT_VERSION}")
            recording = Recording(header)
            for number, line in enumerate(f, start=2):  # noqa: B007  (named in the error)
                doc = json.loads(line)
                if doc.get("end"):
                    recording.footer = doc
                    break
                kind: Kind = doc["kind"]
                value = _ADAPTERS[kind].validate_python(doc["value"])
                recording.entries.append(Entry(float(doc["t"]), kind, value))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}, line {number}: {str(e)[:300]}") from None
    return recording


async def _read_range(
    settings: CommonSettings, topic: str, since_ms: int, until_ms: int, timeout_s: float
) -> list[tuple[int, bytes | None]]:
    """Every record of ``topic`` with a timestamp in [since, until] that was there when
    reading began: (timestamp in ms, value)."""
    consumer = catch_up_consumer(settings)
    out: list[tuple[int, bytes | None]] = []
    try:
        async with asyncio.timeout(timeout_s):
            await consumer.start()
            tps = partitions(consumer, topic)
            consumer.assign(tps)
            await seek_since(consumer, tps, since_ms)
            async for _, r in read_to_end(consumer, tps):
                if since_ms <= r.timestamp <= until_ms:
                    out.append((r.timestamp, r.value))
    finally:
        await consumer.stop()
    out.sort(key=lambda item: item[0])  # the partitions, merged by time
    return out


@dataclass
class RecordSummary:
    records: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    truncated: bool = False
    bytes: int = 0


async def record(
    settings: CommonSettings,
    out: IO[str],
    *,
    since: float,
    until: float,
    max_bytes: int,
    timeout_s: float = 120.0,
) -> RecordSummary:
    """Write the recording of [since, until] (epoch seconds) to ``out``."""
    topics = topics_of(settings)
    names: dict[Kind, str] = {
        "telemetry": topics.telemetry,
        "control": topics.control,
        "completion": topics.completions,
    }
    since_ms, until_ms = int(since * 1000), int(until * 1000)
    ranges = await asyncio.gather(
        *(_read_range(settings, names[k], since_ms, until_ms, timeout_s) for k in KINDS)
    )
    header = {
        "seawall_recording": FORMAT_VERSION,
        "created_at": time.time(),
        "since": since,
        "until": until,
        "topic_prefix": settings.topic_prefix,
        "topics": names,
    }
    summary = RecordSummary()
    summary.bytes += out.write(json.dumps(header) + "\n")
    merged = heapq.merge(
        *(
            [(ts, kind, value) for ts, value in found]
            for kind, found in zip(KINDS, ranges, strict=True)
        ),
        key=lambda item: item[0],
    )
    for ts, kind, value in merged:
        try:
            decode(_ADAPTERS[kind], value)  # only what decodes, checked as the services do
        except DecodeError:
            summary.skipped[kind] += 1
            continue
        assert value is not None
        # a record's JSON as it was (a raw newline can only be whitespace between tokens)
        text = value.decode().replace("\n", " ").replace("\r", " ")
        line = f'{{"t":{ts / 1000},"kind":"{kind}","value":{text}}}\n'
        if summary.bytes + len(line) > max_bytes:
            summary.truncated = True
            break
        summary.bytes += out.write(line)
        summary.records[kind] += 1
    footer = {
        "end": True,
        "records": dict(summary.records),
        "skipped": dict(summary.skipped),
        "truncated": summary.truncated,
    }
    summary.bytes += out.write(json.dumps(footer) + "\n")
    return summary
