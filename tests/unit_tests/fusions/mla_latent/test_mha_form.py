# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of MLA attention over the paged latent cache in the MHA form
(megatron_ext.fusions.mla_latent.mha_form).

On CPU the plain-torch backends (``torch``: top-left causal and a separate prefix call merged by
log-sum-exp, as the cuDNN backend runs; ``torch-bottom-right``: one call per context, as Transformer
Engine's) run against a float64 reference that decompresses each request's rows page by page,
and against the absorbed Triton kernel (interpreter) on the same inputs. Tests marked ``gpu``
run the cuDNN and Transformer Engine backends in bf16.
"""

import math

import numpy as np
import pytest
import torch

from megatron_ext import internals
from megatron_ext.fusions.mla_latent import mha_form, mla_paged_latent_attention
from megatron_ext.fusions.mla_latent.mha_form import bucket, mla_paged_mha_attention
from tests.unit_tests.fusions.mla_latent_cache_testlib import build_step

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda") if ON_GPU else torch.device("cpu")
SCALE = (0.1 * math.log(40) + 1) ** 2 / math.sqrt(192)
CPU_BACKENDS = ("torch", "torch-bottom-right")

# (cached tokens, new tokens) per request.
PREFILL = [(0, 37), (0, 1), (0, 16)]
CHUNKED = [(21, 11), (32, 5), (3, 30)]
MIXED = [(40, 1), (0, 19), (17, 9), (0, 1), (63, 1), (5, 3)]
# Nine requests: a fused call's request count is rounded up to 10 where cuDNN takes zero-length
# sequences.
NINE = [(7 * i, 2 + 3 * i) for i in range(9)]


def mha_step(requests, heads, *, qk_dim=32, v_dim=32, seed=0, dtype=torch.float32, **sizes):
    """A paged step (build_step's cache and table), an MHA-form query, the up-projection
    weight and the host lengths."""
    step = build_step(requests, heads=heads, seed=seed, device=DEVICE, **sizes)
    gen = torch.Generator().manual_seed(seed + 100)
    tokens = step.query.shape[0]
    query = torch.randn(tokens, heads, qk_dim + step.rope_dim, generator=gen)
    # Scaled so that logits are O(1)-O(10), as a trained model's.
    weight = torch.randn(heads * (qk_dim + v_dim), step.latent_dim, generator=gen)
    weight /= math.sqrt(step.latent_dim)
    cache = step.kv_cache
    if dtype != cache.dtype:
        cache = cache.to(dtype)
    lengths = dict(
        query_lengths=[new for _, new in requests],
        kv_lengths=[cached + new for cached, new in requests],
    )
    return step, query.to(DEVICE, dtype), cache, weight.to(DEVICE, dtype), lengths


def deepseek_step(requests, heads, dtype=torch.float32):
    """:func:`mha_step` at DeepSeek-V3's widths (latent 512, RoPE 64, qk 128, v 128), blocks of
    64 rows."""
    sizes = dict(qk_dim=128, v_dim=128, latent_dim=512, rope_dim=64, block_size=64)
    return mha_step(requests, heads, seed=heads, dtype=dtype, **sizes)


def reference(step, query, cache, weight, lengths, softmax_scale=SCALE):
    """float64: each request's rows gathered page by page, decompressed per head, attended
    bottom-right causally."""
    tokens, heads, width = query.shape
    rope = step.rope_dim
    qk_dim = width - rope
    latent = cache.shape[-1] - rope
    w = weight.double().view(heads, -1, latent)
    v_dim = w.shape[1] - qk_dim
    block_size = cache.shape[1]
    out = torch.zeros(tokens, heads, v_dim, dtype=torch.float64, device=query.device)
    start = 0
    for r, (q_len, kv_len) in enumerate(zip(lengths["query_lengths"], lengths["kv_lengths"])):
        keys = torch.arange(kv_len, device=query.device)
        rows = cache[step.block_table[r, keys // block_size].long(), keys % block_size].double()
        k = torch.cat(
            [
                torch.einsum("nc,hdc->nhd", rows[:, :latent], w[:, :qk_dim]),
                rows[:, None, latent:].expand(-1, heads, rope),
            ],
            -1,
        )
        v = torch.einsum("nc,hdc->nhd", rows[:, :latent], w[:, qk_dim:])
        q = query[start : start + q_len].double()
        scores = torch.einsum("qhd,nhd->hqn", q, k) * softmax_scale
        positions = kv_len - q_len + torch.arange(q_len, device=query.device)
        scores = scores.masked_fill(keys[None, None, :] > positions[None, :, None], -math.inf)
        out[start : start + q_len] = torch.einsum("hqn,nhd->qhd", scores.softmax(-1), v)
        start += q_len
    return out


def absorbed(step, query, cache, weight, softmax_scale=SCALE):
    """The same attention through the absorbed kernel: W_UK into the query, W_UV after."""
    tokens, heads, width = query.shape
    rope = step.rope_dim
    qk_dim = width - rope
    latent = cache.shape[-1] - rope
    w = weight.view(heads, -1, latent)
    q_absorbed = torch.einsum("thd,hdc->thc", query[..., :qk_dim], w[:, :qk_dim])
    attended = mla_paged_latent_attention(
        torch.cat([q_absorbed, query[..., qk_dim:]], -1).contiguous(),
        cache,
        step.block_table,
        step.cu_query_lengths,
        step.kv_lengths,
        softmax_scale,
        rope_dim=rope,
    )
    return torch.einsum("thc,hvc->thv", attended, w[:, qk_dim:])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("requests", [PREFILL, CHUNKED, MIXED], ids=["prefill", "chunked", "mixed"])
@pytest.mark.parametrize("heads", [3, 16])
def test_steps_match_float64_and_the_absorbed_kernel(backend, requests, heads):
    step, query, cache, weight, lengths = mha_step(requests, heads, seed=heads)
    got = mla_paged_mha_attention(
        query, cache, step.block_table, weight, SCALE, rope_dim=16, backend=backend, **lengths
    )
    expected = reference(step, query, cache, weight, lengths)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(got, absorbed(step, query, cache, weight), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("heads", [16, 128])
def test_deepseek_v3_widths_match_float64_and_the_absorbed_kernel(heads):
    """kv_lora_rank 512, qk 128, rope 64, v 128; a chunk behind a cached prefix, a fresh prefill
    and a decode, block size 64."""
    step, query, cache, weight, lengths = deepseek_step([(70, 3), (0, 4), (9, 1)], heads)
    got = mla_paged_mha_attention(
        query, cache, step.block_table, weight, SCALE, rope_dim=64, **lengths
    )
    expected = reference(step, query, cache, weight, lengths)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-5)
    # bf16's bound between the two forms: both round their inputs; here both compute in fp32.
    torch.testing.assert_close(got, absorbed(step, query, cache, weight), rtol=1e-4, atol=1e-4)


def test_bf16_is_within_its_bound_of_float64():
    step, query, cache, weight, lengths = mha_step(CHUNKED, 4, seed=9, dtype=torch.bfloat16)
    got = mla_paged_mha_attention(
        query, cache, step.block_table, weight, SCALE, rope_dim=16, **lengths
    )
    expected = reference(step, query, cache, weight, lengths)
    # Inputs in bf16 (8 bits), keys and values decompressed to bf16: a few 2^-8 of |out| <= ~3.
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2**-4)


def test_padding_tokens_get_zeros_and_extra_table_rows_are_ignored():
    step, query, cache, weight, lengths = mha_step(
        MIXED, 2, seed=4, padding_requests=2, padding_tokens=5
    )
    got = mla_paged_mha_attention(
        query, cache, step.block_table, weight, SCALE, rope_dim=16, **lengths
    )
    assert torch.equal(got[-5:], torch.zeros_like(got[-5:]))
    torch.testing.assert_close(
        got.double(), reference(step, query, cache, weight, lengths), rtol=1e-5, atol=2e-5
    )


def test_no_tokens_gives_zeros():
    step, query, cache, weight, lengths = mha_step([(4, 0)], 2, seed=5, padding_tokens=3)
    got = mla_paged_mha_attention(
        query, cache, step.block_table, weight, SCALE, rope_dim=16, **lengths
    )
    assert torch.equal(got, torch.zeros_like(got))


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


def _cudnn_stand_in(seen, stats_layout="THk"):
    """A stand-in for torch's ragged cuDNN operator (its contract: top-left causal, rows past the
    cumulative lengths ignored; an adversarial NaN for queries of sequences without keys) that
    records each call's shapes and checks that every causal call is square."""

    def stand_in(q, k, v, bias, cu_q, cu_k, max_q, max_k, want_lse, dropout, causal, debug, scale):
        q_lens, k_lens = np.diff(cu_q.cpu().numpy()), np.diff(cu_k.cpu().numpy())
        seen.append((q.shape[0], k.shape[0], len(q_lens), max_q, max_k))
        assert cu_q.dtype == cu_k.dtype == torch.int32 and bias is None and dropout == 0.0
        assert max_q >= max(2, q_lens.max()) and max_k >= k_lens.max()
        # Packed rows (some releases address sequences by cumulative length x packed row size)
        # and offsets on 16 bytes (cuDNN's ragged-offset descriptors assume it).
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        assert cu_q.data_ptr() % 16 == 0 and cu_k.data_ptr() % 16 == 0
        # Only square blocks are masked: top-left is then bottom-right.
        assert not causal or (q_lens == k_lens).all(), (q_lens, k_lens)
        causal = "top_left" if causal else None
        out, lse = mha_form._torch_varlen(q, k, v, q_lens, k_lens, causal, scale)
        no_keys = torch.from_numpy(np.repeat(k_lens == 0, q_lens))
        out[: len(no_keys)][no_keys] = float("nan")
        lse = lse.unsqueeze(-1) if stats_layout == "THk" else lse.t().contiguous()
        return out, lse

    return stand_in


def _assert_buckets(seen):
    """Every shape handed to the operator is a bucket."""
    for tokens, rows, entries, max_q, max_k in seen:
        assert tokens == bucket(tokens) and rows == bucket(rows), seen
        assert entries == bucket(entries, minimum=1), seen
        assert max_q == bucket(max_q, minimum=2) and max_k == bucket(max_k, minimum=1), seen


@pytest.mark.parametrize("stats_layout", ["THk", "HT"])
@pytest.mark.parametrize("requests", [PREFILL, CHUNKED, MIXED], ids=["prefill", "chunked", "mixed"])
def test_cudnn_glue_with_a_stand_in_operator(monkeypatch, requests, stats_layout):
    """The cuDNN backend's packing, bucketing, stats layouts and merge, with a stand-in for
    torch's operator."""
    seen = []
    monkeypatch.setattr(mha_form.internals, "cudnn_attention_forward", _cudnn_stand_in(seen))
    step, query, cache, weight, lengths = mha_step(requests, 3, seed=7)
    got = mla_paged_mha_attention(
        query, cache, step.block_table, weight, SCALE, rope_dim=16, backend="cudnn", **lengths
    )
    expected = reference(step, query, cache, weight, lengths)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-5)
    _assert_buckets(seen)
    has_prefix = any(cached for cached, _ in requests)
    assert len(seen) == 1 + has_prefix


