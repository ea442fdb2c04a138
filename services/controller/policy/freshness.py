"""Is a worker's report current, or a backlog read late? Judged without comparing two
hosts' clocks.

A report's ``at`` is the worker's clock, ``now`` the controller's; the two may differ by
any amount, so ``now - at`` says nothing by itself. What does: the *difference* of two
such delays. ``WorkerClock`` keeps an *anchor* — the (``at``, ``now``) pair of the
least delayed report seen — and a report's age is its delay beyond the anchor's:

    age = (now - anchor_now) - (at - anchor_at)

(each difference within one clock). A report more than ``max_age_s`` older than that is
stale (a backlog after the controller was down, or a record that waited long in a
partition) and is not counted as what happens now.

- The anchor moves to any report less delayed than it (``age <= 0``: the minimum
  filter, as NTP takes its best sample), and to the latest current report once it is
  ``refresh_s`` old, so that the two clocks' rates drifting apart never add up.
- A worker's clock that steps (NTP correcting it) makes its live reports look old or
  new by the step. Looking new is harmless (the anchor moves to them); looking old
  would blind the controller to it. So a run of stale reports that has lasted longer
  than ``max_age_s`` of the controller's own time, and that came at the pace the
  worker wrote them (its clock advanced at most ``LIVE_PACE`` times as much as the
  controller's over the run — a backlog is read much faster than it was written), is
  live after all: re-anchored.
- The first report of a worker the controller has never heard of is current (there is
  nothing to compare it with); the anchor is kept in the worker's record, so a
  restarted controller still judges the backlog it reads first. The record is written
  again only once the anchor's delay has moved more than ``SAVE_TOLERANCE`` of
  ``max_age_s`` from the saved one (``moved_from``): the minimum filter finds a report
  a few milliseconds less delayed ever more rarely (about 1/n after n reports), but
  each used to rewrite the record: one changelog record for every 2 reports in a
  worker's second second, one for every 18 in its twentieth (reports read 5-55 ms late
  at random, in-process). A controller restarted on a saved anchor that far off judges
  a report at most that much older or younger than it is.

Pure: no I/O, times passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

LIVE_PACE = 1.5
SAVE_TOLERANCE = 0.01
"""A moved anchor is saved once its delay differs from the saved one's by more than
this share of ``max_age_s`` (0.3 s at the default 30 s)."""


def delay_of(anchor: tuple[float, float] | None) -> float | None:
    """An anchor's delay as the two clocks read it (``now - at``): only differences of
    delays mean anything (the module docstring)."""
    return None if anchor is None else anchor[1] - anchor[0]


@dataclass
class WorkerClock:
    max_age_s: float
    refresh_s: float = 300.0
    anchor_at: float | None = None
    """The anchor's ``at`` (the worker's clock)."""
    anchor_now: float | None = None
    """When the controller read the anchor (its own clock)."""
    stale_since: float | None = None
    """When the current run of stale reports began (the controller's clock) ..."""
    stale_from_at: float | None = None
    """... and the first of them was written (the worker's)."""

    @property
    def anchor(self) -> tuple[float, float] | None:
        if self.anchor_at is None or self.anchor_now is None:
            return None
        return self.anchor_at, self.anchor_now

    def moved_from(self, saved: tuple[float, float] | None) -> bool:
        """Whether the anchor is worth saving over ``saved`` (the anchor last saved):
        there is one and its delay differs from ``saved``'s by more than
        ``SAVE_TOLERANCE`` of ``max_age_s``."""
        delay, before = delay_of(self.anchor), delay_of(saved)
        if delay is None:
            return False
        return before is None or abs(delay - before) > SAVE_TOLERANCE * self.max_age_s

    def age(self, at: float, now: float) -> float | None:
        """How much more delayed than the anchor a report is (``None``: no anchor)."""
        if self.anchor_at is None or self.anchor_now is None:
            return None
        return (now - self.anchor_now) - (at - self.anchor_at)

    def current(self, at: float, now: float) -> bool:
        """Judge one report (and move the anchor as the module says); False: stale."""
        age = self.age(at, now)
        if age is None or age <= 0:
            self._anchor(at, now)
            return True
        if age <= self.max_age_s:
            self.stale_since = self.stale_from_at = None
            assert self.anchor_now is not None
            if now - self.anchor_now >= self.refresh_s:
                self._anchor(at, now)
            return True
        if self.stale_since is None or self.stale_from_at is None:
            self.stale_since, self.stale_from_at = now, at
            return False
        lasted = now - self.stale_since
        if lasted > self.max_age_s and at - self.stale_from_at <= LIVE_PACE * lasted:
            self._anchor(at, now)  # live reports all along: the worker's clock stepped
            return True
        return False

    def _anchor(self, at: float, now: float) -> None:
        self.anchor_at, self.anchor_now = at, now
        self.stale_since = self.stale_from_at = None
