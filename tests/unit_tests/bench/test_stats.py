# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Confidence intervals of the benchmarks' off/on ratios, and a round's step-paired ratio."""

import math
import random

import pytest

from megatron_ext.bench.stats import ratio_interval, step_paired_ratio


def paired_ratio_interval(off, on, **kwargs):
    return ratio_interval([b / a for a, b in zip(off, on)], **kwargs)


def test_a_constant_ratio_has_a_point_interval():
    off = [100.0, 120.0, 90.0, 110.0]
    on = [x * 1.25 for x in off]
    value = paired_ratio_interval(off, on)
    assert value["ratio"] == pytest.approx(1.25)
    assert value["low"] == pytest.approx(1.25) and value["high"] == pytest.approx(1.25)
    assert value["half_width"] == pytest.approx(0.0, abs=1e-12)
    assert value["rounds"] == 4


def test_machine_drift_between_rounds_cancels_in_paired_ratios():
    """Rounds whose absolute figures swing by 2x but whose off/on pairs agree to 1% give a
    tight interval around the true ratio."""
    rng = random.Random(3)
    off, on = [], []
    for _ in range(20):
        level = rng.uniform(50, 100)
        off.append(level * rng.uniform(0.995, 1.005))
        on.append(1.1 * level * rng.uniform(0.995, 1.005))
    value = paired_ratio_interval(off, on)
    assert value["low"] < 1.1 < value["high"]
    assert value["half_width"] < 0.01


def test_noisier_rounds_widen_the_interval_and_more_rounds_narrow_it():
    rng = random.Random(5)

    def rounds(count, noise):
        off = [100.0] * count
        on = [100.0 * math.exp(rng.gauss(0.0, noise)) for _ in range(count)]
        return paired_ratio_interval(off, on)["half_width"]

    assert rounds(8, 0.10) > rounds(8, 0.01)
    assert rounds(64, 0.05) < rounds(6, 0.05)


def test_the_interval_is_reproducible_and_covers_the_estimate():
    off, on = [10.0, 11.0, 9.0, 10.5, 9.5], [10.5, 11.0, 9.9, 10.4, 10.2]
    first, second = paired_ratio_interval(off, on), paired_ratio_interval(off, on)
    assert first == second
    assert first["low"] <= first["ratio"] <= first["high"]
    assert first["round_min"] == pytest.approx(10.4 / 10.5)
    assert first["round_max"] == pytest.approx(1.1)


@pytest.mark.parametrize(
    "ratios,kwargs,message",
    [
        ([1.0], {}, "at least 2 rounds"),
        ([1.0, 0.0], {}, "must be positive"),
        ([1.0, -2.0], {}, "must be positive"),
        ([1.0, 2.0], {"confidence": 1.0}, "confidence must be in"),
    ],
)
def test_bad_input_is_refused(ratios, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ratio_interval(ratios, **kwargs)


def test_a_slow_phase_shared_by_paired_steps_does_not_bias_the_round_ratio():
    """Steps 20-39 of both engines ran 1.5x slower (the machine, not the code): the median of
    the paired step ratios is still the true 1.2x, where comparing each engine's median step
    would not be if the phase had hit one engine's batch only."""
    rng = random.Random(7)
    off, on = [], []
    for step in range(60):
        phase = 1.5 if 20 <= step < 40 else 1.0
        off.append((0.012 * phase * rng.uniform(0.99, 1.01), 256))
        on.append((0.010 * phase * rng.uniform(0.99, 1.01), 256))
    value = step_paired_ratio(off, on)
    assert value["ratio"] == pytest.approx(1.2, rel=0.02)
    assert value["pairs"] == 60 and value["unpaired"] == 0


def test_steps_with_different_active_counts_are_not_paired():
    off = [(2.0, 10), (2.0, 9), (4.0, 8)]
    on = [(1.0, 10), (1.0, 7), (1.0, 8), (1.0, 8)]
    value = step_paired_ratio(off, on)
    assert value["ratio"] == pytest.approx(3.0)  # median of 2.0 and 4.0
    assert value["pairs"] == 2 and value["unpaired"] == 2
    with pytest.raises(ValueError, match="did the same work"):
        step_paired_ratio([(1.0, 3)], [(1.0, 4)])
    with pytest.raises(ValueError, match="must be positive"):
        step_paired_ratio([(0.0, 3)], [(1.0, 3)])


def test_totals_ratio_is_the_ratio_of_the_pooled_rates():
    from megatron_ext.bench.stats import totals_ratio

    # Round 2 of the candidate is slow: the pooled ratio weighs it by its time, as a table's
    # tokens over time does; the geometric mean of the rounds' ratios would not.
    baseline = [(1000, 1.0), (1000, 1.0), (1000, 1.0)]
    candidate = [(1000, 0.5), (1000, 2.0), (1000, 0.5)]
    result = totals_ratio(baseline, candidate)
    assert result["speedup"] == pytest.approx(3000 / 3.0 / (3000 / 3.0))
    assert (result["round_min"], result["round_max"]) == (0.5, 2.0)
    assert result["low"] <= 1.0 <= result["high"]
    constant = totals_ratio(baseline, [(1000, 0.25)] * 3)
    assert constant["low"] == constant["high"] == pytest.approx(4.0)
    assert "low" not in totals_ratio(baseline[:1], candidate[:1])
    for bad in ((baseline, candidate[:2]), ([], []), (baseline, [(0, 1.0)] * 3)):
        with pytest.raises(ValueError):
            totals_ratio(*bad)
