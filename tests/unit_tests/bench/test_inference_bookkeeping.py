# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The inference benchmark's bookkeeping rows: interleaved variants and their paired speedups."""

from types import SimpleNamespace

import pytest

from megatron_ext.bench import inference_bookkeeping
from megatron_ext.bench.inference_bookkeeping import bookkeeping_speedups
from megatron_ext.bench.inference_tables import bookkeeping_ratio_text, bookkeeping_table
from megatron_ext.bench.inference_verdicts import verdict


class _ClockedProbe:
    """A step probe whose bookkeeping time is its variant's cost times the machine's speed at
    that moment (one shared call counter); it records the order the variants stepped in."""

    COST = {"stock": 2.0, "ext-eager": 1.0, "ext-graphed": 0.5}

    def __init__(self, variant, clock):
        self.variant, self.clock = variant, clock
        self.controller = SimpleNamespace()

    def run_step(self):
        call = len(self.clock["order"])
        self.clock["order"].append(self.variant)
        slow = self.clock["slow"][0] <= call < self.clock["slow"][1]
        bookkeeping = self.COST[self.variant] * (3.0 if slow else 1.0)
        return {"step_host_ms": bookkeeping + 5.0, "bookkeeping_host_ms": bookkeeping}


def _clocked_rows(monkeypatch, slow, variants=("stock", "ext-eager", "ext-graphed"), repeats=3):
    clock = {"order": [], "slow": slow}
    monkeypatch.setattr(
        inference_bookkeeping, "build_variant", lambda v, *a, **k: (None, _ClockedProbe(v, clock))
    )
    args = SimpleNamespace(warmup=1, repeats=repeats, block_steps=7)
    return inference_bookkeeping.run_config(64, "greedy", args, False, variants), clock["order"]


def test_bookkeeping_variants_step_in_turn_one_step_each_with_a_rotating_order(monkeypatch):
    variants = ("stock", "ext-eager", "ext-graphed")
    _, order = _clocked_rows(monkeypatch, slow=(0, 0))
    timed = order[len(variants) :]  # after one warm-up step per variant
    turns = [tuple(timed[i : i + 3]) for i in range(0, len(timed), 3)]
    assert len(turns) == 3 * 7
    for index, turn in enumerate(turns):
        shift = index % 3
        assert turn == variants[shift:] + variants[:shift]


def test_a_slow_phase_of_the_machine_cancels_in_the_paired_bookkeeping_ratio(monkeypatch):
    """A slow phase as long as one variant's seven steps (calls 10-16, after three warm-up calls:
    where each variant ran its round's steps back to back, ext-eager's whole first block) leaves
    each round's median paired ratio at the true one."""
    rows, _ = _clocked_rows(monkeypatch, slow=(10, 17))
    speedups = bookkeeping_speedups(rows)
    eager = speedups[(64, "greedy", "ext-eager")]
    graphed = speedups[(64, "greedy", "ext-graphed")]
    assert eager["speedup"] == pytest.approx(2.0) and graphed["speedup"] == pytest.approx(4.0)
    assert eager["low"] == pytest.approx(2.0) and eager["high"] == pytest.approx(2.0)
    by_variant = {r["variant"]: r for r in rows}
    assert by_variant["ext-eager"]["bookkeeping_paired_ratio_rounds"] == pytest.approx([2.0] * 3)
    assert "bookkeeping_paired_ratio_rounds" not in by_variant["stock"]


def test_a_single_bookkeeping_round_has_no_interval(monkeypatch):
    rows, _ = _clocked_rows(monkeypatch, slow=(0, 0), repeats=1)
    value = bookkeeping_speedups(rows)[(64, "greedy", "ext-eager")]
    assert "low" not in value and value["speedup"] == pytest.approx(2.0)
    assert bookkeeping_ratio_text(value) == "2.00x [rounds 2.00-2.00]"
    assert verdict(value) == "faster in every round"
    rows, _ = _clocked_rows(monkeypatch, slow=(0, 0), variants=("ext-eager", "ext-graphed"))
    assert bookkeeping_speedups(rows) == {}  # no stock row: nothing to pair with


def test_the_bookkeeping_table_prints_the_interval(monkeypatch):
    rows, _ = _clocked_rows(monkeypatch, slow=(30, 33))
    table = bookkeeping_table(rows, cuda=True)
    assert "speedup [95% interval, +-; round min-max]" in table
    # Three slowed calls (one turn) move no round's median, neither the times nor the ratios.
    assert (
        "| 64 | greedy | ext-graphed | 500.0 [500.0-500.0] | - | - | -/-/- | 0 | "
        "4.000x [4.000-4.000, +-0.0%; 4.00-4.00] |"
    ) in table.splitlines()
