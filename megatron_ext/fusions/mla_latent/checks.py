# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Input checks of the paged MLA latent cache's kernels: its layout, the attention's call and the
RoPE + append's call.

:mod:`megatron_ext.fusions.mla_latent.rope_cache_append` writes rows into a layer's paged latent
cache and :mod:`megatron_ext.fusions.mla_latent.attention` reads them. Both take megatron-core's
``DynamicInferenceContext`` tensors as they are and check them on the host, before any launch
(on a layout's first call; the plan caches keep what passed): with the generic checks of
:mod:`megatron_ext.fusions.tensor_checks`, and with these for the layouts only the paged cache
has. They raise TypeError or ValueError naming the argument. Nothing here reads a device
tensor's values (no host synchronisation), so what only the values can show (block ids,
lengths, positions) is guarded inside the kernels instead.
"""

import numbers
from typing import Optional, Tuple

import torch

from megatron_ext.fusions.mla_latent.tile_rules import (
    LARGE_SCALE_LOG2,
    LOG2E,
    MAX_BLOCK_SIZE,
    MAX_KV_SPLITS,
    ROW_OFFSET_LIMIT,
)
from megatron_ext.fusions.tensor_checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_device,
    check_disjoint,
    check_index_vector,
    check_int,
    check_no_self_overlap,
    check_runnable,
    check_tensor,
    check_unit_last_stride,
)

__all__ = [
    "APPEND_ARGUMENTS",
    "MHA_MAX_SOFTMAX_SCALE",
    "check_append_cache_disjoint",
    "check_append_call",
    "check_attention_call",
    "check_attention_out_disjoint",
    "check_block_table",
    "check_cache_for_query",
    "check_head_offsets",
    "check_mha_softmax_scale",
    "check_paged_cache",
    "check_pow2",
    "check_query_rope",
    "check_softmax_scale",
    "rows_of",
]

# The RoPE + append's tensor arguments, in its order.
APPEND_ARGUMENTS = (
    "kv_latent",
    "k_pos_emb",
    "cos",
    "sin",
    "positions",
    "kv_cache",
    "block_idx",
    "block_offset",
)


def rows_of(name: str, x: torch.Tensor) -> Tuple[int, int, int]:
    """(rows, row stride, width) of a [rows, width] or [rows, 1, ..., 1, width] tensor.

    megatron-core's dynamic step hands its per-token tensors as [tokens, 1, width] (sbhd with a
    batch of one); any unit dimensions between the first and the last are accepted as views.
    """
    if x.dim() < 2 or any(d != 1 for d in x.shape[1:-1]):
        raise ValueError(
            f"{name} must be [tokens, width] or [tokens, 1, ..., 1, width]; got {tuple(x.shape)}"
        )
    check_unit_last_stride(name, x)
    return x.shape[0], x.stride(0), x.shape[-1]


def check_paged_cache(name: str, cache, device: torch.device) -> Tuple[int, int, int]:
    """Check one layer's paged latent cache; return (blocks, block size, row width).

    The cache is [num_blocks, block_size, width] (``memory_buffer[layer]`` of megatron-core's
    ``DynamicInferenceContext`` with ``cache_mla_latent``): any strides but a unit last one.
    """
    check_tensor(name, cache, FLOAT_DTYPES)
    check_device(name, cache, device)
    if cache.dim() != 3:
        raise ValueError(
            f"{name} must be [num_blocks, block_size, width] (one layer of the latent cache); got "
            f"shape {tuple(cache.shape)}"
        )
    if cache.shape[1] < 1:
        raise ValueError(f"{name} must have a block size >= 1; got shape {tuple(cache.shape)}")
    check_unit_last_stride(name, cache)
    return cache.shape[0], cache.shape[1], cache.shape[2]


def check_pow2(name: str, value: int) -> None:
    """Raise ValueError unless ``value`` (an int) is a power of two >= 16 (a kernel width)."""
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16; got {value}")


def check_cache_for_query(kv_cache, query: torch.Tensor) -> int:
    """Check the paged cache a query attends over (its layout, block size and dtype); return the
    cache's row width."""
    _, block_size, cache_width = check_paged_cache("kv_cache", kv_cache, query.device)
    if block_size > MAX_BLOCK_SIZE:
        raise ValueError(
            f"kv_cache's block size {block_size} is over {MAX_BLOCK_SIZE} (the kernel counts a "
            "key's page and row in 32 bits across up to 64 pages)"
        )
    if kv_cache.dtype != query.dtype:
        raise TypeError(f"kv_cache is {kv_cache.dtype}, query {query.dtype}: they must match")
    return cache_width


