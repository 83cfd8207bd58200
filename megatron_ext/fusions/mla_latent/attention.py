# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Paged attention over MLA's latent cache, in the absorbed form: the public entry.

:func:`mla_paged_latent_attention` computes one step of megatron-core's dynamic batching
(prefill, chunked prefill, decode and any mix of them) over the paged latent cache, reading only
the rows each token attends to through the block table. The kernels and their design are in
:mod:`megatron_ext.fusions.mla_latent.attention_kernels`, the launch choices in
:mod:`~megatron_ext.fusions.mla_latent.tile_rules`.

Launches: a call layout's first call checks every argument
(:func:`~megatron_ext.fusions.mla_latent.checks.check_attention_call`) and keeps the launch plan it
gives (:class:`~megatron_ext.fusions.mla_latent.attention_plan.LatentAttentionPlan`) in
:data:`ATTENTION_PLANS` (:mod:`megatron_ext.fusions.launch_plans`); later calls of the layout
check only that the output shares no memory with an input. A specialisation's first launch goes
through Triton's JIT, later ones through the compiled kernel's C launcher
(:class:`megatron_ext.fusions.direct_launch.PreparedLaunch`), which skips Triton's Python dispatch.
"""

from typing import Optional

import torch
from torch import Tensor

from megatron_ext.fusions.launch_plans import PlanCache, layout_key
from megatron_ext.fusions.mla_latent import attention_plan
from megatron_ext.fusions.mla_latent.attention_plan import LatentAttentionPlan, plan_for_call
from megatron_ext.fusions.mla_latent.checks import (
    check_attention_call,
    check_attention_out_disjoint,
)

__all__ = ["ATTENTION_PLANS", "mla_paged_latent_attention"]

# Checked call layouts -> their launches: ``ATTENTION_PLANS.clear()`` makes the next call of each
# layout check and plan again (as after a change of the tile rules), ``len`` counts them.
ATTENTION_PLANS: PlanCache[LatentAttentionPlan] = PlanCache()


def mla_paged_latent_attention(
    query: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    cu_query_lengths: Tensor,
    kv_lengths: Tensor,
    softmax_scale: float,
    *,
    rope_dim: int = 64,
    max_query_len: Optional[int] = None,
    num_kv_splits: Optional[int] = None,
    out: Optional[Tensor] = None,
    query_rope: Optional[Tensor] = None,
) -> Tensor:
    """Absorbed MLA attention of one dynamic-batching step over the paged latent cache.
    GRAPH-SAFE (no host synchronisation; grids and the split count from static sizes; idle
    programs exit early).

    Request ``r`` has the new tokens ``cu_query_lengths[r]:cu_query_lengths[r + 1]`` of
    ``query`` and ``kv_lengths[r]`` cached rows including them (append first:
    :func:`megatron_ext.fusions.mla_latent.rope_cache_append.fused_mla_rope_cache_append`); its
    row ``n`` is ``kv_cache[block_table[r, n // block_size], n % block_size]``. New token ``i`` of
    the request is at position ``kv_lengths[r] - q_len + i`` and attends to rows ``0..position``
    with keys the whole rows and values their first ``latent_dim`` columns:
    ``out = softmax(scale * q . k) @ v``, accumulated in fp32.

    The lengths and block ids are not checked on the host (each check needs a sync); whatever
    they hold, the kernels stay inside the tensors and write every output row:
    ``cu_query_lengths`` is read clamped into ``[0, tokens]``; tokens outside
    ``[cu_query_lengths[0], cu_query_lengths[-1])`` get zeros (CUDA-graph padding); if the
    clamped values decrease anywhere, every token inside that span gets NaN (no request
    boundary can be trusted). A negative ``kv_lengths`` entry attends to nothing (zeros); one
    past the block table's capacity keeps its positions and is cut at the capacity; a row whose
    block id lies outside the cache is skipped. A token that attends to a row holding NaN or
    inf gets NaN; rows it does not attend to never affect it.

    Inference only: ``out`` carries no autograd history, so no gradient reaches ``query``,
    ``query_rope`` or the cache through it, whatever their ``requires_grad``.

    In megatron-core's ``DynamicInferenceContext`` terms: ``kv_cache`` is
    ``memory_buffer[layer]`` (``key_value_cache(layer)[0]``), ``block_table``,
    ``cu_query_lengths`` and ``kv_lengths`` the attention metadata's ``block_table``,
    ``cu_query_seq_lengths`` and ``kv_seq_lengths`` (padded requests have length 0), and
    ``max_query_len`` its ``max_seqlen_q``.

    Args:
        query (Tensor): [tokens, heads, latent_dim + rope_dim], ``[q_nope @ W_UK | rope(q_pe)]``
            per head; or, with ``query_rope``, [tokens, heads, latent_dim], ``q_nope @ W_UK``
            alone. fp32, fp16 or bf16, unit last stride, any token and head strides (a
            ``[heads, tokens, latent_dim]`` matmul output viewed with ``.transpose(0, 1)``).
            ``heads`` may be a tensor-parallel shard (any count >= 1).
        kv_cache (Tensor): [num_blocks, block_size, latent_dim + rope_dim] in query's dtype, unit
            last stride; any block size.
        block_table (Tensor): [requests, max_blocks] int32/int64, unit last stride.
        cu_query_lengths (Tensor): [requests + 1] int32/int64 cumulative new-token counts.
        kv_lengths (Tensor): [requests] int32/int64 cached rows per request, the new ones
            included.
        softmax_scale (float): the logits' scale (MLA's is ``mscale**2 / sqrt(qk_head_dim +
            qk_pos_emb_head_dim)``, the unabsorbed head size's).
        rope_dim (int): the RoPE columns at the end of each row; it and the latent width
            (``kv_lora_rank``) must be powers of two >= 16.
        max_query_len (Optional[int]): a static bound on the new tokens per request (1 in
            decode-only steps); it picks the tile shape, so any value is correct. None: tokens.
        num_kv_splits (Optional[int]): split-KV count, 1 to ``MAX_KV_SPLITS``; None picks one
            from static sizes (:func:`~.tile_rules.default_num_kv_splits`, or
            :func:`~.tile_rules.wave_num_kv_splits` where the warp-specialized decode kernel
            runs: :func:`~.attention_plan.gluon_decode_refusal`).
        out (Optional[Tensor]): [tokens, heads, latent_dim] in query's dtype, unit last stride,
            any token and head strides whose elements do not share memory (e.g. a ``[heads,
            tokens, latent_dim]`` buffer viewed with ``.transpose(0, 1)``), to write to (a new
            tensor if None).
        query_rope (Optional[Tensor]): the query's RoPE part ``rope(q_pe)`` as a second
            operand, [tokens, heads, rope_dim] in query's dtype, unit last stride, any token and
            head strides (e.g. the slice ``q[..., qk_head_dim:]`` of the projected query), so
            that no copy joins it to ``q_nope @ W_UK``. None: it is the end of ``query``'s rows.
            The kernels load the two parts as they load one query's: the same bits.

    Returns:
        Tensor: ``out``, [tokens, heads, latent_dim] (new tensors are token-major).

    Raises:
        TypeError, ValueError: for arguments of other types, dtypes, shapes, devices or layouts,
            widths the kernels do not take, or an ``out`` that overlaps an input, before any
            launch.
    """
    key = layout_key(
        (query, kv_cache, block_table, cu_query_lengths, kv_lengths, out, query_rope),
        # The kernel switch too: a plan keeps the kernel it was made with.
        (softmax_scale, rope_dim, max_query_len, num_kv_splits, attention_plan.GLUON_DECODE),
    )
    plan = ATTENTION_PLANS.get(key)
    if plan is None:
        # First call of this layout: every check, then the plan (cached once they passed).
        if out is None and isinstance(query, Tensor) and query.dim() == 3:
            width = query.shape[2]
            if query_rope is None:
                width = width - rope_dim if isinstance(rope_dim, int) else 0
            out = torch.empty(
                (*query.shape[:2], max(width, 0)), dtype=query.dtype, device=query.device
            )
        inputs = (query, kv_cache, block_table, cu_query_lengths, kv_lengths)
        _, _, latent_dim = check_attention_call(
            *inputs, softmax_scale, rope_dim, max_query_len, num_kv_splits, out, query_rope
        )
        plan = plan_for_call(
            *inputs,
            softmax_scale,
            out,
            latent_dim=latent_dim,
            max_query_len=max_query_len,
            num_kv_splits=num_kv_splits,
            query_rope=query_rope,
        )
        ATTENTION_PLANS.put(key, plan)
    elif out is None:
        out = torch.empty(plan.out_shape, dtype=query.dtype, device=query.device)
    elif plan.out_meets_an_input(
        query, kv_cache, block_table, cu_query_lengths, kv_lengths, query_rope, out
    ):
        # What the layout cannot tell: whether this call's output shares memory with an input
        # (the full check names it).
        check_attention_out_disjoint(
            query, kv_cache, block_table, cu_query_lengths, kv_lengths, out, query_rope
        )
    plan(query, kv_cache, block_table, cu_query_lengths, kv_lengths, out, query_rope)
    return out
