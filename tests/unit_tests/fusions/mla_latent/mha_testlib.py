# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Steps, references and stand-in operators shared by the MHA form's tests: a paged step with an
MHA-form query and up-projection weight (:func:`mha_step`), its float64 reference, the float64
merge of partial attentions (:func:`float64_merge`), the absorbed kernel on the same inputs, and
stand-ins for torch's ragged cuDNN, dense cuDNN and FlashAttention
operators that keep the operators' contracts and record their calls."""

import math

import numpy as np
import torch

from megatron_ext.fusions.mla_latent import mha_backends, mla_paged_latent_attention
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


def float64_merge(acc, acc_lse, part, part_lse):
    """A partial attention merged into accumulated ones in float64, from the definition: outputs
    weighted by exp(lse) and normalised. Rows whose accumulated log-sum-exp is -inf (no call wrote
    them) count as empty whatever they hold.

    Returns:
        Tuple[Tensor, Tensor]: the merged outputs and log-sum-exps (float64).
    """
    la, lb = acc_lse.double(), part_lse.double()
    a = torch.where((la == -math.inf)[..., None], 0.0, acc.double())
    top = torch.maximum(la, lb)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    wa, wb = torch.exp(la - top), torch.exp(lb - top)
    total = wa + wb
    merged = (a * wa[..., None] + part.double() * wb[..., None]) / total.clamp_min(1e-300)[
        ..., None
    ]
    merged = torch.where(total[..., None] > 0, merged, torch.zeros_like(merged))
    return merged, top + torch.log(total)


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


def cudnn_stand_in(seen, stats_layout="THk"):
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
        out, lse = mha_backends.torch_varlen(q, k, v, q_lens, k_lens, causal, scale)
        no_keys = torch.from_numpy(np.repeat(k_lens == 0, q_lens))
        out[: len(no_keys)][no_keys] = float("nan")
        lse = lse.unsqueeze(-1) if stats_layout == "THk" else lse.t().contiguous()
        return out, lse

    return stand_in


def flash_stand_in(seen):
    """A stand-in for torch's ragged FlashAttention-2 operator (its contract: int32 cumulative
    lengths, one head size for query, key and value, causal aligned bottom-right, log-sum-exp as
    [heads, tokens], +inf for a query with no keys) that records each call's shapes."""

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale):
        q_lens, k_lens = np.diff(cu_q.cpu().numpy()), np.diff(cu_k.cpu().numpy())
        seen.append((q.shape, k.shape, v.shape, len(q_lens)))
        assert cu_q.dtype == cu_k.dtype == torch.int32 and dropout == 0.0 and not debug
        assert max_q >= q_lens.max() and max_k >= k_lens.max()
        assert q.shape[-1] == k.shape[-1] == v.shape[-1], (q.shape, k.shape, v.shape)
        assert q.shape[-1] % 8 == 0 and q.shape[-1] <= mha_backends.FLASH_MAX_HEAD_DIM, q.shape
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        causal = "bottom_right" if causal else None
        out, lse = mha_backends.torch_varlen(q, k, v, q_lens, k_lens, causal, scale)
        lse[lse == -math.inf] = math.inf  # FlashAttention's answer for a query with no key
        return out, lse.t().contiguous(), None, None, None

    return stand_in


def attend(mha, backend, **kwargs):
    """:func:`mla_paged_mha_attention` on an :func:`mha_step` (its tuple) through ``backend``."""
    step, query, cache, weight, lengths = mha
    return mla_paged_mha_attention(
        query,
        cache,
        step.block_table,
        weight,
        SCALE,
        rope_dim=step.rope_dim,
        backend=backend,
        **lengths,
        **kwargs,
    )


def matches_float64(requests, backend, budget, seed, **widths) -> dict:
    """Run a 3-head step of ``requests`` through ``backend`` (stand-ins in place) and check it
    against the float64 reference; return the step's host lengths."""
    mha = mha_step(requests, 3, seed=seed, **widths)
    got = attend(mha, backend, row_budget=budget)
    step, query, cache, weight, lengths = mha
    expected = reference(step, query, cache, weight, lengths)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-5)
    return lengths


def cudnn_dense_stand_in(seen):
    """A stand-in for torch's dense cuDNN operator (its contract: [batch, heads, length, width],
    top-left causal on square calls, an additive bias broadcast to [batch, heads, queries,
    keys], log-sum-exp as [batch, heads, queries]) that records each call's batch, queries,
    query storage, whether it had a bias and whether it was causal."""

    def stand_in(q, k, v, bias, want_lse, dropout, causal, debug, *, scale):
        assert dropout == 0.0 and not debug
        batch, heads, length, _ = q.shape
        keys = k.shape[2]
        assert k.shape[:2] == v.shape[:2] == (batch, heads) and v.shape[2] == keys
        assert not (causal and bias is not None), "the flag or a bias, not both"
        seen.append((batch, length, q.untyped_storage().data_ptr(), bias is not None, causal))
        scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scale
        if causal:
            assert length == keys, "top-left causal on a call that is not square"
            rows = torch.arange(length, device=q.device)
            scores = scores.masked_fill(rows[None, :] > rows[:, None], -math.inf)
        if bias is not None:
            assert bias.shape == (batch, heads, length, keys) and bias.dtype == q.dtype
            scores = scores + bias.double()
        lse = torch.logsumexp(scores, -1)
        out = torch.einsum("bhqk,bhkd->bhqd", torch.exp(scores - lse[..., None]), v.double())
        return out.to(q.dtype), lse.float()

    return stand_in


def dense_backend(monkeypatch, seen=None, flash_seen=None):
    """Stand-ins for both entries the ``cudnn-dense`` backend calls, recording into the lists."""
    dense = cudnn_dense_stand_in([] if seen is None else seen)
    flash = flash_stand_in([] if flash_seen is None else flash_seen)
    monkeypatch.setattr(mha_backends.internals, "cudnn_dense_attention_forward", dense)
    monkeypatch.setattr(mha_backends.internals, "flash_attention_forward", flash)


def assert_buckets(seen):
    """Every shape handed to the operator is a bucket."""
    for tokens, rows, entries, max_q, max_k in seen:
        assert tokens == bucket(tokens) and rows == bucket(rows), seen
        assert entries == bucket(entries, minimum=1), seen
        assert max_q == bucket(max_q, minimum=2) and max_k == bucket(max_k, minimum=1), seen
