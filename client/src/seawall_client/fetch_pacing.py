"""How long a consumer's next fetch may wait at the broker: short while records flow,
long when the consumer is idle (pure; time is the caller's ``now``).

Apache Kafka answers a waiting fetch as soon as a record arrives; the embedded broker
(Tansu) does not: a fetch that finds nothing sleeps out its wait (half of it from
250 ms up) before it looks again, so a record that lands meanwhile waits with it.
Under a steady flow a consumer drains its partitions, its next fetch finds them empty,
and the records behind it pay a share of the wait: measured on the embedded broker,
one plain hop at 1,000 records/s had a p99 of 29 ms at a 50 ms wait and 14 ms with a
10 ms wait while records flow; at 100 records/s 28.5 against 6.6 ms. A short wait
for every consumer at all times costs the broker and the consumers a fetch per wait
even when idle (ten idle consumers: 1.1 cores at 5 ms, 0.28 at 50 ms), hence the two
waits: ``busy_ms`` for ``busy_window_s`` after the last fetch that brought records,
``idle_ms`` otherwise. A busy consumer then fetches at most ``1000 / busy_ms`` times a
second when the flow is sparse; an idle one as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final

BUSY_WINDOW_S: Final = 0.5
"""How long after the last records a consumer counts as busy."""


@dataclass(slots=True)
class FetchPacing:
    idle_ms: int
    """The wait when no records came for ``busy_window_s`` (the consumer's
    ``fetch_max_wait_ms``)."""
    busy_ms: int
    """The wait while records flow."""
    busy_window_s: float = BUSY_WINDOW_S
    _last_records: float = field(default=-math.inf, init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.busy_ms <= self.idle_ms:
            raise ValueError("the busy wait must lie within 1 ms and the idle wait")
        if not self.busy_window_s > 0:
            raise ValueError("busy_window_s must be positive")

    def wait_ms(self, got_records: bool, now: float) -> int:
        """The wait for the fetches after a read that did (or did not) bring records
        at ``now`` (a monotonic clock)."""
        if got_records:
            self._last_records = now
        return self.busy_ms if now - self._last_records < self.busy_window_s else self.idle_ms


LINGER_MARGIN_S: Final = 0.005
PEEK_S: Final = 5.0
"""How often a dormant consumer fetches of its own accord: a ring can be lost (Redis
unreachable, a producer that does not ring), and this bounds what that costs. Each
peek is two or three fetches; at 5 s, a dormant consumer costs the broker about half a
fetch a second against twenty at a 50 ms wait."""


@dataclass(slots=True)
class Dormancy:
    """When a consumer that a doorbell wakes fetches at all (pure; ``now`` monotonic).

    On a broker that answers a waiting fetch late (Tansu), the fetch wait is a trade:
    short, and every idle consumer polls the broker many times a second; long, and a
    record that lands during a wait waits with it. With a doorbell — its producers say
    when they have written (``services.common.doorbell``) — neither is needed: a
    consumer is *awake* (fetching, each fetch waiting ``awake_ms`` at most) for
    ``linger_s`` after its last records or ring, and *dormant* otherwise, with no fetch
    at the broker, until the next ring. A ring's records are then read by a fresh
    fetch, whose first look finds them. A dormant consumer still wakes every ``peek_s``
    by itself, so that a lost ring costs at most that."""

    awake_ms: int
    linger_s: float | None = None
    """How long a consumer stays awake after its last records or ring; by default the
    fetch wait and a margin: a ring that comes while a fetch begun before it waits at
    the broker keeps the consumer awake past that fetch's answer, so that a fetch begun
    after the ring follows, and finds the record; and records keep it fetching until a
    fetch finds none (a backlog is rung once)."""
    peek_s: float = PEEK_S
    _awake_until: float | None = field(default=None, init=False)
    """``None`` until the first read: a consumer starts awake, to catch up."""
    _asleep_since: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.awake_ms < 1:
            raise ValueError("awake_ms must be at least 1")
        if self.linger_s is None:
            self.linger_s = self.awake_ms / 1000 + LINGER_MARGIN_S
        if not (self.linger_s > 0 and self.peek_s > 0):
            raise ValueError("linger_s and peek_s must be positive")

    def woken(self, now: float) -> None:
        """A ring (or a peek): fetch for ``linger_s`` from ``now``."""
        assert self.linger_s is not None  # set in __post_init__
        self._awake_until = max(self._awake_until or now, now + self.linger_s)
        self._asleep_since = None

    def awake(self, got_records: bool, now: float) -> bool:
        """Whether to fetch now, after a read that did (or did not) bring records."""
        if got_records or self._awake_until is None:
            self.woken(now)
        assert self._awake_until is not None
        if now < self._awake_until:
            return True
        if self._asleep_since is None:
            self._asleep_since = now
        elif now >= self._asleep_since + self.peek_s:  # as next_look computes it
            self.woken(now)  # a peek
            return True
        return False

    def next_look(self) -> float:
        """When ``awake`` may answer otherwise (the linger's end, or the next peek)."""
        if self._awake_until is None:
            return -math.inf
        if self._asleep_since is None:
            return self._awake_until
        return self._asleep_since + self.peek_s
