# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The rope benchmark's host timing: interleaved rounds, medians."""

import statistics

import pytest

from megatron_ext.bench import rope


def test_rounds_alternate_the_functions_and_rotate_who_goes_first(monkeypatch):
    monkeypatch.setattr(rope, "_HOST_CALLS", 3)
    log, syncs = [], []
    fns = {name: (lambda name=name: log.append(name)) for name in ("mcore", "ours", "autograd")}
    result = rope.interleaved_host_us(fns, 3, lambda: syncs.append(1))
    per_round = 10 + 3  # warm-up calls, then the timed ones
    blocks = [log[i] for i in range(0, len(log), per_round)]
    assert blocks == ["mcore", "ours", "autograd", "ours", "autograd", "mcore"] + [
        "autograd",
        "mcore",
        "ours",
    ]
    assert all(len(set(log[i : i + per_round])) == 1 for i in range(0, len(log), per_round))
    assert len(syncs) == 2 * 3 * 3  # after the warm-up and at the end of every round
    for name in fns:
        rounds = result[name]["host_us_rounds"]
        assert len(rounds) == 3 and result[name]["host_us"] == statistics.median(rounds)
        assert result[name]["eager_us"] >= min(rounds)


def test_the_median_ignores_one_slow_round(monkeypatch):
    """A round slowed by the machine (here the third, 50x) does not move the reported time."""
    monkeypatch.setattr(rope, "_HOST_CALLS", 1)
    clock = {"now": 0.0, "calls": 0}
    monkeypatch.setattr(rope.time, "perf_counter", lambda: clock["now"])

    def call():
        clock["calls"] += 1
        slow_round = (clock["calls"] - 1) // 11 == 2  # 10 warm-up calls + 1 timed per round
        clock["now"] += 50e-6 if slow_round else 1e-6

    result = rope.interleaved_host_us({"a": call}, 5, lambda: None)["a"]
    assert result["host_us_rounds"] == pytest.approx([1.0, 1.0, 50.0, 1.0, 1.0])
    assert result["host_us"] == pytest.approx(1.0) and result["eager_us"] == pytest.approx(1.0)


def test_rounds_must_be_positive():
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        rope.interleaved_host_us({"a": lambda: None}, 0, lambda: None)
