"""runtime.metrics on synthetic timestamp traces with hand-computed answers (no model, no timing of real work)."""
from __future__ import annotations

import numpy as np
import pytest
from rich.console import Console

from runtime.results import Timings
from runtime.metrics import RequestTrace, format_table, queued_share, summarize


def trace(arrival, prefill_start, token_times, finish, prompt_tokens=4, **extra) -> RequestTrace:
    return RequestTrace(arrival=arrival, prefill_start=prefill_start, first_token=token_times[0],
                        token_times=list(token_times), finish=finish, prompt_tokens=prompt_tokens,
                        output_tokens=len(token_times), **extra)


# Binary-exact timestamps, so the answers compare with ==.
FIVE = dict(arrival=10.0, prefill_start=10.25, token_times=[11.0, 11.5, 11.75, 12.25, 13.0], finish=13.5,
            prompt_tokens=8, prefill_end=10.75)


def test_five_token_request():
    t = trace(**FIVE)
    assert t.ttft == 1.0  # 11.0 - 10.0: queueing + prefill + first token
    assert t.queue == 0.25
    assert t.e2e == 3.0  # to the last token (13.0), not to finish (13.5)
    assert t.tpot == 0.5  # (3.0 - 1.0) / (5 - 1)
    assert t.itl == [0.5, 0.25, 0.5, 0.75]
    assert sum(t.itl) == t.e2e - t.ttft
    assert t.prefill_seconds == 0.5 and t.prefill_tokens_per_s == 16.0
    assert t.decode_seconds_per_step == 0.5 == t.decode_seconds_per_output_token  # one token per step: tpot


def test_prefill_rate_counts_only_the_prompt_tokens_prefilled():
    t = trace(**FIVE, cached_prompt_tokens=6)  # 6 of the 8 prompt tokens came from the prefix cache
    assert t.prefill_tokens_per_s == 4.0  # 2 tokens computed in 0.5 s; counting all 8 would claim 16 tok/s


def test_recorded_decode_steps_and_prefill_fallback():
    t = trace(**{**FIVE, "prefill_end": None}, decode_step_s=[0.25, 0.25, 0.5])  # e.g. a two-token step
    assert t.decode_seconds_per_step == pytest.approx(1.0 / 3)
    assert t.decode_seconds_per_output_token == 0.25  # 1.0 s of steps / 4 decoded tokens
    assert t.prefill_seconds == 0.75  # no prefill_end: up to the first token (includes its sampling)


def test_one_token_output_has_no_tpot():
    t = trace(0.0, 0.0, [0.25], finish=0.5)
    assert t.tpot is None and t.itl == [] and t.decode_seconds_per_output_token is None
    assert t.ttft == t.e2e == 0.25
    summary = summarize([t], slo={"tpot_ms": 1.0})
    assert summary["tpot_ms"] == {"count": 0, "mean": None, "median": None, "p90": None, "p95": None,
                                  "p99": None, "max": None}
    assert summary["itl_ms"]["count"] == 0
    assert summary["goodput"]["good_requests"] == 1  # as in vLLM: TPOT counts as 0 for goodput
    timings = Timings(t)
    assert timings.tpot_s == 0.0 and timings.tokens_per_s == 0.0 and timings.itl_s == []


def test_zero_queueing():
    t = trace(5.0, 5.0, [5.5, 6.0], finish=6.0, prefill_end=5.25)
    assert t.queue == 0.0
    assert t.ttft == 0.5 and t.ttft - t.prefill_seconds == 0.25  # what's left: sampling the first token


@pytest.mark.parametrize("ms, expected", [
    ([1, 2, 3, 4], {"mean": 2.5, "median": 2.5, "p90": 3.7, "p95": 3.85, "p99": 3.97, "max": 4}),
    ([4, 1, 3], {"mean": 8 / 3, "median": 3, "p90": 3.8, "p95": 3.9, "p99": 3.98, "max": 4}),
    ([7], {"mean": 7, "median": 7, "p90": 7, "p95": 7, "p99": 7, "max": 7}),
])
def test_percentiles_use_linear_interpolation(ms, expected):
    traces = [trace(0.0, 0.0, [x / 1e3], finish=0.01) for x in ms]
    stats = summarize(traces)["ttft_ms"]
    assert stats["count"] == len(ms)
    assert {k: stats[k] for k in expected} == pytest.approx(expected)