@pytest.mark.parametrize("supported", [True, False])
def test_the_request_count_is_bucketed_only_where_cudnn_takes_empty_sequences(
    monkeypatch, supported
):
    seen = []
    monkeypatch.setattr(mha_form.internals, "cudnn_attention_forward", _cudnn_stand_in(seen))
    monkeypatch.setattr(mha_form, "empty_sequences_supported", lambda: supported)
    step, query, cache, weight, lengths = mha_step(NINE, 2, seed=8)
    got = mla_paged_mha_attention(
        query, cache, step.block_table, weight, SCALE, rope_dim=16, backend="cudnn", **lengths
    )
    expected = reference(step, query, cache, weight, lengths)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-5)
    # Two calls: the cached prefixes (8 requests have one) and the new tokens' diagonal (9).
    assert sorted(entries for _, _, entries, _, _ in seen) == ([8, 10] if supported else [8, 9])


def test_empty_sequences_need_cudnn_9_25(monkeypatch):
    mha_form.empty_sequences_supported.cache_clear()
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    try:
        for version, supported in ((92401, False), (92500, True), (None, False)):
            monkeypatch.setattr(torch.backends.cudnn, "version", lambda v=version: v)
            mha_form.empty_sequences_supported.cache_clear()
            assert mha_form.empty_sequences_supported() is supported, version
    finally:
        mha_form.empty_sequences_supported.cache_clear()


