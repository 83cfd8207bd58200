# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""MLA's key RoPE and the paged latent-cache append in one Triton kernel: the kernel, its launch
plan and the public entry (its checks are in :mod:`megatron_ext.fusions.mla_latent.checks`).

With ``cache_mla_latents``, megatron-core's dynamic inference step (``MLASelfAttention`` under a
``DynamicInferenceContext``) rotates ``k_pos_emb`` with unfused torch ops on cos/sin rows gathered
by each token's position (``apply_rotary_emb_key``), concatenates it behind the normalised latent
(``torch.cat``) and writes the rows into the layer's paged cache by indexed assignment
(``append_key_value_cache``): about a dozen launches and three temporaries per layer and step.
:func:`fused_mla_rope_cache_append` does it in one launch that reads each input once and writes
each cache row once.

The rotation is megatron-core's unfused formula, operation by operation in the tensor's dtype
(``_apply_rotary_pos_emb_bshd`` with MLA's de-interleaving): ``t = [x_even | x_odd]``,
``t * cos + rotate_half(t) * sin``, each product and the sum rounded to the dtype as torch rounds
them, without contracting a product and a sum into one FMA. So the rows it writes are bitwise
those of megatron-core's path, given cos/sin tables built by megatron-core's formula
(``(cos(freqs) * mscale).to(dtype)``: ``YarnRotaryEmbedding.get_cached_cos_sin``).

The query's RoPE is not done here: the query's RoPE part stays with the contiguous-load kernel
(:func:`megatron_ext.fusions.fused_mla_yarn_rope_apply.fused_apply_mla_rope_for_q` with
``position_ids``), which rotates it in place in the [tokens, 1, heads, 192] query before the
absorption matmul.

Graph safety: one launch, its grid sized by the token count (a shape); no host synchronisation.

The ``@triton.jit`` functions here are those of the former
``megatron_ext/fusions/fused_mla_rope_cache_append.py``, unchanged.
"""

from typing import Tuple

import triton
import triton.language as tl
from torch import Tensor

from megatron_ext.fusions.direct_launch import KernelLaunches, PreparedLaunch
from megatron_ext.fusions.launch_math import cdiv, next_power_of_2
from megatron_ext.fusions.launch_plans import NO_LAUNCH, LaunchPlan, PlanCache, layout_key
from megatron_ext.fusions.mla_latent.checks import check_append_cache_disjoint, check_append_call
from megatron_ext.fusions.tensor_checks import span_bytes, spans_meet

__all__ = [
    "APPEND_LAUNCHES",
    "APPEND_PLANS",
    "AppendPlan",
    "SIZE_NAMES",
    "TOKENS_PER_PROGRAM",
    "fused_mla_rope_cache_append",
    "plan_append_call",
]

# Tokens per program: enough work per program for a 576-wide row, few idle lanes at decode sizes.
TOKENS_PER_PROGRAM = 4


@triton.jit
def _round_to(x, DTYPE: tl.constexpr):
    """``x`` (fp32) rounded to ``DTYPE`` and widened back: one torch op's result in ``DTYPE``."""
    return x.to(DTYPE).to(tl.float32)


# Sizes that change from step to step: not specialised.
_RUNTIME_SIZES = ["num_tokens", "num_positions", "num_blocks"]
# The launch sizes the checks return, by kernel parameter.
SIZE_NAMES = (
    "num_tokens",
    "num_positions",
    "num_blocks",
    "block_size",
    "latent_stride",
    "k_pe_stride",
    "cos_stride",
    "sin_stride",
    "cache_block_stride",
    "cache_row_stride",
)


@triton.jit(do_not_specialize=_RUNTIME_SIZES)
def _rope_cache_append_kernel(
    latent_ptr,
    k_pe_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    block_idx_ptr,
    block_offset_ptr,
    cache_ptr,
    num_tokens,
    num_positions,
    num_blocks,
    block_size,
    latent_stride,
    k_pe_stride,
    cos_stride,
    sin_stride,
    cache_block_stride,
    cache_row_stride,
    LATENT_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_LATENT: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = tokens < num_tokens
    block = tl.load(block_idx_ptr + tokens, mask=in_range, other=-1).to(tl.int64)
    offset = tl.load(block_offset_ptr + tokens, mask=in_range, other=-1).to(tl.int64)
    # A row outside the cache is never written: the values are not checked on the host.
    write = in_range & (block >= 0) & (block < num_blocks) & (offset >= 0) & (offset < block_size)
    # Clamped ids, not a select around the whole offset: with the select, Triton 3.9 loses the
    # rows' 16-byte alignment and writes the latent rows as scalar 2-byte stores (the rows not
    # written are never addressed either way).
    row = (
        tl.where(write, block, 0) * cache_block_stride
        + tl.where(write, offset, 0) * cache_row_stride
    )

    cols = tl.arange(0, BLOCK_LATENT)
    lat_mask = write[:, None] & (cols < LATENT_DIM)[None, :]
    latent = tl.load(latent_ptr + tokens[:, None] * latent_stride + cols[None, :], mask=lat_mask)
    tl.store(cache_ptr + row[:, None] + cols[None, :], latent, mask=lat_mask)

    # Positions outside the tables are clamped to their first or last row, never read past them.
    pos = tl.load(positions_ptr + tokens, mask=write, other=0).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), num_positions - 1)
    HALF: tl.constexpr = ROPE_DIM // 2
    dtype = cache_ptr.dtype.element_ty
    # One contiguous load per row, split into the interleaved (even, odd) pairs in registers.
    x = tl.load(
        k_pe_ptr + tokens[:, None] * k_pe_stride + tl.arange(0, ROPE_DIM)[None, :],
        mask=write[:, None],
        other=0.0,
    )
    x_even, x_odd = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_T, HALF, 2)))
    half = tl.arange(0, HALF)
    cos_row = cos_ptr + pos[:, None] * cos_stride + half[None, :]
    sin_row = sin_ptr + pos[:, None] * sin_stride + half[None, :]
    # megatron-core casts the tables to the tensor's dtype before rotating.
    cos_l = tl.load(cos_row).to(dtype).to(tl.float32)
    cos_r = tl.load(cos_row + HALF).to(dtype).to(tl.float32)
    sin_l = tl.load(sin_row).to(dtype).to(tl.float32)
    sin_r = tl.load(sin_row + HALF).to(dtype).to(tl.float32)
    # t * cos + rotate_half(t) * sin with t = [x_even | x_odd], rotate_half(t) = [-x_odd | x_even];
    # each torch op rounds to the dtype (the launch switches FMA contraction off).
    left = _round_to(x_even * cos_l, dtype) + _round_to(-x_odd * sin_l, dtype)
    right = _round_to(x_odd * cos_r, dtype) + _round_to(x_even * sin_r, dtype)
    rope = cache_ptr + row[:, None] + LATENT_DIM + half[None, :]
    tl.store(rope, left.to(dtype), mask=write[:, None])
    tl.store(rope + HALF, right.to(dtype), mask=write[:, None])


