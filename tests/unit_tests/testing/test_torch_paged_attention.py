# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of the plain-torch paged-KV attention against a per-request reference."""

import math

import pytest
import torch

from megatron_ext.testing.torch_paged_attention import paged_attention


def _layout(specs, block_size, num_blocks, heads_kv, dim, seed):
    """Random paged KV cache holding requests given as (cached length, query length)."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, heads_kv, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, heads_kv, dim, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(math.ceil(total / block_size) for total, _ in specs)
    table = torch.full((len(specs), max_blocks), -1, dtype=torch.int32)
    for r, (total, _) in enumerate(specs):
        for b in range(math.ceil(total / block_size)):
            table[r, b] = free.pop()
    return k_cache, v_cache, table


def _reference(q, k_cache, v_cache, specs, table, block_size, scale):
    heads = q.shape[1]
    out, offset = [], 0
    for r, (total, query_len) in enumerate(specs):
        idx = torch.arange(total)
        blocks = table[r, idx // block_size].long()
        keys = k_cache[blocks, idx % block_size]
        values = v_cache[blocks, idx % block_size]
        group = heads // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        for i in range(query_len):
            position = total - query_len + i
            s = torch.einsum("hd,phd->hp", q[offset + i], keys[: position + 1]) * scale
            out.append(torch.einsum("hp,phd->hd", s.softmax(-1), values[: position + 1]))
        offset += query_len
    return torch.stack(out)


@pytest.mark.parametrize("heads,heads_kv", [(4, 4), (4, 2), (6, 1)])
def test_matches_reference_for_mixed_prefill_and_decode(heads, heads_kv):
    block_size, dim = 4, 8
    # (cached length including this step, tokens fed this step): decode, prefill, chunked
    # continuation, single-token prompt.
    specs = [(9, 1), (7, 7), (13, 5), (1, 1), (4, 1)]
    k_cache, v_cache, table = _layout(specs, block_size, 24, heads_kv, dim, seed=heads)
    total_q = sum(qlen for _, qlen in specs)
    padded_tokens, padded_batch = total_q + 3, len(specs) + 2
    q = torch.randn(padded_tokens, heads, dim, generator=torch.Generator().manual_seed(1))
    cu = torch.zeros(padded_batch + 1, dtype=torch.int32)
    cu[1 : len(specs) + 1] = torch.tensor([qlen for _, qlen in specs]).cumsum(0)
    cu[len(specs) + 1 :] = total_q  # padding requests repeat the total
    seqlens = torch.zeros(padded_batch, dtype=torch.int32)
    seqlens[: len(specs)] = torch.tensor([total for total, _ in specs])
    padded_table = torch.full((padded_batch, table.shape[1]), -1, dtype=torch.int32)
    padded_table[: len(specs)] = table

    out = paged_attention(q, k_cache, v_cache, cu, seqlens, padded_table, token_chunk=5)
    expected = _reference(q, k_cache, v_cache, specs, table, block_size, dim**-0.5)
    torch.testing.assert_close(out[:total_q], expected, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(out[total_q:]) == 0  # padding tokens


def test_unwritten_cache_slots_cannot_leak_into_the_output():
    """Slots past each request's length (and unused blocks) may hold NaN or inf."""
    block_size, dim, heads = 4, 8, 2
    specs = [(6, 1), (3, 3)]
    k_cache, v_cache, table = _layout(specs, block_size, 8, heads, dim, seed=3)
    clean_k, clean_v = k_cache.clone(), v_cache.clone()
    for r, (total, _) in enumerate(specs):
        for pos in range(total, table.shape[1] * block_size):
            block = int(table[r, pos // block_size])
            if block >= 0:
                k_cache[block, pos % block_size] = float("nan")
                v_cache[block, pos % block_size] = float("inf")
    used = {int(b) for b in table.flatten() if b >= 0}
    for block in set(range(8)) - used:
        k_cache[block], v_cache[block] = float("nan"), float("-inf")
    q = torch.randn(5, heads, dim)
    cu = torch.tensor([0, 1, 4, 4], dtype=torch.int32)
    seqlens = torch.tensor([6, 3, 0], dtype=torch.int32)
    padded_table = torch.cat([table, torch.full((1, table.shape[1]), -1, dtype=torch.int32)])
    out = paged_attention(q, k_cache, v_cache, cu, seqlens, padded_table)
    expected = _reference(q, clean_k, clean_v, specs, table, block_size, dim**-0.5)
    torch.testing.assert_close(out[:4], expected, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(out[4]) == 0


def test_rejects_inconsistent_shapes():
    q = torch.zeros(3, 4, 8)
    cache = torch.zeros(5, 4, 3, 8)
    with pytest.raises(ValueError):
        paged_attention(q, cache, cache, torch.zeros(2), torch.zeros(1), torch.zeros(1, 2))
    cache = torch.zeros(5, 4, 2, 8)
    with pytest.raises(ValueError):
        paged_attention(q, cache, cache, torch.zeros(3), torch.zeros(1), torch.zeros(1, 2))


def test_without_einops_the_head_merge_is_a_torch_stand_in(monkeypatch):
    from megatron.core.transformer import attention

    from megatron_ext.testing.torch_paged_attention import (
        allow_dynamic_inference_without_flash_attn,
    )

    installed = attention.rearrange
    monkeypatch.setattr(attention, "rearrange", None)  # as without einops
    with allow_dynamic_inference_without_flash_attn():
        merge = attention.rearrange
        assert attention.is_fa_min_version("2.7.3")
    assert attention.rearrange is None
    x = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    assert torch.equal(merge(x, "s b h d -> s b (h d)"), x.reshape(2, 3, 20))
    with pytest.raises(ValueError, match="only 's b h d -> s b \\(h d\\)' is supported"):
        merge(x, "s b h d -> b s h d")
    monkeypatch.setattr(attention, "rearrange", installed)
    if installed is not None:  # with einops the block leaves megatron-core's own in place
        with allow_dynamic_inference_without_flash_attn():
            assert attention.rearrange is installed