def _refusing_operator(*args, **kwargs):
    raise RuntimeError("cuDNN varlen attention requires cuDNN >= 9.24 for short queries")


def _unmasked_operator(*args, scale):
    """Takes every call as unmasked (``is_causal`` is the 11th argument): a causal call comes out
    wrong."""
    return _cudnn_stand_in([])(*args[:10], False, *args[11:], scale=scale)


def _scrambled_stats_operator(*args, **kwargs):
    """Right outputs, the log-sum-exp's rows in the wrong order (a misread stats layout)."""
    out, lse = _cudnn_stand_in([])(*args, **kwargs)
    return out, lse.flip(0)


@pytest.mark.parametrize(
    "operator, problem",
    [
        (_cudnn_stand_in([]), None),
        (_refusing_operator, "refused a top_left call: cuDNN varlen attention requires"),
        (_unmasked_operator, "disagreed with plain torch on a top_left call"),
        (_scrambled_stats_operator, "disagreed with plain torch on a top_left call"),
    ],
    ids=["faithful", "refusing", "unmasked", "scrambled_stats"],
)
def test_cudnn_ragged_check(monkeypatch, operator, problem):
    """The once-per-device check passes an operator of the assumed contract and names what is
    wrong with one that refuses the call or answers differently."""
    monkeypatch.setattr(mha_form.internals, "cudnn_attention_forward", operator)
    found = mha_form.ragged_check("cudnn", torch.device("cpu"))
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found, found


def _flash_stand_in(seen):
    """A stand-in for torch's ragged FlashAttention-2 operator (its contract: int32 cumulative
    lengths, one head size for query, key and value, causal aligned bottom-right, log-sum-exp as
    [heads, tokens], +inf for a query with no keys) that records each call's shapes."""

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale):
        q_lens, k_lens = np.diff(cu_q.cpu().numpy()), np.diff(cu_k.cpu().numpy())
        seen.append((q.shape, k.shape, v.shape, len(q_lens)))
        assert cu_q.dtype == cu_k.dtype == torch.int32 and dropout == 0.0 and not debug
        assert max_q >= q_lens.max() and max_k >= k_lens.max()
        assert q.shape[-1] == k.shape[-1] == v.shape[-1], (q.shape, k.shape, v.shape)
        assert q.shape[-1] % 8 == 0 and q.shape[-1] <= mha_form.FLASH_MAX_HEAD_DIM, q.shape
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        causal = "bottom_right" if causal else None
        out, lse = mha_form._torch_varlen(q, k, v, q_lens, k_lens, causal, scale)
        lse[lse == -math.inf] = math.inf  # FlashAttention's answer for a query with no key
        return out, lse.t().contiguous(), None, None, None

    return stand_in


