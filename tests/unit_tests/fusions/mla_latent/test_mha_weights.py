# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of the MHA form's decompression weights (megatron_ext.fusions.mla_latent.mha_weights):
their layout, the decompression through them, and when a kept layout is reused, rebuilt or
dropped."""

import gc

import pytest
import torch

from megatron_ext.fusions.mla_latent import mha_form, mha_weights
from megatron_ext.fusions.mla_latent.mha_form import mla_paged_mha_attention
from tests.unit_tests.fusions.mla_latent.mha_testlib import SCALE, mha_step, reference

HEADS, QK, ROPE, V, LATENT = 3, 5, 4, 6, 7


def _weight(dtype=torch.float64, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(HEADS * (QK + V), LATENT, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_up_projections_lay_keys_and_values_out_at_their_widths(dtype):
    """Per head: W_UK's rows, an identity onto the RoPE part, zeros on; W_UV's rows, then zeros.
    The decompressed rows are the GEMMs' results, with the cached RoPE part copied exactly."""
    weight = _weight(dtype)
    keys, values = mha_weights.up_projections(weight, HEADS, QK, ROPE, 16, 8)
    per_head = weight.view(HEADS, QK + V, LATENT)
    keys, values = keys.view(HEADS, 16, LATENT + ROPE), values.view(HEADS, 8, LATENT)
    assert torch.equal(keys[:, :QK, :LATENT], per_head[:, :QK]) and not keys[:, :QK, LATENT:].any()
    rope_rows = torch.zeros(ROPE, LATENT + ROPE, dtype=dtype)
    rope_rows[:, LATENT:] = torch.eye(ROPE, dtype=dtype)
    assert torch.equal(keys[:, QK : QK + ROPE], rope_rows.expand(HEADS, -1, -1))
    assert not keys[:, QK + ROPE :].any()
    assert torch.equal(values[:, :V], per_head[:, QK:]) and not values[:, V:].any()


def _decompress(cache, dtype):
    """Six rows of one request whose table holds block 1 then block 0, through the layout."""
    weight = _weight(dtype)
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    positions = torch.arange(6)
    index = torch.stack([positions // 4, positions % 4]).int()  # request 0: table place = column
    up = mha_weights.up_projections(weight, HEADS, QK, ROPE, QK + ROPE, V)
    return weight, mha_form.decompressed_keys_values(cache, table, index, up, HEADS, ROPE)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_decompression_gives_the_gemms_results_and_the_rope_part_exactly(dtype):
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(2, 4, LATENT + ROPE, generator=gen).to(dtype)
    weight, (k, val) = _decompress(cache, dtype)
    per_head = weight.view(HEADS, QK + V, LATENT)
    rows = cache[[1, 0]].reshape(-1, LATENT + ROPE)[:6]  # block 1's rows, then block 0's
    assert k.is_contiguous() and val.is_contiguous()
    # The RoPE part bit for bit: a product by 1.0 and sums of zeros.
    assert torch.equal(k[..., QK:], rows[:, None, LATENT:].expand(-1, HEADS, ROPE))
    tol = dict(rtol=0, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-2, atol=1e-2)
    expected_k = rows[:, :LATENT].double() @ per_head[:, :QK].double().reshape(-1, LATENT).t()
    torch.testing.assert_close(k[..., :QK].double(), expected_k.view(6, HEADS, QK), **tol)
    expected_v = rows[:, :LATENT].double() @ per_head[:, QK:].double().reshape(-1, LATENT).t()
    torch.testing.assert_close(val.double(), expected_v.view(6, HEADS, V), **tol)


def test_a_cache_whose_blocks_are_not_one_run_of_rows_is_gathered_the_same():
    """Blocks strided apart (not viewable as one [rows, width] matrix) take the indexed gather:
    the same rows, the same bits."""
    gen = torch.Generator().manual_seed(5)
    packed = torch.randn(2, 4, LATENT + ROPE, generator=gen, dtype=torch.float64)
    strided = torch.zeros(2, 5, LATENT + ROPE, dtype=torch.float64)[:, :4]
    strided.copy_(packed)
    assert strided.stride(0) != 4 * strided.stride(1)
    _, (k_packed, v_packed) = _decompress(packed, torch.float64)
    _, (k_strided, v_strided) = _decompress(strided, torch.float64)
    assert torch.equal(k_packed, k_strided) and torch.equal(v_packed, v_strided)


def test_a_kept_layout_is_reused_while_the_weight_is_unchanged():
    weight = _weight()
    first = mha_weights.cached_up_projections(weight, HEADS, QK, ROPE, 16, 8)
    again = mha_weights.cached_up_projections(weight, HEADS, QK, ROPE, 16, 8)
    assert all(a is b for a, b in zip(first, again)), "an unchanged weight's layout was rebuilt"
    other_widths = mha_weights.cached_up_projections(weight, HEADS, QK, ROPE, QK + ROPE, V)
    assert other_widths[0].shape != first[0].shape


def test_an_in_place_write_to_the_weight_rebuilds_its_layout():
    weight = _weight()
    before = mha_weights.cached_up_projections(weight, HEADS, QK, ROPE, 16, 8)
    with torch.no_grad():
        weight.mul_(2)  # what an optimizer step or a checkpoint load does
    after = mha_weights.cached_up_projections(weight, HEADS, QK, ROPE, 16, 8)
    assert torch.equal(after[0], mha_weights.up_projections(weight, HEADS, QK, ROPE, 16, 8)[0])
    assert not torch.equal(after[0], before[0]), "the old layout was served after the write"


def test_a_layout_goes_with_its_weight():
    mha_weights.clear_up_projections()
    weight = _weight()
    mha_weights.cached_up_projections(weight, HEADS, QK, ROPE, 16, 8)
    assert mha_weights.kept_up_projections() == 1
    del weight
    gc.collect()
    assert mha_weights.kept_up_projections() == 0, "a freed weight's layout stayed in memory"


def test_under_autograd_nothing_is_kept_and_gradients_reach_the_weight():
    mha_weights.clear_up_projections()
    weight = _weight().requires_grad_()
    keys, values = mha_weights.cached_up_projections(weight, HEADS, QK, ROPE, 16, 8)
    assert mha_weights.kept_up_projections() == 0
    (keys.sum() + values.sum()).backward()
    assert weight.grad is not None and torch.equal(weight.grad, torch.ones_like(weight))


def test_attention_after_an_in_place_weight_update_uses_the_new_weight():
    """Two calls with one weight object, written in place between them: the second answer is
    the float64 reference's for the new values, not the kept layout's."""
    step, query, cache, weight, lengths = mha_step([(5, 2), (0, 3)], 2, seed=6)
    call = dict(rope_dim=16, backend="torch-bottom-right", **lengths)
    mla_paged_mha_attention(query, cache, step.block_table, weight, SCALE, **call)
    with torch.no_grad():
        weight.mul_(1.5)
    got = mla_paged_mha_attention(query, cache, step.block_table, weight, SCALE, **call)
    expected = reference(step, query, cache, weight, lengths)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-5)
