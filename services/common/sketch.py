"""Latency sketches on the wire (``schemas.LatencySketch``): built where requests finish,
merged where decisions are made.

One mapping for both ends (DDSketch's logarithmic mapping at
``SKETCH_RELATIVE_ACCURACY``): a sketch merges only with sketches of the same mapping,
and then a merge of per-second sketches answers a quantile over minutes within the same
relative accuracy as one sketch fed every value.
"""

from __future__ import annotations

from ddsketch.ddsketch import BaseDDSketch
from ddsketch.mapping import LogarithmicMapping
from ddsketch.store import DenseStore

from schemas import LatencySketch
from schemas.telemetry import SKETCH_MAX_KEY, SKETCH_RELATIVE_ACCURACY

MAPPING = LogarithmicMapping(SKETCH_RELATIVE_ACCURACY)


class SketchBuilder:
    """Values added one by one; ``wire()`` is what they make on the wire."""

    def __init__(self) -> None:
        self._bins: dict[int, int] = {}
        self._zero_count = 0

    def add(self, value_ms: float) -> None:
        """Count a value; one beyond the wire's keys (under a nanosecond, over 10^17 ms)
        counts in the outermost bin."""
        if value_ms > MAPPING.min_possible:
            key = max(-SKETCH_MAX_KEY, min(SKETCH_MAX_KEY, MAPPING.key(value_ms)))
            self._bins[key] = self._bins.get(key, 0) + 1
        else:
            self._zero_count += 1

    def wire(self) -> LatencySketch:
        return LatencySketch(bins=tuple(sorted(self._bins.items())), zero_count=self._zero_count)


def ddsketch_of(sketch: LatencySketch) -> BaseDDSketch:
    """The sketch as a ``DDSketch`` that merges with ``DDSketch(SKETCH_RELATIVE_ACCURACY)``
    (its sum, minimum and maximum are not carried: only quantiles and counts are read)."""
    store = DenseStore()
    for key, count in sketch.bins:
        if count:
            store.add(key, float(count))
    return BaseDDSketch(
        mapping=MAPPING,  # immutable: shared, not built again for every report
        store=store,
        negative_store=DenseStore(),
        zero_count=float(sketch.zero_count),
    )