def check_block_table(block_table, device: torch.device) -> int:
    """Check a [requests, max_blocks] block table; return its request count."""
    check_tensor("block_table", block_table, INDEX_DTYPES)
    check_device("block_table", block_table, device)
    if block_table.dim() != 2:
        raise ValueError(
            "block_table must be [requests, max_blocks_per_request]; got "
            f"{tuple(block_table.shape)}"
        )
    check_unit_last_stride("block_table", block_table)
    return block_table.shape[0]


def check_softmax_scale(softmax_scale) -> float:
    """Check an attention's softmax scale (a positive, finite real whose product with log2(e) is
    a normal float32); return it as a float."""
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    try:
        scale = float(softmax_scale)
    except OverflowError:
        raise ValueError(f"softmax_scale {softmax_scale} is too large for a float") from None
    if not (0 < scale < float("inf")):
        raise ValueError(f"softmax_scale must be positive and finite; got {softmax_scale}")
    # The kernel takes scale * log2(e) as an fp32 argument: outside fp32's normal range it would
    # arrive as 0 (uniform attention) or inf (NaN logits), a plausible wrong answer. Inside it,
    # no logit overflows (LARGE_SCALE_LOG2).
    fp32 = torch.finfo(torch.float32)
    if not (fp32.tiny <= scale * LOG2E <= fp32.max):
        raise ValueError(
            f"softmax_scale {softmax_scale} times log2(e) is outside float32's normal range "
            f"[{fp32.tiny:.3g}, {fp32.max:.3g}]: the kernel scales its logits in float32"
        )
    return scale


# The largest scale at which scaling a finite float32 logit before subtracting the row maximum
# cannot overflow, which the MHA form's backends do (cuDNN, flash, torch); stage 1 keeps larger
# ones in raw units and scales only differences (LARGE_SCALE_LOG2).
MHA_MAX_SOFTMAX_SCALE = LARGE_SCALE_LOG2 / LOG2E


def check_mha_softmax_scale(softmax_scale) -> float:
    """Check the MHA form's softmax scale: :func:`check_softmax_scale`, and at most
    :data:`MHA_MAX_SOFTMAX_SCALE` (above it a logit can overflow to inf and a row become NaN or
    a one-hot at the wrong key); return it as a float."""
    scale = check_softmax_scale(softmax_scale)
    if scale > MHA_MAX_SOFTMAX_SCALE:
        raise ValueError(
            f"softmax_scale {softmax_scale} is above the MHA form's {MHA_MAX_SOFTMAX_SCALE:.6g}: "
            "its backends scale each float32 logit before subtracting the row maximum, which can "
            "overflow past it (the absorbed form, mla_paged_latent_attention, takes any scale)"
        )
    return scale


