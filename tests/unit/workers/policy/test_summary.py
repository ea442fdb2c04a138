"""A worker's per-interval summary of the requests it finished."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import RequestSummary
from services.common.sketch import ddsketch_of
from services.controller.decider.pool import samples_of
from services.workers.policy.summary import RequestSummarizer, inter_token_ms

pytestmark = pytest.mark.unit

request = st.tuples(
    st.floats(0.0, 600_000.0),  # latency
    st.booleans(),  # ok
    st.one_of(st.none(), st.floats(0.0, 1.0)),  # ttft as a share of the latency
    st.integers(0, 4096),  # completion tokens
)


def test_inter_token_latency_is_the_decode_time_per_token_after_the_first() -> None:
    assert inter_token_ms(1_100.0, 100.0, 11) == 100.0
    assert inter_token_ms(100.0, 100.0, 1) is None  # one token: no interval
    assert inter_token_ms(500.0, None, 5) is None  # no first token


@settings(max_examples=60, deadline=None)
@given(requests=st.lists(request, max_size=60))
def test_a_summary_carries_what_the_controller_reads_of_its_requests(
    requests: list[tuple[float, bool, float | None, int]],
) -> None:
    summarizer = RequestSummarizer(since=100.0)
    ttfts, itls = [], []
    for latency, ok, ttft_share, tokens in requests:
        ttft = None if ttft_share is None else latency * ttft_share
        summarizer.add(latency, ok, ttft, prompt_tokens=7, completion_tokens=tokens)
        if ttft is not None:
            ttfts.append(ttft)
        itl = inter_token_ms(latency, ttft, tokens)
        if itl is not None:
            itls.append(itl)
    summary = RequestSummary.model_validate_json(summarizer.take(101.5).model_dump_json())
    latencies = [r[0] for r in requests]
    assert summary.window_s == 1.5
    assert (summary.count, summary.errors) == (len(requests), sum(not r[1] for r in requests))
    assert summary.latency.count == len(requests)
    assert summary.prompt_tokens == 7 * len(requests)
    assert summary.completion_tokens == sum(r[3] for r in requests)
    assert (summary.ttft_count, summary.itl_count) == (len(ttfts), len(itls))
    assert summary.ttft_sum_ms == pytest.approx(math.fsum(ttfts), rel=1e-9)
    assert summary.itl_sum_ms == pytest.approx(math.fsum(itls), rel=1e-9)
    assert summary.latency_sum_ms == pytest.approx(math.fsum(latencies), rel=1e-9, abs=1e-6)
    if len(latencies) > 1:
        m2 = statistics.variance(latencies) * (len(latencies) - 1)
        assert summary.latency_m2_ms2 == pytest.approx(m2, rel=1e-6, abs=1e-3)
        samples = samples_of(summary)
        assert samples.latency_mean_ms == pytest.approx(statistics.fmean(latencies), abs=1e-6)
    if latencies:
        p99 = ddsketch_of(summary.latency).get_quantile_value(0.99)
        exact = sorted(latencies)[math.floor(0.99 * (len(latencies) - 1))]
        assert p99 == pytest.approx(exact, rel=0.01, abs=1e-6)


def test_taking_a_summary_starts_the_next_interval() -> None:
    summarizer = RequestSummarizer(since=0.0)
    summarizer.add(100.0, ok=False)
    first = summarizer.take(1.0)
    second = summarizer.take(2.5)
    assert (first.count, first.errors, first.window_s) == (1, 1, 1.0)
    assert (second.count, second.errors, second.window_s, second.latency.bins) == (0, 0, 1.5, ())


def test_a_long_prompt_has_strictly_more_than_4096_tokens() -> None:
    summarizer = RequestSummarizer(since=0.0)
    for tokens in (100, 4096, 4097, 30_000):
        summarizer.add(10.0, ok=True, prompt_tokens=tokens)
    summary = summarizer.take(1.0)
    assert (summary.count, summary.long_prompts) == (4, 2)
    assert summarizer.take(2.0).long_prompts == 0
