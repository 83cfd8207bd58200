# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The inference benchmark's engine rows: turns, pairing, and the ratio of a configuration."""

from types import SimpleNamespace

import pytest
import torch

from megatron_ext.bench.inference_engine import (
    ENGINE_MODELS,
    engine_model_parameters,
    engine_ratio,
    engine_rows,
    step_engines,
)
from megatron_ext.bench.inference_tables import engine_table
from megatron_ext.testing.small_gpt import build_small_gpt
from megatron_ext.testing.synthetic import cpu_torch_compat, ensure_model_parallel

SMALL_256 = ("small", "greedy", 256, "legacy")


def test_engine_ratio_pairs_only_rows_of_one_configuration(engine_rows_of):
    """Rows of another model, sampling mode or schedule at the same request count are not
    paired."""
    rows = engine_rows_of([100, 100, 100], [120, 120, 120]) + engine_rows_of(
        [100, 100, 100], [80, 80, 80], model="1b", sampling="top_k"
    )
    rows += engine_rows_of([100, 100, 100], [90, 90, 90], schedule="async")
    assert abs(engine_ratio(rows, SMALL_256)["speedup"] - 1.2) < 1e-9
    one_b = ("1b", "top_k", 256, "legacy")
    assert abs(engine_ratio(rows, one_b)["speedup"] - 0.8) < 1e-9
    small_async = ("small", "greedy", 256, "async")
    assert abs(engine_ratio(rows, small_async)["speedup"] - 0.9) < 1e-9
    assert engine_ratio(rows, ("1b", "greedy", 256, "legacy")) is None
    table = engine_table(
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


def test_engine_model_parameter_counts():
    """The count the table prints is the model's own (the small model built on CPU); the large
    model is the about-1e9-parameter case."""
    if torch.cuda.is_available():
        pytest.skip("builds the model on CPU")
    sizes = SimpleNamespace(**ENGINE_MODELS["small"], max_sequence_length=512, seed=1, device="cpu")
    with cpu_torch_compat():
        ensure_model_parallel()
        model, _ = build_small_gpt(sizes, torch.float32)
    built = sum(p.numel() for p in model.parameters())
    assert engine_model_parameters("small") == built
    assert 0.9e9 < engine_model_parameters("1b") < 1.2e9


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
    turns = step_engines(_fakes(log, off=3, on=4), ("on", "off"))
    assert log == ["on", "off", "on", "off", "on", "off", "on"]
    # The prefill is a turn of its own and is not recorded; each decode turn is one step with
    # its active count as its tokens.
    assert [(n, k) for _, n, k in turns["off"]] == [(2, 1), (1, 1)]
    assert [(n, k) for _, n, k in turns["on"]] == [(3, 1), (2, 1), (1, 1)]
    assert all(t >= 0 for t, _, _ in turns["off"] + turns["on"])


def test_longer_turns_pair_the_same_steps_of_both_engines():
    log = []
    turns = step_engines(_fakes(log, off=6, on=6), ("off", "on"), steps_per_turn=2)
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
    turns = step_engines(stacks, ("off",), steps_per_turn=4)
    # prefill | decode 5, 4 (a request waits) | admitting step alone | decode 2, 1
    assert [(n, k) for _, n, k in turns["off"]] == [(5 + 4, 2), (2 + 1, 2)]
    assert len(log) == 6


@pytest.mark.parametrize("bad", [0, -1])
def test_turns_need_a_step(bad):
    with pytest.raises(ValueError, match="steps_per_turn must be at least 1"):
        step_engines(_fakes([], off=2), ("off",), steps_per_turn=bad)


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
        rows = engine_rows(6, "small", "greedy", schedule, args, models)
        rows += engine_rows(6, "small", "top_k", schedule, args, models)
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
    value = engine_ratio(rows, ("small", "greedy", 6, schedule))
    assert value["low"] <= value["speedup"] <= value["high"]
    # The A/A control: the same models, both engines megatron-core's own.
    with cpu_torch_compat():
        control = engine_rows(6, "small", "greedy", schedule, args, models, True)
    assert len(builds) == 2
    assert [r["context_class"] for r in control] == ["DynamicInferenceContext"] * 2
    assert [r["controller_class"] for r in control] == [off["controller_class"]] * 2
    assert all(r["control"] for r in control) and not any(r["control"] for r in rows)
    assert control[1]["unpaired_turns"] == 0


def test_step_paired_rounds_decide_the_engine_ratio(engine_rows_of):
    """Rows that carry step-paired round ratios are judged by those, not by the rounds'
    throughputs (which a slow batch would tilt)."""
    rows = engine_rows_of([100, 50, 100, 100], [120, 120, 60, 120])
    rows[1]["step_paired_ratio_rounds"] = [1.2, 1.2, 1.2, 1.2]
    value = engine_ratio(rows, SMALL_256)
    assert value["speedup"] == pytest.approx(1.2) and value["half_width"] == pytest.approx(0.0)
