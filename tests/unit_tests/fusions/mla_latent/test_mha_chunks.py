# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of the MHA form's chunks of attended rows (megatron_ext.fusions.mla_latent.mha_chunks):
row budgets that split requests across chunks keep the result, and a step in one chunk writes its
calls' outputs straight out with the merge's bits. The merge itself: test_mha_merge.py.
"""

import pytest
import torch

from megatron_ext.fusions.mla_latent import (
    mha_backends,
    mha_form,
    mha_plan,
)
from megatron_ext.fusions.mla_latent.mha_form import mla_paged_mha_attention
from tests.unit_tests.fusions.mla_latent.mha_testlib import (
    CHUNKED,
    CPU_BACKENDS,
    MIXED,
    PREFILL,
    SCALE,
    assert_buckets,
    cudnn_stand_in,
    deepseek_step,
    flash_stand_in,
    mha_step,
    reference,
)

BEHIND_LONG_PREFIX = [(150, 7)]


LONGER_THAN_BUDGET = [(0, 45)]


BUDGET_CASES = [PREFILL, BEHIND_LONG_PREFIX, MIXED, LONGER_THAN_BUDGET, [(20, 40), (0, 3)]]


BUDGET_IDS = ["prefill", "behind_long_prefix", "mixed", "longer_than_budget", "long_chunk_first"]


def _recorded_rows(monkeypatch) -> list:
    """Record the rows of every decompression (keys and values built at once)."""
    rows = []
    original = mha_form.decompressed_keys_values

    def spy(*args, **kwargs):
        keys, values = original(*args, **kwargs)
        assert keys.shape[0] == values.shape[0]
        rows.append(keys.shape[0])
        return keys, values

    monkeypatch.setattr(mha_form, "decompressed_keys_values", spy)
    return rows


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("requests", BUDGET_CASES, ids=BUDGET_IDS)
@pytest.mark.parametrize("budget", [1, 5, 16])
def test_a_row_budget_bounds_the_rows_and_keeps_the_result(monkeypatch, backend, requests, budget):
    """Many chunks (a request's rows split across them, the new tokens' block too): the rows
    decompressed at once stay within the budget, each row once, and the result is the unchunked
    one within fp32 rounding and float64's within its bound."""
    step, query, cache, weight, lengths = mha_step(requests, 3, seed=budget)
    call = dict(rope_dim=16, backend=backend, **lengths)
    rows = _recorded_rows(monkeypatch)
    whole = mla_paged_mha_attention(query, cache, step.block_table, weight, SCALE, **call)
    attended = sum(lengths["kv_lengths"])
    assert rows == [attended]
    rows.clear()
    got = mla_paged_mha_attention(
        query, cache, step.block_table, weight, SCALE, row_budget=budget, **call
    )
    assert max(rows) <= budget and sum(rows) == attended
    assert len(rows) == -(-attended // budget)
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-6)
    expected = reference(step, query, cache, weight, lengths)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("backend", CPU_BACKENDS + ("flash",))
@pytest.mark.parametrize("requests", [PREFILL, MIXED], ids=["prefill", "mixed"])
def test_writing_calls_straight_out_gives_the_merged_bits(monkeypatch, backend, requests):
    """Where each token is in one call its output is written straight into the result; the
    merge into an accumulator (forced here) gives the same bits, and only it merges."""
    monkeypatch.setattr(mha_backends.internals, "flash_attention_forward", flash_stand_in([]))
    merges = []
    merge = mha_form.merge_partials_into
    monkeypatch.setattr(mha_form, "merge_partials_into", lambda *a: merges.append(1) or merge(*a))
    step, query, cache, weight, lengths = mha_step(requests, 3, seed=12)
    call = dict(rope_dim=16, backend=backend, **lengths)
    direct = mla_paged_mha_attention(query, cache, step.block_table, weight, SCALE, **call)
    # Top-left masks take a cached prefix and the new rows in two calls: their tokens merge.
    assert bool(merges) == (backend == "torch" and requests is MIXED), merges
    merges.clear()
    monkeypatch.setattr(mha_plan, "each_token_once", lambda *a: False)
    mha_plan.MHA_PLANS.clear()  # the step's plan, kept from the first call, said "direct"
    merged = mla_paged_mha_attention(query, cache, step.block_table, weight, SCALE, **call)
    assert merges, "the forced merge path did not merge"
    assert torch.equal(
        direct.view(torch.int32), merged.view(torch.int32)
    ), f"the direct write moved bits against the merge: {(direct != merged).sum()} elements"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_budget_over_the_rows_is_the_unchunked_result_exactly(backend):
    step, query, cache, weight, lengths = mha_step(MIXED, 3, seed=8)
    call = dict(rope_dim=16, backend=backend, **lengths)
    default = mla_paged_mha_attention(query, cache, step.block_table, weight, SCALE, **call)
    exact = mla_paged_mha_attention(
        query, cache, step.block_table, weight, SCALE, row_budget=sum(lengths["kv_lengths"]), **call
    )
    assert torch.equal(default, exact)


