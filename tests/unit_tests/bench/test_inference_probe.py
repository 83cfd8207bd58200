# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The inference benchmark's step probe, on real stacks (CPU: host time only)."""

from types import SimpleNamespace

import pytest
import torch
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)

from megatron_ext.bench.inference_bookkeeping import build_variant
from megatron_ext.bench.inference_probe import CONTEXT_PARTS, CONTROLLER_PARTS, GRAPH_SAFE_PARTS
from megatron_ext.testing.synthetic import cpu_torch_compat


@pytest.mark.parametrize("variant", ["stock", "ext-eager"])
def test_the_probe_times_each_part_without_writing_to_the_objects(variant):
    if torch.cuda.is_available():
        pytest.skip("the CPU run of the bookkeeping rows; on a GPU they are the benchmark")
    classes = {cls: dict(vars(cls)) for cls in (DynamicInferenceContext, TextGenerationController)}
    args = SimpleNamespace(warmup=1, repeats=1, block_steps=2, vocab_size=64)
    with cpu_torch_compat():
        stack, probe = build_variant(variant, 8, "greedy", args, cuda=False)
        times = probe.run_step()
    assert probe.controller is stack.controller and probe.context is stack.context
    assert set(times) >= {"step_host_ms", "forward_host_ms", "update_host_ms"}
    assert 0 < times["forward_host_ms"] < times["step_host_ms"]
    assert times["bookkeeping_host_ms"] > 0
    # The timed methods come from the probe's subclasses, not from the objects or megatron-core.
    parts = {**CONTEXT_PARTS, **CONTROLLER_PARTS, **GRAPH_SAFE_PARTS}
    for obj in (stack.context, stack.controller):
        assert not set(parts) & set(vars(obj)), type(obj).__name__
    for cls, namespace in classes.items():
        assert dict(vars(cls)) == namespace, cls.__name__
    assert type(stack.controller).__name__.startswith("Timed")
