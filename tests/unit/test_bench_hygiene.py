"""Hygiene checks on fabricated points: a rate far off its neighbours or a stalled TTFT is flagged, re-measured once."""

import pytest

from peagle.bench.hygiene import HygieneRules, flag_points, settle
from peagle.bench.measurement import Measurement
from peagle.bench.report import make_point, markdown

CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)
# Run 3's no-speculation row on MT-Bench (BENCHMARKS.md), a healthy series.
RUN3_NONE = (743, 1486, 2578, 5046, 8358, 18500, 31237)


def measured(rate: float, ttft_p99: float = 30.0) -> Measurement:
    return Measurement(num_prompts=48, num_failed=0, output_tokens=int(rate * 5), wall_s=5.0, tokens_per_s=rate,
                       acceptance_length=None, per_position_acceptance=[], draft_acceptance_rate=None,
                       ttft_p50_ms=15.0, ttft_p99_ms=ttft_p99, itl_p50_ms=1.0, itl_p99_ms=2.0)


def row(rates, method="none", k=None, ttfts=None, dataset="mtbench", temperature=0.0):
    ttfts = ttfts or [30.0 * c ** 0.5 for c in CONCURRENCY]
    return [make_point(dataset, method, k, c, measured(r, t), temperature=temperature)
            for c, r, t in zip(CONCURRENCY, rates, ttfts)]


def test_a_healthy_series_is_not_flagged():
    points = row(RUN3_NONE) + row([r * 1.2 for r in RUN3_NONE], "peagle", 7)
    assert flag_points(points) == {}


def test_the_issue_stall_is_flagged_where_it_happened():
    # No speculation at c=16 measured 2,359 tok/s between 5,046 (c=8) and 18,500 (c=32).
    rates = list(RUN3_NONE)
    rates[4] = 2359
    flags = flag_points(row(rates))
    assert list(flags) == [4]
    assert flags[4] == ["tokens/s 53% below c=8's", "tokens/s per request 74% below c=32's"]


def test_a_slow_first_point_is_flagged_by_its_rate_per_request():
    rates = list(RUN3_NONE)
    rates[0] = 400  # c=1 at 400 tok/s against 743 per request at c=2
    assert list(flag_points(row(rates))) == [0]


def test_series_are_separate_per_method_k_dataset_and_temperature():
    # Each series is healthy on its own; mixing them would show falls.
    points = (row(RUN3_NONE) + row([r / 3 for r in RUN3_NONE], "eagle3", 11)
              + row([r / 2 for r in RUN3_NONE], dataset="humaneval")
              + row([r / 2 for r in RUN3_NONE], temperature=0.7))
    assert flag_points(points) == {}


def test_a_ttft_tail_far_above_its_neighbours_is_a_stall():
    ttfts = [30.0 * c ** 0.5 for c in CONCURRENCY]
    ttfts[2] = 2080.0  # a first-use compilation inside the c=4 point
    flags = flag_points(row(RUN3_NONE, ttfts=ttfts))
    assert list(flags) == [2] and "TTFT p99 2080 ms" in flags[2][0]
    ttfts[2] = 60.0
    ttfts[0] = 200.0  # 4.7x c=2's 42 ms but not 250 ms above it: noise at this size
    assert flag_points(row(RUN3_NONE, ttfts=ttfts)) == {}
    assert list(flag_points(row(RUN3_NONE, ttfts=ttfts), HygieneRules(stall_min_ms=100.0))) == [0]


def test_a_prefill_bound_tail_that_grows_with_concurrency_is_not_a_stall():
    # Run 23's long-code row (prompts of thousands of tokens), no speculation at 1, 4, 16, 64: TTFT p99 29, 52, 169
    # and 1,563 ms, the last a burst of 64 prefills queued (re-measured: 863 then 1,563 ms, the same rate). Against
    # c=16's tail scaled to 64 (676 ms) it is no stall; the same tail at c=4, beside c=1's and c=16's, is one.
    conc = (1, 4, 16, 64)
    points = [make_point("longcode", "none", None, c, measured(r, t))
              for c, r, t in zip(conc, (810, 2776, 6336, 8538), (29.0, 52.0, 169.0, 1563.0))]
    assert flag_points(points) == {}
    points[1]["ttft_p99_ms"] = 1563.0
    flags = flag_points(points)
    assert list(flags) == [1] and "against 169 ms" in flags[1][0]  # c=16's (c=1's 29 ms scaled to 4 is 116)


def test_tolerance_is_an_option():
    rates = list(RUN3_NONE)
    rates[6] = rates[5] * 0.9  # a 10% fall from c=32 to c=64
    assert 6 in flag_points(row(rates), HygieneRules(drop_tolerance=0.05))
    assert flag_points(row(rates), HygieneRules(drop_tolerance=0.15)) == {}
    with pytest.raises(ValueError):
        HygieneRules(drop_tolerance=1.5)


def test_settle_remeasures_each_flagged_point_once_and_records_the_first():
    rates = list(RUN3_NONE)
    rates[4] = 2359
    points = row(rates)
    asked = []

    def measure_again(p):
        asked.append(p["concurrency"])
        return make_point(p["dataset"], p["method"], p["k"], p["concurrency"], measured(8100.0))

    assert settle(points, measure_again) == [4]
    assert asked == [16]
    assert points[4]["tokens_per_s"] == 8100.0 and points[4]["flags"] == []
    assert points[4]["remeasured"]["tokens_per_s"] == 2359 and "53% below" in points[4]["remeasured"]["flags"][0]
    assert all(p["flags"] == [] and p["remeasured"] is None for i, p in enumerate(points) if i != 4)


def test_a_point_that_stays_off_is_reported_flagged_after_one_remeasure():
    rates = list(RUN3_NONE)
    rates[6] = 12000  # c=64 below c=32 twice in a row: a real limit or a machine problem, reported either way
    points = row(rates) + row([r * 1.2 for r in RUN3_NONE], "peagle", 7)
    redone = settle(points, lambda p: make_point(p["dataset"], p["method"], p["k"], p["concurrency"],
                                                 measured(12500.0)))
    assert redone == [6]
    assert points[6]["flags"] == ["tokens/s 32% below c=32's"] and points[6]["remeasured"]["tokens_per_s"] == 12000
    text = markdown({"config": {"min_waves": 3, "min_seconds": 5}, "points": points})
    assert "1 point(s) re-measured once, 1 still flagged" in text
    assert ("| no speculation, mtbench, greedy, c=64 | 12000 | 12500 | tokens/s 35% below c=32's | "
            "tokens/s 32% below c=32's |") in text
    assert "12500 !r" in text  # the full table marks it


def test_a_neighbour_flagged_after_a_remeasure_is_remeasured_too():
    # c=16 stalled; its re-measurement is high enough that c=8 now looks slow per request, so c=8 is re-measured
    # as well (once), and nothing stays flagged.
    rates = list(RUN3_NONE)
    rates[4] = 2359
    points = row(rates)
    again = {16: 12000.0, 8: 5500.0}
    redone = settle(points, lambda p: make_point(p["dataset"], p["method"], p["k"], p["concurrency"],
                                                 measured(again[p["concurrency"]])))
    assert sorted(points[i]["concurrency"] for i in redone) == [8, 16]
    assert [p["flags"] for p in points] == [[]] * 7
