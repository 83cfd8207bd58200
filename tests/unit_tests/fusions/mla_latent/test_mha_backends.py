# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of the MHA form's ragged attention backends
(megatron_ext.fusions.mla_latent.mha_backends): each fused backend's glue with a stand-in for
torch's operator (or Transformer Engine's module) that keeps its contract, through the MHA form's
entry, and each backend's once-per-device check; tests marked ``gpu`` run the real operators in
bf16 against float64.
"""

import math
import sys
import types

import numpy as np
import pytest
import torch

from megatron_ext.fusions.mla_latent import (
    mha_backends,
    mha_form,
    mha_plan,
    mha_weights,
)
from megatron_ext.fusions.mla_latent.mha_form import bucket, mla_paged_mha_attention
from tests.unit_tests.fusions.mla_latent.mha_testlib import (
    CHUNKED,
    MIXED,
    NINE,
    PREFILL,
    SCALE,
    assert_buckets,
    cudnn_dense_stand_in,
    cudnn_stand_in,
    deepseek_step,
    dense_backend,
    flash_stand_in,
    matches_float64,
    mha_step,
    reference,
)


def test_bucket_rounds_up_by_at_most_a_quarter():
    for value in list(range(0, 300)) + [1000, 4097, 32768 + 1, 10**6]:
        b = bucket(value)
        assert b >= max(value, 16) and b <= max(16, value * 1.25 + 1), (value, b)
        assert b == bucket(b)
    assert len({bucket(v) for v in range(16, 4097)}) <= 4 * 8 + 1


def test_top_left_and_bottom_right_torch_backends_differ_where_they_should():
    """The split backend's top-left mask on a chunk behind a prefix, without the prefix call,
    would be wrong: check that the merge is what makes them agree."""
    step, query, cache, weight, lengths = mha_step(CHUNKED, 2, seed=6)
    q_lens = np.array(lengths["query_lengths"])
    kv_lens = np.array(lengths["kv_lengths"])
    k, v = torch.randn(int(kv_lens.sum()), 2, 48), torch.randn(int(kv_lens.sum()), 2, 32)
    q = torch.randn(int(q_lens.sum()), 2, 48)
    top_left, _ = mha_form.varlen_attention(
        "torch", q, k, v, (q_lens, kv_lens), "top_left", 0.3, False
    )
    bottom_right, _ = mha_form.varlen_attention(
        "torch", q, k, v, (q_lens, kv_lens), "bottom_right", 0.3, False
    )
    assert not torch.allclose(top_left, bottom_right)


@pytest.mark.parametrize("stats_layout", ["THk", "HT"])
@pytest.mark.parametrize("requests", [PREFILL, CHUNKED, MIXED], ids=["prefill", "chunked", "mixed"])
def test_cudnn_glue_with_a_stand_in_operator(monkeypatch, requests, stats_layout):
    """The cuDNN backend's packing, bucketing, stats layouts and merge, with a stand-in for
    torch's operator."""
    seen = []
    monkeypatch.setattr(mha_backends.internals, "cudnn_attention_forward", cudnn_stand_in(seen))
    step, query, cache, weight, lengths = mha_step(requests, 3, seed=7)
    got = mla_paged_mha_attention(
        query, cache, step.block_table, weight, SCALE, rope_dim=16, backend="cudnn", **lengths
    )
    expected = reference(step, query, cache, weight, lengths)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-5)
    assert_buckets(seen)
    has_prefix = any(cached for cached, _ in requests)
    assert len(seen) == 1 + has_prefix


@pytest.mark.parametrize("supported", [True, False])
def test_the_request_count_is_bucketed_only_where_cudnn_takes_empty_sequences(
    monkeypatch, supported
):
    seen = []
    monkeypatch.setattr(mha_backends.internals, "cudnn_attention_forward", cudnn_stand_in(seen))
    monkeypatch.setattr(mha_backends, "empty_sequences_supported", lambda: supported)
    step, query, cache, weight, lengths = mha_step(NINE, 2, seed=8)
    got = mla_paged_mha_attention(
        query, cache, step.block_table, weight, SCALE, rope_dim=16, backend="cudnn", **lengths
    )
    expected = reference(step, query, cache, weight, lengths)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-5)
    # Two calls: the cached prefixes (8 requests have one) and the new tokens' diagonal (9).
    assert sorted(entries for _, _, entries, _, _ in seen) == ([8, 10] if supported else [8, 9])


