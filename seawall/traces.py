"""Reading the spans the services wrote (``services.common.tracing``'s file sink):
one request's waterfall (``seawall trace``) and the stages of many (``seawall load``,
``bench/overhead.py``), with no tracing backend.

A request's spans share a trace id; the one to look for is found by the request id its
spans carry (``request_id``: ingress's ``X-Request-Id``, or the id a producer chose; a
retried SDK request's attempts are ``<id>.<n>``), or by its trace id.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path

from services.common.tracing import ROOT, STAGES, FinishedSpan, read_spans

Traces = dict[str, list[FinishedSpan]]


def traces_in(directory: Path, trace_ids: Collection[str] | None = None) -> Traces:
    """The spans in ``directory`` by trace id (only those of ``trace_ids`` if given),
    each trace's in start order."""
    found: Traces = defaultdict(list)
    for span in read_spans(directory):
        if trace_ids is None or span.trace_id in trace_ids:
            found[span.trace_id].append(span)
    for spans in found.values():
        spans.sort(key=lambda s: (s.start_ns, s.end_ns))
    return dict(found)


def traces_of(directory: Path, request_id: str) -> Traces:
    """The traces of a request: its trace id, or the request id its spans carry (and
    its SDK attempts, ``<id>.<n>``)."""
    ids: set[str] = set()
    spans = list(read_spans(directory))
    for span in spans:
        rid = span.attributes.get("request_id")
        if span.trace_id == request_id or (
            isinstance(rid, str) and (rid == request_id or rid.startswith(request_id + "."))
        ):
            ids.add(span.trace_id)
    found: Traces = defaultdict(list)
    for span in spans:
        if span.trace_id in ids:
            found[span.trace_id].append(span)
    for group in found.values():
        group.sort(key=lambda s: (s.start_ns, s.end_ns))
    return dict(found)


def waterfall(spans: Sequence[FinishedSpan], width: int = 40) -> list[str]:
    """One line per span: its start after the trace's first, its duration, a bar on a
    common scale, where it ran and its name (indented by depth)."""
    if not spans:
        return []
    t0 = min(s.start_ns for s in spans)
    t1 = max(s.end_ns for s in spans)
    scale = max(t1 - t0, 1)
    by_id = {s.span_id: s for s in spans}

    def depth(span: FinishedSpan) -> int:
        d, parent = 0, span.parent_id
        while parent is not None and parent in by_id and d < 16:
            d, parent = d + 1, by_id[parent].parent_id
        return d

    lines = [f"{'start ms':>9} {'dur ms':>8}  {'':{width}}  stage"]
    for s in spans:
        a = min(width - 1, int((s.start_ns - t0) / scale * width))
        b = min(width, max(a + 1, math.ceil((s.end_ns - t0) / scale * width)))
        bar = " " * a + "█" * (b - a) + " " * (width - b)
        extra = _attributes(s.attributes)
        lines.append(
            f"{(s.start_ns - t0) / 1e6:9.1f} {s.duration_ms:8.1f}  {bar}  "
            f"{'  ' * depth(s)}{s.name}{extra}"
        )
    return lines


def _attributes(attributes: Mapping[str, object]) -> str:
    shown = {k: v for k, v in attributes.items() if k != "request_id"}
    return "  " + " ".join(f"{k}={v}" for k, v in shown.items()) if shown else ""


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def stage_quantiles(traces: Iterable[Sequence[FinishedSpan]]) -> dict[str, dict[str, float]]:
    """Per stage (``STAGES`` order, then the root), the p50 and p99 of its duration in
    ms over the traces that have it, and how many did (``n``). A stage a trace went
    through twice (a retried attempt, a second generation) counts each time."""
    durations: defaultdict[str, list[float]] = defaultdict(list)
    for spans in traces:
        for s in spans:
            durations[s.name].append(s.duration_ms)
    out: dict[str, dict[str, float]] = {}
    for name in (*STAGES, ROOT):
        values = durations.get(name)
        if values:
            out[name] = {
                "p50": round(_quantile(values, 0.5), 2),
                "p99": round(_quantile(values, 0.99), 2),
                "n": len(values),
            }
    return out


def stage_table(stages: Mapping[str, Mapping[str, float]]) -> list[str]:
    """The breakdown as aligned text lines."""
    lines = [f"{'stage':<28}{'p50 ms':>9}{'p99 ms':>9}{'n':>7}"]
    for name, q in stages.items():
        lines.append(f"{name:<28}{q['p50']:>9.1f}{q['p99']:>9.1f}{int(q['n']):>7}")
    return lines