def check_attention_call(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_query_lengths: torch.Tensor,
    kv_lengths: torch.Tensor,
    softmax_scale: float,
    rope_dim: int,
    max_query_len: Optional[int],
    num_kv_splits: Optional[int],
    out: torch.Tensor,
    query_rope: Optional[torch.Tensor] = None,
) -> Tuple[int, int, int]:
    """Check every argument of a latent attention call (its ``out`` allocated already).

    ``query_rope`` None: ``query`` is [tokens, heads, latent_dim + rope_dim]. Given: ``query`` is
    [tokens, heads, latent_dim] and ``query_rope`` [tokens, heads, rope_dim], each checked as the
    one-operand query is.

    Returns:
        Tuple[int, int, int]: (tokens, heads, latent_dim).
    """
    function = "mla_paged_latent_attention"
    check_tensor("query", query, FLOAT_DTYPES)
    check_runnable(function, "query", query)
    device = query.device
    two = query_rope is not None
    if query.dim() != 3:
        layout = "latent_dim] (query_rope given)" if two else "latent_dim + rope_dim]"
        raise ValueError(
            f"query must be [tokens, heads, {layout} (squeeze megatron-core's batch dimension of "
            f"1); got shape {tuple(query.shape)}"
        )
    check_unit_last_stride("query", query)
    check_head_offsets("query", query)
    tokens, heads, width = query.shape
    check_int("rope_dim", rope_dim, 1)
    check_pow2("rope_dim", rope_dim)
    if two:
        check_query_rope(query, query_rope, rope_dim)
        latent_dim, width = width, width + rope_dim
        check_pow2(f"the latent width (query width {latent_dim}, query_rope given)", latent_dim)
    else:
        latent_dim = width - rope_dim
        if latent_dim < 1:
            raise ValueError(
                f"query's width {width} leaves no latent part beside rope_dim={rope_dim}"
            )
        check_pow2(f"the latent width (query width {width} - rope_dim {rope_dim})", latent_dim)
    cache_width = check_cache_for_query(kv_cache, query)
    if cache_width != width:
        rows = f"query rows {width}"
        if two:
            rows = f"query + query_rope rows {latent_dim} + {rope_dim}"
        raise ValueError(f"kv_cache rows are {cache_width} wide, {rows}")
    requests = check_block_table(block_table, device)
    check_index_vector("cu_query_lengths", cu_query_lengths, requests + 1, device)
    check_index_vector("kv_lengths", kv_lengths, requests, device)
    check_softmax_scale(softmax_scale)
    if max_query_len is not None:
        check_int("max_query_len", max_query_len, 1)
    if num_kv_splits is not None:
        check_int("num_kv_splits", num_kv_splits, 1)
        if num_kv_splits > MAX_KV_SPLITS:
            raise ValueError(f"num_kv_splits must be <= {MAX_KV_SPLITS}; got {num_kv_splits}")
    check_tensor("out", out, (query.dtype,))
    check_device("out", out, device)
    if tuple(out.shape) != (tokens, heads, latent_dim):
        raise ValueError(
            f"out must have shape {(tokens, heads, latent_dim)}; got {tuple(out.shape)}"
        )
    check_unit_last_stride("out", out)
    check_head_offsets("out", out)
    check_no_self_overlap("out", out)
    check_attention_out_disjoint(
        query, kv_cache, block_table, cu_query_lengths, kv_lengths, out, query_rope
    )
    return tokens, heads, latent_dim


def check_query_rope(query: torch.Tensor, query_rope, rope_dim: int) -> None:
    """Check the attention's second query operand against the first (a 3-d ``query``).

    Args:
        query: the query's latent part, [tokens, heads, latent_dim].
        query_rope: its RoPE part, [tokens, heads, rope_dim] in query's dtype and device, unit
            last stride (any token and head strides).
        rope_dim: the call's RoPE width.
    """
    check_tensor("query_rope", query_rope, FLOAT_DTYPES)
    check_device("query_rope", query_rope, query.device)
    if query_rope.dtype != query.dtype:
        raise TypeError(f"query_rope is {query_rope.dtype}, query {query.dtype}: they must match")
    expected = (*query.shape[:2], rope_dim)
    if tuple(query_rope.shape) != expected:
        raise ValueError(
            f"query_rope must be [tokens, heads, rope_dim] = {expected} (query's tokens and heads, "
            f"rope_dim={rope_dim}); got shape {tuple(query_rope.shape)}"
        )
    check_unit_last_stride("query_rope", query_rope)
    check_head_offsets("query_rope", query_rope)


def check_head_offsets(name: str, x: torch.Tensor) -> None:
    """Refuse a [tokens, heads, width] tensor whose last head starts 2**31 elements or more past
    its first.

    The attention kernels count a head's offset (head index times head stride) in 32 bits, as
    every layout megatron-core produces needs (heads inside a token's row); a head-major view of a
    long batch would wrap it and read or write another token's row.

    Args:
        name: the argument's name, for the message.
        x: the tensor, 3-d.
    """
    if (x.shape[1] - 1) * x.stride(1) >= ROW_OFFSET_LIMIT:
        raise ValueError(
            f"{name}'s head stride {x.stride(1)} over its {x.shape[1]} heads puts the last head "
            f"2**31 elements or more past the first, which the kernel's 32-bit head offsets "
            f"cannot reach: give {name} with its heads inside each token's row (e.g. .contiguous())"
        )


def check_attention_out_disjoint(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_query_lengths: torch.Tensor,
    kv_lengths: torch.Tensor,
    out: torch.Tensor,
    query_rope: Optional[torch.Tensor] = None,
) -> None:
    """Raise ValueError if the attention's ``out`` shares memory with an input (checked on every
    call: the layout cannot tell)."""
    check_disjoint(
        "out",
        out,
        (
            ("query", query),
            ("query_rope", query_rope),
            ("kv_cache", kv_cache),
            ("block_table", block_table),
            ("cu_query_lengths", cu_query_lengths),
            ("kv_lengths", kv_lengths),
        ),
    )