def test_empty_sequences_need_cudnn_9_25(monkeypatch):
    mha_backends.empty_sequences_supported.cache_clear()
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    try:
        for version, supported in ((92401, False), (92500, True), (None, False)):
            monkeypatch.setattr(torch.backends.cudnn, "version", lambda v=version: v)
            mha_backends.empty_sequences_supported.cache_clear()
            assert mha_backends.empty_sequences_supported() is supported, version
    finally:
        mha_backends.empty_sequences_supported.cache_clear()


def _refusing_operator(*args, **kwargs):
    raise RuntimeError("cuDNN varlen attention requires cuDNN >= 9.24 for short queries")


def _unmasked_operator(*args, scale):
    """Takes every call as unmasked (``is_causal`` is the 11th argument): a causal call comes out
    wrong."""
    return cudnn_stand_in([])(*args[:10], False, *args[11:], scale=scale)


def _scrambled_stats_operator(*args, **kwargs):
    """Right outputs, the log-sum-exp's rows in the wrong order (a misread stats layout)."""
    out, lse = cudnn_stand_in([])(*args, **kwargs)
    return out, lse.flip(0)


@pytest.mark.parametrize(
    "operator, problem",
    [
        (cudnn_stand_in([]), None),
        (_refusing_operator, "refused a top_left call: cuDNN varlen attention requires"),
        (_unmasked_operator, "disagreed with plain torch on a top_left call"),
        (_scrambled_stats_operator, "disagreed with plain torch on a top_left call"),
    ],
    ids=["faithful", "refusing", "unmasked", "scrambled_stats"],
)
def test_cudnn_ragged_check(monkeypatch, operator, problem):
    """The once-per-device check passes an operator of the assumed contract and names what is
    wrong with one that refuses the call or answers differently."""
    monkeypatch.setattr(mha_backends.internals, "cudnn_attention_forward", operator)
    found = mha_form.ragged_check("cudnn", torch.device("cpu"))
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found, found


@pytest.mark.parametrize("budget", [None, 16])
@pytest.mark.parametrize(
    "requests", [PREFILL, CHUNKED, MIXED, NINE], ids=["prefill", "chunked", "mixed", "nine"]
)
def test_cudnn_dense_glue_with_stand_in_operators(monkeypatch, requests, budget):
    """The dense cuDNN backend, top-left: square causal blocks batched by length bucket with the
    causal flag (padded rows and empty sequences), the rows before them (a chunk's cached
    prefix, a cut chunk's rest) in unmasked calls batched by bucketed lengths, merged; never a
    causal bias, never FlashAttention's entry; float64's result."""
    seen, flash_seen = [], []
    dense_backend(monkeypatch, seen, flash_seen)
    matches_float64(requests, "cudnn-dense", budget, seed=13)
    assert seen and all(length == bucket(length) and batch >= 1 for batch, length, *_ in seen)
    assert flash_seen == []
    assert not any(bias and causal for *_, bias, causal in seen)
    # A cached prefix (or, under a budget, rows of an earlier chunk) takes an unmasked call.
    has_prefix = any(cached for cached, _ in requests)
    unmasked = any(not causal for *_, causal in seen)
    assert unmasked == has_prefix if budget is None else unmasked >= has_prefix


@pytest.mark.parametrize("budget", [None, 9 * 16])
def test_cudnn_dense_fresh_prefills_run_on_views_and_write_the_result_once(monkeypatch, budget):
    """Thirteen fresh 16-token prompts (13 and 9 sit between buckets), in one chunk or in chunks
    of nine and four: every dense call a view of the packed rows (no padded batch), and, where
    the step is more than one call, each call's groups write straight into the result's rows
    (no output of the call to copy there); float64's result."""
    seen, outs = [], []
    dense_backend(monkeypatch, seen)
    square = mha_backends.square_causal_attention

    def spy(*args):
        outs.append(args[6] if len(args) > 6 else None)
        return square(*args)

    monkeypatch.setattr(mha_backends, "square_causal_attention", spy)
    requests = [(0, 16)] * 13
    matches_float64(requests, "cudnn-dense", budget, seed=5)
    # Batches of 12 and 1, or 8 and 1 then 4 (no batch padded past its sequences).
    want = [(12, 16), (1, 16)] if budget is None else [(8, 16), (1, 16), (4, 16)]
    assert [(b, n) for b, n, *_ in seen] == want
    # One call: its result is the step's (nothing to write into); chunks: each into its rows.
    if budget is None:
        assert outs == [None]
    else:
        assert [None if o is None else o.shape[0] for o in outs] == [144, 64]
        assert outs[0].untyped_storage().data_ptr() == outs[1].untyped_storage().data_ptr()