def _matches_float64(requests, backend, budget, seed, **widths) -> dict:
    """Run a 3-head step of ``requests`` through ``backend`` (stand-ins in place) and check it
    against the float64 reference; return the step's host lengths."""
    step, query, cache, weight, lengths = mha_step(requests, 3, seed=seed, **widths)
    got = mla_paged_mha_attention(
        query,
        cache,
        step.block_table,
        weight,
        SCALE,
        rope_dim=16,
        backend=backend,
        row_budget=budget,
        **lengths,
    )
    expected = reference(step, query, cache, weight, lengths)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-5)
    return lengths


def _cudnn_dense_stand_in(seen):
    """A stand-in for torch's dense cuDNN operator (its contract: [batch, heads, length, width],
    top-left causal, log-sum-exp as [batch, heads, length]) that records each call's shapes and
    storage."""

    def stand_in(q, k, v, bias, want_lse, dropout, causal, debug, *, scale):
        assert bias is None and dropout == 0.0 and causal and not debug
        batch, heads, length, _ = q.shape
        assert k.shape[:3] == v.shape[:3] == (batch, heads, length)
        seen.append((batch, length, q.untyped_storage().data_ptr()))
        rows = torch.arange(length)
        scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scale
        scores = scores.masked_fill(rows[None, :] > rows[:, None], -math.inf)
        lse = torch.logsumexp(scores, -1)
        out = torch.einsum("bhqk,bhkd->bhqd", torch.exp(scores - lse[..., None]), v.double())
        return out.to(q.dtype), lse.float()

    return stand_in


def _dense_backend(monkeypatch, seen=None, flash_seen=None):
    """Stand-ins for both entries the ``cudnn-dense`` backend calls, recording into the lists."""
    dense = _cudnn_dense_stand_in([] if seen is None else seen)
    flash = _flash_stand_in([] if flash_seen is None else flash_seen)
    monkeypatch.setattr(mha_form.internals, "cudnn_dense_attention_forward", dense)
    monkeypatch.setattr(mha_form.internals, "flash_attention_forward", flash)


@pytest.mark.parametrize("budget", [None, 16])
@pytest.mark.parametrize(
    "requests", [PREFILL, CHUNKED, MIXED, NINE], ids=["prefill", "chunked", "mixed", "nine"]
)
def test_cudnn_dense_glue_with_stand_in_operators(monkeypatch, requests, budget):
    """The dense cuDNN backend: causal blocks batched by length bucket (padded rows and empty
    sequences), cached prefixes through FlashAttention's entry, merged; float64's result."""
    seen, flash_seen = [], []
    _dense_backend(monkeypatch, seen, flash_seen)
    _matches_float64(requests, "cudnn-dense", budget, seed=13)
    assert seen and all(length == bucket(length) and batch >= 1 for batch, length, _ in seen)
    # A cached prefix (or, under a budget, rows of an earlier chunk) is attended unmasked,
    # through FlashAttention's entry.
    has_prefix = any(cached for cached, _ in requests)
    assert bool(flash_seen) == has_prefix if budget is None else bool(flash_seen) >= has_prefix


def test_cudnn_dense_takes_equal_back_to_back_prefills_as_views(monkeypatch):
    """Two fresh prefills of one bucketed length: one dense call over views of the packed
    rows (no padded copies); a third of another length gets its own call."""
    seen = []
    _dense_backend(monkeypatch, seen)
    q = torch.randn(2 * 32 + 5, 2, 24, dtype=torch.float64)
    k, v = torch.randn_like(q), torch.randn(q.shape[0], 2, 8, dtype=torch.float64)
    lengths = np.array([32, 32, 5])
    out, lse = mha_form.varlen_attention(
        "cudnn-dense", q, k, v, (lengths, lengths), "top_left", 0.3, True
    )
    assert sorted((b, n) for b, n, _ in seen) == [(1, 16), (2, 32)]
    views = [ptr for b, n, ptr in seen if n == 32]
    assert views == [q.untyped_storage().data_ptr()]
    want, want_lse = mha_form._torch_varlen(q, k, v, lengths, lengths, "top_left", 0.3)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse.float(), rtol=1e-6, atol=1e-6)


