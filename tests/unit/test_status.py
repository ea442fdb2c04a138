"""``seawall status`` without a broker: the fold of telemetry and control records into a
``FleetStatus``, consumer-group lags, and how the status is printed."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence

import pytest
from aiokafka import TopicPartition
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from schemas import (
    BatchLimit,
    BreakerLevel,
    BreakerState,
    DegradationLevel,
    EngineStats,
    Evidence,
    GpuStats,
    WorkerHeartbeat,
    WorkerReport,
)
from schemas.base import Message
from seawall import steer
from seawall.events import describe
from seawall.status import STALE_AFTER_S, FleetStatus, StatusFold, TopicLag, lags, render
from seawall_client.serde import encode
from tests import builders

pytestmark = pytest.mark.unit

NOW = 1_700_000_000.0
WINDOW = 30.0


# -- builders (the integration test uses them too) -------------------------------------


def heartbeat(
    worker: str,
    at: float,
    pool: str = "main",
    *,
    in_flight: int = 3,
    batch_limit: int = 16,
    status: str = "serving",
) -> WorkerHeartbeat:
    return builders.heartbeat(
        worker, at, pool, in_flight=in_flight, batch_limit=batch_limit, status=status
    )


def engine_stats(
    worker: str,
    at: float,
    pool: str = "main",
    *,
    running: int = 4,
    waiting: int = 2,
    kv: float = 0.5,
    in_flight: int = 6,
    batch_limit: int = 16,
) -> EngineStats:
    return builders.engine_stats(
        worker,
        at,
        pool,
        running=running,
        waiting=waiting,
        kv_cache_usage=kv,
        in_flight=in_flight,
        batch_limit=batch_limit,
    )


def gpu(
    worker: str, at: float, pool: str = "main", *, index: int = 0, temp: float = 60.0
) -> GpuStats:
    return builders.gpu_stats(
        worker,
        at,
        pool,
        gpu_index=index,
        name="sim-H100",
        memory_used_bytes=10**9,
        temperature_c=temp,
    )


def breaker(
    seq: int, scope: str, state: str = "open", *, at: float = NOW, valid_for_s: float = 60.0
) -> BreakerState:
    return BreakerState(
        scope=scope,
        seq=seq,
        issued_at=at,
        valid_for_s=valid_for_s,
        evidence=Evidence(reason=f"{state} because"),
        state=state,
        level=BreakerLevel.REJECT_NEW if state == "open" else BreakerLevel.NONE,
        tripped=("error_rate",) if state == "open" else (),
    )


def degradation(seq: int, pool: str, level: int, *, at: float = NOW) -> DegradationLevel:
    return DegradationLevel(
        scope=f"pool:{pool}",
        seq=seq,
        issued_at=at,
        evidence=Evidence(reason="p99 over"),
        level=level,
        small_pool="small" if level >= 1 else None,
    )


def batch_limit(seq: int, worker: str, limit: int, *, at: float = NOW) -> BatchLimit:
    return BatchLimit(
        scope=f"worker:{worker}",
        seq=seq,
        issued_at=at,
        worker_id=worker,
        limit=limit,
        evidence=Evidence(reason="latency EWMA"),
    )


# -- helpers -------------------------------------------------------------------------


def fold(
    telemetry: Sequence[Message] = (),
    control: Sequence[Message] = (),
    *,
    now: float = NOW,
    pools: tuple[str, ...] = (),
) -> FleetStatus:
    f = StatusFold()
    for t in telemetry:
        f.feed_telemetry(encode(t))
    for c in control:
        f.feed_control(encode(c))
    return f.result(now, WINDOW, pools)


# -- workers -------------------------------------------------------------------------


def test_nothing_read_is_an_empty_fleet_with_the_configured_pools() -> None:
    status = fold(pools=("main", "small"))
    assert status.workers == ()
    assert [(p.pool, p.workers, p.alive, p.degradation, p.breaker) for p in status.pools] == [
        ("main", 0, 0, None, None),
        ("small", 0, 0, None, None),
    ]
    assert (status.breakers, status.degradations, status.batch_limits) == ((), (), ())
    assert (status.lags, status.groups) == ((), ())
    assert status.control_age_s is None
    assert (status.control_events, status.telemetry_events, status.invalid_records) == (0, 0, 0)


def test_a_worker_is_alive_stale_or_gone_by_the_age_of_its_newest_telemetry() -> None:
    assert STALE_AFTER_S < WINDOW
    status = fold(
        [
            heartbeat("fresh", NOW - 1),
            heartbeat("edge", NOW - STALE_AFTER_S),
            heartbeat("stale", NOW - STALE_AFTER_S - 0.5),
            heartbeat("gone", NOW - WINDOW - 0.5),
        ]
    )
    assert [(w.worker_id, w.alive) for w in status.workers] == [
        ("edge", True),
        ("fresh", True),
        ("stale", False),
    ]
    fresh = status.workers[1]
    assert fresh.last_seen_s == pytest.approx(1.0)
    assert status.telemetry_events == 3


def test_any_telemetry_counts_as_being_heard_from() -> None:
    status = fold([heartbeat("w1", NOW - 25), gpu("w1", NOW - 1)])
    (w1,) = status.workers
    assert w1.alive
    assert w1.last_seen_s == pytest.approx(1.0)
    assert w1.status == "serving"  # from the older heartbeat, still in the window


def test_a_worker_known_only_from_a_gpu_reading_has_no_engine_figures() -> None:
    (w1,) = fold([gpu("w1", NOW - 1, pool="small")]).workers
    assert (w1.pool, w1.alive, w1.status, w1.in_flight, w1.running, w1.batch_limit) == (
        "small",
        True,
        None,
        None,
        None,
        None,
    )
    assert [g.index for g in w1.gpus] == [0]


def test_a_report_folds_as_its_parts() -> None:
    report = WorkerReport(
        worker_id="w1",
        pool="main",
        at=NOW - 1,
        heartbeat=heartbeat("w1", NOW - 1, in_flight=5, batch_limit=12, status="draining"),
        engine=engine_stats("w1", NOW - 1, running=3),
        gpus=(gpu("w1", NOW - 1, index=0), gpu("w1", NOW - 1, index=1)),
    )
    (w1,) = fold([report]).workers
    assert (w1.status, w1.in_flight, w1.batch_limit, w1.running) == ("draining", 5, 12, 3)
    assert [g.index for g in w1.gpus] == [0, 1]


def test_a_worker_reporting_stopped_is_not_alive() -> None:
    (w1,) = fold([heartbeat("w1", NOW - 1, status="stopped")]).workers
    assert w1.status == "stopped"
    assert not w1.alive


def test_the_newest_report_wins_whatever_the_order_read() -> None:
    status = fold(
        [
            heartbeat("w1", NOW - 2, in_flight=9, batch_limit=32),
            heartbeat("w1", NOW - 5, in_flight=1, batch_limit=8, status="draining"),
        ]
    )
    (w1,) = status.workers
    assert (w1.status, w1.in_flight, w1.batch_limit) == ("serving", 9, 32)
    assert w1.last_seen_s == pytest.approx(2.0)


def test_engine_stats_give_the_scheduler_figures_and_the_newer_in_flight() -> None:
    status = fold(
        [
            heartbeat("w1", NOW - 3, in_flight=3, batch_limit=16),
            engine_stats("w1", NOW - 1, running=5, waiting=7, kv=0.8, in_flight=12, batch_limit=24),
            heartbeat("w2", NOW - 1, in_flight=2, batch_limit=8),
            engine_stats("w2", NOW - 4, in_flight=30, batch_limit=64),
        ]
    )
    w1, w2 = status.workers
    assert (w1.running, w1.waiting, w1.kv_cache_usage) == (5, 7, 0.8)
    assert (w1.in_flight, w1.batch_limit) == (12, 24)
    assert (w2.in_flight, w2.batch_limit) == (2, 8)
    assert w2.running == 4


def test_figures_older_than_the_window_are_left_out() -> None:
    (w1,) = fold(
        [
            engine_stats("w1", NOW - WINDOW - 1),
            gpu("w1", NOW - WINDOW - 1, index=1),
            heartbeat("w1", NOW - 1),
            gpu("w1", NOW - 2, index=0),
        ]
    ).workers
    assert w1.running is None
    assert w1.kv_cache_usage is None
    assert [g.index for g in w1.gpus] == [0]


def test_gpus_are_kept_per_index_newest_first() -> None:
    (w1,) = fold(
        [
            gpu("w1", NOW - 1, index=1, temp=81.0),
            gpu("w1", NOW - 3, index=0, temp=50.0),
            gpu("w1", NOW - 2, index=0, temp=55.0),
            gpu("w1", NOW - 4, index=1, temp=70.0),
        ]
    ).workers
    assert [(g.index, g.temperature_c, g.utilization_pct, g.simulated) for g in w1.gpus] == [
        (0, 55.0, 75.0, True),
        (1, 81.0, 75.0, True),
    ]


def test_pools_sum_their_alive_workers() -> None:
    status = fold(
        [
            heartbeat("a1", NOW - 1, "main"),
            engine_stats("a1", NOW - 0.5, "main", in_flight=5, waiting=2),
            heartbeat("a2", NOW - 2, "main", in_flight=4),
            engine_stats("a3", NOW - 20, "main", in_flight=100, waiting=100),  # stale
            heartbeat("b1", NOW - 1, "big", in_flight=7),
        ],
        pools=("main", "small"),
    )
    pools = {p.pool: p for p in status.pools}
    assert list(pools) == ["big", "main", "small"]
    main = pools["main"]
    assert (main.workers, main.alive, main.in_flight, main.waiting) == (3, 2, 5 + 4, 2)
    assert (pools["big"].workers, pools["big"].in_flight) == (1, 7)
    assert (pools["small"].workers, pools["small"].alive) == (0, 0)


def test_a_worker_moved_to_another_pool_shows_in_its_newest() -> None:
    (w1,) = fold([heartbeat("w1", NOW - 1, "small"), heartbeat("w1", NOW - 9, "main")]).workers
    assert w1.pool == "small"


# -- decisions -------------------------------------------------------------------------


def test_decisions_in_force_are_the_highest_seq_per_scope() -> None:
    status = fold(
        control=[
            breaker(1, "worker:w1", "open", at=NOW - 30),
            breaker(3, "worker:w1", "closed", at=NOW - 10),
            breaker(2, "worker:w1", "open", at=NOW - 20),  # stale: lower seq
            breaker(4, "pool:main", "half_open", at=NOW - 5),
            degradation(1, "main", 2, at=NOW - 40),
            degradation(5, "main", 1, at=NOW - 4),
            degradation(2, "small", 0, at=NOW - 8),
            batch_limit(7, "w1", 12, at=NOW - 3),
            batch_limit(6, "w1", 32, at=NOW - 2),  # stale: lower seq, though newer
            batch_limit(1, "w2", 8, at=NOW - 6),
        ],
        pools=("main", "small"),
    )
    assert [(b.scope, b.state, b.level, b.decided.seq) for b in status.breakers] == [
        ("pool:main", "half_open", "NONE", 4),
        ("worker:w1", "closed", "NONE", 3),
    ]
    assert [(d.scope, d.level, d.small_pool, d.decided.seq) for d in status.degradations] == [
        ("pool:main", 1, "small", 5),
        ("pool:small", 0, None, 2),
    ]
    assert [(b.worker_id, b.limit, b.decided.seq) for b in status.batch_limits] == [
        ("w1", 12, 7),
        ("w2", 8, 1),
    ]
    pools = {p.pool: p for p in status.pools}
    assert (pools["main"].degradation, pools["main"].breaker) == (1, "half_open")
    assert (pools["small"].degradation, pools["small"].breaker) == (0, None)
    assert status.control_events == 10
    # The newest event issued, applied or not, dates the control state.
    assert status.control_age_s == pytest.approx(2.0)


def test_a_decision_carries_its_summary_age_reason_and_expiry() -> None:
    event = breaker(1, "worker:w1", "open", at=NOW - 61, valid_for_s=60.0)
    fresh = breaker(1, "worker:w2", "open", at=NOW - 59, valid_for_s=60.0)
    status = fold(control=[event, fresh])
    old, new = status.breakers
    assert old.decided.summary == describe(event)
    assert old.tripped == ("error_rate",)
    assert old.level == "REJECT_NEW"
    assert old.decided.age_s == pytest.approx(61.0)
    assert old.decided.reason == "open because"
    assert old.decided.expired
    assert not new.decided.expired


def test_undecodable_records_are_counted_and_skipped() -> None:
    f = StatusFold()
    f.feed_telemetry(b"{not json")
    f.feed_telemetry(None)
    f.feed_control(encode(heartbeat("w1", NOW)))  # telemetry is no control event
    f.feed_control(encode(breaker(1, "pool:main")))
    f.feed_telemetry(encode(heartbeat("w1", NOW - 1)))
    status = f.result(NOW, WINDOW)
    assert status.invalid_records == 3
    assert status.control_events == 1
    assert [w.worker_id for w in status.workers] == ["w1"]


@given(st.permutations(range(8)), st.permutations(range(6)))
def test_the_order_records_are_read_in_does_not_matter(
    telemetry_order: list[int], control_order: list[int]
) -> None:
    telemetry: list[Message] = [
        heartbeat("w1", NOW - 1, in_flight=1),
        heartbeat("w1", NOW - 3, in_flight=2),
        engine_stats("w1", NOW - 2, running=9),
        engine_stats("w1", NOW - 4, running=1),
        gpu("w1", NOW - 1.5, temp=70.0),
        gpu("w1", NOW - 2.5, temp=40.0),
        heartbeat("w2", NOW - 12, "small"),
        gpu("w2", NOW - 11, "small"),
    ]
    control: list[Message] = [
        breaker(1, "pool:main", "open"),
        breaker(2, "pool:main", "closed"),
        degradation(3, "main", 2),
        degradation(4, "main", 0),
        batch_limit(5, "w1", 4),
        batch_limit(6, "w1", 20),
    ]
    expected = fold(telemetry, control)
    shuffled = fold([telemetry[i] for i in telemetry_order], [control[i] for i in control_order])
    assert shuffled == expected


# -- lags ----------------------------------------------------------------------------


def test_lags_sum_per_group_and_topic_over_the_committed_partitions() -> None:
    a0, a1, a2 = (TopicPartition("t.llm.requests.vip", p) for p in range(3))
    b0 = TopicPartition("t.llm.dispatch.main", 0)
    ends = {a0: 10, a1: 5, a2: 7, b0: 3}
    result = lags(
        {
            "t.seawall.admission": {a0: 4, a1: 5, a2: 9},  # a2: committed past the end read
            "t.seawall.workers.main": {b0: 0},
            "t.seawall.ingress": {},
        },
        ends,
    )
    assert result == (
        TopicLag("t.seawall.admission", "t.llm.requests.vip", 3, 18, 10 + 5 + 9, 6),
        TopicLag("t.seawall.workers.main", "t.llm.dispatch.main", 1, 0, 3, 3),
    )


def test_a_partition_without_a_known_end_is_left_out_of_the_lag() -> None:
    tp = TopicPartition("t.x", 0)
    other = TopicPartition("t.x", 1)
    assert lags({"g": {tp: 1, other: 2}}, {tp: 4}) == (TopicLag("g", "t.x", 1, 1, 4, 3),)
    assert lags({}, {tp: 4}) == ()


# -- output --------------------------------------------------------------------------


def full_status() -> FleetStatus:
    f = StatusFold()
    for t in (
        heartbeat("w-alive", NOW - 1),
        engine_stats("w-alive", NOW - 1, kv=0.25),
        gpu("w-alive", NOW - 1, temp=66.0),
        heartbeat("w-stale", NOW - 20, "small", status="draining"),
    ):
        f.feed_telemetry(encode(t))
    for c in (
        breaker(1, "pool:main", "open", at=NOW - 100),
        degradation(2, "main", 2),
        batch_limit(3, "w-alive", 12),
    ):
        f.feed_control(encode(c))
    tp = TopicPartition("t.llm.dispatch.main", 0)
    lag = lags({"t.seawall.workers.main": {tp: 2}}, {tp: 5})
    return f.result(NOW, WINDOW, ("main",), ["t.seawall.workers.main", "t.seawall.ingress"], lag)


def test_the_json_document_holds_every_figure() -> None:
    doc = json.loads(full_status().to_json())
    assert [(w["worker_id"], w["pool"], w["alive"]) for w in doc["workers"]] == [
        ("w-alive", "main", True),
        ("w-stale", "small", False),
    ]
    assert doc["workers"][0]["gpus"][0]["temperature_c"] == 66.0
    assert doc["breakers"][0]["level"] == "REJECT_NEW"
    assert doc["breakers"][0]["decided"]["expired"] is True
    assert doc["degradations"][0]["level"] == 2
    assert doc["batch_limits"][0] == {
        "scope": "worker:w-alive",
        "worker_id": "w-alive",
        "limit": 12,
        "decided": {
            "summary": "limit 12",
            "seq": 3,
            "issued_at": NOW,
            "age_s": 0.0,
            "expired": False,
            "reason": "latency EWMA",
        },
    }
    assert doc["lags"] == [
        {
            "group": "t.seawall.workers.main",
            "topic": "t.llm.dispatch.main",
            "partitions": 1,
            "committed": 2,
            "end": 5,
            "lag": 3,
        }
    ]
    assert doc["groups"] == ["t.seawall.ingress", "t.seawall.workers.main"]
    assert doc["control_age_s"] == 0.0


def test_the_tables_show_each_section() -> None:
    out = io.StringIO()
    render(full_status(), Console(file=out, width=250, color_system=None))
    text = out.getvalue()
    alive_row = next(line for line in text.splitlines() if "w-alive" in line and "main" in line)
    assert "alive" in alive_row
    assert "25%" in alive_row
    assert "4/2" in alive_row  # running/waiting
    assert "66°C 75% sim" in alive_row
    assert "stale (draining)" in next(line for line in text.splitlines() if "w-stale" in line)
    assert "open level=REJECT_NEW tripped=error_rate" in text
    assert "(expired)" in text
    assert "level 2 small_pool=small" in text
    assert "t.seawall.ingress" in text
    assert "(nothing committed)" in text
    assert "newest decision 0.0s ago (3 events read)" in text


def test_empty_sections_are_one_line_each() -> None:
    out = io.StringIO()
    render(fold(), Console(file=out, width=250, color_system=None))
    text = out.getvalue()
    sections = ("workers", "breakers", "degradation", "batch limits", "operators' overrides")
    for section in (*sections, "consumer lag"):
        assert f"{section}: none" in text
    assert "newest decision - (0 events read)" in text


def test_operators_overrides_in_force_are_shown_with_who_and_why() -> None:
    who = steer.operator("dana")
    quota = steer.quota_set(
        "acme",
        requests_per_s=5,
        tokens_per_minute=None,
        burst=None,
        ttl_s=600,
        reason="launch day",
        issuer=who,
        now=NOW - 10,
    )
    cleared = steer.quota_clear("other", reason="done", issuer=who, now=NOW - 5)
    throttle = steer.region_throttle(
        "eu", rate_per_s=2, ttl_s=600, reason="surge", issuer=who, now=NOW - 3
    )
    ran_out = steer.quota_set(
        "late",
        requests_per_s=1,
        tokens_per_minute=None,
        burst=None,
        ttl_s=5,
        reason="brief",
        issuer=who,
        now=NOW - 6,
    )
    status = fold(control=[quota, cleared, throttle, ran_out])
    assert [(o.scope, o.issuer, o.decided.reason) for o in status.overrides] == [
        ("region:eu", "operator:dana", "surge"),
        ("tenant:acme", "operator:dana", "launch day"),
    ]
    out = io.StringIO()
    render(status, Console(file=out, width=250, color_system=None))
    text = out.getvalue()
    assert "operators' overrides" in text
    assert "operator:dana" in next(line for line in text.splitlines() if "launch day" in line)
