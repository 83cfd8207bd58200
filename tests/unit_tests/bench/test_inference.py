# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The inference benchmark's engine verdicts: paired rounds, an interval, and what it decides."""

from types import SimpleNamespace

import pytest
import torch

from megatron_ext.bench import inference
from megatron_ext.testing.small_gpt import build_small_gpt
from megatron_ext.testing.synthetic import cpu_torch_compat, ensure_model_parallel


def _rows(off, on, requests=256, model="small", sampling="greedy", schedule="legacy"):
    common = {"requests": requests, "model": model, "sampling": sampling, "schedule": schedule}
    return [
        {"mode": "off", **common, "decode_tokens_per_s_rounds": off},
        {"mode": "on", **common, "decode_tokens_per_s_rounds": on},
    ]


SMALL_256 = ("small", "greedy", 256, "legacy")


def test_engine_ratio_is_decided_by_its_interval():
    faster = inference._engine_ratio(_rows([100, 80, 120, 90], [110, 88, 132, 99]), SMALL_256)
    assert abs(faster["speedup"] - 1.1) < 1e-9 and faster["low"] > 1.0
    assert inference._verdict(faster) == "faster: the interval is above 1.00"
    assert "+-0.0%" in inference._ratio_text(faster)
    mixed = inference._engine_ratio(_rows([100, 100, 100, 100], [90, 110, 95, 108]), SMALL_256)
    assert inference._verdict(mixed) == "the interval contains 1.00"
    assert mixed["half_width"] > 0.03
    assert (
        inference._engine_ratio(_rows([100, 100], [90, 110]), ("small", "greedy", 1024, "legacy"))
        is None
    )


def test_a_single_round_has_no_interval():
    one = inference._engine_ratio(_rows([100.0], [120.0]), SMALL_256)
    assert one == {"speedup": 1.2, "round_min": 1.2, "round_max": 1.2}
    assert inference._ratio_text(one) == "1.20x [one round]"
    assert inference._verdict(one) == "faster in every round"


def test_engine_ratio_pairs_only_rows_of_one_configuration():
    """Rows of another model, sampling mode or schedule at the same request count are not
    paired."""
    rows = _rows([100, 100, 100], [120, 120, 120]) + _rows(
        [100, 100, 100], [80, 80, 80], model="1b", sampling="top_k"
    )
    rows += _rows([100, 100, 100], [90, 90, 90], schedule="async")
    assert abs(inference._engine_ratio(rows, SMALL_256)["speedup"] - 1.2) < 1e-9
    one_b = ("1b", "top_k", 256, "legacy")
    assert abs(inference._engine_ratio(rows, one_b)["speedup"] - 0.8) < 1e-9
    small_async = ("small", "greedy", 256, "async")
    assert abs(inference._engine_ratio(rows, small_async)["speedup"] - 0.9) < 1e-9
    assert inference._engine_ratio(rows, ("1b", "greedy", 256, "legacy")) is None
    table = inference._engine_table(
        [
            dict(
                r,
                median_decode_step_ms=1.0,
                decode_tokens_per_s=100.0,
                decode_tokens_per_s_spread={"min": 100.0, "max": 100.0},
            )
            for r in rows
        ]
    )
    assert "| 1b | top_k | 256 | legacy | on |" in table and "0.800x" in table
    assert "| small | greedy | 256 | async | on |" in table and "0.900x" in table


def test_the_summary_names_the_worst_row_and_reports_the_control_apart():
    """The worst engine row is the one whose interval reaches lowest; the A/A control's rows are
    summarised on their own lines and never compete for worst."""
    engine = _rows([100, 100, 100, 100], [120, 118, 122, 121])
    engine += _rows([100, 100, 100, 100], [101, 99, 103, 97], requests=1024)
    control = _rows([100, 100, 100, 100], [80, 82, 79, 81])
    report = {"engine_rows": engine, "engine_control_rows": control}
    lines = inference._engine_summary(report)
    assert len(lines) == 3
    assert "1024 concurrent requests" in lines[1] and lines[1].endswith("<- worst engine row")
    assert report["worst_engine_row"]["requests"] == 1024
    assert lines[2].startswith("A/A control, small model, greedy, 256 concurrent requests")
    assert "worst" not in lines[2]
    assert inference._engine_summary({"engine_rows": [], "engine_control_rows": []}) == []


def test_a_second_schedule_is_refused_on_megatron_core_0_16(capsys):
    from megatron_ext.inference.contexts.static_slices_context_base import (
        UPSTREAM_HAS_ACTIVE_SLICES,
    )

    if UPSTREAM_HAS_ACTIVE_SLICES:
        pytest.skip("megatron-core 0.19 has both schedules")
    argv = ["--engine-schedules", "legacy", "async", "--max-requests", "4", "--engine-requests"]
    assert inference.main(argv) == 2
    assert "0.16 has one schedule" in capsys.readouterr().err