@pytest.mark.parametrize(
    "qk_dim, v_dim", [(32, 32), (12, 60), (13, 21)], ids=["v_narrower", "v_wider", "odd_widths"]
)
@pytest.mark.parametrize("budget", [None, 16])
@pytest.mark.parametrize(
    "requests", [PREFILL, CHUNKED, MIXED, NINE], ids=["prefill", "chunked", "mixed", "nine"]
)
def test_flash_glue_with_a_stand_in_operator(monkeypatch, requests, budget, qk_dim, v_dim):
    """The FlashAttention backend's operands padded to one head size (a multiple of 8), the
    padding dropped, its log-sum-exp layout and the merge across chunks of rows, with a
    stand-in for torch's operator."""
    seen = []
    monkeypatch.setattr(mha_backends.internals, "flash_attention_forward", flash_stand_in(seen))
    lengths = matches_float64(requests, "flash", budget, seed=9, qk_dim=qk_dim, v_dim=v_dim)
    rows = sum(lengths["kv_lengths"][r] for r, q in enumerate(lengths["query_lengths"]) if q)
    # Sizes are not bucketed: one call over every attended row, or one per chunk and more.
    assert len(seen) == 1 if budget is None else len(seen) >= -(-rows // budget), seen
    assert sum(k[0] for _, k, _, _ in seen) >= rows


@pytest.mark.parametrize("backend", ["cudnn", "cudnn-dense", "flash"])
def test_ragged_check_of_each_backend_passes_a_faithful_operator(monkeypatch, backend):
    monkeypatch.setattr(mha_backends.internals, "cudnn_attention_forward", cudnn_stand_in([]))
    dense_backend(monkeypatch)
    assert mha_form.ragged_check(backend, torch.device("cpu")) is None


@pytest.mark.parametrize("ignores", ["causal flag", "bias"])
def test_dense_cudnn_check_refuses_an_operator_that_drops_a_mask(monkeypatch, ignores):
    """A dense operator that ignores the causal flag (the square path) or the bias (the
    unmasked path's padding) disagrees with plain torch on that call: refused, the call
    named."""
    seen = []
    faithful = cudnn_dense_stand_in(seen)

    def unfaithful(q, k, v, bias, want_lse, dropout, causal, debug, *, scale):
        if ignores == "bias":
            bias = None
        return faithful(
            q,
            k,
            v,
            bias,
            want_lse,
            dropout,
            causal and ignores != "causal flag",
            debug,
            scale=scale,
        )

    monkeypatch.setattr(mha_backends.internals, "cudnn_dense_attention_forward", unfaithful)
    problem = mha_form.ragged_check("cudnn-dense", torch.device("cpu"))
    call = "top_left" if ignores == "causal flag" else "unmasked"
    assert problem is not None and "dense cuDNN" in problem and f"a {call} call" in problem
    assert seen, "the check never reached the operator"


def _top_left_flash(*args, scale):
    """FlashAttention's contract but the causal mask aligned top-left (an older alignment)."""
    q, k, v, cu_q, cu_k = args[:5]
    q_lens, k_lens = np.diff(cu_q.cpu().numpy()), np.diff(cu_k.cpu().numpy())
    causal = "top_left" if args[8] else None
    out, lse = mha_backends.torch_varlen(q, k, v, q_lens, k_lens, causal, scale)
    return out, lse.t().contiguous(), None, None, None


def _padded_lse_flash(*args, scale):
    """Right outputs, the log-sum-exp as [requests, heads, longest] (older FlashAttention)."""
    out, lse, *rest = flash_stand_in([])(*args, scale=scale)
    return (out, lse.reshape(lse.shape[0], 3, -1).transpose(0, 1).flip(-1), *rest)


@pytest.mark.parametrize(
    "operator, problem",
    [
        (_top_left_flash, "FlashAttention disagreed with plain torch on a bottom_right call"),
        (_padded_lse_flash, "refused a bottom_right call: FlashAttention's log-sum-exp has shape"),
        (_refusing_operator, "FlashAttention refused a bottom_right call"),
    ],
    ids=["top_left_mask", "padded_lse", "refusing"],
)
def test_flash_ragged_check_names_what_is_wrong(monkeypatch, operator, problem):
    monkeypatch.setattr(mha_backends.internals, "flash_attention_forward", operator)
    found = mha_form.ragged_check("flash", torch.device("cpu"))
    assert found is not None and problem in found, found


def test_flash_gives_a_query_without_keys_zeros_and_a_log_sum_exp_of_minus_inf(monkeypatch):
    """FlashAttention answers +inf for a query with no key (here the first of three queries on
    two keys, bottom-right causal); the merge takes -inf as nothing."""
    monkeypatch.setattr(mha_backends.internals, "flash_attention_forward", flash_stand_in([]))
    gen = torch.Generator().manual_seed(3)
    q_lens, k_lens = np.array([3, 2]), np.array([2, 4])
    q = torch.randn(5, 2, 24, generator=gen)
    k, v = torch.randn(6, 2, 24, generator=gen), torch.randn(6, 2, 16, generator=gen)
    causal = "bottom_right"
    out, lse = mha_form.varlen_attention("flash", q, k, v, (q_lens, k_lens), causal, 0.5, True)
    assert torch.equal(out[0], torch.zeros(2, 16))
    assert torch.equal(lse[0], torch.full((2,), -math.inf))
    want, want_lse = mha_backends.torch_varlen(q, k, v, q_lens, k_lens, causal, 0.5)
    torch.testing.assert_close(out[1:], want[1:])
    torch.testing.assert_close(lse[1:], want_lse[1:])


@pytest.mark.parametrize("backend", ["flash", "cudnn-dense"])
def test_head_sizes_past_256_are_refused_before_any_work(monkeypatch, backend):
    """FlashAttention's largest head size, which the dense cuDNN backend is held to too: refused
    before either operator is called."""
    seen = []
    dense_backend(monkeypatch, seen, seen)
    step, query, cache, weight, lengths = mha_step(CHUNKED, 2, v_dim=300)
    message = f"the {backend} backend runs head sizes up to 256; .* 304"
    with pytest.raises(ValueError, match=message):
        mla_paged_mha_attention(
            query, cache, step.block_table, weight, SCALE, rope_dim=16, backend=backend, **lengths
        )
    assert seen == []


def test_ragged_check_refuses_a_backend_it_does_not_check():
    with pytest.raises(ValueError, match="backend must be one of"):
        mha_form.ragged_check("te", torch.device("cpu"))


class _TEStandIn:
    """A stand-in for Transformer Engine's ``DotProductAttention`` in THD (its 2.20 contract:
    int32 cumulative lengths, ``[tokens, heads, dim]`` operands, ``[tokens, heads x v]`` out,
    bottom-right causal; what it writes past ``cu_seqlens_q[-1]`` is not specified, NaN here)."""

    built = []
    seen = []

    def __init__(self, heads, kv_channels, **kwargs):
        self.heads, self.kv_channels, self.kwargs = heads, kv_channels, kwargs
        self.built.append((heads, kv_channels, kwargs))

    def __call__(self, q, k, v, *, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv):
        assert cu_seqlens_q.dtype == cu_seqlens_kv.dtype == torch.int32
        assert self.kwargs["qkv_format"] == "thd" and self.kwargs["attention_dropout"] == 0.0
        assert self.kwargs["attn_mask_type"] == "padding_causal_bottom_right"
        assert q.shape[1:] == (self.heads, self.kv_channels[0]) and k.shape[1:] == q.shape[1:]
        assert v.shape[1:] == (self.heads, self.kv_channels[1]) and v.is_contiguous()
        q_lens, k_lens = np.diff(cu_seqlens_q.cpu().numpy()), np.diff(cu_seqlens_kv.cpu().numpy())
        assert max_seqlen_q >= q_lens.max() and max_seqlen_kv >= k_lens.max()
        self.seen.append((q.shape[0], k.shape[0], len(q_lens)))
        out, _ = mha_backends.torch_varlen(
            q, k, v, q_lens, k_lens, "bottom_right", self.kwargs["softmax_scale"]
        )
        out[int(cu_seqlens_q[-1]) :] = float("nan")
        return out.reshape(q.shape[0], -1)


@pytest.mark.parametrize("requests", [PREFILL, CHUNKED, MIXED], ids=["prefill", "chunked", "mixed"])
def test_transformer_engine_glue_with_a_stand_in_module(monkeypatch, requests):
    """The Transformer Engine backend's packing and call, with a stand-in for TE's module: one
    call per step over whole contexts, one module per shape and scale, padding tokens zero."""
    import sys

    te = types.ModuleType("transformer_engine")
    te.pytorch = types.SimpleNamespace(DotProductAttention=_TEStandIn)
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)
    monkeypatch.setattr(mha_backends, "_TE_MODULES", {})
    monkeypatch.setattr(_TEStandIn, "built", [])
    monkeypatch.setattr(_TEStandIn, "seen", [])
    step, query, cache, weight, lengths = mha_step(requests, 3, seed=11)
    for _ in range(2):
        got = mla_paged_mha_attention(
            query, cache, step.block_table, weight, SCALE, rope_dim=16, backend="te", **lengths
        )
        expected = reference(step, query, cache, weight, lengths)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-5)
    assert [b[:2] for b in _TEStandIn.built] == [(3, (32 + 16, 32))]  # built once, reused
    assert len(_TEStandIn.seen) == 2  # one call per step, prefix and chunk together