def test_the_module_budget_is_the_default(monkeypatch):
    step, query, cache, weight, lengths = mha_step(CHUNKED, 2, seed=10)
    rows = _recorded_rows(monkeypatch)
    monkeypatch.setattr(mha_form, "ROW_BUDGET", 20)
    mla_paged_mha_attention(query, cache, step.block_table, weight, SCALE, rope_dim=16, **lengths)
    assert max(rows) <= 20 and sum(rows) == sum(lengths["kv_lengths"])


@pytest.mark.parametrize("requests", BUDGET_CASES, ids=BUDGET_IDS)
def test_cudnn_glue_with_a_row_budget(monkeypatch, requests):
    """The cuDNN backend chunked (budget 16, its smallest bucket): causal calls only on square
    blocks, every shape a bucket, float64's result."""
    seen = []
    monkeypatch.setattr(mha_backends.internals, "cudnn_attention_forward", cudnn_stand_in(seen))
    rows = _recorded_rows(monkeypatch)
    step, query, cache, weight, lengths = mha_step(requests, 3, seed=11)
    chunked = dict(rope_dim=16, backend="cudnn", row_budget=16, **lengths)
    got = mla_paged_mha_attention(query, cache, step.block_table, weight, SCALE, **chunked)
    torch.testing.assert_close(
        got.double(), reference(step, query, cache, weight, lengths), rtol=1e-5, atol=2e-5
    )
    assert_buckets(seen)
    # Two padded sections per chunk (cached rows, new rows): each at most a bucket of the budget.
    assert max(rows) <= 2 * 16 and len(rows) == -(-sum(lengths["kv_lengths"]) // 16)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "requests",
    [MIXED, [(3072, 1024)], [(0, 1536), (0, 1536)], [(5000, 300), (0, 700), (40, 1)]],
    ids=["mixed", "chunk_behind_3k", "prefill_2x1536", "long_and_short"],
)
@pytest.mark.parametrize("budget", [16, 1024])
@pytest.mark.parametrize("backend", ["cudnn", "cudnn-dense", "flash"])
def test_gpu_merging_backends_with_a_row_budget_match_float64_in_bf16(requests, budget, backend):
    """The backends that return log-sum-exps with a small budget: requests split across
    chunks, the new tokens' block too, partial results merged."""
    if backend not in mha_backends.present_backends():
        pytest.skip(f"the {backend} backend is not available here")
    step, query, cache, weight, lengths = deepseek_step(requests, 16, torch.bfloat16)
    chunked = dict(rope_dim=64, backend=backend, row_budget=budget, **lengths)
    got = mla_paged_mha_attention(query, cache, step.block_table, weight, SCALE, **chunked)
    expected = reference(step, query, cache, weight, lengths)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2**-4)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "requests",
    [[(1024, 512)], MIXED, [(5000, 300), (0, 700), (40, 1)]],
    ids=["chunk_behind_1k", "mixed", "long_and_short"],
)
@pytest.mark.parametrize("heads", [16, 128])
# flash's plan (bottom-right) has one call per chunk here: nothing to put side by side.
@pytest.mark.parametrize("backend", ["cudnn", "cudnn-dense"])
def test_gpu_a_chunks_calls_on_two_streams_give_the_in_order_bits(
    monkeypatch, requests, heads, backend
):
    """A chunk's merged calls side by side (its first call on the side stream): the bits of the
    same calls run in order on one stream, in bf16 at DeepSeek-V3's widths."""
    if backend not in mha_backends.present_backends():
        pytest.skip(f"the {backend} backend is not available here")
    step, query, cache, weight, lengths = deepseek_step(requests, heads, torch.bfloat16)
    args = (query, cache, step.block_table, weight, SCALE)
    kwargs = dict(rope_dim=64, backend=backend, **lengths)
    streams = []
    attention = mha_form.varlen_attention

    def recording(*call_args):
        streams.append(torch.cuda.current_stream().cuda_stream)
        return attention(*call_args)

    monkeypatch.setattr(mha_form, "varlen_attention", recording)
    mla_paged_mha_attention(*args, overlap=True, **kwargs)  # plans and builds graphs first
    streams.clear()
    got = mla_paged_mha_attention(*args, overlap=True, **kwargs)
    main_stream = torch.cuda.current_stream().cuda_stream
    # Each chunk's first call on the side stream, the others on the current one.
    assert streams[0] != main_stream and set(streams) == {streams[0], main_stream}
    streams.clear()
    expected = mla_paged_mha_attention(*args, **kwargs)  # the default: in order
    assert set(streams) == {main_stream}
    moved = (got != expected).nonzero()
    assert not len(moved), f"the two-stream calls' bits moved from the in-order run's at {moved}"