def test_cudnn_dense_refuses_a_causal_call_that_is_not_square(monkeypatch):
    _dense_backend(monkeypatch)
    q = torch.randn(4, 2, 24, dtype=torch.float64)
    k, v = torch.randn(6, 2, 24, dtype=torch.float64), torch.randn(6, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="square sequences only"):
        mha_form.varlen_attention(
            "cudnn-dense", q, k, v, (np.array([4]), np.array([6])), "top_left", 0.3, True
        )


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
    monkeypatch.setattr(mha_form.internals, "flash_attention_forward", _flash_stand_in(seen))
    lengths = _matches_float64(requests, "flash", budget, seed=9, qk_dim=qk_dim, v_dim=v_dim)
    rows = sum(lengths["kv_lengths"][r] for r, q in enumerate(lengths["query_lengths"]) if q)
    # Sizes are not bucketed: one call over every attended row, or one per chunk and more.
    assert len(seen) == 1 if budget is None else len(seen) >= -(-rows // budget), seen
    assert sum(k[0] for _, k, _, _ in seen) >= rows


@pytest.mark.parametrize("backend", ["cudnn", "cudnn-dense", "flash"])
def test_ragged_check_of_each_backend_passes_a_faithful_operator(monkeypatch, backend):
    monkeypatch.setattr(mha_form.internals, "cudnn_attention_forward", _cudnn_stand_in([]))
    _dense_backend(monkeypatch)
    assert mha_form.ragged_check(backend, torch.device("cpu")) is None


def test_dense_cudnn_check_names_a_mask_aligned_otherwise(monkeypatch):
    """A dense operator that ignores the causal flag disagrees with plain torch: refused."""
    _dense_backend(monkeypatch)
    faithful = mha_form.internals.cudnn_dense_attention_forward

    def unmasked(q, k, v, bias, want_lse, dropout, causal, debug, *, scale):
        length = q.shape[2]
        ones = torch.ones(length, length, dtype=torch.bool)
        scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scale
        lse = torch.logsumexp(scores.masked_fill(~ones, -math.inf), -1)
        out = torch.einsum("bhqk,bhkd->bhqd", torch.exp(scores - lse[..., None]), v.double())
        return out.to(q.dtype), lse.float()

    assert faithful is not None
    monkeypatch.setattr(mha_form.internals, "cudnn_dense_attention_forward", unmasked)
    problem = mha_form.ragged_check("cudnn-dense", torch.device("cpu"))
    assert problem is not None and "dense cuDNN" in problem and "top_left" in problem


def _top_left_flash(*args, scale):
    """FlashAttention's contract but the causal mask aligned top-left (an older alignment)."""
    q, k, v, cu_q, cu_k = args[:5]
    q_lens, k_lens = np.diff(cu_q.cpu().numpy()), np.diff(cu_k.cpu().numpy())
    causal = "top_left" if args[8] else None
    out, lse = mha_form._torch_varlen(q, k, v, q_lens, k_lens, causal, scale)
    return out, lse.t().contiguous(), None, None, None


def _padded_lse_flash(*args, scale):
    """Right outputs, the log-sum-exp as [requests, heads, longest] (older FlashAttention)."""
    out, lse, *rest = _flash_stand_in([])(*args, scale=scale)
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
    monkeypatch.setattr(mha_form.internals, "flash_attention_forward", operator)
    found = mha_form.ragged_check("flash", torch.device("cpu"))
    assert found is not None and problem in found, found


def test_flash_gives_a_query_without_keys_zeros_and_a_log_sum_exp_of_minus_inf(monkeypatch):
    """FlashAttention answers +inf for a query with no key (here the first of three queries on
    two keys, bottom-right causal); the merge takes -inf as nothing."""
    monkeypatch.setattr(mha_form.internals, "flash_attention_forward", _flash_stand_in([]))
    gen = torch.Generator().manual_seed(3)
    q_lens, k_lens = np.array([3, 2]), np.array([2, 4])
    q = torch.randn(5, 2, 24, generator=gen)
    k, v = torch.randn(6, 2, 24, generator=gen), torch.randn(6, 2, 16, generator=gen)
    causal = "bottom_right"
    out, lse = mha_form.varlen_attention("flash", q, k, v, (q_lens, k_lens), causal, 0.5, True)
    assert torch.equal(out[0], torch.zeros(2, 16))
    assert torch.equal(lse[0], torch.full((2,), -math.inf))
    want, want_lse = mha_form._torch_varlen(q, k, v, q_lens, k_lens, causal, 0.5)
    torch.testing.assert_close(out[1:], want[1:])
    torch.testing.assert_close(lse[1:], want_lse[1:])


@pytest.mark.parametrize("backend", ["flash", "cudnn-dense"])
def test_flash_refuses_head_sizes_past_flashattentions_before_any_work(monkeypatch, backend):
    """The backends that call FlashAttention's entry (``cudnn-dense`` for its unmasked calls)."""
    seen = []
    _dense_backend(monkeypatch, seen, seen)
    step, query, cache, weight, lengths = mha_step(CHUNKED, 2, v_dim=300)
    message = f"the {backend} backend runs FlashAttention's head sizes, up to 256; .* 304"
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
        out, _ = mha_form._torch_varlen(
            q, k, v, q_lens, k_lens, "bottom_right", self.kwargs["softmax_scale"]
        )
        out[int(cu_seqlens_q[-1]) :] = float("nan")
        return out.reshape(q.shape[0], -1)


@pytest.mark.parametrize("requests", [PREFILL, CHUNKED, MIXED], ids=["prefill", "chunked", "mixed"])
def test_transformer_engine_glue_with_a_stand_in_module(monkeypatch, requests):
    """The Transformer Engine backend's packing and call, with a stand-in for TE's module: one
    call per step over whole contexts, one module per shape and scale, padding tokens zero."""
    import sys
    import types

    te = types.ModuleType("transformer_engine")
    te.pytorch = types.SimpleNamespace(DotProductAttention=_TEStandIn)
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)
    monkeypatch.setattr(mha_form, "_TE_MODULES", {})
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