# (cached tokens, new tokens): a chunk behind a long prefix; requests of different lengths; one
# request longer than every budget below.


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cudnn", "cudnn-dense", "flash", "te"])
@pytest.mark.parametrize(
    "requests",
    [PREFILL, CHUNKED, MIXED, NINE, [(3072, 1024)], [(0, 1536), (0, 1536)]],
    ids=["prefill", "chunked", "mixed", "nine", "chunk_behind_3k", "prefill_2x1536"],
)
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_fused_backends_match_float64_in_bf16(backend, requests, heads):
    if backend not in mha_backends.present_backends():
        pytest.skip(f"the {backend} backend is not available here")
    step, query, cache, weight, lengths = deepseek_step(requests, heads, torch.bfloat16)
    got = mla_paged_mha_attention(
        query, cache, step.block_table, weight, SCALE, rope_dim=64, backend=backend, **lengths
    )
    expected = reference(step, query, cache, weight, lengths)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2**-4)
    # And the plain-torch backend of the same semantics, on the same bf16 inputs.
    plain = "torch" if backend in mha_form.SPLIT_BACKENDS else "torch-bottom-right"
    same = mla_paged_mha_attention(
        query, cache, step.block_table, weight, SCALE, rope_dim=64, backend=plain, **lengths
    )
    torch.testing.assert_close(got.float(), same.float(), rtol=0, atol=2**-5)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "backend, floor", [("cudnn", (9, 0)), ("flash", (8, 0)), ("cudnn-dense", (8, 0))]
)
def test_gpu_check_of_each_backend_passes_where_torch_and_the_gpu_have_it(backend, floor):
    """Where torch has the backend's operators and the GPU is new enough (sm90 for the ragged
    cuDNN entry, sm80 for FlashAttention and dense cuDNN), its once-per-device check passes: mask
    alignment and log-sum-exp layout as the backend reads them."""
    if backend not in mha_backends.present_backends():
        pytest.skip(f"this torch lacks the {backend} backend's operators")
    if torch.cuda.get_device_capability() < floor:
        pytest.skip(f"the {backend} backend runs on sm{floor[0]}{floor[1]} and newer only")
    assert mha_form.ragged_check(backend, torch.device("cuda")) is None