def test_latency_stats_are_numpys_percentiles_in_float64():
    """Timestamps as time.perf_counter gives them (large, not binary-exact): every statistic is the float64 one, so a
    summary's max is exactly the slowest request's metric as its trace says (float32 would move it by ~1e-7)."""
    rng = np.random.default_rng(3)
    traces = []
    for arrival in 81234.5678901 + np.cumsum(rng.uniform(0.001, 0.3, size=11)):
        token_times = (arrival + 0.05 + np.cumsum(rng.uniform(0.002, 0.2, size=4))).tolist()
        traces.append(trace(float(arrival), float(arrival) + 0.01, token_times, finish=token_times[-1] + 0.01))
    summary = summarize(traces)
    for name, values in (("ttft", [t.ttft for t in traces]), ("e2e", [t.e2e for t in traces]),
                         ("itl", [gap for t in traces for gap in t.itl])):
        ms = 1e3 * np.array(values, dtype=np.float64)
        p50, p90, p95, p99 = np.percentile(ms, [50, 90, 95, 99])
        expected = {"mean": ms.mean(), "median": p50, "p90": p90, "p95": p95, "p99": p99, "max": ms.max()}
        assert {k: summary[f"{name}_ms"][k] for k in expected} == pytest.approx(expected, rel=1e-12, abs=0)
        assert summary[f"{name}_ms"]["max"] == 1e3 * max(values)


def three_requests() -> list[RequestTrace]:
    return [
        # ttft 100 ms, tpot 100 ms, e2e 300 ms
        trace(0.0, 0.0, [0.1, 0.2, 0.3], finish=0.3, prompt_tokens=10),
        # ttft 300 ms (100 ms queued), tpot 50 ms, e2e 500 ms
        trace(0.5, 0.6, [0.8, 0.85, 0.9, 0.95, 1.0], finish=1.0, prompt_tokens=20),
        # one token: ttft 50 ms, no tpot, e2e 50 ms; finishes (post-processing) at 2.0
        trace(1.0, 1.0, [1.05], finish=2.0, prompt_tokens=30),
    ]