def test_engine_model_parameter_counts():
    """The count the table prints is the model's own (the small model built on CPU); the large
    model is the about-1e9-parameter case."""
    if torch.cuda.is_available():
        pytest.skip("builds the model on CPU")
    sizes = SimpleNamespace(
        **inference.ENGINE_MODELS["small"], max_sequence_length=512, seed=1, device="cpu"
    )
    with cpu_torch_compat():
        ensure_model_parallel()
        model, _ = build_small_gpt(sizes, torch.float32)
    built = sum(p.numel() for p in model.parameters())
    assert inference.engine_model_parameters("small") == built
    assert 0.9e9 < inference.engine_model_parameters("1b") < 1.2e9


class _FakeEngine:
    """Counts down a batch: the first step is a prefill, then decode steps with fewer and fewer
    active requests; records the global order of steps and whether the device was synchronised
    before each."""

    def __init__(self, name, steps, log):
        self.name, self.left, self.log = name, steps, log
        self.waiting_request_ids = []
        self.total_request_count, self.paused_request_count = steps, 0
        self.first = True

    def has_unfinished_requests(self):
        return self.left > 0

    def is_decode_only(self):
        return not self.first

    def step_modern(self):
        self.log.append(self.name)
        self.first = False
        self.left -= 1
        self.total_request_count = self.left


def _fakes(log, **steps):
    engines = {name: _FakeEngine(name, count, log) for name, count in steps.items()}
    return {name: (engine, engine) for name, engine in engines.items()}  # each its own context


def test_engines_step_in_alternating_turns_of_one_step():
    log = []
    turns = inference.step_engines(_fakes(log, off=3, on=4), ("on", "off"))
    assert log == ["on", "off", "on", "off", "on", "off", "on"]
    # The prefill is a turn of its own and is not recorded; each decode turn is one step with
    # its active count as its tokens.
    assert [(n, k) for _, n, k in turns["off"]] == [(2, 1), (1, 1)]
    assert [(n, k) for _, n, k in turns["on"]] == [(3, 1), (2, 1), (1, 1)]
    assert all(t >= 0 for t, _, _ in turns["off"] + turns["on"])


def test_longer_turns_pair_the_same_steps_of_both_engines():
    log = []
    turns = inference.step_engines(_fakes(log, off=6, on=6), ("off", "on"), steps_per_turn=2)
    # prefill alone, then decode steps two at a time, the last turn shorter.
    assert log == ["off", "on"] + ["off", "off", "on", "on"] * 2 + ["off", "on"]
    for name in ("off", "on"):
        assert [(n, k) for _, n, k in turns[name]] == [(5 + 4, 2), (3 + 2, 2), (1, 1)]


def test_a_turn_ends_before_a_step_that_is_not_a_decode_step():
    log = []
    stacks = _fakes(log, off=6)
    engine = stacks["off"][0]
    original = engine.step_modern

    def step_then_admit():
        original()
        engine.waiting_request_ids = [7] if engine.left == 3 else []

    engine.step_modern = step_then_admit
    turns = inference.step_engines(stacks, ("off",), steps_per_turn=4)
    # prefill | decode 5, 4 (a request waits) | admitting step alone | decode 2, 1
    assert [(n, k) for _, n, k in turns["off"]] == [(5 + 4, 2), (2 + 1, 2)]
    assert len(log) == 6


@pytest.mark.parametrize("bad", [0, -1])
def test_turns_need_a_step(bad):
    with pytest.raises(ValueError, match="steps_per_turn must be at least 1"):
        inference.step_engines(_fakes([], off=2), ("off",), steps_per_turn=bad)