def test_present_backends_follow_the_operators_torch_has(monkeypatch):
    """Dense cuDNN stands in for FlashAttention only (``mla_prefill.backend_for``): listed where
    both entries are; TE where it imports."""
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)  # import fails
    for name in ("flash", "cudnn_dense", "cudnn"):
        monkeypatch.setattr(mha_backends.internals, f"{name}_attention_forward", None)
    assert mha_backends.present_backends() == ()
    monkeypatch.setattr(mha_backends.internals, "cudnn_dense_attention_forward", object())
    assert mha_backends.present_backends() == ()
    monkeypatch.setattr(mha_backends.internals, "flash_attention_forward", object())
    monkeypatch.setattr(mha_backends.internals, "cudnn_attention_forward", object())
    assert mha_backends.present_backends() == ("flash", "cudnn-dense", "cudnn")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cudnn-dense", "flash"])
@pytest.mark.parametrize("requests", [PREFILL, CHUNKED, MIXED], ids=["prefill", "chunked", "mixed"])
def test_gpu_building_a_steps_plan_and_masks_does_not_synchronise(backend, requests):
    """A step's first call builds its plan, its groups or masks and the weights' layout: all of
    it queued on the stream, no host synchronisation (the operators' own first-use planning is
    done by a call before)."""
    if backend not in mha_backends.present_backends():
        pytest.skip(f"the {backend} backend is not available here")
    step, query, cache, weight, lengths = deepseek_step(requests, 16, torch.bfloat16)
    call = dict(rope_dim=64, backend=backend, **lengths)
    expected = mla_paged_mha_attention(query, cache, step.block_table, weight, SCALE, **call)
    mha_plan.clear_step_caches()
    mha_weights.clear_up_projections()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = mla_paged_mha_attention(query, cache, step.block_table, weight, SCALE, **call)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, expected), "a rebuilt plan moved the bits"