# ------------------------------------------------------------------------------- row budget

# (cached tokens, new tokens): a chunk behind a long prefix; requests of different lengths; one
# request longer than every budget below.
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
    monkeypatch.setattr(mha_form.internals, "flash_attention_forward", _flash_stand_in([]))
    merges = []
    merge = mha_form._merge
    monkeypatch.setattr(mha_form, "_merge", lambda *a: merges.append(1) or merge(*a))
    step, query, cache, weight, lengths = mha_step(requests, 3, seed=12)
    call = dict(rope_dim=16, backend=backend, **lengths)
    direct = mla_paged_mha_attention(query, cache, step.block_table, weight, SCALE, **call)
    # Top-left masks take a cached prefix and the new rows in two calls: their tokens merge.
    assert bool(merges) == (backend == "torch" and requests is MIXED), merges
    merges.clear()
    monkeypatch.setattr(mha_form, "_each_token_once", lambda *a: False)
    merged = mla_paged_mha_attention(query, cache, step.block_table, weight, SCALE, **call)
    assert merges, "the forced merge path did not merge"
    assert torch.equal(
        direct.view(torch.int32), merged.view(torch.int32)
    ), f"the direct write moved bits against the merge: {(direct != merged).sum()} elements"


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_up_projections_lay_keys_and_values_out_at_their_widths(dtype):
    """Per head: W_UK's rows, an identity onto the RoPE part, zeros on; W_UV's rows, then zeros.
    The decompressed rows are the GEMMs' results, with the cached RoPE part copied exactly."""
    heads, qk, rope, v, latent = 3, 5, 4, 6, 7
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(heads * (qk + v), latent, generator=gen).to(dtype)
    keys, values = mha_form.up_projections(weight, heads, qk, rope, 16, 8)
    per_head = weight.view(heads, qk + v, latent)
    keys, values = keys.view(heads, 16, latent + rope), values.view(heads, 8, latent)
    assert torch.equal(keys[:, :qk, :latent], per_head[:, :qk]) and not keys[:, :qk, latent:].any()
    rope_rows = torch.zeros(rope, latent + rope, dtype=dtype)
    rope_rows[:, latent:] = torch.eye(rope, dtype=dtype)
    assert torch.equal(keys[:, qk : qk + rope], rope_rows.expand(heads, -1, -1))
    assert not keys[:, qk + rope :].any()
    assert torch.equal(values[:, :v], per_head[:, qk:]) and not values[:, v:].any()
    cache = torch.randn(2, 4, latent + rope, generator=gen).to(dtype)
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    positions = torch.arange(6)
    index = torch.stack([torch.zeros(6, dtype=torch.long), positions // 4, positions % 4])
    up = mha_form.up_projections(weight, heads, qk, rope, qk + rope, v)
    k, val = mha_form.decompressed_keys_values(cache, table, index.int(), up, heads, qk, rope)
    rows = cache[table[0].long()].reshape(-1, latent + rope)[:6]  # block 1's rows, then block 0's
    assert k.is_contiguous() and val.is_contiguous()
    # The RoPE part bit for bit: a product by 1.0 and sums of zeros.
    assert torch.equal(k[..., qk:], rows[:, None, latent:].expand(-1, heads, rope))
    tol = dict(rtol=0, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-2, atol=1e-2)
    expected_k = rows[:, :latent].double() @ per_head[:, :qk].double().reshape(-1, latent).t()
    torch.testing.assert_close(k[..., :qk].double(), expected_k.view(6, heads, qk), **tol)
    expected_v = rows[:, :latent].double() @ per_head[:, qk:].double().reshape(-1, latent).t()
    torch.testing.assert_close(val.double(), expected_v.view(6, heads, v), **tol)


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
    monkeypatch.setattr(mha_form.internals, "cudnn_attention_forward", _cudnn_stand_in(seen))
    rows = _recorded_rows(monkeypatch)
    step, query, cache, weight, lengths = mha_step(requests, 3, seed=11)
    chunked = dict(rope_dim=16, backend="cudnn", row_budget=16, **lengths)
    got = mla_paged_mha_attention(query, cache, step.block_table, weight, SCALE, **chunked)
    torch.testing.assert_close(
        got.double(), reference(step, query, cache, weight, lengths), rtol=1e-5, atol=2e-5
    )
    _assert_buckets(seen)
    # Two padded sections per chunk (cached rows, new rows): each at most a bucket of the budget.
    assert max(rows) <= 2 * 16 and len(rows) == -(-sum(lengths["kv_lengths"]) // 16)


def test_merge_of_queries_without_keys():
    """Both sides -inf (no keys in either): zeros and -inf, no NaN; one side -inf: the other."""
    out_a, out_b = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    none = torch.full((3, 2), -math.inf)
    lse_b = torch.randn(3, 2)
    merged, lse = mha_form._merge(out_a, none, out_b, none)
    assert torch.equal(merged, torch.zeros_like(merged)) and torch.equal(lse, none)
    merged, lse = mha_form._merge(out_a, none, out_b, lse_b)
    assert torch.equal(merged, out_b) and torch.equal(lse, lse_b)


def _bad_inputs():
    step, query, cache, weight, lengths = mha_step([(5, 2), (0, 3)], 2, seed=12)
    good = dict(
        query=query,
        kv_cache=cache,
        block_table=step.block_table,
        kv_up_weight=weight,
        softmax_scale=SCALE,
        rope_dim=16,
        **lengths,
    )
    table = step.block_table
    # The arguments the absorbed kernel shares: its messages.
    yield "query list", dict(good, query=query.tolist()), TypeError, "query must be a torch.Tensor"
    yield "int query", dict(good, query=query.long()), TypeError, "query must have dtype"
    yield "4-d query", dict(good, query=query.unsqueeze(1)), ValueError, "query must be"
    yield "rope_dim not a power of two", dict(good, rope_dim=12), ValueError, "rope_dim must be"
    yield "latent width not a power of two", dict(
        good, kv_cache=torch.zeros(4, 16, 40, device=DEVICE)
    ), ValueError, "latent width"
    yield "cache dtype", dict(good, kv_cache=cache.half()), TypeError, "kv_cache is torch.float16"
    yield "2-d cache", dict(good, kv_cache=cache[0]), ValueError, "kv_cache must be"
    huge_blocks = cache[:1, :1].expand(1, 2**24 + 1, cache.shape[2])
    yield "block size", dict(good, kv_cache=huge_blocks), ValueError, "block size 16777217"
    yield "float table", dict(good, block_table=table.float()), TypeError, "block_table must"
    yield "1-d table", dict(good, block_table=table[0]), ValueError, "block_table must be"
    yield "tensor scale", dict(good, softmax_scale=torch.tensor(0.1)), TypeError, "softmax_scale"
    yield "negative scale", dict(good, softmax_scale=-1.0), ValueError, "softmax_scale must be"
    yield "nan scale", dict(good, softmax_scale=float("nan")), ValueError, "softmax_scale must be"
    yield "scale below float32", dict(good, softmax_scale=1e-300), ValueError, "normal range"
    yield "table on the meta device", dict(
        good, block_table=table.to("meta")
    ), ValueError, "block_table is on meta"
    # The MHA form's own arguments.
    yield "weight dtype", dict(good, kv_up_weight=weight.double()), TypeError, "kv_up_weight"
    yield "weight width", dict(good, kv_up_weight=weight[:, :16]), ValueError, "kv_up_weight"
    yield "weight rows", dict(good, kv_up_weight=weight[:-1]), ValueError, "kv_up_weight"
    yield "no value rows", dict(good, kv_up_weight=weight[:64]), ValueError, "none left"
    yield "backend", dict(good, backend="flash-attn"), ValueError, "backend must be"
    yield "zero row budget", dict(good, row_budget=0), ValueError, "row_budget"
    yield "float row budget", dict(good, row_budget=8.0), TypeError, "row_budget"
    yield "float lengths", dict(good, query_lengths=[2.0, 3.0]), TypeError, "query_lengths"
    yield "negative length", dict(good, kv_lengths=[7, -3]), ValueError, "kv_lengths must be"
    yield "length count", dict(good, kv_lengths=[7]), ValueError, "same requests"
    yield "more new than cached", dict(good, kv_lengths=[7, 2]), ValueError, "count its new"
    yield "too many tokens", dict(
        good, query_lengths=[2, 30], kv_lengths=[7, 30]
    ), ValueError, "over the"
    yield "over the table", dict(good, kv_lengths=[7, 300]), ValueError, "capacity"


@pytest.mark.parametrize("case", list(_bad_inputs()), ids=lambda case: case[0])
def test_bad_input_is_refused_before_any_work(case, monkeypatch):
    _, kwargs, error, match = case
    calls = []
    monkeypatch.setattr(mha_form, "decompressed_keys_values", lambda *a, **k: calls.append(1))
    with pytest.raises(error, match=match):
        mla_paged_mha_attention(**kwargs)
    assert calls == []


def _error(call) -> tuple:
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    return type(info.value), str(info.value)


def test_shared_arguments_are_refused_with_the_absorbed_kernels_messages():
    """Each shared argument's bad value raises the same type and message in both forms."""
    step, query, cache, weight, lengths = mha_step([(5, 2), (0, 3)], 2, seed=12)
    absorbed_query = torch.zeros(5, 2, 48, device=DEVICE)
    for name, value in (
        ("kv_cache", cache.half()),
        ("kv_cache", cache[0]),
        ("block_table", step.block_table.float()),
        ("softmax_scale", -1.0),
        ("softmax_scale", 1e-300),
    ):
        shared = dict(kv_cache=cache, block_table=step.block_table, softmax_scale=SCALE)
        shared[name] = value
        absorbed_error = _error(
            lambda shared=shared: mla_paged_latent_attention(
                absorbed_query,
                cu_query_lengths=step.cu_query_lengths,
                kv_lengths=step.kv_lengths,
                rope_dim=16,
                **shared,
            )
        )
        mha_error = _error(
            lambda shared=shared: mla_paged_mha_attention(
                query, kv_up_weight=weight, rope_dim=16, **shared, **lengths
            )
        )
        assert absorbed_error == mha_error, name


# ------------------------------------------------------------------------------- GPU


def _gpu_backends():
    backends = []
    if internals.cudnn_attention_forward is not None:
        backends.append("cudnn")
    if internals.flash_attention_forward is not None:
        backends.append("flash")
        if internals.cudnn_dense_attention_forward is not None:
            backends.append("cudnn-dense")
    try:
        import transformer_engine  # noqa: F401

        backends.append("te")
    except ImportError:
        pass
    return backends


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cudnn", "cudnn-dense", "flash", "te"])
@pytest.mark.parametrize(
    "requests",
    [PREFILL, CHUNKED, MIXED, NINE, [(3072, 1024)], [(0, 1536), (0, 1536)]],
    ids=["prefill", "chunked", "mixed", "nine", "chunk_behind_3k", "prefill_2x1536"],
)
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_fused_backends_match_float64_in_bf16(backend, requests, heads):
    if backend not in _gpu_backends():
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
    "requests",
    [MIXED, [(3072, 1024)], [(0, 1536), (0, 1536)], [(5000, 300), (0, 700), (40, 1)]],
    ids=["mixed", "chunk_behind_3k", "prefill_2x1536", "long_and_short"],
)
@pytest.mark.parametrize("budget", [16, 1024])
@pytest.mark.parametrize("backend", ["cudnn", "cudnn-dense", "flash"])
def test_gpu_merging_backends_with_a_row_budget_match_float64_in_bf16(requests, budget, backend):
    """The backends that return log-sum-exps with a small budget: requests split across
    chunks, the new tokens' block too, partial results merged."""
    if backend not in _gpu_backends():
        pytest.skip(f"the {backend} backend is not available here")
    step, query, cache, weight, lengths = deepseek_step(requests, 16, torch.bfloat16)
    chunked = dict(rope_dim=64, backend=backend, row_budget=budget, **lengths)
    got = mla_paged_mha_attention(query, cache, step.block_table, weight, SCALE, **chunked)
    expected = reference(step, query, cache, weight, lengths)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2**-4)


@pytest.mark.gpu
def test_gpu_cudnn_ragged_check_passes_on_hopper():
    """Where torch has the operator and the GPU is sm90+, the once-per-device check passes: the
    backend rule picks cuDNN here."""
    if internals.cudnn_attention_forward is None:
        pytest.skip("this torch has no ragged cuDNN attention operator")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch runs ragged cuDNN attention on sm90 and newer only")
    assert mha_form.ragged_check("cudnn", torch.device("cuda")) is None


@pytest.mark.gpu
def test_gpu_flash_ragged_check_passes_on_ampere_and_up():
    """Where torch has the operator and the GPU is sm80+, FlashAttention's check passes (its mask
    aligned bottom-right, its log-sum-exp [heads, tokens]): the backend rule picks it here."""
    if internals.flash_attention_forward is None:
        pytest.skip("this torch has no ragged FlashAttention operator")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("FlashAttention-2 runs on sm80 and newer only")
    assert mha_form.ragged_check("flash", torch.device("cuda")) is None


@pytest.mark.gpu
def test_gpu_dense_cudnn_check_passes_on_ampere_and_up():
    """Where torch has both entries and the GPU is sm80+, the dense cuDNN backend's check passes
    (top-left causal, its log-sum-exp layout read right; unmasked calls through FlashAttention)."""
    if internals.cudnn_dense_attention_forward is None or internals.flash_attention_forward is None:
        pytest.skip("this torch lacks the dense cuDNN or the ragged FlashAttention operator")
    if torch.cuda.get_device_capability() < (8, 0) or not torch.backends.cudnn.is_available():
        pytest.skip("cuDNN's attention runs on sm80 and newer only")
    assert mha_form.ragged_check("cudnn-dense", torch.device("cuda")) is None
