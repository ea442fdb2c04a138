"""Alerts: de-duplication by fingerprint, grouping of bursts, re-notification after a
hold. Pure: no I/O, time is what the caller passes as ``now``.

Level-triggered, like the rest of the controller: at every evaluation the caller hands
``AlertBook.reconcile`` every condition that holds now (``Condition``), and the book
works out what changed:

- a condition not firing in the book *fires*: a record to publish (``Alert``, status
  ``firing``) and a notification, unless the same fingerprint was notified firing less
  than ``renotify_s`` ago — a flapping condition counts up (``Alert.count``) instead of
  paging again;
- a condition still holding keeps its alert firing: ``last_seen`` moves, the record is
  re-published every ``republish_s`` (readers trust it for ``valid_for_s``), and it is
  notified again every ``renotify_s``;
- an alert whose condition is gone *resolves*: a record, and a notification if its
  firing was notified. One that resolves while its firing notification still waits in
  its group is never notified at all (a blip shorter than ``group_wait_s``).

Notifications of the same (rule, pool, status) wait ``group_wait_s`` from the first of
them and go out as one ``Notification`` (``due``): twenty workers of a pool tripping
within seconds are one message listing twenty scopes, not twenty messages.

An instance owns only some pools (the controller scales out by pool): conditions of the
pools it owns are all it can see, so ``reconcile`` resolves only alerts of pools the
caller says it owns, and drops without a word those of pools it no longer owns (their
new owner raises them again).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from schemas import Alert, Evidence
from schemas.alerts import AlertRule, AlertStatus, Severity


@dataclass(frozen=True)
class AlertConfig:
    group_wait_s: float = 10.0
    """How long the first notification of a group waits for others to join it."""
    renotify_s: float = 3600.0
    """A firing alert is notified again after this long; a fingerprint notified firing
    less than this long ago is not notified again when it re-fires (flapping)."""
    republish_s: float = 30.0
    """A firing alert's record is re-published this often (level-triggered)."""
    valid_for_s: float = 120.0
    """How long a reader may trust a firing record without a re-publication."""
    forget_after_s: float = 86_400.0
    """A resolved alert is forgotten this long after it resolved (then the same condition
    starts a new ``first_seen`` and ``count``)."""

    def __post_init__(self) -> None:
        for name in ("group_wait_s", "renotify_s", "republish_s", "valid_for_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.republish_s >= self.valid_for_s:
            raise ValueError("republish_s must be below valid_for_s (readers would drop it)")


@dataclass(frozen=True)
class Condition:
    """Something that holds now and deserves an operator's attention."""

    rule: AlertRule
    scope: str
    pool: str | None
    severity: Severity
    summary: str
    evidence: Evidence


@dataclass(frozen=True)
class Notification:
    """One message for a group of alerts of the same rule, pool and status."""

    rule: AlertRule
    pool: str | None
    status: AlertStatus
    alerts: tuple[Alert, ...]
    at: float

    @property
    def severity(self) -> Severity:
        order: dict[Severity, int] = {"info": 0, "warning": 1, "critical": 2}
        return max((a.severity for a in self.alerts), key=order.__getitem__)


def fingerprint(rule: str, scope: str) -> str:
    """The same for every alert of one (rule, scope), different otherwise."""
    return hashlib.sha256(f"{rule}\0{scope}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Reconciled:
    records: list[Alert]
    """To publish, in order: changes and re-publications."""
    changes: list[Alert]
    """Of those, the alerts that fired, resolved or changed severity (worth a log line)."""


@dataclass
class _Tracked:
    alert: Alert
    published_at: float
    notified_firing_at: float | None = None
    """When a firing notification of this fingerprint last went out."""
    episode_notified: bool = False
    """Whether the current firing was notified (then its resolution is too)."""
    waiting: bool = False
    """Whether its firing notification waits in a group (not sent yet)."""


GroupKey = tuple[AlertRule, str | None, AlertStatus]


@dataclass
class _Group:
    since: float
    alerts: dict[str, Alert] = field(default_factory=dict)


class AlertBook:
    def __init__(self, config: AlertConfig | None = None) -> None:
        self.config = config or AlertConfig()
        self._tracked: dict[str, _Tracked] = {}
        self._groups: dict[GroupKey, _Group] = {}

    def active(self) -> list[Alert]:
        """The alerts firing now."""
        return [t.alert for t in self._tracked.values() if t.alert.status == "firing"]

    def reconcile(
        self,
        conditions: Iterable[Condition],
        now: float,
        owned: Callable[[str | None], bool] = lambda pool: True,
    ) -> Reconciled:
        """Bring the book in line with ``conditions`` (everything that holds now in the
        pools ``owned`` says this caller owns); return the records to publish."""
        cfg = self.config
        out: list[Alert] = []
        changes: list[Alert] = []
        holding: set[str] = set()
        for c in conditions:
            fp = fingerprint(c.rule, c.scope)
            if fp in holding:
                continue
            holding.add(fp)
            tracked = self._tracked.get(fp)
            if tracked is None or tracked.alert.status == "resolved":
                out.append(self._fire(fp, c, tracked, now))
                changes.append(out[-1])
                continue
            before = tracked.alert
            tracked.alert = before.model_copy(
                update={
                    "last_seen": now,
                    "severity": c.severity,
                    "summary": c.summary,
                    "evidence": c.evidence,
                }
            )
            if before.severity != c.severity:
                changes.append(tracked.alert)
            if before.severity != c.severity or now - tracked.published_at >= cfg.republish_s:
                tracked.published_at = now
                out.append(tracked.alert)
            last = tracked.notified_firing_at
            if not tracked.waiting and (last is None or now - last >= cfg.renotify_s):
                self._queue(fp, tracked, now)
        for fp, tracked in list(self._tracked.items()):
            alert = tracked.alert
            if not owned(alert.pool):
                self._unqueue(fp, alert)
                del self._tracked[fp]
            elif alert.status == "firing" and fp not in holding:
                out.append(self._resolve(fp, tracked, now))
                changes.append(out[-1])
            elif alert.status == "resolved" and now - alert.last_seen > cfg.forget_after_s:
                del self._tracked[fp]
        return Reconciled(out, changes)

    def due(self, now: float) -> list[Notification]:
        """The groups whose wait is over, as one notification each (oldest first)."""
        ready = [
            (key, group)
            for key, group in self._groups.items()
            if now - group.since >= self.config.group_wait_s
        ]
        notes: list[Notification] = []
        for key, group in sorted(ready, key=lambda kg: kg[1].since):
            del self._groups[key]
            rule, pool, status = key
            alerts: list[Alert] = []
            for fp, queued in group.alerts.items():
                tracked = self._tracked.get(fp)
                if status == "firing" and tracked is not None:
                    tracked.waiting = False
                    tracked.notified_firing_at = now
                    tracked.episode_notified = True
                    queued = tracked.alert  # as it stands now (last_seen, evidence)
                alerts.append(queued)
            notes.append(Notification(rule, pool, status, tuple(alerts), now))
        return notes

    # -- transitions -----------------------------------------------------------
    def _fire(self, fp: str, c: Condition, tracked: _Tracked | None, now: float) -> Alert:
        alert = Alert(
            rule=c.rule,
            scope=c.scope,
            pool=c.pool,
            severity=c.severity,
            status="firing",
            fingerprint=fp,
            first_seen=now if tracked is None else tracked.alert.first_seen,
            last_seen=now,
            count=1 if tracked is None else min(2**31, tracked.alert.count + 1),
            valid_for_s=self.config.valid_for_s,
            summary=c.summary,
            evidence=c.evidence,
        )
        # A resolution not sent yet is taken back: to whoever heard of the firing, it
        # simply went on (and this episode's own resolution will be sent).
        taken_back = tracked is not None and self._unqueue(fp, tracked.alert)
        if tracked is None:
            tracked = self._tracked[fp] = _Tracked(alert, now)
        else:
            tracked.alert, tracked.published_at = alert, now
        tracked.episode_notified = taken_back
        last = tracked.notified_firing_at
        if not taken_back and (last is None or now - last >= self.config.renotify_s):
            self._queue(fp, tracked, now)
        return alert

    def _resolve(self, fp: str, tracked: _Tracked, now: float) -> Alert:
        resolved = tracked.alert.model_copy(update={"status": "resolved", "last_seen": now})
        if tracked.waiting:  # a firing notification not sent: it never will be
            self._unqueue(fp, tracked.alert)
            tracked.waiting = False
        if tracked.episode_notified:  # whoever heard of the firing hears of this
            self._group(resolved, now).alerts[fp] = resolved
        tracked.alert, tracked.published_at = resolved, now
        tracked.episode_notified = False
        return resolved

    def _queue(self, fp: str, tracked: _Tracked, now: float) -> None:
        self._group(tracked.alert, now).alerts[fp] = tracked.alert
        tracked.waiting = True

    def _unqueue(self, fp: str, alert: Alert) -> bool:
        """Take ``fp`` out of the groups waiting; whether it was in one."""
        found = False
        statuses: tuple[AlertStatus, ...] = ("firing", "resolved")
        for status in statuses:
            key = (alert.rule, alert.pool, status)
            group = self._groups.get(key)
            if group is not None and group.alerts.pop(fp, None) is not None:
                found = True
                if not group.alerts:
                    del self._groups[key]
        return found

    def _group(self, alert: Alert, now: float) -> _Group:
        key = (alert.rule, alert.pool, alert.status)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(now)
        return group