# Triton's JIT on a specialisation's first call, then the direct launch (host profiles read its
# bound C launchers, ``.launches``).
APPEND_LAUNCHES = KernelLaunches(_rope_cache_append_kernel, _RUNTIME_SIZES)
# The cache's place among the call's tensors (fused_mla_rope_cache_append's order).
_CACHE = 5


class AppendPlan(LaunchPlan):
    """A checked append layout: its launch and the byte spans of its tensors, so that the test
    every call needs (the cache sharing memory with an input; the layout cannot tell) reads only
    data pointers.

    Args:
        launch: the prepared launch (:data:`~megatron_ext.fusions.launch_plans.NO_LAUNCH` without
            tokens), called with the tensors in the kernel's order (the cache last).
        tensors: the checked call's tensors, in :func:`fused_mla_rope_cache_append`'s order.
    """

    __slots__ = ("launch", "spans")

    def __init__(self, launch: LaunchPlan, tensors: Tuple[Tensor, ...]) -> None:
        self.launch = launch
        self.spans = tuple(span_bytes(x) for x in tensors)

    def __call__(self, *tensors: Tensor) -> None:
        """Check the cache against the inputs, then launch (tensors in the call's order)."""
        if spans_meet(tensors, self.spans, _CACHE):
            check_append_cache_disjoint(*tensors)
        kv_latent, k_pos_emb, cos, sin, positions, kv_cache, block_idx, block_offset = tensors
        self.launch(kv_latent, k_pos_emb, cos, sin, positions, block_idx, block_offset, kv_cache)


# Checked call layouts -> their plans (megatron_ext.fusions.launch_plans).
APPEND_PLANS: PlanCache[AppendPlan] = PlanCache()


