"""The report's arithmetic (``seawall.report``) on a synthetic recording."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas import BreakerLevel, BreakerState, Evidence, Priority, RequestCompleted, Tier
from seawall.recording import Entry, Recording, read_recording
from seawall.report import analyse, pearson, percentile

T0 = 1_000_000.0


def done(i: int, at: float, latency_ms: float, cls: Priority, error: str | None = None) -> Entry:
    return Entry(
        at,
        "completion",
        RequestCompleted(
            worker_id="w1",
            pool="main",
            request_id=f"r{i}",
            tenant="acme",
            priority=cls,
            tier=Tier.PRO,
            queue_wait_ms=1.0,
            latency_ms=latency_ms,
            prompt_tokens=5,
            completion_tokens=5,
            error=error,
            at=at,
        ),
    )


def breaker(at: float, state: str) -> Entry:
    return Entry(
        at,
        "control",
        BreakerState(
            scope="pool:main",
            seq=int(at * 1000),
            issued_at=at,
            evidence=Evidence(reason="t"),
            state=state,
            level=BreakerLevel.REJECT_NEW if state == "open" else BreakerLevel.NONE,
        ),
    )


def test_percentile_and_pearson() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3, 1, 2], 0.5) == 2
    assert percentile(list(range(1, 101)), 0.99) == 99
    assert pearson([1, 2, 3, 4], [2, 4, 6, 8]) == pytest.approx(1.0)
    assert pearson([1, 2, 3, 4], [8, 6, 4, 2]) == pytest.approx(-1.0)
    assert pearson([1, 1, 1], [1, 2, 3]) is None  # no variance
    assert pearson([1, 2], [1, 2]) is None  # too few


def test_slo_attainment_trips_and_the_minute_after() -> None:
    entries = [done(i, T0 + i, 100.0, Priority.VIP) for i in range(10)]
    entries += [done(10 + i, T0 + i, 8_000.0, Priority.STANDARD) for i in range(5)]  # over SLO
    entries += [breaker(T0 + 20, "closed"), breaker(T0 + 30, "open")]
    entries += [done(20 + i, T0 + 31 + i, 50.0, Priority.VIP, "engine_error" if i < 3 else None)
                for i in range(4)]  # fmt: skip
    run = Recording({"seawall_recording": 1, "since": T0}, sorted(entries, key=lambda e: e.t))
    a = analyse(run, window_s=10.0)
    slo = a.slo()
    assert slo["vip"]["requests"] == 14
    assert slo["vip"]["failed"] == 3
    assert slo["vip"]["attainment"] == pytest.approx(11 / 14)
    assert slo["standard"]["attainment"] == 0.0
    ((t, key, n, share),) = a.after_trips()
    assert (t, key, n) == (T0 + 30, "breaker/pool:main", 4)
    assert share == pytest.approx(0.25)
    first = a.windows[0]
    assert first.hol_index == pytest.approx((8_000 - 100) / ((10 * 100 + 5 * 8_000) / 15))


def test_a_file_that_is_not_a_recording_is_a_clear_error(tmp_path: Path) -> None:
    cases = {
        "garbage": "not json\n",
        "other": '{"hello": 1}\n',
        "bad record": '{"seawall_recording": 1, "since": 0}\n'
        '{"t": 1, "kind": "control", "value": {}}\n',
    }
    for name, text in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text(text)
        with pytest.raises(ValueError, match=r"line \d"):
            read_recording(path)
