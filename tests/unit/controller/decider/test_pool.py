"""The controller's pool decider: telemetry in, control events with evidence out, and
what survives a restart."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import pytest

from schemas import (
    BatchLimit,
    BreakerLevel,
    BreakerState,
    ControlEvent,
    DegradationLevel,
    EngineStats,
    GpuStats,
    WorkerHeartbeat,
    WorkerReport,
)
from services.controller.decider.config import DeciderConfig
from services.controller.decider.pool import Output, PoolDecider, memory_headroom_pct
from services.controller.decider.records import PoolRecord, Records, WorkerRecord
from services.controller.policy import HeartbeatConfig
from services.workers.policy.summary import RequestSummarizer
from tests import builders

pytestmark = pytest.mark.unit

T0 = 1_700_000_000.0
GIB = 1024**3


def report(
    worker: str, at: float, latencies_ms: Iterable[float] = (), errors: int = 0
) -> WorkerReport:
    """A worker's report at ``at``: its heartbeat and the requests it finished (the
    first ``errors`` of them failed)."""
    summary = RequestSummarizer(at - 1.0)
    for i, latency in enumerate(latencies_ms):
        summary.add(latency, ok=i >= errors, prompt_tokens=10, completion_tokens=10)
    return WorkerReport(
        worker_id=worker,
        pool="main",
        at=at,
        heartbeat=heartbeat(worker, at),
        requests=summary.take(at),
    )


def heartbeat(
    worker: str,
    at: float,
    cpu: float = 20.0,
    status: Literal["serving", "stopped"] = "serving",
    incarnation: str = "first",
) -> WorkerHeartbeat:
    return builders.heartbeat(
        worker, at, host_cpu_pct=cpu, status=status, incarnation=incarnation, started_at=T0 - 100
    )


def engine_stats(
    worker: str,
    at: float,
    batch_limit: int = 32,
    max_num_seqs: int = 64,
    gpu_memory_utilization: float = 0.0,
    preempted_total: int = 0,
    waiting: int = 0,
    kv_cache_usage: float = 0.1,
) -> EngineStats:
    return builders.engine_stats(
        worker,
        at,
        waiting=waiting,
        preempted_total=preempted_total,
        kv_cache_usage=kv_cache_usage,
        batch_limit=batch_limit,
        limits=builders.engine_limits(
            max_num_seqs=max_num_seqs, gpu_memory_utilization=gpu_memory_utilization
        ),
    )


def gpu(worker: str, at: float, temperature_c: float = 60.0, memory_pct: float = 40.0) -> GpuStats:
    return builders.gpu_stats(
        worker,
        at,
        name="sim",
        utilization_pct=50.0,
        memory_used_bytes=int(80 * GIB * memory_pct / 100),
        memory_total_bytes=80 * GIB,
        temperature_c=temperature_c,
        power_limit_w=400.0,
    )


def breaker_states(events: Iterable[ControlEvent], scope: str) -> list[str]:
    return [e.state for e in events if isinstance(e, BreakerState) and e.scope == scope]


def of_kind(
    events: tuple[ControlEvent, ...], kind: type[ControlEvent], scope: str
) -> list[ControlEvent]:
    return [e for e in events if isinstance(e, kind) and e.scope == scope]


class Fleet:
    """One pool decider and a clock; collects every event it emits."""

    def __init__(
        self, config: DeciderConfig | None = None, records: Records | None = None, now: float = T0
    ) -> None:
        self.config = config or DeciderConfig()
        self.now = now
        saved = records or Records()
        workers = [w for w in saved.workers.values() if w is not None]
        self.decider = PoolDecider("main", self.config, now, saved.pool, workers)
        self.events: list[ControlEvent] = []

    def feed(self, *telemetry: object) -> Output:
        outs = [self.decider.observe(t, self.now) for t in telemetry]  # type: ignore[arg-type]
        changes = tuple(e for out in outs for e in out.changes)
        republished = tuple(e for out in outs for e in out.republished)
        self.events += changes + republished
        return Output(changes, republished, stale=any(out.stale for out in outs))

    def tick(self, advance: float = 0.0) -> Output:
        self.now += advance
        out = self.decider.tick(self.now)
        self.events += out.events
        return out

    def serve(
        self,
        worker: str,
        n: int,
        *,
        latency_ms: float = 100.0,
        errors: int = 0,
        spread_s: float = 1.0,
    ) -> None:
        """``n`` requests (the first ``errors`` of them failed) over ``spread_s``."""
        for i in range(n):
            self.now += spread_s / n
            self.feed(report(worker, self.now, [latency_ms], errors=int(i < errors)))


def test_a_pool_and_a_worker_get_an_explicit_first_state() -> None:
    fleet = Fleet()
    out = fleet.feed(heartbeat("w1", T0), engine_stats("w1", T0, batch_limit=100, max_num_seqs=64))
    keys = [e.control_key for e in out.changes]
    assert keys == [
        "breaker/pool:main",
        "degradation/pool:main",
        "breaker/worker:w1",
        "batch_limit/worker:w1",
    ]
    assert all(e.issuer == "controller" and e.issued_at == T0 for e in out.changes)
    _pool_breaker, degradation, worker_breaker, limit = out.changes
    assert isinstance(worker_breaker, BreakerState)
    assert worker_breaker.state == "closed"
    assert isinstance(degradation, DegradationLevel)
    assert degradation.level == 0
    assert isinstance(limit, BatchLimit)
    assert (limit.worker_id, limit.limit) == ("w1", 64)  # the worker's 100, within max_num_seqs
    assert limit.evidence.thresholds["max_num_seqs"] == 64
    records = fleet.decider.take_records()
    assert records.pool is not None
    assert [e.control_key for e in records.pool.events] == [
        "breaker/pool:main",
        "degradation/pool:main",
    ]
    (worker,) = records.workers.values()
    assert worker is not None
    assert (worker.worker_id, worker.max_num_seqs) == ("w1", 64)
    assert {e.control_key for e in worker.events} == {"breaker/worker:w1", "batch_limit/worker:w1"}
    assert not fleet.decider.take_records()  # nothing changed since


def test_a_change_rewrites_only_the_records_of_the_scopes_it_touched() -> None:
    fleet = Fleet()
    workers = [f"w{i}" for i in range(50)]
    fleet.feed(*(heartbeat(w, T0) for w in workers), *(engine_stats(w, T0) for w in workers))
    assert len(fleet.decider.take_records().workers) == 50
    fleet.serve("w7", 40, errors=20)  # trips w7's breaker (and the pool's: it is all w7)
    fleet.tick()
    changed = fleet.decider.take_records()
    assert set(changed.workers) == {"w7"}
    w7 = changed.workers["w7"]
    assert w7 is not None
    (breaker,) = [e for e in w7.events if isinstance(e, BreakerState)]
    assert breaker.state == "open"


def test_sequence_numbers_increase_even_when_the_clock_stands_still_or_goes_back() -> None:
    fleet = Fleet()
    fleet.feed(heartbeat("w1", T0), heartbeat("w2", T0), engine_stats("w1", T0))
    fleet.now -= 50  # the wall clock stepped back
    fleet.feed(heartbeat("w3", fleet.now))
    fleet.tick(advance=10)
    seqs = [e.seq for e in fleet.events]
    assert seqs == sorted(seqs)
    assert len(set(seqs)) == len(seqs)
    assert seqs[0] >= int(T0 * 1_000_000)  # a hybrid clock: microseconds at least


def test_latency_above_the_sla_shrinks_the_batch_limit_with_evidence() -> None:
    fleet = Fleet()
    fleet.feed(heartbeat("w1", T0), engine_stats("w1", T0, batch_limit=32))
    fleet.serve("w1", 40, latency_ms=5_000.0)
    limits = [e for e in fleet.events if isinstance(e, BatchLimit)]
    assert [e.limit for e in limits] == [32, 22]  # 32 x 0.7, rounded down
    shrink = limits[-1]
    assert (
        shrink.evidence.metrics["latency_ewma_ms"] > shrink.evidence.thresholds["adjusted_sla_ms"]
    )
    assert shrink.evidence.previous == "32"
    fleet.serve("w1", 40, latency_ms=5_000.0, spread_s=10.0)
    # one change per min_interval_s (5 s) at most
    assert [e.limit for e in fleet.events if isinstance(e, BatchLimit)] == [32, 22, 15, 10]


def test_errors_trip_the_worker_and_pool_breakers_and_the_ladder() -> None:
    fleet = Fleet()
    fleet.feed(heartbeat("w1", T0))
    fleet.serve("w1", 40, errors=20)
    out = fleet.tick()
    (worker,) = of_kind(out.changes, BreakerState, "worker:w1")
    (pool,) = of_kind(out.changes, BreakerState, "pool:main")
    (ladder,) = of_kind(out.changes, DegradationLevel, "pool:main")
    for breaker in (worker, pool):
        assert isinstance(breaker, BreakerState)
        assert (breaker.state, breaker.level, breaker.tripped) == (
            "open",
            BreakerLevel.LOG,
            ("error_rate",),
        )
        assert breaker.evidence.metrics["error_rate"] == pytest.approx(0.5)
        assert breaker.evidence.thresholds["error_rate"] == pytest.approx(0.30)
        assert breaker.evidence.window_s == 300.0
        assert breaker.evidence.previous == "closed"
    assert isinstance(ladder, DegradationLevel)
    assert (ladder.level, ladder.max_tokens_cap, ladder.small_pool) == (2, 512, "small")
    assert ladder.evidence.metrics["error_rate"] == pytest.approx(0.5)


def test_a_report_of_many_requests_trips_as_its_requests_one_by_one() -> None:
    """One report summarizing 40 requests, 20 failed: the same breaker decisions, with
    the same evidence, as 40 requests reported one by one."""
    fleet = Fleet()
    fleet.feed(heartbeat("w1", T0))
    fleet.now += 1.0
    fleet.feed(report("w1", fleet.now, [100.0] * 40, errors=20))
    out = fleet.tick()
    (worker,) = of_kind(out.changes, BreakerState, "worker:w1")
    assert isinstance(worker, BreakerState)
    assert (worker.state, worker.tripped) == ("open", ("error_rate",))
    assert worker.evidence.metrics["error_rate"] == pytest.approx(0.5)


def test_the_pool_p99_merges_the_workers_sketches() -> None:
    """Latency quantiles over reports of two workers: within the sketch's accuracy of
    the quantile of every request they summarize."""
    fleet = Fleet()
    fast, slow = [float(50 + i) for i in range(99)], [float(4_000 + i) for i in range(99)]
    fleet.feed(report("w1", T0 + 1, fast), report("w2", T0 + 1, slow))
    fleet.tick(advance=1.0)
    p99 = fleet.decider.inputs["pool:main"]["latency_p99_ms"]
    assert p99 == pytest.approx(sorted(fast + slow)[round(0.99 * 197)], rel=0.02)


def test_probes_reported_together_close_a_half_open_breaker_and_a_failure_among_them_reopens() -> (
    None
):
    config = DeciderConfig(heartbeat=HeartbeatConfig(timeout_s=10.0))
    for errors, expected in ((0, "closed"), (1, "open")):
        fleet = Fleet(config)
        fleet.feed(heartbeat("w1", T0))
        fleet.tick(advance=11.0)
        fleet.feed(heartbeat("w1", fleet.now))
        assert breaker_states(fleet.events, "worker:w1")[-1] == "half_open"
        fleet.now += 1.0
        fleet.feed(report("w1", fleet.now, [100.0] * 5, errors=errors))
        assert breaker_states(fleet.events, "worker:w1")[-1] == expected


def test_a_report_whose_heartbeat_says_stopped_forgets_the_worker() -> None:
    fleet = Fleet()
    fleet.feed(heartbeat("w1", T0), engine_stats("w1", T0))
    fleet.decider.take_records()
    stopped = report("w1", T0).model_copy(
        update={"heartbeat": heartbeat("w1", T0, status="stopped")}
    )
    fleet.feed(stopped)
    assert fleet.decider.take_records().workers == {"w1": None}


def test_preemptions_shrink_the_worker_limit_and_sustained_ones_take_the_pool_to_level_1() -> None:
    fleet = Fleet()
    fleet.feed(heartbeat("w1", T0), engine_stats("w1", T0, preempted_total=100))
    # The first report only sets the count; 2 preemptions a second from then on.
    changes: list[ControlEvent] = []
    for second in range(1, 101):
        fleet.now = T0 + second
        stats = engine_stats(
            "w1", fleet.now, preempted_total=100 + 2 * second, waiting=6, kv_cache_usage=0.98
        )
        changes += fleet.feed(heartbeat("w1", fleet.now), stats).changes
        changes += fleet.tick().changes
    limits = [e for e in changes if isinstance(e, BatchLimit)]
    assert [e.limit for e in limits][:3] == [22, 15, 10]  # one shrink per min_interval_s
    assert limits[1].issued_at - limits[0].issued_at == 5.0
    assert limits[0].evidence.metrics == {
        "preemptions": 2.0,
        "kv_cache_usage": 0.98,
        "waiting": 6.0,
    }
    ladders = [e for e in changes if isinstance(e, DegradationLevel)]
    assert [e.level for e in ladders] == [1]
    rung = ladders[-1]
    # 2/s fills the minute's window past 1/s after 30 s; then the trip holds 60 s.
    assert rung.issued_at - T0 >= 90.0
    # (a window reaches up to one bucket further back than its 60 s)
    assert rung.evidence.metrics["preemptions_per_s"] == pytest.approx(2.0, rel=0.1)
    assert rung.evidence.thresholds["preemptions_per_s"] == 1.0
    assert fleet.decider.inputs["pool:main"]["kv_cache_usage"] == pytest.approx(0.98, rel=0.01)


def test_an_engine_whose_count_went_down_restarted_and_did_not_preempt() -> None:
    fleet = Fleet()
    fleet.feed(engine_stats("w1", T0, preempted_total=500))
    fleet.now += 10
    fleet.feed(engine_stats("w1", fleet.now, preempted_total=0))
    fleet.now += 10
    fleet.feed(engine_stats("w1", fleet.now, preempted_total=0))
    assert [e.limit for e in fleet.events if isinstance(e, BatchLimit)] == [32]


def test_an_over_temperature_gpu_puts_the_pool_on_level_3() -> None:
    fleet = Fleet()
    fleet.feed(heartbeat("w1", T0), gpu("w1", T0, temperature_c=91.0))
    (ladder,) = of_kind(fleet.tick().changes, DegradationLevel, "pool:main")
    assert isinstance(ladder, DegradationLevel)
    assert ladder.level == 3
    assert ladder.evidence.metrics["gpu_temperature_c"] == 91.0
    assert ladder.evidence.thresholds["gpu_temperature_c"] == 85.0


@pytest.mark.parametrize("host_cpu_breaker", [True, False])
def test_host_cpu_feeds_the_breaker_only_when_enabled(host_cpu_breaker: bool) -> None:
    fleet = Fleet(DeciderConfig(host_cpu_breaker=host_cpu_breaker))
    for _ in range(40):  # longer than the CPU row's window
        fleet.feed(heartbeat("w1", fleet.now, cpu=99.0))
        fleet.tick(1.0)
    states = breaker_states(fleet.events, "worker:w1")
    assert ("open" in states) is host_cpu_breaker


@pytest.mark.parametrize(
    ("used", "reserved", "pct"),
    [
        (0.90, 0.90, 0.0),
        (0.80, 0.90, 0.0),
        (0.95, 0.90, 50.0),
        (1.0, 0.90, 100.0),
        (0.40, 0.0, 40.0),
    ],
)
def test_gpu_memory_is_measured_against_the_headroom(
    used: float, reserved: float, pct: float
) -> None:
    assert memory_headroom_pct(int(used * 80 * GIB), 80 * GIB, reserved) == pytest.approx(pct)


def test_gpu_memory_is_not_judged_before_the_engine_reported_its_reservation() -> None:
    fleet = Fleet()
    for _ in range(40):  # GpuStats only, as from a backlog read out of order
        fleet.feed(heartbeat("w1", fleet.now), gpu("w1", fleet.now, memory_pct=90.0))
        fleet.tick(1.0)
    assert set(breaker_states(fleet.events, "worker:w1")) == {"closed"}


def test_vllm_preallocation_does_not_trip_the_memory_breaker_but_a_leak_does() -> None:
    fleet = Fleet()
    fleet.feed(heartbeat("w1", T0), engine_stats("w1", T0, gpu_memory_utilization=0.9))
    fleet.feed(gpu("w1", T0, memory_pct=90.0))  # a healthy vLLM: its whole reservation
    fleet.tick()
    assert breaker_states(fleet.events, "worker:w1") == ["closed"]
    for _ in range(40):  # a leak ate 90 % of the rest, for longer than the row's window
        fleet.feed(heartbeat("w1", fleet.now), gpu("w1", fleet.now, memory_pct=99.0))
        fleet.tick(1.0)
    (breaker,) = of_kind(fleet.events, BreakerState, "worker:w1")[-1:]
    assert isinstance(breaker, BreakerState)
    assert breaker.state == "open"
    assert breaker.level == BreakerLevel.EMERGENCY
    assert breaker.incarnation == "first"  # the process to restart, not its successor


def test_another_processs_memory_on_the_gpu_does_not_restart_this_worker() -> None:
    """The board is 99 % used, but this worker's own processes hold only its 90 %
    reservation (``process_memory_bytes``): nothing trips. Where its processes cannot be
    told apart (``None``), the device's use is judged, as before; figures the device
    does not report (a MIG instance) are not judged at all."""
    fleet = Fleet()
    fleet.feed(heartbeat("w1", T0), engine_stats("w1", T0, gpu_memory_utilization=0.9))
    own = int(0.9 * 80 * GIB)
    for _ in range(40):
        crowded = gpu("w1", fleet.now, memory_pct=99.0).model_copy(
            update={"process_memory_bytes": own}
        )
        blind = crowded.model_copy(
            update={"gpu_index": 1, "memory_used_bytes": None, "temperature_c": None,
                    "power_w": None, "utilization_pct": None}
        )  # fmt: skip
        fleet.feed(heartbeat("w1", fleet.now), crowded, blind)
        fleet.tick(1.0)
    assert set(breaker_states(fleet.events, "worker:w1")) == {"closed"}
    for _ in range(40):  # not attributable: the device's use is all there is to judge
        unknown = gpu("w1", fleet.now, memory_pct=99.0)
        fleet.feed(heartbeat("w1", fleet.now), unknown)
        fleet.tick(1.0)
    assert breaker_states(fleet.events, "worker:w1")[-1] == "open"


def test_a_restart_order_names_the_process_heard_from_not_a_time() -> None:
    """The replacement process (a new incarnation) is not named by the order its
    predecessor got, so it never obeys it, whatever the clocks of the two hosts."""
    fleet = Fleet()
    fleet.feed(heartbeat("w1", T0), engine_stats("w1", T0, gpu_memory_utilization=0.9))
    fleet.tick()
    for _ in range(40):  # restarted as "second", which leaks in its turn
        fleet.feed(heartbeat("w1", fleet.now, incarnation="second"))
        fleet.feed(gpu("w1", fleet.now, memory_pct=99.0))
        fleet.tick(1.0)
    first, *_, latest = of_kind(fleet.events, BreakerState, "worker:w1")
    assert isinstance(first, BreakerState)
    assert isinstance(latest, BreakerState)
    assert (first.incarnation, first.level) == ("first", BreakerLevel.NONE)
    assert (latest.incarnation, latest.level) == ("second", BreakerLevel.EMERGENCY)


def test_the_small_pool_is_not_diverted_to_itself() -> None:
    config = DeciderConfig(small_pool="main")
    fleet = Fleet(config)
    fleet.feed(heartbeat("w1", T0), gpu("w1", T0, temperature_c=95.0))
    (ladder,) = of_kind(fleet.tick().changes, DegradationLevel, "pool:main")
    assert isinstance(ladder, DegradationLevel)
    assert ladder.level == 3
    assert ladder.small_pool is None


def test_decisions_in_force_are_republished_with_a_new_seq_and_the_same_decision() -> None:
    fleet = Fleet()
    fleet.feed(heartbeat("w1", T0), engine_stats("w1", T0))
    assert fleet.tick(advance=1.0).republished == ()  # just issued
    before = dict(fleet.decider.in_force)
    out = fleet.tick(advance=fleet.config.republish_s)
    assert out.changes == ()
    assert sorted(e.control_key for e in out.republished) == sorted(before)
    for again in out.republished:
        first = before[again.control_key]
        assert again.seq > first.seq
        assert again.issued_at == first.issued_at  # when it was decided
        assert again.valid_for_s == pytest.approx(fleet.now - first.issued_at + 60.0)
        same = {"seq", "valid_for_s"}
        assert again.model_dump(exclude=same) == first.model_dump(exclude=same)
    assert fleet.tick(advance=1.0).republished == ()  # not due yet


def test_a_decision_in_force_for_a_day_is_issued_afresh() -> None:
    fleet = Fleet()
    fleet.feed(heartbeat("w1", T0))
    fleet.now += 86_400.0
    fleet.feed(heartbeat("w1", fleet.now))
    out = fleet.tick()
    assert out.republished
    assert all(e.issued_at == fleet.now and e.valid_for_s == 60.0 for e in out.republished)


def test_a_worker_whose_clock_is_an_hour_off_is_heard() -> None:
    """No comparison of the worker's clock with the controller's: a worker an hour
    behind is heard like any other (its reports are current as they come)."""
    fleet = Fleet()
    for _ in range(5):
        out = fleet.feed(heartbeat("w1", fleet.now - 3600.0))
        assert not out.stale
        fleet.tick(1.0)
    assert "worker:w1" in fleet.decider.breakers()


def test_a_backlog_read_after_a_controller_restart_is_skipped_then_live_reports_count() -> None:
    """The controller goes down for two minutes; the decider that restarts from the
    records reads the backlog it left (stale: more than 30 s later than the worker's
    least delayed report, by the anchor in the worker's record), then live reports."""
    skew = 500.0  # the worker's clock, ahead: it changes nothing
    fleet = Fleet()
    for _ in range(5):
        fleet.feed(heartbeat("w1", fleet.now + skew))
        fleet.tick(1.0)
    records = fleet.decider.records()
    saved = records.workers["w1"]
    assert saved is not None
    assert saved.clock_anchor is not None
    back = Fleet(records=records, now=fleet.now + 120.0)
    written = fleet.now
    # written in the minute after the controller stopped, read two minutes on: stale
    assert all(back.feed(heartbeat("w1", written + k + skew)).stale for k in range(60))
    # written 20 s before it is read: current (within 30 s of the anchor's delay)
    assert not back.feed(heartbeat("w1", back.now - 20.0 + skew)).stale
    back.now += 1.0
    assert not back.feed(heartbeat("w1", back.now + skew)).stale


def test_a_worker_record_is_rewritten_only_once_its_anchor_moved_past_the_tolerance() -> None:
    """Each report a little less delayed than any before moves the anchor (the minimum
    filter), but the worker's record, by which a restarted controller judges what it
    reads first, is written again only once the anchor's delay moved more than the
    tolerance (0.3 s at the default 30 s) from the one the record holds."""
    fleet = Fleet()
    fleet.feed(heartbeat("w1", fleet.now - 0.5))  # read 0.5 s after it was written
    first = fleet.decider.take_records().workers["w1"]
    assert first is not None
    assert first.clock_anchor == (fleet.now - 0.5, fleet.now)
    for k in range(1, 5):  # each read 0.05 s sooner than the last: 0.2 s at most
        fleet.now += 1.0
        assert not fleet.feed(heartbeat("w1", fleet.now - 0.5 + 0.05 * k)).stale
        assert not fleet.decider.take_records()
    assert fleet.decider.records().workers["w1"].clock_anchor == (  # type: ignore[union-attr]
        fleet.now - 0.3,
        fleet.now,
    )
    fleet.now += 1.0
    fleet.feed(heartbeat("w1", fleet.now - 0.1))  # 0.4 s less delayed than the record's
    saved = fleet.decider.take_records().workers["w1"]
    assert saved is not None
    assert saved.clock_anchor == (fleet.now - 0.1, fleet.now)


def test_heartbeat_loss_isolates_a_worker_until_it_beats_and_passes_its_probes() -> None:
    config = DeciderConfig(heartbeat=HeartbeatConfig(timeout_s=10.0))
    fleet = Fleet(config)
    fleet.feed(heartbeat("w1", T0))
    (lost,) = of_kind(fleet.tick(advance=11.0).changes, BreakerState, "worker:w1")
    assert isinstance(lost, BreakerState)
    assert (lost.state, lost.tripped) == ("open", ("heartbeat",))
    assert lost.evidence.metrics["heartbeat_age_s"] == pytest.approx(11.0)
    (back,) = of_kind(fleet.feed(heartbeat("w1", fleet.now)).changes, BreakerState, "worker:w1")
    assert isinstance(back, BreakerState)
    assert back.state == "half_open"
    fleet.serve("w1", 3)  # the three probes pass
    last = of_kind(tuple(fleet.events), BreakerState, "worker:w1")[-1]
    assert isinstance(last, BreakerState)
    assert last.state == "closed"


def test_a_stopped_worker_is_forgotten_and_no_longer_republished() -> None:
    fleet = Fleet()
    fleet.feed(heartbeat("w1", T0), heartbeat("w2", T0), engine_stats("w1", T0))
    fleet.decider.take_records()
    fleet.feed(heartbeat("w1", T0, status="stopped"))
    assert fleet.decider.take_records().workers == {"w1": None}  # its record is deleted
    assert set(fleet.decider.records().workers) == {"w2"}
    out = fleet.tick(advance=fleet.config.republish_s)
    assert {e.scope for e in out.republished} == {"pool:main", "worker:w2"}


def test_a_worker_lost_for_long_is_forgotten() -> None:
    config = DeciderConfig(heartbeat=HeartbeatConfig(timeout_s=10.0), forget_after_s=100.0)
    fleet = Fleet(config)
    fleet.feed(heartbeat("w1", T0))
    fleet.tick(advance=11.0)  # lost
    fleet.tick(advance=50.0)
    assert "worker:w1" in fleet.decider.breakers()
    fleet.tick(advance=51.0)
    assert "worker:w1" not in fleet.decider.breakers()
    assert all(e.scope != "worker:w1" for e in fleet.decider.in_force.values())


def restarted(fleet: Fleet, after_s: float) -> Fleet:
    """A new decider from the old one's records, as a restarted controller builds it (from
    their JSON, as the changelog holds them)."""
    saved = fleet.decider.records()
    assert saved.pool is not None
    records = Records(
        PoolRecord.model_validate_json(saved.pool.model_dump_json()),
        {
            worker_id: WorkerRecord.model_validate_json(w.model_dump_json())
            for worker_id, w in saved.workers.items()
            if w is not None
        },
    )
    return Fleet(fleet.config, records, now=fleet.now + after_s)


def test_a_restart_republishes_the_decisions_in_force_and_nothing_else() -> None:
    fleet = Fleet()
    fleet.feed(heartbeat("w1", T0), engine_stats("w1", T0))
    fleet.serve("w1", 40, errors=20)
    fleet.tick()
    before = dict(fleet.decider.in_force)
    again = restarted(fleet, after_s=5.0)
    out = again.tick()
    assert out.changes == ()
    assert {e.control_key: e.seq for e in out.republished}.keys() == before.keys()
    for event in out.republished:
        old = before[event.control_key]
        assert event.seq > max(e.seq for e in before.values())
        assert event.model_dump(exclude={"seq", "valid_for_s"}) == old.model_dump(
            exclude={"seq", "valid_for_s"}
        )


def test_a_restarted_breaker_stays_open_while_errors_go_on_and_recovers_in_full() -> None:
    fleet = Fleet()
    fleet.feed(heartbeat("w1", T0))
    fleet.serve("w1", 40, errors=20)
    fleet.tick()
    again = restarted(fleet, after_s=5.0)
    hold = again.config.breaker.error_rate.recover_hold_s
    for _ in range(int(hold / 10) * 2):  # twice the recovery hold, errors still coming
        again.feed(heartbeat("w1", again.now))
        again.serve("w1", 40, errors=10, spread_s=10.0)
        again.tick()
    states = breaker_states(again.events, "worker:w1")
    assert len(states) > 2
    assert set(states) == {"open"}
    # The errors stop; the breaker goes half-open only once the hold has passed.
    t_healthy = again.now
    while "half_open" not in breaker_states(again.events, "worker:w1"):
        again.feed(heartbeat("w1", again.now))
        again.serve("w1", 40, spread_s=5.0)
        again.tick()
        assert again.now - t_healthy < 600, "never recovered"
    assert again.now - t_healthy >= hold


def test_a_restarted_batch_limit_continues_from_its_last_value() -> None:
    fleet = Fleet()
    fleet.feed(heartbeat("w1", T0), engine_stats("w1", T0, batch_limit=32))
    fleet.serve("w1", 40, latency_ms=5_000.0)
    assert fleet.decider.batch_limits()["w1"][0] == 22
    again = restarted(fleet, after_s=5.0)
    assert again.decider.batch_limits()["w1"] == (22, None)
    again.feed(engine_stats("w1", again.now, batch_limit=22))  # no jump back to 32
    again.serve("w1", 40, latency_ms=5_000.0)
    assert [e.limit for e in again.events if isinstance(e, BatchLimit)] == [15]


def test_a_worker_restored_as_lost_stays_lost_until_it_beats() -> None:
    config = DeciderConfig(heartbeat=HeartbeatConfig(timeout_s=10.0))
    fleet = Fleet(config)
    fleet.feed(heartbeat("w1", T0), heartbeat("w2", T0))
    fleet.now += 11.0
    fleet.feed(heartbeat("w2", fleet.now))
    fleet.tick()
    again = restarted(fleet, after_s=3.0)
    assert again.tick().changes == ()
    assert again.decider.breakers()["worker:w1"].tripped == ("heartbeat",)
    assert again.decider.breakers()["worker:w2"].tripped == ()
    # w2 known from before the restart and silent since: lost after the timeout.
    assert breaker_states(again.tick(advance=11.0).changes, "worker:w2") == ["open"]
    back = again.feed(heartbeat("w1", again.now)).changes
    assert breaker_states(back, "worker:w1") == ["half_open"]


def test_a_restarted_ladder_keeps_its_level_until_its_rung_recovers() -> None:
    fleet = Fleet()
    fleet.feed(heartbeat("w1", T0), gpu("w1", T0, temperature_c=95.0))
    fleet.tick()
    again = restarted(fleet, after_s=2.0)
    assert again.decider.degradation.level == 3
    again.feed(gpu("w1", again.now, temperature_c=95.0))
    assert of_kind(again.tick(advance=1.0).changes, DegradationLevel, "pool:main") == []
    hold = again.config.degradation.gpu_temperature_c.recover_hold_s
    cooled_at = again.now
    while again.decider.degradation.level == 3:
        again.feed(heartbeat("w1", again.now), gpu("w1", again.now, temperature_c=60.0))
        again.tick(advance=1.0)
        assert again.now - cooled_at < 600, "never recovered"
    # the hot sample leaves the window, then the cool readings must hold in full
    assert again.now - cooled_at >= hold
    levels = [e.level for e in again.events if isinstance(e, DegradationLevel)]
    assert levels[0] == 3
    assert levels[-1] == 0
    assert set(levels) == {0, 3}


def test_react_evaluates_the_workers_that_reported_and_tick_all_of_them() -> None:
    """A worker whose errors trip its breaker is decided at the next reaction once its
    own report came; a worker that went silent with its trip hold running out is decided
    at the next full tick."""
    fleet = Fleet()
    fleet.feed(heartbeat("w1", T0), heartbeat("w2", T0))
    fleet.tick()
    fleet.decider.inputs.clear()
    fleet.serve("w1", 40, errors=20)
    out = fleet.decider.react(fleet.now)
    assert breaker_states(out.changes, "worker:w1") == ["open"]
    assert set(fleet.decider.inputs) == {"worker:w1", "pool:main"}  # w2 sent nothing since
    assert fleet.decider.react(fleet.now).changes == ()  # nothing observed since
    fleet.tick()
    assert {"worker:w1", "worker:w2", "pool:main"} <= set(fleet.decider.inputs)
