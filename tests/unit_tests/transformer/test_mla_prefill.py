# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The MHA form of the dynamic MLA path's prefill requests (megatron_ext.transformer.mla_prefill).

On CPU the form is forced (``MODE = "force"``, the plain-torch backend with cuDNN's semantics):
the engine's generation with prefills, chunked prefills behind cached prefixes, mixed
decode + chunk steps, pauses and evictions matches a float64 teacher-forced forward, one step
matches the absorbed form, and the absorbed + MHA split of a mixed step matches too. The rules
that keep the form out (mode, backend, CUDA graphs, decode-only steps) and the cost model are
checked directly. Tests marked ``gpu`` run the default (cuDNN) backend in bf16 and megatron-core's
CUDA graphs around it.
"""

import dataclasses
import functools
import math
import os
import types
import warnings
from typing import Any, List

import numpy as np
import pytest
import torch

from megatron_ext.fusions.launch_plans import PlanCache
from megatron_ext.fusions.mla_latent import mha_form
from megatron_ext.inference.contexts.static_slices_context_base import UPSTREAM_HAS_ACTIVE_SLICES
from megatron_ext.testing import small_mla_gpt
from megatron_ext.testing.mla_dynamic_engine import build_mla_dynamic_engine
from megatron_ext.testing.synthetic import run_engine
from megatron_ext.transformer import mla_dynamic_inference, mla_prefill
from megatron_ext.transformer.multi_latent_attention import ExtMLASelfAttention
from tests.unit_tests.transformer import test_mla_dynamic_inference as dynamic
from tests.unit_tests.transformer.test_mla_dynamic_inference import (
    DEEPSEEK_LIKE,
    DEVICE,
    PAUSING_CACHE,
    PAUSING_LENGTHS,
    TINY,
    _context_step,
    build_model,
    generate_and_check,
    requests_for,
)

# megatron-core's inference stack, the flags undone afterwards (the dynamic path's fixture).
stack = dynamic.stack
DEEPSEEK_WIDTHS = (512, 64, 128, 128)


@pytest.fixture
def mha_calls(monkeypatch) -> List[int]:
    """Record the MHA form's calls (their token counts)."""
    calls: List[int] = []
    original = mla_prefill.mla_paged_mha_attention

    def spy(query, *args, **kwargs):
        calls.append(int(np.sum(kwargs["query_lengths"])))
        return original(query, *args, **kwargs)

    monkeypatch.setattr(mla_prefill, "mla_paged_mha_attention", spy)
    return calls


def _hidden(context: Any, seed: int) -> torch.Tensor:
    n = int(context.padded_active_token_count)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, TINY["hidden_size"], generator=generator).to(DEVICE)


def _attention(model: Any) -> Any:
    return next(m for m in model.modules() if isinstance(m, ExtMLASelfAttention))


# ------------------------------------------------------------------------------- generation


@pytest.mark.parametrize("backend", ["torch", "torch-bottom-right"])
def test_forced_mha_form_generation_matches_float64(stack, monkeypatch, mha_calls, backend):
    """Chunked prompts (one over the step budget), pauses, evictions, mixed decode + prefill
    steps, every prefill step's requests in the MHA form."""
    monkeypatch.setattr(mla_prefill, "MODE", "force")
    monkeypatch.setattr(mla_prefill, "BACKEND", backend)
    model = build_model(TINY)
    requests = requests_for(PAUSING_LENGTHS, 24, TINY["vocab_size"])
    seen = generate_and_check(model, TINY, requests, 2**-14, **PAUSING_CACHE)
    assert seen["stats"]["evicted"] > 0 and seen["kinds"] == {True, False}
    # Every prompt token went through the MHA form (recomputed ones after eviction too).
    assert sum(mha_calls) >= sum(PAUSING_LENGTHS) * TINY["num_layers"]


def test_the_default_mode_is_off():
    """Off: the engine's golden values are taken in the absorbed form, which auto changes."""
    import os

    if "MEGATRON_EXT_MLA_MHA_FORM" in os.environ:
        pytest.skip("MEGATRON_EXT_MLA_MHA_FORM is set in this environment")
    assert mla_prefill.MODE == "off"


def test_auto_mode_on_cpu_stays_absorbed(stack, mha_calls, monkeypatch):
    monkeypatch.setattr(mla_prefill, "MODE", "auto")
    assert mla_prefill.backend_for(torch.device("cpu"), torch.float32) is None
    model = build_model(TINY)
    requests = requests_for([70, 12], 4, TINY["vocab_size"])
    generate_and_check(model, TINY, requests, 2**-14, block_size_tokens=16, kv_blocks=32)
    assert mha_calls == []


# ------------------------------------------------------------------------------- one step


