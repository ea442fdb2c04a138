"""The incident benchmark's peer arms (bench/_incident_peers.py) behave as their sources
document (bench/README.md, "Incident": the files and lines each rule is taken from).

- vLLM (v0.34.0): ``--scheduling-policy priority`` orders the waiting queue by
  ``(priority, arrival_time)``, lower first (``vllm/v1/core/sched/request_queue.py``
  131-151, ``vllm/v1/request.py`` 409-419); a waiting request preempts no running one
  (``scheduler.py`` 1066, 1516-1523); the queue is unbounded by default
  (``max_num_queued_reqs`` None, ``vllm/config/scheduler.py`` 104-116); production-stack's
  ``roundrobin`` takes the endpoints in turn, ignoring load (``routing_logic.py``
  187-195).
- The GIE (v1.5.0): default scorers queue 2, KV cache 2, prefix cache 3
  (``pkg/epp/config/loader/defaults.go`` 46-91); queue score ``(max-q)/(max-min)``, 1 when
  equal (``scorer/queuedepth/queue.go`` 78-107); KV ``1 - usage``
  (``kvcache_utilization.go`` 76-82); max score, ties at random (``max_score_picker.go``
  80-108); saturation the mean over pods of ``max(q/5, kv/0.8)``
  (``saturationdetector/utilization/detector.go`` 106-137, ``config.go`` 29-39); a request
  of priority below 0 refused at saturation 1 or more, any other admitted
  (``requestcontrol/admission.go`` 64-128, ``util/request/sheddable.go`` 20-22).
- LiteLLM (1.108.0): per-key ``rpm_limit``/``tpm_limit`` in a 60 s window that starts at
  the key's first request and resets to zero after it (``proxy/hooks/
  parallel_request_limiter_v3.py`` 895, 1315-1340, 1389-1412), tokens reserved before the
  call (901, 2647-2691), 429 past a limit (``proxy_rate_limit_error.py`` 129-131); the
  router's default ``simple-shuffle``, uniform without weights (``router.py`` 1136,
  ``router_strategy/simple_shuffle.py`` 50-67).
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from _incident_peers import (
    PEERS,
    FixedWindowLimits,
    GieScorer,
    Replica,
    RoundRobin,
    SaturationShedding,
    SimpleShuffle,
    run_peer,
)
from _incident_scenario import Arrival, Scenario

from schemas import Priority, Tier

pytestmark = pytest.mark.unit


def arrival(i: int = 0, tier: Tier = Tier.BASIC, tenant: str = "t", at: float = 0.0) -> Arrival:
    return Arrival(i, at, tenant, tier, 100, 10, False)


def idle(n: int) -> list[Replica]:
    return [Replica(0, 0, 0.0) for _ in range(n)]


def test_round_robin_takes_the_replicas_in_turn_whatever_their_load() -> None:
    router = RoundRobin()
    loaded = [Replica(50, 40, 0.9), Replica(0, 0, 0.0), Replica(10, 5, 0.5)]
    assert [router.pick(loaded, arrival(i)) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_simple_shuffle_spreads_evenly_at_random() -> None:
    router = SimpleShuffle()
    picks = Counter(router.pick(idle(4), arrival(i)) for i in range(8000))
    assert set(picks) == {0, 1, 2, 3}
    assert all(1800 < n < 2200 for n in picks.values())


def test_the_gie_picks_the_shortest_queue_and_freest_cache() -> None:
    scorer = GieScorer()
    replicas = [Replica(9, 8, 0.5), Replica(3, 0, 0.9), Replica(4, 2, 0.2)]
    # scores: 2*0 + 2*0.5 = 1.0; 2*1 + 2*0.1 = 2.2; 2*0.75 + 2*0.8 = 3.1
    assert scorer.pick(replicas, arrival()) == 2
    # equal queues: every queue score is 1, the KV cache decides
    assert scorer.pick([Replica(0, 3, 0.6), Replica(0, 3, 0.1)], arrival()) == 1


def test_the_gie_breaks_ties_at_random() -> None:
    scorer = GieScorer()
    picks = Counter(scorer.pick(idle(3), arrival(i)) for i in range(3000))
    assert set(picks) == {0, 1, 2}


def test_the_gie_sheds_all_but_vip_at_a_mean_saturation_of_one() -> None:
    gate = SaturationShedding()
    # one replica far past its queue threshold, the other idle: mean (10/5 + 0)/2 = 1.0
    saturated = [Replica(0, 10, 0.0), Replica(0, 0, 0.0)]
    assert gate.saturation(saturated) == pytest.approx(1.0)
    for tier, admitted in ((Tier.ENTERPRISE, True), (Tier.PRO, False), (Tier.BASIC, False)):
        assert gate.admit(0.0, arrival(tier=tier), saturated) is admitted
    # KV cache: 0.72 / 0.8 = 0.9 on each replica, under 1: every class admitted
    busy = [Replica(0, 0, 0.72), Replica(0, 4, 0.1)]
    assert gate.saturation(busy) == pytest.approx((0.9 + 0.8) / 2)
    assert gate.admit(0.0, arrival(tier=Tier.BASIC), busy)


def test_litellm_refuses_past_a_keys_minute_and_forgets_it_the_next() -> None:
    limits = FixedWindowLimits(
        rpm={t: 3 for t in Tier}, tpm={t: 10_000 for t in Tier}, window_s=60.0
    )
    a = arrival(tenant="acme")
    assert [limits.admit(t, a, idle(1)) for t in (1.0, 2.0, 3.0, 4.0)] == [
        True,
        True,
        True,
        False,
    ]
    assert limits.admit(5.0, arrival(tenant="other"), idle(1))  # per key
    assert not limits.admit(60.5, a, idle(1))  # the window began at the first request
    assert limits.admit(61.0, a, idle(1))  # a new window from here
    assert [limits.admit(t, a, idle(1)) for t in (62.0, 63.0)] == [True, True]
    assert not limits.admit(120.0, a, idle(1))
    tight = FixedWindowLimits(rpm={t: 100 for t in Tier}, tpm={t: 250 for t in Tier})
    assert [tight.admit(0.0, a, idle(1)) for _ in range(3)] == [True, True, False]  # 110 each


def test_vllm_serves_a_queued_vip_before_the_bulk_ahead_of_it() -> None:
    """Priority scheduling on the engines (lower first): a VIP arriving behind a backlog
    of bulk requests on the same replica is answered long before them."""
    s = dataclasses.replace(Scenario(), main_gpus=1, small_gpus=0, timeout_s=600.0)
    backlog = [Arrival(i, 0.0, "b", Tier.BASIC, 1500, 64, True) for i in range(400)]
    vip = Arrival(400, 0.1, "v", Tier.ENTERPRISE, 100, 16, False)
    assert vip.priority is Priority.VIP
    vllm = next(p for p in PEERS if p.name == "vllm")
    outcomes = run_peer(s, [*backlog, vip], vllm)
    vip_latency = outcomes[-1].latency
    assert vip_latency is not None
    bulk = sorted(o.latency for o in outcomes[:-1] if o.latency is not None)
    assert vip_latency < bulk[len(bulk) // 2]  # ahead of most of the backlog
    fcfs = dataclasses.replace(vllm, priority_policy=False)
    fcfs_latency = run_peer(s, [*backlog, vip], fcfs)[-1].latency
    assert fcfs_latency is not None
    assert vip_latency < fcfs_latency / 2


def test_every_peer_serves_everyone_when_the_load_is_light() -> None:
    s = dataclasses.replace(Scenario(), main_gpus=2, small_gpus=0)
    light = [arrival(i, Tier.PRO, f"t{i % 5}", at=0.5 * i) for i in range(20)]
    for peer in PEERS:
        outcomes = run_peer(s, light, peer)
        assert all(o.kind == "ok" for o in outcomes), peer.name