def fused_mla_rope_cache_append(
    kv_latent: Tensor,
    k_pos_emb: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    kv_cache: Tensor,
    block_idx: Tensor,
    block_offset: Tensor,
) -> Tensor:
    """Rotate each token's ``k_pos_emb`` and write ``[kv_latent | rotated k_pos_emb]`` into its
    row of one layer's paged latent cache. GRAPH-SAFE (one launch, grid from the token count; no
    host synchronisation).

    Token ``i`` is rotated at position ``positions[i]`` (rows of cos/sin; clamped to the tables)
    and written to ``kv_cache[block_idx[i], block_offset[i]]``. A row whose block index or offset
    lies outside the cache is skipped (never written out of bounds); several tokens naming one row
    (megatron-core's padding tokens all name its dummy block's row 0) leave one of them there.

    In megatron-core's ``DynamicInferenceContext`` terms, with ``n = padded_active_token_count``:
    ``kv_latent`` is the normalised ``kv_compressed[:n]``, ``k_pos_emb`` the raw (interleaved)
    ``k_pos_emb[:n]``, ``positions`` is ``token_to_position_in_request[:n]`` (what
    ``apply_rotary_emb_key`` gathers by), ``kv_cache`` is ``memory_buffer[layer]``, ``block_idx``
    ``token_to_block_idx[:n]`` and ``block_offset`` ``token_to_local_position_within_kv_block[:n]``
    (0.19: their ``gpu_view`` copies).

    Args:
        kv_latent (Tensor): [tokens, latent_dim] or [tokens, 1, latent_dim]; unit last stride.
        k_pos_emb (Tensor): [tokens, rope_dim] or [tokens, 1, rope_dim], its RoPE pairs
            interleaved (as ``linear_kv_down_proj`` produces them); rope_dim a power of two.
        cos (Tensor): [positions, rope_dim] or [positions, 1, 1, rope_dim] with the mscale
            folded in, in k_pos_emb's dtype or float32 (converted to k_pos_emb's dtype).
        sin (Tensor): like ``cos``.
        positions (Tensor): [tokens] int32/int64.
        kv_cache (Tensor): [num_blocks, block_size, latent_dim + rope_dim] in kv_latent's dtype;
            unit last stride. Written in place, outside autograd (the cache is inference
            state: its version counter does not move and no gradient flows through it).
        block_idx (Tensor): [tokens] int32/int64 cache block of each token.
        block_offset (Tensor): [tokens] int32/int64 row of each token within its block.

    Returns:
        Tensor: ``kv_cache``.

    Raises:
        TypeError, ValueError: for arguments of other types, dtypes, shapes, devices or layouts,
            or a cache that overlaps an input, before any launch.
    """
    tensors = (kv_latent, k_pos_emb, cos, sin, positions, kv_cache, block_idx, block_offset)
    key = layout_key(tensors, ())
    plan = APPEND_PLANS.get(key)
    if plan is None:
        # First call of this layout: every check, then the plan (cached once they passed).
        plan = APPEND_PLANS.put(key, AppendPlan(plan_append_call(*tensors), tensors))
    plan(*tensors)
    return kv_cache


def plan_append_call(*tensors: Tensor) -> LaunchPlan:
    """Check a call (:func:`~megatron_ext.fusions.mla_latent.checks.check_append_call`).

    Args:
        tensors: the call's tensors, as :func:`fused_mla_rope_cache_append` takes them.

    Returns:
        LaunchPlan: its prepared launch (``NO_LAUNCH`` without tokens), called with the tensors
        in the kernel's order (the cache last).
    """
    plan = check_append_call(*tensors)
    kv_latent, k_pos_emb, cos, sin, positions, kv_cache, block_idx, block_offset = tensors
    if plan is None:
        return NO_LAUNCH
    sizes, latent_dim, rope_dim = plan
    args = dict(
        latent_ptr=kv_latent,
        k_pe_ptr=k_pos_emb,
        cos_ptr=cos,
        sin_ptr=sin,
        positions_ptr=positions,
        block_idx_ptr=block_idx,
        block_offset_ptr=block_offset,
        cache_ptr=kv_cache,
        **dict(zip(SIZE_NAMES, sizes)),
        LATENT_DIM=latent_dim,
        ROPE_DIM=rope_dim,
        BLOCK_LATENT=next_power_of_2(latent_dim),
        BLOCK_T=TOKENS_PER_PROGRAM,
    )
    # torch rounds each product and the sum; a contracted FMA would round once.
    options = dict(num_warps=4, enable_fp_fusion=False)
    return PreparedLaunch(APPEND_LAUNCHES, (cdiv(sizes[0], TOKENS_PER_PROGRAM),), args, options)