def _absorbed_and_mha(model: Any, context: Any, monkeypatch, seed: int = 0):
    module = _attention(model)
    hidden = _hidden(context, seed)
    with torch.no_grad():
        monkeypatch.setattr(mla_prefill, "MODE", "off")
        absorbed, _ = mla_dynamic_inference.mla_dynamic_attention(module, hidden, context)
        monkeypatch.setattr(mla_prefill, "MODE", "force")
        mha, _ = mla_dynamic_inference.mla_dynamic_attention(module, hidden, context)
    active = context.active_token_count
    return absorbed, mha, active


def test_prefill_step_equals_the_absorbed_form(stack, monkeypatch, mha_calls):
    model = build_model(TINY)
    context = _context_step(model, [7, 19, 3])
    absorbed, mha, active = _absorbed_and_mha(model, context, monkeypatch)
    assert mha_calls == [29]
    scale = float(absorbed[:active].abs().max())
    assert scale > 0
    assert float((mha - absorbed).abs().max()) <= 2**-18 * scale


def test_a_step_all_in_the_mha_form_hands_its_result_to_the_output_projection(stack, monkeypatch):
    """Every request in the MHA form (a prefill step): the form's result is the core output
    the output projection reads, with no buffer to copy it into."""
    model = build_model(TINY)
    context = _context_step(model, [7, 19, 3])
    module, hidden = _attention(model), _hidden(context, 3)
    results, inputs = [], []
    original = mla_prefill.mla_paged_mha_attention

    def spy(*args, **kwargs):
        results.append(original(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(mla_prefill, "mla_paged_mha_attention", spy)
    monkeypatch.setattr(mla_prefill, "MODE", "force")
    hook = module.linear_proj.register_forward_pre_hook(lambda _, args: inputs.append(args[0]))
    try:
        with torch.no_grad():
            mla_dynamic_inference.mla_dynamic_attention(module, hidden, context)
    finally:
        hook.remove()
    (result,) = results
    (core,) = inputs
    assert core.data_ptr() == result.data_ptr() and core.numel() == result.numel()


def test_split_step_runs_the_leading_requests_absorbed(stack, monkeypatch, mha_calls):
    """The cost model's split point: the first request absorbed, the others in the MHA form,
    the same output as the whole step absorbed."""
    model = build_model(TINY)
    context = _context_step(model, [7, 19, 3])
    module, hidden = _attention(model), _hidden(context, 2)
    absorbed_calls = []
    original = mla_dynamic_inference.mla_paged_latent_attention

    def absorbed_spy(query, *args, **kwargs):
        absorbed_calls.append(query.shape[0])
        return original(query, *args, **kwargs)

    with torch.no_grad():
        monkeypatch.setattr(mla_prefill, "MODE", "off")
        expected, _ = mla_dynamic_inference.mla_dynamic_attention(module, hidden, context)
        monkeypatch.setattr(mla_dynamic_inference, "mla_paged_latent_attention", absorbed_spy)
        monkeypatch.setattr(mla_prefill, "MODE", "auto")
        monkeypatch.setattr(mla_prefill, "BACKEND", "torch")
        monkeypatch.setattr(mla_prefill, "absorbed_request_count", lambda *args, **kwargs: 1)
        got, _ = mla_dynamic_inference.mla_dynamic_attention(module, hidden, context)
    assert absorbed_calls == [7] and mha_calls == [22]
    active = context.active_token_count
    scale = float(expected[:active].abs().max())
    assert float((got - expected).abs().max()) <= 2**-18 * scale


def test_graphed_and_decode_only_steps_and_off_mode_stay_absorbed(stack, monkeypatch, mha_calls):
    model = build_model(TINY)
    context = _context_step(model, [7, 19])
    module, hidden = _attention(model), _hidden(context, 3)
    monkeypatch.setattr(mla_prefill, "MODE", "force")
    with torch.no_grad():
        monkeypatch.setattr(context, "using_cuda_graph_this_step", lambda: True)
        mla_dynamic_inference.mla_dynamic_attention(module, hidden, context)
        monkeypatch.setattr(context, "using_cuda_graph_this_step", lambda: False)
        monkeypatch.setattr(context, "is_decode_only", lambda: True)
        mla_dynamic_inference.mla_dynamic_attention(module, hidden, context)
        monkeypatch.setattr(context, "is_decode_only", lambda: False)
        monkeypatch.setattr(mla_prefill, "MODE", "off")
        mla_dynamic_inference.mla_dynamic_attention(module, hidden, context)
        assert mha_calls == []
        monkeypatch.setattr(mla_prefill, "MODE", "force")
        mla_dynamic_inference.mla_dynamic_attention(module, hidden, context)
    assert mha_calls == [26]


def test_a_scale_past_the_mha_forms_bound_stays_absorbed(stack, monkeypatch, mha_calls):
    """Above MHA_MAX_SOFTMAX_SCALE a scaled logit can overflow in the MHA form's backends, so
    even ``force`` keeps the step absorbed (whose kernel takes any scale); at the bound it runs."""
    model = build_model(TINY)
    context = _context_step(model, [7, 19])
    module, hidden = _attention(model), _hidden(context, 3)
    monkeypatch.setattr(mla_prefill, "MODE", "force")
    bound = mla_prefill.MHA_MAX_SOFTMAX_SCALE
    with torch.no_grad():
        monkeypatch.setattr(module, "softmax_scale", math.nextafter(bound, math.inf))
        out, _ = mla_dynamic_inference.mla_dynamic_attention(module, hidden, context)
        assert mha_calls == [] and bool(out[: context.active_token_count].isfinite().all())
        monkeypatch.setattr(module, "softmax_scale", bound)
        mla_dynamic_inference.mla_dynamic_attention(module, hidden, context)
    assert mha_calls == [26]


def test_step_lengths_are_read_once_per_step_and_follow_the_step(stack):
    model = build_model(TINY)
    context = _context_step(model, [7, 19, 3])
    first = mla_prefill.step_lengths(context)
    assert first[0].tolist() == [7, 19, 3] and first[1].tolist() == [7, 19, 3]
    assert mla_prefill.step_lengths(context) is first  # same step: the cached copy
    # An in-place write (a new step's bookkeeping) makes it read again.
    context.request_query_lengths[0] += 0
    again = mla_prefill.step_lengths(context)
    assert again is not first and again[0].tolist() == [7, 19, 3]


# ------------------------------------------------------------------------------- rules


def test_cost_model_split_points_at_deepseek_widths():
    """The FlashAttention rates pick the form that measured faster on the H100 where the two
    differ by more than a tenth (eager calls of one layer's attention, ms, the step's plan and
    the decompression weights kept)."""

    def split(q, kv, heads=128, backend="flash"):
        model = mla_prefill.COST_MODELS[backend]
        return mla_prefill.absorbed_request_count(
            np.array(q), np.array(kv), heads, DEEPSEEK_WIDTHS, model
        )

    # Decode-only: absorbed.
    assert split([1] * 8, [4096] * 8) == 8
    # 128 heads: prefills and long chunks in the MHA form (2 x 1536: 1.28 against 3.92; 1024
    # behind 3072: 1.64 against 5.54; earlier, 4096: 3.96 against 14.5; behind 32k: 17.4
    # against 49.4).
    assert split([1536, 1536], [1536, 1536]) == 0
    assert split([4096], [4096]) == 0
    assert split([1024], [1024 + 3072]) == 0
    assert split([1024], [1024 + 32768]) == 0
    # 16 heads: the MHA form pays from 2 x 1536 (0.45 against 0.56: not all absorbed; the model
    # may keep a request absorbed, the host planning the rest meanwhile) and 1024 behind 3072
    # (0.35 against 0.74).
    assert split([1536, 1536], [1536, 1536], heads=16) < 2
    assert split([1024], [1024 + 3072], heads=16) == 0
    assert split([4096], [4096], heads=16) == 0
    assert split([8192], [8192], heads=16) == 0
    # A short chunk behind a long prefix: decompressing the prefix does not pay.
    assert split([64], [64 + 32768]) == 1
    # Mixed: 8 decodes (first, as megatron-core orders them) absorbed; the chunk in the MHA form
    # at 128 heads (0.62 against 1.39 for the whole step), absorbed at 16 (0.97 against 0.40).
    assert split([1] * 8 + [512], [4096] * 8 + [512 + 1024]) == 8
    assert split([1] * 8 + [512], [4096] * 8 + [512 + 1024], heads=16) == 9
    # A tiny step: the MHA form's host time keeps it absorbed.
    assert split([9, 30, 17], [9, 30, 17], heads=4) == 3
    # Dense cuDNN's rates (fresh prefills only): 2 x 1536 at 128 heads, 0.69 against 3.92.
    assert split([1536, 1536], [1536, 1536], backend="cudnn-dense") == 0


def test_an_absorbed_launch_of_prefill_tiles_is_floored_by_its_longest_rows():
    """8 decodes at 4k beside a 512 chunk on 1k, 16 heads, dense cuDNN's rates: absorbed, the
    step is one 4k decode's serial key loop (0.39 ms measured on an H100, where the FLOPs give
    0.14 ms); the split (decodes absorbed, the chunk in the MHA form) is bound by its host time
    (0.31 ms in the model, 0.30 ms measured): the split. Without the floor the model kept the
    step absorbed. A launch of decodes alone has no floor (it splits its keys)."""
    model = mla_prefill.COST_MODELS["cudnn-dense"]
    q, kv = np.array([1] * 8 + [512]), np.array([4096] * 8 + [512 + 1024])
    assert mla_prefill.absorbed_request_count(q, kv, 16, DEEPSEEK_WIDTHS, model) == 8
    no_floor = dataclasses.replace(model, absorbed_row_seconds=0.0)
    assert mla_prefill.absorbed_request_count(q, kv, 16, DEEPSEEK_WIDTHS, no_floor) == 9
    decodes = np.array([1] * 8), np.array([4096] * 8)
    assert mla_prefill.absorbed_request_count(*decodes, 16, DEEPSEEK_WIDTHS, model) == 8


def test_cost_model_keeps_cudnn_out_of_every_step():
    """torch's ragged cuDNN entry rebuilds its plan per call (tens of ms): never worth it."""
    model = mla_prefill.COST_MODELS["cudnn"]
    q, kv = np.array([8192]), np.array([8192])
    assert mla_prefill.absorbed_request_count(q, kv, 128, DEEPSEEK_WIDTHS, model) == 1
    assert mla_prefill.absorbed_request_count(q, kv, 128, DEEPSEEK_WIDTHS) == 0


def test_cost_model_counts_host_time_per_extra_chunk(monkeypatch):
    """Past the row budget each chunk adds ``mha_chunk_seconds`` of host time: a cost that moves
    the split."""

    def split(model, budget):
        monkeypatch.setattr(mha_form, "ROW_BUDGET", budget)
        q, kv = np.array([1024]), np.array([1024 + 32768])
        return mla_prefill.absorbed_request_count(q, kv, 128, DEEPSEEK_WIDTHS, model)

    cheap = mla_prefill.CostModel(mha_chunk_seconds=0.0)
    dear = mla_prefill.CostModel(mha_chunk_seconds=1e-3)
    assert split(cheap, 64) == split(dear, 2**20) == 0  # no chunk cost or a single chunk
    assert split(dear, 64) == 1  # 529 chunks of 64 rows: absorbed


def test_cost_model_takes_the_slower_of_host_and_gpu():
    """The MHA form's host time overlaps the GPU's work: a step whose GPU work outlasts it pays
    none of it, one that does not pays it whole."""
    q, kv = np.array([4096]), np.array([4096])
    gpu_bound = mla_prefill.CostModel(mha_fixed_seconds=1e-3)  # GPU work here: ~4 ms at 128 heads
    host_bound = mla_prefill.CostModel(mha_fixed_seconds=20e-3)
    assert mla_prefill.absorbed_request_count(q, kv, 128, DEEPSEEK_WIDTHS, gpu_bound) == 0
    assert mla_prefill.absorbed_request_count(q, kv, 128, DEEPSEEK_WIDTHS, host_bound) == 1


def test_where_the_host_bounds_two_splits_alike_the_one_with_less_gpu_work_wins():
    """Two fresh prefills of 1536 at 16 heads: the host's time bounds both the MHA form and the
    split that keeps one request absorbed; the MHA form's GPU work is less (the absorbed form
    was picked on the tie before, and ran at twice the MHA form's time)."""
    q = kv = np.array([1536, 1536])
    model = mla_prefill.COST_MODELS["cudnn-dense"]
    assert mla_prefill.absorbed_request_count(q, kv, 16, DEEPSEEK_WIDTHS, model) == 0
    # Without the tie (host time under both splits' GPU work) the cheaper GPU work wins as well.
    fast_host = dataclasses.replace(model, mha_fixed_seconds=1e-6)
    assert mla_prefill.absorbed_request_count(q, kv, 16, DEEPSEEK_WIDTHS, fast_host) == 0


def test_the_cost_models_split_is_worked_out_once_per_lengths_and_rates(monkeypatch):
    """Every layer of a step asks for the same split: worked out once, then kept by what it
    depends on (the lengths' values, heads, widths, rates, row budget), never by the arrays'
    identity."""
    worked_out = []
    original = mla_prefill._cheapest_split

    def counted(*args):
        worked_out.append(args)
        return original(*args)

    monkeypatch.setattr(mla_prefill, "_cheapest_split", counted)
    monkeypatch.setattr(mla_prefill, "_SPLITS", PlanCache(max_entries=64))
    # A short chunk behind a long prefix (absorbed), then a prefill (in the MHA form).
    q, kv = np.array([64, 4096]), np.array([64 + 32768, 4096])

    def split(model=mla_prefill.COST_MODEL, heads=128):
        return mla_prefill.absorbed_request_count(q, kv, heads, DEEPSEEK_WIDTHS, model)

    assert [split() for _ in range(4)] == [1] * 4 and len(worked_out) == 1
    q[1] = 1  # the same array, new values: a decode, absorbed too
    assert split() == 2 and len(worked_out) == 2
    q[1] = 4096  # the first values again: kept
    assert split() == 1 and len(worked_out) == 2
    assert split(mla_prefill.CostModel(mha_fixed_seconds=1.0)) == 2 and len(worked_out) == 3
    assert split(heads=1) == 2 and len(worked_out) == 4
    monkeypatch.setattr(mha_form, "ROW_BUDGET", 1)
    split()
    assert len(worked_out) == 5


def test_backend_rule(monkeypatch):
    cpu = torch.device("cpu")
    assert mla_prefill.backend_for(cpu, torch.float32) is None
    assert mla_prefill.backend_for(cpu, torch.bfloat16) is None
    assert mla_prefill.backend_for(cpu, torch.float32, "force") == "torch"
    monkeypatch.setattr(mla_prefill, "BACKEND", "cudnn")
    assert mla_prefill.backend_for(cpu, torch.bfloat16, "force") is None
    monkeypatch.setattr(mla_prefill, "BACKEND", "torch-bottom-right")
    assert mla_prefill.backend_for(cpu, torch.float32) == "torch-bottom-right"
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(mla_prefill, "BACKEND", "auto")
    usable = {"flash", "cudnn"}
    monkeypatch.setattr(mla_prefill, "_fused_usable", lambda backend, device: backend in usable)
    monkeypatch.setattr(mla_prefill, "_te_present", lambda: True)
    # FlashAttention first, then TE, then cuDNN (which rebuilds its plan on every call).
    assert mla_prefill.backend_for(cuda, torch.bfloat16) == "flash"
    assert mla_prefill.backend_for(cuda, torch.float16) == "flash"
    assert mla_prefill.backend_for(cuda, torch.float32) is None
    usable.discard("flash")
    assert mla_prefill.backend_for(cuda, torch.bfloat16) == "te"
    monkeypatch.setattr(mla_prefill, "_te_present", lambda: False)
    assert mla_prefill.backend_for(cuda, torch.bfloat16) == "cudnn"
    # A head size past FlashAttention's skips it without checking it.
    usable.add("flash")
    monkeypatch.setattr(mla_prefill, "_te_present", lambda: True)
    assert mla_prefill.backend_for(cuda, torch.bfloat16, head_dim=264) == "te"
    usable.clear()
    monkeypatch.setattr(mla_prefill, "_te_present", lambda: False)
    assert mla_prefill.backend_for(cuda, torch.bfloat16) is None
    # A backend named by the override is taken only where it runs.
    monkeypatch.setattr(mla_prefill, "BACKEND", "flash")
    assert mla_prefill.backend_for(cuda, torch.bfloat16) is None
    usable.add("flash")
    assert mla_prefill.backend_for(cuda, torch.bfloat16) == "flash"
    # Dense cuDNN stands in for FlashAttention where both run, and only there: not over a named
    # backend, not where the rule took another, not past FlashAttention's head size.
    usable.update({"cudnn-dense", "cudnn"})
    assert mla_prefill.backend_for(cuda, torch.bfloat16) == "flash"
    monkeypatch.setattr(mla_prefill, "BACKEND", "auto")
    assert mla_prefill.backend_for(cuda, torch.bfloat16) == "cudnn-dense"
    assert mla_prefill.backend_for(cuda, torch.bfloat16, head_dim=264) == "cudnn"
    usable.discard("flash")
    assert mla_prefill.backend_for(cuda, torch.bfloat16) == "cudnn"


def _split_of(monkeypatch, query_lengths, kv_lengths, heads=128):
    """mha_form_split on a stand-in module and context with these lengths, dense cuDNN the
    rule's backend."""
    config = types.SimpleNamespace(
        kv_lora_rank=512, qk_pos_emb_head_dim=64, qk_head_dim=128, v_head_dim=128
    )
    # DeepSeek-V3's scale: 192 ** -0.5 times YaRN's mscale (0.1 ln 40 + 1) squared.
    scale = 192**-0.5 * (0.1 * math.log(40) + 1) ** 2
    module = types.SimpleNamespace(
        config=config, num_attention_heads_per_partition=heads, softmax_scale=scale
    )
    context = types.SimpleNamespace(is_decode_only=lambda: False)
    lengths = (np.array(query_lengths), np.array(kv_lengths))
    monkeypatch.setattr(mla_prefill, "MODE", "auto")
    monkeypatch.setattr(mla_prefill, "step_lengths", lambda _: lengths)
    monkeypatch.setattr(mla_prefill, "backend_for", lambda *args: "cudnn-dense")
    return mla_prefill.mha_form_split(module, context, torch.zeros(1, heads, 192))


def test_prefill_and_chunk_steps_take_dense_cudnn_at_its_rates(monkeypatch):
    fresh = _split_of(monkeypatch, [1536, 1536], [1536, 1536])
    assert fresh.backend == "cudnn-dense" and fresh.absorbed_requests == 0
    chunk = _split_of(monkeypatch, [1024], [1024 + 3072])
    assert chunk.backend == "cudnn-dense" and chunk.absorbed_requests == 0
    mixed = _split_of(monkeypatch, [1] * 8 + [512], [4096] * 8 + [1536])
    assert mixed.backend == "cudnn-dense" and mixed.absorbed_requests == 8
    # The split is dense cuDNN's: at FlashAttention's rates a 96-token chunk behind 8k rows
    # stays absorbed, at dense cuDNN's it does not.
    widths = (512, 64, 128, 128)
    q, kv = np.array([96]), np.array([8192 + 96])
    flash = mla_prefill.absorbed_request_count(q, kv, 128, widths, mla_prefill.COST_MODELS["flash"])
    dense = mla_prefill.absorbed_request_count(
        q, kv, 128, widths, mla_prefill.COST_MODELS["cudnn-dense"]
    )
    assert (flash, dense) == (1, 0)
    assert mla_prefill.step_split(q, kv, 128, widths, "cudnn-dense") == 0
    assert mla_prefill.step_split(q, kv, 128, widths, "flash") == 1
    monkeypatch.setattr(mla_prefill, "MODE", "force")
    assert mla_prefill.step_split(q, kv, 128, widths, "flash") == 0


def test_the_backend_rule_checks_a_backend_only_when_it_reaches_it(monkeypatch):
    """The first usable backend ends the search: cuDNN's check call (tens of milliseconds where
    torch rebuilds its graph) does not run where FlashAttention is taken."""
    asked = []

    def usable(backend, device):
        asked.append(backend)
        return True

    monkeypatch.setattr(mla_prefill, "BACKEND", "auto")
    monkeypatch.setattr(mla_prefill, "_fused_usable", usable)
    # FlashAttention's stand-in is asked about after it; cuDNN's ragged entry never.
    assert mla_prefill.backend_for(torch.device("cuda", 0), torch.bfloat16) == "cudnn-dense"
    assert asked == ["flash", "cudnn-dense"]


@pytest.mark.parametrize(
    "backend, capability, problem, usable",
    [
        ("cudnn", (9, 0), None, True),
        ("cudnn", (9, 0), "it refused", False),
        ("cudnn", (8, 0), None, False),
        ("flash", (8, 0), None, True),
        ("flash", (9, 0), "it disagreed", False),
        ("flash", (7, 5), None, False),
        ("cudnn-dense", (8, 0), None, True),
        ("cudnn-dense", (9, 0), "it disagreed", False),
        ("cudnn-dense", (7, 5), None, False),
    ],
    ids=[
        "cudnn_hopper",
        "cudnn_check_fails",
        "cudnn_ampere",
        "flash_ampere",
        "flash_check_fails",
        "flash_turing",
        "cudnn_dense_ampere",
        "cudnn_dense_check_fails",
        "cudnn_dense_turing",
    ],
)
def test_a_fused_backend_is_used_where_the_gpu_takes_it_and_its_check_passes(
    monkeypatch, backend, capability, problem, usable
):
    """Decided once per backend and device: the GPU generation (sm90+ for cuDNN's ragged
    attention, sm80+ for FlashAttention), then the check call; a failed check warns; then the
    SDPA switch for the backend, read on every call."""
    checked = []

    def check(name, device):
        checked.append((name, device))
        return problem

    switch = {"on": True}
    monkeypatch.setattr(mla_prefill, "_DEVICE_SUPPORT", {})
    monkeypatch.setattr(mla_prefill.internals, "cudnn_attention_forward", object())
    monkeypatch.setattr(mla_prefill.internals, "flash_attention_forward", object())
    monkeypatch.setattr(mla_prefill.internals, "cudnn_dense_attention_forward", object())
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: switch["on"])
    monkeypatch.setattr(torch.backends.cuda, "flash_sdp_enabled", lambda: switch["on"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    monkeypatch.setattr(mla_prefill.mha_form, "ragged_check", check)
    device = torch.device("cuda", 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mla_prefill._fused_usable(backend, device) is usable
        assert mla_prefill._fused_usable(backend, device) is usable
        switch["on"] = False
        assert mla_prefill._fused_usable(backend, device) is False
    floor = (9, 0) if backend == "cudnn" else (8, 0)
    assert checked == ([(backend, torch.device("cuda", 3))] if capability >= floor else [])
    messages = [str(w.message) for w in caught]
    assert messages == (
        [f"megatron_ext: the MHA form does not use its {backend} backend on cuda:3: {problem}"]
        if problem
        else []
    )


@pytest.mark.parametrize("off", ["cudnn", "flash"])
def test_the_dense_cudnn_backend_needs_both_sdpa_switches(monkeypatch, off):
    """It runs cuDNN's entry in place of FlashAttention's: either switch off, and it is not
    used."""
    monkeypatch.setattr(mla_prefill, "_DEVICE_SUPPORT", {("cudnn-dense", 0): True})
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: off != "cudnn")
    monkeypatch.setattr(torch.backends.cuda, "flash_sdp_enabled", lambda: off != "flash")
    assert mla_prefill._fused_usable("cudnn-dense", torch.device("cuda", 0)) is False
    monkeypatch.setattr(torch.backends.cuda, f"{off}_sdp_enabled", lambda: True)
    assert mla_prefill._fused_usable("cudnn-dense", torch.device("cuda", 0)) is True


def test_capturing_stream_counts_as_graphed(monkeypatch):
    class Context:
        def using_cuda_graph_this_step(self):
            return False

    assert not mla_prefill.graphed_step(Context())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert mla_prefill.graphed_step(Context())


def test_backends_listed():
    assert set(mha_form.BACKENDS) == {
        "cudnn",
        "cudnn-dense",
        "flash",
        "te",
        "torch",
        "torch-bottom-right",
    }


# ------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_auto_mha_form_generation_matches_float64_in_bf16(stack, monkeypatch, mha_calls):
    """The auto mode on the GPU (the backend the rule picks, cost models without host time,
    which keeps 4-head steps absorbed): DeepSeek-like widths, prompts chunked over a 256-token
    step budget, the static bf16 bound."""
    monkeypatch.setattr(mla_prefill, "MODE", "auto")
    free = mla_prefill.CostModel(mha_fixed_seconds=0.0, mha_chunk_seconds=0.0)
    monkeypatch.setattr(mla_prefill, "COST_MODELS", {name: free for name in mha_form.BACKENDS})
    model = build_model(dict(DEEPSEEK_LIKE, max_sequence_length=1200), torch.bfloat16)
    requests = requests_for([900, 300, 40], 8, DEEPSEEK_LIKE["vocab_size"])
    engine, _, wrapper = build_mla_dynamic_engine(
        model,
        max_requests=8,
        max_tokens=256,
        max_sequence_length=1200,
        block_size_tokens=64,
        kv_blocks=64,
    )
    outputs, _ = run_engine(engine, requests)
    sequences = {i: requests[i][0] + outputs[i]["generated_tokens"] for i in outputs}
    from megatron_ext.testing.mla_dynamic_engine import teacher_forced_errors

    reference = small_mla_gpt.float64_copy(
        model, device=DEVICE, **dict(DEEPSEEK_LIKE, max_sequence_length=1200)
    )
    result = teacher_forced_errors(wrapper.rows, reference, sequences)
    assert result["max_abs_error"] <= result["largest_abs_logit"] / 16, result
    assert mha_calls, "the MHA form never ran"


@pytest.mark.gpu
@pytest.mark.skipif(not UPSTREAM_HAS_ACTIVE_SLICES, reason="0.16 reads the lengths from the GPU")
def test_gpu_mha_form_prefill_step_has_no_host_sync(stack, monkeypatch, mha_calls):
    """0.19 keeps the request bookkeeping on the host: the MHA form reads no device memory."""
    monkeypatch.setattr(mla_prefill, "MODE", "force")
    model = build_model(DEEPSEEK_LIKE, torch.bfloat16)
    context = _context_step(model, [9, 30, 17])
    module = _attention(model)
    hidden = torch.randn(
        int(context.padded_active_token_count),
        1,
        DEEPSEEK_LIKE["hidden_size"],
        dtype=torch.bfloat16,
        device=DEVICE,
    )
    with torch.no_grad():
        module(hidden, None, inference_context=context)  # plans outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            module(hidden, None, inference_context=context)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert len(mha_calls) == 2


@pytest.mark.gpu
def test_gpu_split_step_on_two_streams_equals_it_in_order(stack, monkeypatch, mha_calls):
    """A split step (two decodes absorbed, a chunk in the MHA form) with its parts on two
    streams and the chunk's calls on two more (MEGATRON_EXT_MLA_MHA_OVERLAP=on): the same bits
    as everything run in order on one stream, and no host synchronisation on 0.19."""
    monkeypatch.setattr(mla_prefill, "MODE", "auto")
    monkeypatch.setattr(mla_prefill, "OVERLAP_CALLS", True)
    monkeypatch.setattr(mla_prefill, "absorbed_request_count", lambda *args, **kwargs: 2)
    model = build_model(DEEPSEEK_LIKE, torch.bfloat16)
    context = _context_step(model, [1, 1, 40])
    module = _attention(model)
    generator = torch.Generator().manual_seed(11)
    hidden = torch.randn(
        int(context.padded_active_token_count), 1, DEEPSEEK_LIKE["hidden_size"], generator=generator
    ).to(DEVICE, torch.bfloat16)
    overlapped = mla_dynamic_inference.side_by_side
    with torch.no_grad():
        module(hidden, None, inference_context=context)  # plans and compiles outside the checks
        torch.cuda.synchronize()
        if UPSTREAM_HAS_ACTIVE_SLICES:
            torch.cuda.set_sync_debug_mode("error")
        try:
            got, _ = module(hidden, None, inference_context=context)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        in_order = functools.partial(overlapped, overlap=False)
        # Both levels in order: the step's two parts and the MHA form's calls of its chunk.
        monkeypatch.setattr(mla_dynamic_inference, "side_by_side", in_order)
        monkeypatch.setattr(mha_form, "side_by_side", in_order)
        expected, _ = module(hidden, None, inference_context=context)
    assert mha_calls == [40] * 3
    active = context.active_token_count
    moved = (got[:active] != expected[:active]).nonzero()
    assert not len(moved), f"the two-stream split's bits moved from the in-order run's at {moved}"


@pytest.mark.gpu
def test_gpu_engine_with_cuda_graphs_and_the_mha_form_generates_as_eager(stack, monkeypatch):
    """megatron-core's CUDA graphs (decode and small mixed steps graphed) with the MHA form
    forced in the eager steps: the same greedy tokens as the eager engine without the MHA form."""

    def mode(impl):
        monkeypatch.setattr(mla_prefill, "MODE", "off" if impl == "none" else "force")

    runs = dynamic.eager_and_graphed_runs(stack, mode)
    for request_id, eager in runs["none"].items():
        assert runs["local"][request_id]["generated_tokens"] == eager["generated_tokens"]


@pytest.mark.parametrize(
    "name, value",
    [
        ("MEGATRON_EXT_MLA_MHA_FORM", "on"),
        ("MEGATRON_EXT_MLA_MHA_BACKEND", "flash-attn"),
        ("MEGATRON_EXT_MLA_MHA_OVERLAP", "yes"),
    ],
)
def test_a_misspelt_setting_fails_at_import(name, value):
    """An unknown mode or backend is an error naming the variable, not the default in disguise."""
    import subprocess
    import sys

    env = {**os.environ, name: value}
    proc = subprocess.run(
        [sys.executable, "-c", "import megatron_ext.transformer.mla_prefill"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode != 0
    assert f"{name}={value!r}: expected one of" in proc.stderr


@pytest.mark.parametrize("overlap", [False, True])
def test_the_mha_form_core_passes_the_overlap_setting(monkeypatch, overlap):
    """The chunk's calls run side by side only where MEGATRON_EXT_MLA_MHA_OVERLAP says so (off
    by default: more host time per eager call)."""
    seen = {}

    def attention(*args, **kwargs):
        seen.update(kwargs)
        return "out"

    monkeypatch.setattr(mla_prefill, "mla_paged_mha_attention", attention)
    monkeypatch.setattr(mla_prefill, "OVERLAP_CALLS", overlap)
    lengths = np.array([3, 5], dtype=np.int64)
    split = mla_prefill.MhaFormSplit("torch", lengths, lengths + 2, 1, 3, 3)
    module = types.SimpleNamespace(
        linear_kv_up_proj=types.SimpleNamespace(weight="w"),
        softmax_scale=0.5,
        config=types.SimpleNamespace(qk_pos_emb_head_dim=64),
    )
    table = torch.zeros(2, 4, dtype=torch.int32)
    assert mla_prefill.mha_form_core(module, "q", "cache", table, split) == "out"
    assert seen["overlap"] is overlap and seen["backend"] == "torch"
    assert list(seen["query_lengths"]) == [5] and list(seen["kv_lengths"]) == [7]


def test_the_overlap_setting_is_off_by_default():
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_EXT_MLA_MHA_OVERLAP"}
    code = "import megatron_ext.transformer.mla_prefill as m; print(m.OVERLAP_CALLS)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "False"


def test_mha_form_mode_sets_and_restores_the_process_wide_mode():
    before = mla_prefill.MODE
    with mla_prefill.mha_form_mode("force"):
        assert mla_prefill.MODE == "force"
        with mla_prefill.mha_form_mode("auto"):
            assert mla_prefill.MODE == "auto"
        assert mla_prefill.MODE == "force"
    assert mla_prefill.MODE == before
    with pytest.raises(RuntimeError, match="inside"):
        with mla_prefill.mha_form_mode("auto"):
            raise RuntimeError("inside")
    assert mla_prefill.MODE == before
    with pytest.raises(ValueError, match="'on': expected one of auto, off, force"):
        with mla_prefill.mha_form_mode("on"):
            pass
    assert mla_prefill.MODE == before
