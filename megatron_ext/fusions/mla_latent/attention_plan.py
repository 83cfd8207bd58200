# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The launch plan of a checked latent attention call: both stages' launch arguments, prepared.

A call layout's first call is checked (:mod:`.checks`) and planned here: its tile, split count
and stage count (:mod:`.tile_rules`) turned into the arguments of stage 1 and of the split
combine (:mod:`.attention_kernels`), each kept as a
:class:`~megatron_ext.fusions.direct_launch.PreparedLaunch`. A specialisation's first launch goes
through Triton's JIT, later ones through the compiled kernel's C launcher, which skips Triton's
Python dispatch. The plan holds no tensor; a call passes its own.
"""

import os
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from megatron_ext.fusions.direct_launch import PreparedLaunch
from megatron_ext.fusions.launch_math import cdiv
from megatron_ext.fusions.launch_plans import LaunchPlan
from megatron_ext.fusions.mla_latent.attention_kernels import COMBINE_LAUNCHES, STAGE1_LAUNCHES
from megatron_ext.fusions.mla_latent.decode_gluon import (
    GLUON_DECODE_LAUNCHES,
    GLUON_IMPORT_ERROR,
    HEADS_FIRST,
    HEADS_PER_PROGRAM,
    KEY_TILE,
    NUM_BUFFERS,
    ORDER,
    P_BUFFERS,
    SHARED_BUFFERS,
    SHARED_KEY_TILE,
    SHARED_ORDER,
    gluon_shared_memory,
)
from megatron_ext.fusions.mla_latent.tile_rules import (
    LARGE_SCALE_LOG2,
    LOG2E,
    ROW_OFFSET_LIMIT,
    SEQ_BLOCK,
    TRITON_RELEASE,
    CombineTile,
    TileShape,
    combine_tile,
    default_num_kv_splits,
    launch_limits,
    page_tiles,
    tile_shape,
    wave_num_kv_splits,
)
from megatron_ext.fusions.tensor_checks import check_int, span_bytes, spans_meet

__all__ = [
    "GLUON_DECODE_ENV",
    "GLUON_MIN_HEADS",
    "LatentAttentionPlan",
    "SplitOutputs",
    "gluon_decode_enabled",
    "gluon_decode_refusal",
    "gluon_ring",
    "plan_for_call",
]

# The warp-specialized decode kernel (:mod:`.decode_gluon`) runs wherever gluon_decode_refusal
# gives no reason, unless this is "off" (stage 1 everywhere: its bits, e.g. to compare with a run
# made before the kernel was the default). Where it runs it was faster than stage 1 in every row
# measured (32-128 heads: an H100 under Triton 3.7.1 and 3.9, an H200 under 3.7.1; perf notes).
GLUON_DECODE_ENV = "MEGATRON_EXT_MLA_GLUON_DECODE"
# Below this many heads a 64-row program wastes most of its MMA rows; stage 1's 16- and 32-head
# tiles are memory-bound there already.
GLUON_MIN_HEADS = 32


def gluon_decode_enabled(value: Optional[str] = None) -> bool:
    """Whether :data:`GLUON_DECODE_ENV` turns the warp-specialized decode kernel on.

    Args:
        value: the variable's value (None: read the environment).

    Returns:
        bool: True for "on" or unset, False for "off".

    Raises:
        ValueError: for any other value, naming the variable and the accepted values.
    """
    value = os.environ.get(GLUON_DECODE_ENV, "on") if value is None else value
    if value not in ("on", "off"):
        raise ValueError(f"{GLUON_DECODE_ENV}={value!r}: expected 'on' or 'off'")
    return value == "on"


# Read once, at import (a bad value fails there); tests and tools may set it (the plan cache is
# keyed by it).
GLUON_DECODE = gluon_decode_enabled()


# Whether the kernel takes the two-tile ring of 64 keys (decode_gluon.SHARED_*, named for the
# key tiles a token's head groups share above 64 heads) at every head count; a tool that sets the
# 32-key ring's constants above for every head count turns it off. At 32 and 64 heads it took
# 1-18% less time than the 32-key ring on an H200 (Triton 3.7.1, 7 of 7 rows, timed in turns) and
# 0.6-1.2% less on an H100 (8 of 8); perf notes.
SHARED_KEYS_RING = True


def gluon_ring(heads: int) -> Dict[str, int]:
    """The warp-specialized decode kernel's ring and order for ``heads`` query heads.

    Args:
        heads: the call's query heads.

    Returns:
        Dict[str, int]: ``KEY_TILE``, ``BUFFERS``, ``ORDER`` and ``P_BUFFERS`` (its constexprs).

    Raises:
        TypeError, ValueError: for ``heads`` not an int of at least 1.
    """
    check_int("heads", heads, 1)
    if SHARED_KEYS_RING:
        return dict(
            KEY_TILE=SHARED_KEY_TILE, BUFFERS=SHARED_BUFFERS, ORDER=SHARED_ORDER, P_BUFFERS=1
        )
    return dict(KEY_TILE=KEY_TILE, BUFFERS=NUM_BUFFERS, ORDER=ORDER, P_BUFFERS=P_BUFFERS)


def gluon_decode_refusal(
    query: Tensor,
    kv_cache: Tensor,
    latent_dim: int,
    max_query_len: Optional[int],
    *,
    enabled: Optional[bool] = None,
    query_rope: Optional[Tensor] = None,
) -> Optional[str]:
    """Why a checked call does not take the warp-specialized decode kernel, or None if it does.

    The one place the launch layer chooses between it and stage 1: stage 1 runs wherever this
    gives a reason.

    Args:
        query: the call's query (dtype, heads, device).
        kv_cache: its cache (row width).
        latent_dim: the latent width.
        max_query_len: its static bound on new tokens per request.
        enabled: the switch (None: :data:`GLUON_DECODE`; a benchmark passes True to time it).
        query_rope: the query's RoPE part where the call gives it as its own operand.

    Returns:
        Optional[str]: the reason, or None.

    Raises:
        TypeError: if ``query`` or ``kv_cache`` is not a tensor, or ``query_rope`` is neither a
            tensor nor None.
    """
    for name, value in (("query", query), ("kv_cache", kv_cache)):
        if not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if query_rope is not None and not isinstance(query_rope, Tensor):
        raise TypeError(
            f"query_rope must be a torch.Tensor or None, got {type(query_rope).__name__}"
        )
    if not (GLUON_DECODE if enabled is None else enabled):
        return f"off ({GLUON_DECODE_ENV}=off)"
    if GLUON_IMPORT_ERROR is not None or TRITON_RELEASE < (3, 7):
        return f"Triton {'.'.join(map(str, TRITON_RELEASE))} has no Gluon Hopper API of 3.7"
    if max_query_len != 1:
        return "not a decode step (max_query_len is not 1)"
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"{query.dtype} (wgmma here takes 16-bit inputs)"
    if query.shape[1] < GLUON_MIN_HEADS:
        return f"{query.shape[1]} heads (fewer than {GLUON_MIN_HEADS})"
    rope_dim = kv_cache.shape[2] - latent_dim
    if latent_dim not in (128, 256, 512) or rope_dim % 64 != 0:
        return f"widths {latent_dim} + {rope_dim} (takes 128, 256 or 512 + multiples of 64)"
    # Its rows are copied 16 bytes at a time, which Triton compiles only where the pointer and
    # strides are known to be 16-byte multiples (its specialisation: divisible by 16).
    if kv_cache.data_ptr() % 16 or kv_cache.stride(0) % 16 or kv_cache.stride(1) % 16:
        return (
            f"a cache at byte {kv_cache.data_ptr() % 16} of 16 or with strides "
            f"{kv_cache.stride()[:2]} (the rows are copied 16 bytes at a time: 16-byte aligned, "
            "strides multiples of 16)"
        )
    # The query's rows too, once per program (all in flight beside the first key tiles').
    for name, rows in (("query", query), ("query_rope", query_rope)):
        if rows is not None and (
            rows.data_ptr() % 16 or rows.stride(0) % 16 or rows.stride(1) % 16
        ):
            return (
                f"a {name} at byte {rows.data_ptr() % 16} of 16 or with strides "
                f"{rows.stride()[:2]} (its rows are copied 16 bytes at a time: 16-byte aligned, "
                "strides multiples of 16)"
            )
    if query.device.type != "cuda":
        return f"device {query.device} (Hopper only)"
    limits = launch_limits(query.device)
    if limits.capability != (9, 0):
        return f"compute capability {limits.capability} (wgmma is sm_90a's)"
    ring = gluon_ring(query.shape[1])
    memory = gluon_shared_memory(
        latent_dim, rope_dim, ring["KEY_TILE"], ring["BUFFERS"], ring["P_BUFFERS"]
    )
    if limits.shared_memory < memory:
        return f"{limits.shared_memory} bytes of shared memory a block"
    return None


class SplitOutputs(NamedTuple):
    """Where stage 1 writes: the output itself (one split) or the split-KV workspace.

    ``partial`` and ``lse`` stand in for the layout (each call passes its own tensors);
    ``workspace`` is the (partial, lse) shapes a call allocates, None with one split.
    """

    partial: Tensor
    lse: Tensor
    partial_strides: Tuple[int, int, int]  # split, token, head
    lse_strides: Tuple[int, int]  # split, token
    workspace: Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]]


def split_outputs(query: Tensor, out: Tensor, latent_dim: int, num_kv_splits: int) -> SplitOutputs:
    """What stage 1 writes for ``num_kv_splits`` splits.

    Args:
        query: the call's query (its shape, device).
        out: the call's output.
        latent_dim: the latent width.
        num_kv_splits: the split count.

    Returns:
        SplitOutputs: the output (one split) or the fp32 workspace's layout.
    """
    tokens, heads = query.shape[:2]
    if num_kv_splits == 1:
        # Stage 1 writes the output; lse is not used.
        return SplitOutputs(out, out, (0, out.stride(0), out.stride(1)), (0, 0), None)
    # Token-major, so that no stride varies with the step's token count: the strides are
    # specialised arguments, and a varying one would give each decode batch size its own launch
    # key (a JIT launch, not the direct one, on each new size).
    workspace = ((tokens, num_kv_splits, heads, latent_dim), (tokens, num_kv_splits, heads))
    # Stand-ins for the dtype; each call passes its own workspace.
    partial = query.new_empty(0, dtype=torch.float32)
    partial_strides = (heads * latent_dim, num_kv_splits * heads * latent_dim, latent_dim)
    lse_strides = (heads, num_kv_splits * heads)
    return SplitOutputs(partial, partial, partial_strides, lse_strides, workspace)


def stage1_args(
    query: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    cu_query_lengths: Tensor,
    kv_lengths: Tensor,
    outputs: SplitOutputs,
    scale_log2: float,
    *,
    latent_dim: int,
    tile: TileShape,
    num_kv_splits: int,
    query_rope: Optional[Tensor] = None,
) -> Dict[str, Any]:
    """Stage 1's kernel arguments by name, its tensors first (the prepared launch's order).

    Args:
        query, kv_cache, block_table, cu_query_lengths, kv_lengths: the call's inputs.
        outputs: where stage 1 writes (:func:`split_outputs`).
        scale_log2: the softmax scale times log2(e).
        latent_dim: the latent width.
        tile: stage 1's tile.
        num_kv_splits: the split count.
        query_rope: the query's RoPE part as its own operand, or None (the RoPE columns follow
            the latent ones in ``query``).

    Returns:
        Dict[str, Any]: every parameter of ``_latent_attention_kernel``.
    """
    fp32 = query.dtype == torch.float32
    # One operand: the RoPE part is read through query's pointer and strides, at column
    # latent_dim. Two: through its own, from column 0.
    rope_rows, rope_col = (query, latent_dim) if query_rope is None else (query_rope, 0)
    return dict(
        q_ptr=query,
        q_rope_ptr=rope_rows,
        cache_ptr=kv_cache,
        block_table_ptr=block_table,
        cu_q_ptr=cu_query_lengths,
        kv_len_ptr=kv_lengths,
        out_ptr=outputs.partial,
        lse_ptr=outputs.lse,
        scale_log2=scale_log2,
        num_tokens=query.shape[0],
        num_heads=query.shape[1],
        num_requests=block_table.shape[0],
        num_blocks=kv_cache.shape[0],
        BLOCK_SIZE=kv_cache.shape[1],
        max_blocks=block_table.shape[1],
        q_stride_t=query.stride(0),
        q_stride_h=query.stride(1),
        q_rope_stride_t=rope_rows.stride(0),
        q_rope_stride_h=rope_rows.stride(1),
        cache_stride_b=kv_cache.stride(0),
        cache_stride_o=kv_cache.stride(1),
        table_stride=block_table.stride(0),
        out_stride_s=outputs.partial_strides[0],
        out_stride_t=outputs.partial_strides[1],
        out_stride_h=outputs.partial_strides[2],
        lse_stride_s=outputs.lse_strides[0],
        lse_stride_t=outputs.lse_strides[1],
        LATENT_DIM=latent_dim,
        ROPE_DIM=kv_cache.shape[2] - latent_dim,
        Q_ROPE_COL=rope_col,
        BLOCK_Q=tile.block_q,
        BLOCK_H=tile.block_h,
        BLOCK_N=tile.block_n,
        NUM_SPLITS=num_kv_splits,
        SEQ_BLOCK=SEQ_BLOCK,
        # fp32 products in full precision, not TF32 (16-bit inputs: tensor cores either way).
        DOT_PRECISION="ieee" if fp32 else "tf32",
        PAGE_TILES=page_tiles(kv_cache.shape[1], tile),
        WIDE_ROWS=tile.block_n * kv_cache.stride(1) + kv_cache.shape[2] >= ROW_OFFSET_LIMIT,
        LARGE_SCALE=scale_log2 > LARGE_SCALE_LOG2,
    )


def combine_args(
    cu_query_lengths: Tensor,
    out: Tensor,
    outputs: SplitOutputs,
    scale_log2: float,
    *,
    requests: int,
    tile: CombineTile,
    num_kv_splits: int,
) -> Dict[str, Any]:
    """Stage 2's kernel arguments by name, its tensors first (the prepared launch's order).

    Args:
        cu_query_lengths: the call's cumulative new-token counts.
        out: the call's output, [tokens, heads, latent_dim].
        outputs: the split-KV workspace stage 1 writes (:func:`split_outputs`).
        scale_log2: the softmax scale times log2(e) (the log-sum-exps' units).
        requests: the block table's rows.
        tile: stage 2's tile.
        num_kv_splits: the split count (> 1).

    Returns:
        Dict[str, Any]: every parameter of ``_combine_splits_kernel``.
    """
    return dict(
        partial_ptr=outputs.partial,
        lse_ptr=outputs.lse,
        cu_q_ptr=cu_query_lengths,
        out_ptr=out,
        num_tokens=out.shape[0],
        num_heads=out.shape[1],
        num_requests=requests,
        partial_stride_s=outputs.partial_strides[0],
        partial_stride_t=outputs.partial_strides[1],
        partial_stride_h=outputs.partial_strides[2],
        lse_stride_s=outputs.lse_strides[0],
        lse_stride_t=outputs.lse_strides[1],
        out_stride_t=out.stride(0),
        out_stride_h=out.stride(1),
        lse_scale=scale_log2,
        BLOCK_H=tile.block_h,
        BLOCK_D=tile.block_d,
        NUM_SPLITS=num_kv_splits,
        LARGE_SCALE=scale_log2 > LARGE_SCALE_LOG2,
    )


class LatentAttentionPlan(LaunchPlan):
    """Both stages of one checked call layout, prepared (:class:`PreparedLaunch`): a call
    allocates the split-KV workspace and launches them with its tensors. Holds no tensor.

    The tile, split count and stage count are explicit (the launcher's choices,
    :func:`plan_for_call`, or a tuning script's: any tile whose sizes are powers of two with
    ``block_q * block_h >= 16`` computes the same attention), and so may stage 2's tile be (by
    default :func:`~.tile_rules.combine_tile`'s; any gives the same bits). The tensors given here
    only set the layout.

    Args:
        query, kv_cache, block_table, cu_query_lengths, kv_lengths: a checked call's inputs.
        softmax_scale: its scale.
        out: its output.
        latent_dim: the latent width.
        tile: stage 1's tile.
        num_kv_splits: the split count.
        num_stages: stage 1's pipelining stages.
        combine: stage 2's tile (None: the launcher's).
        query_rope: the query's RoPE part as its own operand (its calls pass theirs), or None
            (one operand: the RoPE columns follow the latent ones in ``query``).
        gluon: launch the warp-specialized decode kernel (:mod:`.decode_gluon`) in stage 1's
            place (the caller checked :func:`gluon_decode_refusal`; ``tile`` is unused then).

    Attributes:
        kernel: ``"gluon"`` or ``"stage1"``, what computes the splits.
        out_shape: the output's shape (a call without ``out`` allocates it).
        stage1, combine: the prepared launches (None where nothing, or no combine, is launched).
        workspace: the split-KV workspace's (partial, lse) shapes, None with one split.
        device: the device the workspace is allocated on.
        spans: the byte spans of the call's tensors (:meth:`out_meets_an_input`).
    """

    __slots__ = ("out_shape", "stage1", "combine", "workspace", "device", "spans", "kernel")

    def __init__(
        self,
        query: Tensor,
        kv_cache: Tensor,
        block_table: Tensor,
        cu_query_lengths: Tensor,
        kv_lengths: Tensor,
        softmax_scale: float,
        out: Tensor,
        *,
        latent_dim: int,
        tile: TileShape,
        num_kv_splits: int,
        num_stages: int,
        combine: Optional[CombineTile] = None,
        query_rope: Optional[Tensor] = None,
        gluon: bool = False,
    ):
        tokens, heads = query.shape[:2]
        self.kernel = "gluon" if gluon else "stage1"
        self.out_shape = (tokens, heads, latent_dim)
        self.device = query.device
        self.spans = tuple(
            span_bytes(x)
            for x in (query, kv_cache, block_table, cu_query_lengths, kv_lengths, query_rope, out)
        )
        self.stage1: Optional[PreparedLaunch] = None
        self.combine: Optional[PreparedLaunch] = None
        self.workspace: Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]] = None
        if tokens == 0 or heads == 0:
            return
        requests = block_table.shape[0]
        scale_log2 = float(softmax_scale) * LOG2E
        outputs = split_outputs(query, out, latent_dim, num_kv_splits)
        self.workspace = outputs.workspace
        # Decode: tile t is token t. Otherwise each request's tiles start at
        # cu_query_lengths[r] // block_q + r + 1 (_first_tile), the tiles before request 0's
        # holding the tokens before it, and the padding tokens' tiles follow the last request's.
        query_tiles = tokens if tile.block_q == 1 else tokens // tile.block_q + requests + 2
        args = stage1_args(
            query,
            kv_cache,
            block_table,
            cu_query_lengths,
            kv_lengths,
            outputs,
            scale_log2,
            latent_dim=latent_dim,
            tile=tile,
            num_kv_splits=num_kv_splits,
            query_rope=query_rope,
        )
        if gluon:
            # Stage 1's arguments less its tile's: the kernel's tile is its module's (one token,
            # 64 heads, its key ring), its three partitions one warpgroup each.
            names = GLUON_DECODE_LAUNCHES.kernel.arg_names
            # An axis past the first holds 65,535 programs at most.
            heads_first = HEADS_FIRST and tokens <= 65535
            # The kernel's timeline stays off (None compiles it out).
            ring = dict(gluon_ring(heads), HEADS_FIRST=heads_first, trace_ptr=None)
            groups = cdiv(heads, HEADS_PER_PROGRAM)
            self.stage1 = PreparedLaunch(
                GLUON_DECODE_LAUNCHES,
                (groups, tokens, num_kv_splits) if heads_first else (tokens, groups, num_kv_splits),
                {name: ring[name] if name in ring else args[name] for name in names},
                dict(num_warps=4, num_stages=1),
            )
        else:
            self.stage1 = PreparedLaunch(
                STAGE1_LAUNCHES,
                (query_tiles, cdiv(heads, tile.block_h), num_kv_splits),
                args,
                dict(num_warps=tile.num_warps, num_stages=num_stages),
            )
        if num_kv_splits > 1:
            combine = CombineTile(*(combine or combine_tile(heads, latent_dim, num_kv_splits)))
            self.combine = PreparedLaunch(
                COMBINE_LAUNCHES,
                (tokens, cdiv(heads, combine.block_h), latent_dim // combine.block_d),
                combine_args(
                    cu_query_lengths,
                    out,
                    outputs,
                    scale_log2,
                    requests=requests,
                    tile=combine,
                    num_kv_splits=num_kv_splits,
                ),
                dict(num_warps=4),
            )

    def out_meets_an_input(self, *tensors: Optional[Tensor]) -> bool:
        """Whether a call's ``out`` shares memory with one of its inputs, from the layout's spans
        and the call's data pointers (what a cached layout must still test on every call).

        Args:
            tensors: ``query, kv_cache, block_table, cu_query_lengths, kv_lengths, query_rope,
                out`` of a call with this plan's layout.

        Returns:
            bool: True if they meet (the full check then names the input).
        """
        return spans_meet(tensors, self.spans, len(self.spans) - 1)

    def __call__(
        self,
        query: Tensor,
        kv_cache: Tensor,
        block_table: Tensor,
        cu_query_lengths: Tensor,
        kv_lengths: Tensor,
        out: Tensor,
        query_rope: Optional[Tensor] = None,
    ) -> None:
        """Launch with this call's tensors (of the plan's layout; ``query_rope`` given if and
        only if the plan was made with one)."""
        if self.stage1 is None:
            return
        # One operand: its RoPE part is read through query's own pointer.
        rope = query if query_rope is None else query_rope
        inputs = (query, rope, kv_cache, block_table, cu_query_lengths, kv_lengths)
        if self.workspace is None:
            self.stage1(*inputs, out, out)
            return
        partial_shape, lse_shape = self.workspace
        partial = torch.empty(partial_shape, dtype=torch.float32, device=self.device)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=self.device)
        self.stage1(*inputs, partial, lse)
        self.combine(partial, lse, cu_query_lengths, out)


def plan_for_call(
    query: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    cu_query_lengths: Tensor,
    kv_lengths: Tensor,
    softmax_scale: float,
    out: Tensor,
    *,
    latent_dim: int,
    max_query_len: Optional[int],
    num_kv_splits: Optional[int],
    query_rope: Optional[Tensor] = None,
    kernel: Optional[str] = None,
) -> LatentAttentionPlan:
    """The launcher's kernel, tile, split count and stage count for a checked call, as a plan.

    Args:
        query, kv_cache, block_table, cu_query_lengths, kv_lengths: the checked call's inputs.
        softmax_scale: its scale.
        out: its output.
        latent_dim: the latent width.
        max_query_len: its static bound on new tokens per request (None: the token count).
        num_kv_splits: its split count (None: :func:`~.tile_rules.wave_num_kv_splits` for the
            Gluon kernel, else :func:`~.tile_rules.default_num_kv_splits`).
        query_rope: its query's RoPE part, when given as a second operand.
        kernel: ``"gluon"`` or ``"stage1"`` to choose the kernel (a benchmark timing both), None
            for :func:`gluon_decode_refusal`'s choice.

    Returns:
        LatentAttentionPlan: the plan.

    Raises:
        ValueError: for another ``kernel``, or ``"gluon"`` where the kernel is refused (the
            reason in the message).
    """
    if kernel not in (None, "gluon", "stage1"):
        raise ValueError(f"kernel must be None, 'gluon' or 'stage1', got {kernel!r}")
    tokens, heads = query.shape[:2]
    limits = launch_limits(query.device)
    stages = limits.stages
    fp32 = query.dtype == torch.float32
    tile = tile_shape(tokens, heads, latent_dim, max_query_len, fp32, num_stages=stages)
    refusal = gluon_decode_refusal(
        query,
        kv_cache,
        latent_dim,
        max_query_len,
        enabled=None if kernel is None else True,
        query_rope=query_rope,
    )
    if kernel == "gluon" and refusal is not None:
        raise ValueError(f"the Gluon decode kernel does not take this call: {refusal}")
    gluon = refusal is None and kernel != "stage1"
    if gluon and num_kv_splits is None:
        # One program per SM (its shared memory): the split count of the cheapest waves.
        num_kv_splits = wave_num_kv_splits(
            tokens * cdiv(heads, HEADS_PER_PROGRAM),
            limits.sms,
            block_table.shape[1] * kv_cache.shape[1],
        )
    elif num_kv_splits is None:
        num_kv_splits = default_num_kv_splits(
            cdiv(tokens, tile.block_q),
            cdiv(heads, tile.block_h),
            block_table.shape[1] * kv_cache.shape[1],
            query.device,
            num_warps=tile.num_warps,
        )
    return LatentAttentionPlan(
        query,
        kv_cache,
        block_table,
        cu_query_lengths,
        kv_lengths,
        softmax_scale,
        out,
        latent_dim=latent_dim,
        tile=tile,
        num_kv_splits=num_kv_splits,
        num_stages=stages,
        combine=None,
        query_rope=query_rope,
        gluon=gluon,
    )
