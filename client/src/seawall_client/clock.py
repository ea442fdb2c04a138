"""The injected clock: policies take time from here (or as an argument), never from
``time`` directly, so that tests can run hours of policy in microseconds."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """Wall-clock epoch seconds (what goes on the wire)."""
        ...

    def monotonic(self) -> float:
        """Seconds from an arbitrary origin that never goes backwards (for durations)."""
        ...


class SystemClock:
    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._origin = start

    def time(self) -> float:
        return self._now

    def monotonic(self) -> float:
        return self._now - self._origin

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        self._now += seconds


SYSTEM_CLOCK = SystemClock()