def test_throughput_over_first_arrival_to_last_finish():
    s = summarize(three_requests())
    assert s["requests"] == 3 and s["duration_s"] == 2.0
    assert s["prompt_tokens"] == 60 and s["output_tokens"] == 9
    assert s["requests_per_s"] == 1.5
    assert s["output_tokens_per_s"] == 4.5
    assert s["total_tokens_per_s"] == 34.5
    assert s["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert s["e2e_ms"]["mean"] == pytest.approx(850 / 3)
    assert s["queue_ms"]["max"] == pytest.approx(100.0)
    assert s["tpot_ms"]["count"] == 2 and s["tpot_ms"]["mean"] == pytest.approx(75.0)
    # ITL pooled: [100, 100] + [50, 50, 50, 50]
    itl = s["itl_ms"]
    assert itl["count"] == 6 and itl["mean"] == pytest.approx(400 / 6)
    assert itl["median"] == pytest.approx(50.0) and itl["p90"] == pytest.approx(100.0)
    assert "goodput" not in s


def test_queued_share_is_the_union_of_the_waits_over_the_run():
    waits = [trace(0.0, 2.0, [2.5], finish=5.0),  # waited 0-2
             trace(1.0, 3.0, [3.5], finish=6.0),  # 1-3 overlaps it: together 0-3
             trace(7.0, 7.0, [7.5], finish=10.0)]  # no wait; the run spans 0-10
    assert queued_share(waits) == pytest.approx(0.3)
    assert summarize(waits)["queued_share"] == pytest.approx(0.3)
    assert queued_share(waits[2:]) == 0.0
    assert summarize(three_requests())["queued_share"] == pytest.approx(0.05)  # 0.5-0.6 of 0-2


def test_queued_share_does_not_depend_on_the_order_of_the_traces():
    waits = [trace(7.0, 7.0, [7.5], finish=10.0),  # the last to arrive, listed first
             trace(1.0, 3.0, [3.5], finish=6.0),
             trace(0.0, 2.0, [2.5], finish=5.0)]
    assert queued_share(waits) == pytest.approx(0.3)  # waits 0-3 of the run 0-10, as in arrival order


def test_given_duration_overrides():
    s = summarize(three_requests(), duration=3.0)
    assert s["requests_per_s"] == 1.0 and s["output_tokens_per_s"] == 3.0 and s["total_tokens_per_s"] == 23.0


@pytest.mark.parametrize("slo, good", [
    ({"ttft_ms": 200}, 2),  # request 2 (300 ms) misses
    ({"ttft_ms": 400, "tpot_ms": 60}, 2),  # request 1 (100 ms TPOT) misses; request 3's TPOT counts as 0
    ({"tpot_ms": 60, "e2e_ms": 400}, 1),  # only request 3
    ({"e2e_ms": 10}, 0),
])
def test_goodput(slo, good):
    g = summarize(three_requests(), slo=slo)["goodput"]
    assert g["good_requests"] == good
    assert g["fraction"] == pytest.approx(good / 3)
    assert g["requests_per_s"] == pytest.approx(good / 2.0)


def test_failed_requests_count_against_the_goodput_fraction():
    """A request that failed met no SLO: the fraction is over every request sent (test_bench covered it only end to
    end)."""
    g = summarize(three_requests(), slo={"ttft_ms": 200}, failed=1)["goodput"]
    assert g["good_requests"] == 2 and g["fraction"] == pytest.approx(2 / 4)


def test_a_request_exactly_at_its_slo_meets_it():
    t = trace(0.0, 0.0, [0.25, 0.5, 0.75], finish=1.0)  # ttft 250 ms, tpot 250 ms, e2e 750 ms, binary-exact
    for slo in ({"ttft_ms": 250}, {"tpot_ms": 250}, {"e2e_ms": 750}, {"ttft_ms": 250, "tpot_ms": 250, "e2e_ms": 750}):
        assert summarize([t], slo=slo)["goodput"]["good_requests"] == 1, slo  # metric <= limit
    assert summarize([t], slo={"ttft_ms": 249.9})["goodput"]["good_requests"] == 0


def test_errors():
    with pytest.raises(ValueError, match="at least one"):
        summarize([])
    with pytest.raises(ValueError, match="subset"):
        summarize(three_requests(), slo={"e2el_ms": 1})
    with pytest.raises(ValueError, match="duration"):
        summarize(three_requests(), duration=0)
    with pytest.raises(ValueError, match="one token time per output token"):
        RequestTrace(0.0, 0.0, 0.1, [0.1], 0.2, prompt_tokens=1, output_tokens=2)
    with pytest.raises(ValueError, match="out of order"):
        trace(1.0, 0.5, [1.5], finish=2.0)


def test_timings_expose_the_trace():
    t = trace(**FIVE)
    timings = Timings(t, tokenize_s=0.125)
    assert timings.trace is t
    assert (timings.ttft_s, timings.e2e_s, timings.tpot_s, timings.prefill_s) == (1.0, 3.0, 0.5, 0.5)
    assert timings.token_times_s == [1.0, 1.5, 1.75, 2.25, 3.0] and timings.itl_s == t.itl
    assert timings.tokens_per_s == 2.0 and timings.prefill_tokens_per_s == 16.0
    assert timings.summary()["queue_ms"] == 250.0


def test_format_table_renders():
    console = Console(record=True, width=140)
    console.print(format_table(summarize(three_requests(), slo={"ttft_ms": 200})))
    text = console.export_text()
    for word in ("TTFT", "TPOT", "ITL", "E2E", "p99", "4.5 output tok/s", "goodput 1.00 req/s"):
        assert word in text
