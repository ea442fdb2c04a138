"""The alert book: what is published, what is notified, and when."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import Alert, Evidence
from schemas.alerts import AlertRule
from services.controller.policy.alerts import (
    AlertBook,
    AlertConfig,
    Condition,
    Notification,
    fingerprint,
)

pytestmark = pytest.mark.unit

CFG = AlertConfig(group_wait_s=10, renotify_s=600, republish_s=30, valid_for_s=120)


def cond(
    scope: str = "worker:w1", rule: AlertRule = "breaker_open", pool: str = "main"
) -> Condition:
    return Condition(rule, scope, pool, "warning", f"{rule} on {scope}", Evidence(reason="test"))


def test_a_condition_fires_once_and_is_notified_after_the_group_wait() -> None:
    book = AlertBook(CFG)
    out = book.reconcile([cond()], 0.0)
    (fired,) = out.records
    assert out.changes == [fired]
    assert (fired.status, fired.count, fired.first_seen) == ("firing", 1, 0.0)
    assert fired.fingerprint == fingerprint("breaker_open", "worker:w1")
    assert book.due(9.9) == []
    assert book.reconcile([cond()], 5.0).records == []  # still holding: nothing new to publish
    (note,) = book.due(10.0)
    assert (note.rule, note.pool, note.status) == ("breaker_open", "main", "firing")
    assert [a.last_seen for a in note.alerts] == [5.0]  # as it stands when sent
    assert book.due(100.0) == []
    assert [a.scope for a in book.active()] == ["worker:w1"]


def test_a_burst_in_one_pool_is_one_notification() -> None:
    book = AlertBook(CFG)
    book.reconcile([cond(f"worker:w{i}") for i in range(3)], 0.0)
    book.reconcile([cond(f"worker:w{i}") for i in range(20)], 4.0)
    breakers = [cond(f"worker:w{i}") for i in range(20)] + [cond("pool:main")]
    book.reconcile(breakers, 6.0)
    book.reconcile([*breakers, *(cond(f"worker:w{i}", "degradation") for i in range(2))], 7.0)
    (burst,) = book.due(12.0)  # everything that joined within the first one's wait
    assert len(burst.alerts) == 21
    assert burst.alerts[-1].scope == "pool:main"
    assert book.due(16.0) == []
    (other_rule,) = book.due(17.0)  # another rule is another group
    assert other_rule.rule == "degradation"


def test_a_blip_shorter_than_the_group_wait_is_published_but_never_notified() -> None:
    book = AlertBook(CFG)
    book.reconcile([cond()], 0.0)
    (resolved,) = book.reconcile([], 3.0).records
    assert (resolved.status, resolved.last_seen) == ("resolved", 3.0)
    assert book.due(60.0) == []
    assert book.active() == []


def test_resolution_is_notified_after_a_notified_firing() -> None:
    book = AlertBook(CFG)
    book.reconcile([cond()], 0.0)
    book.due(10.0)
    book.reconcile([], 20.0)
    assert book.due(25.0) == []
    (note,) = book.due(30.0)
    assert note.status == "resolved"
    assert note.alerts[0].status == "resolved"


def test_flapping_counts_up_instead_of_paging_again() -> None:
    book = AlertBook(CFG)
    book.reconcile([cond()], 0.0)
    assert len(book.due(10.0)) == 1
    book.reconcile([], 20.0)
    (again,) = book.reconcile([cond()], 25.0).records  # the resolution had not gone out yet
    assert (again.count, again.first_seen) == (2, 0.0)
    assert book.due(40.0) == []  # neither the resolution nor a second firing
    book.reconcile([], 50.0)
    assert [n.status for n in book.due(60.0)] == ["resolved"]
    (third,) = book.reconcile([cond()], 100.0).records
    assert third.count == 3
    assert book.due(200.0) == []  # notified firing 190 s ago: within renotify_s
    book.reconcile([cond()], 610.0)  # still firing 600 s after the last firing notification
    assert [n.status for n in book.due(620.0)] == ["firing"]


def test_a_firing_alert_is_republished_and_renotified() -> None:
    book = AlertBook(CFG)
    book.reconcile([cond()], 0.0)
    book.due(10.0)
    assert book.reconcile([cond()], 29.0).records == []
    (again,) = book.reconcile([cond()], 30.0).records
    assert (again.status, again.last_seen, again.count) == ("firing", 30.0, 1)
    escalated = Condition(
        "breaker_open", "worker:w1", "main", "critical", "s", Evidence(reason="x")
    )
    out = book.reconcile([escalated], 31.0)  # a severity change is published at once
    (changed,) = out.records
    assert out.changes == [changed]
    assert changed.severity == "critical"
    book.reconcile([escalated], 610.0)
    (note,) = book.due(620.0)
    assert note.status == "firing"
    assert note.severity == "critical"


def test_alerts_of_pools_no_longer_owned_are_dropped_silently() -> None:
    book = AlertBook(CFG)
    book.reconcile([cond(pool="main"), cond("worker:s1", pool="small")], 0.0)
    book.due(10.0)
    out = book.reconcile([cond(pool="main")], 20.0, owned=lambda pool: pool == "main").records
    assert out == []  # no resolution for what another instance now owns
    assert [a.scope for a in book.active()] == ["worker:w1"]
    assert book.due(100.0) == []


def test_resolved_alerts_are_forgotten_after_a_day() -> None:
    book = AlertBook(CFG)
    book.reconcile([cond()], 0.0)
    book.reconcile([], 1.0)
    book.reconcile([], 1.0 + 86_401)
    (fresh,) = book.reconcile([cond()], 90_000.0).records
    assert (fresh.count, fresh.first_seen) == (1, 90_000.0)


def test_config_bounds() -> None:
    with pytest.raises(ValueError, match="republish_s"):
        AlertConfig(republish_s=120, valid_for_s=120)
    with pytest.raises(ValueError, match="group_wait_s"):
        AlertConfig(group_wait_s=-1)


# -- the rules under any sequence of conditions ------------------------------------
SCOPES = [("breaker_open", "worker:a"), ("breaker_open", "worker:b"), ("degradation", "pool:main")]
steps = st.lists(
    st.tuples(st.integers(1, 400), st.sets(st.sampled_from(range(len(SCOPES))))),
    min_size=1,
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_published_records_and_notifications_follow_the_rules(
    plan: list[tuple[int, set[int]]],
) -> None:
    book = AlertBook(CFG)
    now = 0.0
    published: defaultdict[str, list[Alert]] = defaultdict(list)
    notified: defaultdict[str, list[tuple[float, str]]] = defaultdict(list)
    held_since: dict[str, float] = {}

    def record(notes: list[Notification]) -> None:
        for n in notes:
            assert len({a.fingerprint for a in n.alerts}) == len(n.alerts)
            for a in n.alerts:
                assert (a.rule, a.pool, a.status) == (n.rule, n.pool, n.status)
                notified[a.fingerprint].append((n.at, n.status))

    for dt, active in [*plan, (CFG.renotify_s * 2, set())]:
        # time passes in small steps, as the controller's ticks would
        target = now + dt
        while now < target:
            now = min(target, now + 5)
            record(book.due(now))
        conditions = [cond(SCOPES[i][1], SCOPES[i][0]) for i in sorted(active)]
        for a in book.reconcile(conditions, now).records:
            published[a.fingerprint].append(a)
        for c in conditions:
            held_since.setdefault(fingerprint(c.rule, c.scope), now)
        for fp in [
            fp for fp in held_since if fp not in {fingerprint(c.rule, c.scope) for c in conditions}
        ]:
            del held_since[fp]
        assert {a.fingerprint for a in book.active()} == set(held_since)
    for _ in range(3):
        now += CFG.group_wait_s
        record(book.due(now))

    for records in published.values():
        # Records alternate firing → resolved, count goes up by one per firing.
        statuses = [r.status for r in records]
        changes = [s for i, s in enumerate(statuses) if i == 0 or s != statuses[i - 1]]
        assert changes[0] == "firing"
        assert all(a != b for a, b in itertools.pairwise(changes))
        firings = [
            r.count
            for i, r in enumerate(records)
            if r.status == "firing" and (i == 0 or records[i - 1].status == "resolved")
        ]
        assert firings == list(range(1, len(firings) + 1))
        assert records[-1].status == "resolved"  # every condition ended
    for notes in notified.values():
        # Never a resolution nobody heard the firing of; never two in a row.
        assert notes[0][1] == "firing"
        assert all(not (a[1] == b[1] == "resolved") for a, b in itertools.pairwise(notes))
        firing_times = [t for t, s in notes if s == "firing"]
        # A fingerprint is not paged twice within renotify_s (flapping counts up instead).
        assert all(b - a >= CFG.renotify_s for a, b in itertools.pairwise(firing_times))
        assert notes[-1][1] == "resolved"  # whoever was paged hears that it ended