def check_append_call(
    kv_latent: torch.Tensor,
    k_pos_emb: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    kv_cache: torch.Tensor,
    block_idx: torch.Tensor,
    block_offset: torch.Tensor,
) -> Optional[tuple]:
    """Check every argument of a RoPE + cache append call.

    Returns:
        Optional[tuple]: None when there are no tokens, else ``(sizes, latent_dim, rope_dim)``,
        ``sizes`` the kernel's size and stride arguments in the order of
        :data:`megatron_ext.fusions.mla_latent.rope_cache_append.SIZE_NAMES`.
    """
    function = "fused_mla_rope_cache_append"
    check_tensor("kv_latent", kv_latent, FLOAT_DTYPES)
    check_runnable(function, "kv_latent", kv_latent)
    device = kv_latent.device
    check_tensor("k_pos_emb", k_pos_emb, FLOAT_DTYPES)
    check_device("k_pos_emb", k_pos_emb, device)
    tokens, latent_stride, latent_dim = rows_of("kv_latent", kv_latent)
    rope_tokens, k_pe_stride, rope_dim = rows_of("k_pos_emb", k_pos_emb)
    if rope_tokens != tokens:
        raise ValueError(f"k_pos_emb has {rope_tokens} tokens, kv_latent {tokens}")
    if rope_dim < 2 or rope_dim & (rope_dim - 1):
        raise ValueError(f"k_pos_emb's width must be a power of two >= 2; got {rope_dim}")
    if latent_dim < 1:
        raise ValueError("kv_latent's width must be >= 1")
    num_blocks, block_size, width = check_paged_cache("kv_cache", kv_cache, device)
    if width != latent_dim + rope_dim:
        raise ValueError(
            f"kv_cache rows are {width} wide, but kv_latent + k_pos_emb are {latent_dim} + "
            f"{rope_dim} = {latent_dim + rope_dim}"
        )
    for name, x in (("kv_latent", kv_latent), ("k_pos_emb", k_pos_emb)):
        if x.dtype != kv_cache.dtype:
            raise TypeError(f"{name} is {x.dtype}, kv_cache {kv_cache.dtype}: they must match")
    for name, table in (("cos", cos), ("sin", sin)):
        check_tensor(name, table, FLOAT_DTYPES)
        check_device(name, table, device)
        if table.dtype not in (k_pos_emb.dtype, torch.float32):
            raise TypeError(
                f"{name} must be {k_pos_emb.dtype} (k_pos_emb's dtype) or float32, got "
                f"{table.dtype}: megatron-core rotates with tables in the tensor's dtype"
            )
        positions_rows, _, table_width = rows_of(name, table)
        if table_width != rope_dim or positions_rows < 1:
            raise ValueError(
                f"{name} must be [positions >= 1, {rope_dim}] or [positions, 1, 1, {rope_dim}]; "
                f"got {tuple(table.shape)}"
            )
    if cos.shape != sin.shape or cos.dtype != sin.dtype:
        raise ValueError(
            f"cos and sin must have one shape and dtype; got {tuple(cos.shape)} {cos.dtype} and "
            f"{tuple(sin.shape)} {sin.dtype}"
        )
    check_index_vector("positions", positions, tokens, device)
    check_index_vector("block_idx", block_idx, tokens, device)
    check_index_vector("block_offset", block_offset, tokens, device)
    check_no_self_overlap("kv_cache", kv_cache)
    check_append_cache_disjoint(
        kv_latent, k_pos_emb, cos, sin, positions, kv_cache, block_idx, block_offset
    )
    if tokens == 0:
        return None
    strides = (latent_stride, k_pe_stride, cos.stride(0), sin.stride(0))
    strides += (kv_cache.stride(0), kv_cache.stride(1))
    return (tokens, cos.shape[0], num_blocks, block_size, *strides), latent_dim, rope_dim


def check_append_cache_disjoint(*tensors: torch.Tensor) -> None:
    """Raise ValueError if the append's ``kv_cache`` shares memory with an input (checked on every
    call: the layout cannot tell).

    Args:
        tensors: the call's tensors, in the order of :data:`APPEND_ARGUMENTS`.
    """
    named = dict(zip(APPEND_ARGUMENTS, tensors))
    cache = named.pop("kv_cache")
    check_disjoint("kv_cache", cache, tuple(named.items()))