def test_engine_rows_pair_the_turns_of_two_real_engines(monkeypatch):
    """The engine rows end to end on the CPU (the GPU run is the benchmark): megatron-core's
    engine off and the extension's on, every turn paired, each model built once. Legacy schedule
    only: megatron-core 0.19's async schedule needs CUDA streams (turns of several steps are
    checked with fake engines above)."""
    if torch.cuda.is_available():
        pytest.skip("the CPU run of the engine rows; on a GPU they are the benchmark")
    from megatron.core.inference.contexts import dynamic_context

    from megatron_ext.testing import small_gpt

    # Its fused KV append is a Triton GPU kernel; megatron-core indexes when it is absent.
    monkeypatch.setattr(dynamic_context, "triton_append_key_value_cache", None)
    builds = []
    original = small_gpt.build_small_gpt

    def counting(*args, **kwargs):
        builds.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(small_gpt, "build_small_gpt", counting)
    args, models, schedule = SimpleNamespace(quick=True, engine_repeats=2), {}, "legacy"
    with cpu_torch_compat():
        rows = inference._engine_rows(6, "small", "greedy", schedule, args, models)
        rows += inference._engine_rows(6, "small", "top_k", schedule, args, models)
    assert len(builds) == 2  # off and on, once for both configurations
    for off, on in (rows[:2], rows[2:]):
        assert (off["mode"], on["mode"]) == ("off", "on")
        assert off["context_class"] == "DynamicInferenceContext"
        assert on["context_class"] == "StaticSlicesInferenceContext"
        assert on["steps_per_turn"] == 1
        assert on["unpaired_turns"] == 0 and len(on["step_paired_ratio_rounds"]) == 2
        # 24 generated tokens: the prefill samples the first, 23 decode steps the others.
        assert off["decode_steps_per_round"] == on["decode_steps_per_round"] == 23
        assert all(r > 0 for r in on["decode_tokens_per_s_rounds"])
    value = inference._engine_ratio(rows, ("small", "greedy", 6, schedule))
    assert value["low"] <= value["speedup"] <= value["high"]
    # The A/A control: the same models, both engines megatron-core's own.
    with cpu_torch_compat():
        control = inference._engine_rows(6, "small", "greedy", schedule, args, models, True)
    assert len(builds) == 2
    assert [r["context_class"] for r in control] == ["DynamicInferenceContext"] * 2
    assert [r["controller_class"] for r in control] == [off["controller_class"]] * 2
    assert all(r["control"] for r in control) and not any(r["control"] for r in rows)
    assert control[1]["unpaired_turns"] == 0


def test_step_paired_rounds_decide_the_engine_ratio():
    """Rows that carry step-paired round ratios are judged by those, not by the rounds'
    throughputs (which a slow batch would tilt)."""
    rows = _rows([100, 50, 100, 100], [120, 120, 60, 120])
    rows[1]["step_paired_ratio_rounds"] = [1.2, 1.2, 1.2, 1.2]
    value = inference._engine_ratio(rows, SMALL_256)
    assert value["speedup"] == pytest.approx(1.2) and value["half_width"] == pytest.approx(0.0)


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
        inference, "_build_variant", lambda v, *a, **k: (None, _ClockedProbe(v, clock))
    )
    args = SimpleNamespace(warmup=1, repeats=repeats, block_steps=7)
    return inference._run_config(64, "greedy", args, False, variants), clock["order"]


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
    speedups = inference._speedups(rows)
    eager = speedups[(64, "greedy", "ext-eager")]
    graphed = speedups[(64, "greedy", "ext-graphed")]
    assert eager["speedup"] == pytest.approx(2.0) and graphed["speedup"] == pytest.approx(4.0)
    assert eager["low"] == pytest.approx(2.0) and eager["high"] == pytest.approx(2.0)
    by_variant = {r["variant"]: r for r in rows}
    assert by_variant["ext-eager"]["bookkeeping_paired_ratio_rounds"] == pytest.approx([2.0] * 3)
    assert "bookkeeping_paired_ratio_rounds" not in by_variant["stock"]


def test_a_single_bookkeeping_round_has_no_interval(monkeypatch):
    rows, _ = _clocked_rows(monkeypatch, slow=(0, 0), repeats=1)
    value = inference._speedups(rows)[(64, "greedy", "ext-eager")]
    assert "low" not in value and value["speedup"] == pytest.approx(2.0)
    assert inference._bookkeeping_ratio_text(value) == "2.00x [rounds 2.00-2.00]"
    assert inference._verdict(value) == "faster in every round"
    rows, _ = _clocked_rows(monkeypatch, slow=(0, 0), variants=("ext-eager", "ext-graphed"))
    assert inference._speedups(rows) == {}  # no stock row: nothing to pair with


def test_the_bookkeeping_table_prints_the_interval(monkeypatch):
    rows, _ = _clocked_rows(monkeypatch, slow=(30, 33))
    table = inference._table(rows, cuda=True)
    assert "speedup [95% interval, +-; round min-max]" in table
    # Three slowed calls (one turn) move no round's median, neither the times nor the ratios.
    assert (
        "| 64 | greedy | ext-graphed | 500.0 [500.0-500.0] | - | - | -/-/- | 0 | "
        "4.000x [4.000-4.000, +-0.0%; 4.00-4.00] |"
    ) in table.splitlines()
