"""The ledger's running totals and suffix walks against a plain walk of every entry."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.admission.policy.cost import Cost
from services.admission.policy.ledger import SLICE_S, Ledger, Sums

pytestmark = pytest.mark.unit

WORKERS = ["w1", "w2", "w3"]

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(0, 30),  # request id
            # time steps: ties are the edge cases, and several times within one slice
            st.sampled_from([0.0, 0.0, 0.004, 0.01, SLICE_S, 1.0, 3.0]),
            st.tuples(st.integers(0, 5000), st.integers(0, 2000)),
            st.sampled_from([*WORKERS, None]),
        ),
        st.tuples(st.just("pop"), st.integers(0, 30)),
        st.tuples(st.just("expire"), st.integers(0, 4000).map(lambda t: t / 100)),
    ),
    max_size=120,
)


def naive(
    entries: dict[str, tuple[float, Cost, str | None]],
    workers: dict[str, float],
    others: float,
) -> tuple[dict[str, Sums], Sums]:
    out = {w: Sums() for w in workers}
    rest = Sums()
    for at, cost, placed in entries.values():
        if placed in workers:
            if at > workers[placed]:
                out[placed].add(cost)
        elif at > others:
            rest.add(cost)
    return out, rest


def check_answers(
    ledger: Ledger,
    model: dict[str, tuple[float, Cost, str | None]],
    data: st.DataObject,
    usual: list[float],
) -> None:
    """Every question the ledger answers, against a walk of every entry."""
    # times asked about: mostly a few asked again and again (as a worker's report time
    # is, round after round: the ledger remembers those answers), the entries' own
    # (ties are the edge cases), or any
    times = st.one_of(
        st.sampled_from(usual),
        st.sampled_from(sorted({at for at, _, _ in model.values()} | {-1.0, 0.0})),
        st.integers(-100, 6000).map(lambda t: t / 100),
    )
    asked = data.draw(st.dictionaries(st.sampled_from(WORKERS), times))
    others = data.draw(st.one_of(times, st.just(math.inf)))
    assert ledger.unplaced_since(asked, others) == naive(model, asked, others)[1]
    t = data.draw(times)
    assert ledger.newer_than(t) == naive(model, {}, t)[1]
    for worker in WORKERS:  # at the times asked about again and again, and any
        after, also_after = data.draw(st.sampled_from(usual)), data.draw(times)
        total, since, also_since = ledger.placed_on(worker, after, also_after)
        assert total == naive(model, {worker: -math.inf}, math.inf)[0][worker]
        assert since == naive(model, {worker: after}, math.inf)[0][worker]
        assert also_since == naive(model, {worker: also_after}, math.inf)[0][worker]


@settings(max_examples=600, deadline=None)
@given(ops=ops, data=st.data())
def test_totals_and_since_sums_match_a_walk_of_every_entry(
    ops: list[tuple[object, ...]], data: st.DataObject
) -> None:
    ledger = Ledger()
    model: dict[str, tuple[float, Cost, str | None]] = {}
    usual = data.draw(st.lists(st.integers(-1, 80).map(lambda t: t / 10), min_size=1, max_size=3))
    now = 0.0
    for op in ops:
        if op[0] == "add":
            _, rid, step, (prompt, max_tokens), worker = op
            now += step  # type: ignore[operator]
            cost = Cost(prompt, max_tokens)  # type: ignore[arg-type]
            ledger.add(f"r{rid}", now, cost, worker)  # type: ignore[arg-type]
            model.pop(f"r{rid}", None)  # a re-dispatch moves to the end
            model[f"r{rid}"] = (now, cost, worker)  # type: ignore[assignment]
        elif op[0] == "pop":
            ledger.pop(f"r{op[1]}")
            model.pop(f"r{op[1]}", None)
        else:
            ledger.expire(op[1])  # type: ignore[arg-type]
            model = {k: v for k, v in model.items() if v[0] >= op[1]}  # type: ignore[operator]
        check_answers(ledger, model, data, usual)  # remembered answers follow every change
    assert len(ledger) == len(model)
    total = Sums()
    for _, cost, _ in model.values():
        total.add(cost)
    assert ledger.total == total
    check_answers(ledger, model, data, usual)


def test_an_entry_at_the_very_time_asked_about_is_not_newer() -> None:
    ledger = Ledger()
    cost = Cost(10, 5)
    for rid, at, worker in [("r1", 1.0, "w1"), ("r2", 2.0, "w2"), ("r3", 2.0, None)]:
        ledger.add(rid, at, cost, worker)
    ledger.add("r4", 3.0, cost, "w1")
    one, two = Sums(1, 15, 10), Sums(2, 30, 20)
    assert ledger.placed_on("w1", 1.0, 0.0) == (two, one, two)
    assert ledger.placed_on("w2", 2.0, 1.0) == (one, Sums(), one)
    assert ledger.unplaced_since({"w1", "w2"}, 2.0) == Sums()
    assert ledger.unplaced_since({"w2"}, 1.0) == two  # w1's r4 and the by-key r3
    assert ledger.newer_than(2.0) == one
    ledger.expire(2.0)  # r1 only: r2 and r3 were dispatched at 2.0
    assert len(ledger) == 3
    assert ledger.placed_on("w1", 0.0, 0.0) == (one, one, one)
