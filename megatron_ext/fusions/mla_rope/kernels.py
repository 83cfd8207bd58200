# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The Triton kernels of megatron_ext's MLA RoPE and their jit helpers.

Five kernels: the query forward and backward (in place on the RoPE part of each head), the query
backward into a new tensor, and the key/value forward and backward (out of place). Launch them
through :mod:`megatron_ext.fusions.mla_rope.launch`; the host-side contract (shapes, dtypes, what
is and is not checked) is in :mod:`megatron_ext.fusions.fused_mla_yarn_rope_apply`.
"""

import triton
import triton.language as tl

# Integer arguments whose value would otherwise be specialised into extra compiled variants
# (Triton specialises integers equal to 1 and multiples of 16). Strides and the RoPE offset stay
# specialised: their divisibility is what lets the compiler emit 16-byte loads and stores.
RUNTIME_INTS = [
    "head_num",
    "batch_size",
    "seq_num",
    "n_rope_rows",
    "cp_rank",
    "cp_size",
]
# cu_seqlens entries compared per step of the thd sequence lookup.
SEQ_BLOCK = 128
# Heads whose loads are issued together in the kv backward's ordered head sum. On an H200 (bf16,
# 128 heads, one token) 16 took the kernel from 8.1 to 4.3 us; 32 gave no more.
HEAD_UNROLL = 16


@triton.jit
def _rope_row(
    row,
    batch_size,
    cu_seqlens,
    seq_num,
    position_ids,
    cp_rank,
    cp_size,
    n_rope_rows,
    SEQ_BLOCK: tl.constexpr,
):
    """Row of the cos/sin tables used by row ``row`` of the flattened token dimension."""
    if position_ids is not None:
        pos = tl.load(position_ids + row).to(tl.int64)
    elif cu_seqlens is None:
        pos = (row // batch_size).to(tl.int64)
    else:
        # cu_seqlens is non-decreasing, so the sequence holding `row` is the number of sequences
        # that end at or before it. Counting with vector loads replaces a loop of one dependent
        # load per sequence.
        row64 = row.to(tl.int64)
        seq = tl.full((), 0, dtype=tl.int32)
        for start in range(0, seq_num, SEQ_BLOCK):
            idx = start + 1 + tl.arange(0, SEQ_BLOCK)
            valid = idx <= seq_num
            ends = tl.load(cu_seqlens + idx, mask=valid, other=0).to(tl.int64) // cp_size
            seq += tl.sum((valid & (ends <= row64)).to(tl.int32), axis=0)
        found = seq < seq_num
        # Rows past cu_seqlens[-1] (CUDA-graph padding) belong to no sequence; they use row 0.
        seq = tl.where(found, seq, 0)
        first = tl.load(cu_seqlens + seq).to(tl.int64) // cp_size
        last = tl.load(cu_seqlens + seq + 1).to(tl.int64) // cp_size
        pos = row64 - first
        seq_len = last - first
        # Context parallelism splits each sequence into 2 * cp_size chunks; rank r holds chunks r
        # and 2 * cp_size - 1 - r (an identity map when cp_size == 1).
        pos = tl.where(
            pos < seq_len // 2,
            pos + cp_rank * seq_len // 2,
            pos - seq_len // 2 + (2 * cp_size - cp_rank - 1) * seq_len // 2,
        )
        pos = tl.where(found, pos, 0)
    # Positions the host cannot check without a sync (position_ids, thd sequences longer than the
    # tables) are clamped, so a bad input never reads outside cos/sin.
    return tl.minimum(tl.maximum(pos, 0), n_rope_rows - 1)


@triton.jit
def _load_cos_sin(
    cos_ptr,
    sin_ptr,
    pos,
    stride_cos,
    stride_sin,
    EMB_DIM: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
):
    half = tl.arange(0, EMB_DIM // 2)
    cos_row = cos_ptr + pos * stride_cos
    sin_row = sin_ptr + pos * stride_sin
    cos_l = tl.load(cos_row + half).to(COMPUTE_DTYPE)
    cos_r = tl.load(cos_row + EMB_DIM // 2 + half).to(COMPUTE_DTYPE)
    sin_l = tl.load(sin_row + half).to(COMPUTE_DTYPE)
    sin_r = tl.load(sin_row + EMB_DIM // 2 + half).to(COMPUTE_DTYPE)
    return cos_l, cos_r, sin_l, sin_r


@triton.jit
def _neg(x):
    """``-x`` with the sign bit flipped for every value, +0 included.

    Triton up to 3.7 lowers unary minus to ``0 - x``, which gives +0 for +0; the compiler's
    contraction of megatron-core's ``a * b - c * d`` negates the product exactly (``fneg``).
    """
    return x * -1.0


@triton.jit
def _pair(a, b, c, d, SUBTRACT: tl.constexpr, FUSE: tl.constexpr):
    """``a * b - c * d`` (SUBTRACT) or ``a * b + c * d``, with its products paired as FUSE says.

    FUSE (a :mod:`megatron_ext.fusions.mla_rope.pairing` value): FUSE_FIRST contracts ``a * b``
    into the FMA, FUSE_SECOND ``c * d``; UNFUSED rounds both products (the kernel is then compiled
    with FP fusion off, so the compiler contracts nothing either). A subtraction negates exactly,
    as the compiler's contraction of megatron-core's subtraction does.
    """
    if FUSE == 0:
        if SUBTRACT:
            out = tl.fma(a, b, _neg(c * d))
        else:
            out = tl.fma(a, b, c * d)
    elif FUSE == 1:
        if SUBTRACT:
            out = tl.fma(_neg(c), d, a * b)
        else:
            out = tl.fma(c, d, a * b)
    else:
        if SUBTRACT:
            out = a * b - c * d
        else:
            out = a * b + c * d
    return out


@triton.jit
def _rotate_fwd(x1, x2, cos_l, cos_r, sin_l, sin_r, FMA_1: tl.constexpr, FMA_2: tl.constexpr):
    """(x1 * cos_l - x2 * sin_l, x2 * cos_r + x1 * sin_r), megatron-core's forward.

    megatron-core writes both sums unfused and the compiler contracts one product of each into an
    FMA; FMA_1 / FMA_2 name the product it contracts (chosen per installed Triton by
    :mod:`megatron_ext.fusions.mla_rope.pairing`). Writing the FMAs out keeps the result
    independent of the block shape, which otherwise changes how the compiler contracts.
    """
    left = _pair(x1, cos_l, x2, sin_l, True, FMA_1)
    right = _pair(x2, cos_r, x1, sin_r, False, FMA_2)
    return left, right


@triton.jit
def _rotate_bwd(g_l, g_r, cos_l, cos_r, sin_l, sin_r, FMA_1: tl.constexpr, FMA_2: tl.constexpr):
    """(g_l * cos_l + g_r * sin_r, -g_l * sin_l + g_r * cos_r), megatron-core's backward, its
    products paired as in :func:`_rotate_fwd`.

    The second sum's first product is ``(-g_l) * sin_l``, negated where megatron-core negates.
    """
    g1 = _pair(g_l, cos_l, g_r, sin_r, False, FMA_1)
    g2 = _pair(-g_l, sin_l, g_r, cos_r, False, FMA_2)
    return g1, g2


@triton.jit
def _q_row_base(q_ptr, row, batch_size, stride_s, stride_b, rope_offset):
    s_idx = row // batch_size
    b_idx = row - s_idx * batch_size
    return q_ptr + s_idx.to(tl.int64) * stride_s + b_idx.to(tl.int64) * stride_b + rope_offset


@triton.jit
def _q_setup(
    q_ptr,
    cos_ptr,
    sin_ptr,
    cu_seqlens,
    position_ids,
    head_num,
    batch_size,
    seq_num,
    n_rope_rows,
    cp_rank,
    cp_size,
    stride_s,
    stride_b,
    stride_h,
    rope_offset,
    stride_cos,
    stride_sin,
    EMB_DIM: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    INVERSE: tl.constexpr,
    SEQ_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """What the query forward and backward share for program (row, head block).

    Returns the [BLOCK_H, 1] pointers to the first RoPE element of each head, the head mask, and
    cos_l, cos_r, sin_l, sin_r broadcast to [BLOCK_H, EMB_DIM // 2] (sin negated for INVERSE).
    """
    row = tl.program_id(0)
    pos = _rope_row(
        row,
        batch_size,
        cu_seqlens,
        seq_num,
        position_ids,
        cp_rank,
        cp_size,
        n_rope_rows,
        SEQ_BLOCK,
    )
    cos_l, cos_r, sin_l, sin_r = _load_cos_sin(
        cos_ptr, sin_ptr, pos, stride_cos, stride_sin, EMB_DIM, COMPUTE_DTYPE
    )
    if INVERSE:
        sin_l = -sin_l
        sin_r = -sin_r
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (heads < head_num)[:, None]
    ptrs = _q_row_base(q_ptr, row, batch_size, stride_s, stride_b, rope_offset)
    ptrs += heads[:, None] * stride_h
    return (
        ptrs,
        mask,
        tl.broadcast_to(cos_l[None, :], (BLOCK_H, EMB_DIM // 2)),
        tl.broadcast_to(cos_r[None, :], (BLOCK_H, EMB_DIM // 2)),
        tl.broadcast_to(sin_l[None, :], (BLOCK_H, EMB_DIM // 2)),
        tl.broadcast_to(sin_r[None, :], (BLOCK_H, EMB_DIM // 2)),
    )


@triton.jit(do_not_specialize=RUNTIME_INTS)
def mla_rope_q_fwd_kernel(
    q_ptr,
    cos_ptr,
    sin_ptr,
    cu_seqlens,
    position_ids,
    head_num,
    batch_size,
    seq_num,
    n_rope_rows,
    cp_rank,
    cp_size,
    stride_s,
    stride_b,
    stride_h,
    rope_offset,
    stride_cos,
    stride_sin,
    EMB_DIM: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    INVERSE: tl.constexpr,
    REMOVE_INTERLEAVING: tl.constexpr,
    FMA_1: tl.constexpr,
    FMA_2: tl.constexpr,
    SEQ_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """In-place RoPE on the last EMB_DIM elements of each head of one token (grid: rows x heads).

    The input pairs are interleaved (x1 = even, x2 = odd elements). The rotated halves are written
    as [left | right], or interleaved again with REMOVE_INTERLEAVING (the drop-ins'
    ``remove_interleaving``, upstream Megatron-LM's name for it).

    Race-free: relaunched on the same input it writes the same bits, at every BLOCK_H and
    num_warps. Program (row, head block) reads and then writes only the EMB_DIM RoPE elements of
    its own token's heads (block pid1 of BLOCK_H heads, masked by
    global head index), so no two programs touch one address; the host refuses inputs whose
    elements overlap, which would break that. Inside a program an element's new value comes from
    other elements (left[j] is stored where x[j] was loaded but computed from x[2j], x[2j+1]),
    possibly loaded by another warp; every load of the tile is issued before a CTA barrier
    (``tl.debug_barrier``) and every store after it, so no store can overwrite an element before
    every thread of the program has read it, whatever layout the compiler picks for the tile.
    """
    ptrs, mask, cos_l, cos_r, sin_l, sin_r = _q_setup(
        q_ptr,
        cos_ptr,
        sin_ptr,
        cu_seqlens,
        position_ids,
        head_num,
        batch_size,
        seq_num,
        n_rope_rows,
        cp_rank,
        cp_size,
        stride_s,
        stride_b,
        stride_h,
        rope_offset,
        stride_cos,
        stride_sin,
        EMB_DIM,
        COMPUTE_DTYPE,
        INVERSE,
        SEQ_BLOCK,
        BLOCK_H,
    )
    dims = tl.arange(0, EMB_DIM)[None, :]
    x = tl.load(ptrs + dims, mask=mask)
    x1, x2 = tl.split(tl.reshape(x, (BLOCK_H, EMB_DIM // 2, 2)))
    left, right = _rotate_fwd(
        x1.to(COMPUTE_DTYPE), x2.to(COMPUTE_DTYPE), cos_l, cos_r, sin_l, sin_r, FMA_1, FMA_2
    )
    out_ty = q_ptr.dtype.element_ty
    tl.debug_barrier()
    if REMOVE_INTERLEAVING:
        out = tl.reshape(tl.join(left, right), (BLOCK_H, EMB_DIM))
        tl.store(ptrs + dims, out.to(out_ty), mask=mask)
    else:
        half = tl.arange(0, EMB_DIM // 2)[None, :]
        tl.store(ptrs + half, left.to(out_ty), mask=mask)
        tl.store(ptrs + EMB_DIM // 2 + half, right.to(out_ty), mask=mask)


@triton.jit
def _q_bwd_tile(
    g_ptrs,
    mask,
    cos_l,
    cos_r,
    sin_l,
    sin_r,
    EMB_DIM: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    REMOVE_INTERLEAVING: tl.constexpr,
    FMA_1: tl.constexpr,
    FMA_2: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """The query gradient's RoPE tile at ``g_ptrs``, rotated back and interleaved (computed in
    COMPUTE_DTYPE)."""
    if REMOVE_INTERLEAVING:
        g = tl.load(g_ptrs + tl.arange(0, EMB_DIM)[None, :], mask=mask)
        g_l, g_r = tl.split(tl.reshape(g, (BLOCK_H, EMB_DIM // 2, 2)))
    else:
        half = tl.arange(0, EMB_DIM // 2)[None, :]
        g_l = tl.load(g_ptrs + half, mask=mask)
        g_r = tl.load(g_ptrs + EMB_DIM // 2 + half, mask=mask)
    g1, g2 = _rotate_bwd(
        g_l.to(COMPUTE_DTYPE), g_r.to(COMPUTE_DTYPE), cos_l, cos_r, sin_l, sin_r, FMA_1, FMA_2
    )
    return tl.reshape(tl.join(g1, g2), (BLOCK_H, EMB_DIM))


@triton.jit(do_not_specialize=RUNTIME_INTS)
def mla_rope_q_bwd_kernel(
    g_ptr,
    cos_ptr,
    sin_ptr,
    cu_seqlens,
    position_ids,
    head_num,
    batch_size,
    seq_num,
    n_rope_rows,
    cp_rank,
    cp_size,
    stride_s,
    stride_b,
    stride_h,
    rope_offset,
    stride_cos,
    stride_sin,
    EMB_DIM: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    INVERSE: tl.constexpr,
    REMOVE_INTERLEAVING: tl.constexpr,
    FMA_1: tl.constexpr,
    FMA_2: tl.constexpr,
    SEQ_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """In-place gradient of :func:`mla_rope_q_fwd_kernel`: reads the forward's output layout and
    writes the interleaved input layout with one contiguous store.

    Race-free, for the reason given in :func:`mla_rope_q_fwd_kernel`: each program reads and writes
    only its own heads' RoPE elements of its own token, and all its loads (the two halves, g_l at
    j and g_r at EMB_DIM // 2 + j) come before a CTA barrier that precedes the interleaved store
    (g1 at 2j, g2 at 2j + 1, addresses that other threads loaded). megatron-core's
    ``rotary_bwd_q_kernel`` has the same load/store pattern without the barrier, and races.
    """
    ptrs, mask, cos_l, cos_r, sin_l, sin_r = _q_setup(
        g_ptr,
        cos_ptr,
        sin_ptr,
        cu_seqlens,
        position_ids,
        head_num,
        batch_size,
        seq_num,
        n_rope_rows,
        cp_rank,
        cp_size,
        stride_s,
        stride_b,
        stride_h,
        rope_offset,
        stride_cos,
        stride_sin,
        EMB_DIM,
        COMPUTE_DTYPE,
        INVERSE,
        SEQ_BLOCK,
        BLOCK_H,
    )
    out = _q_bwd_tile(
        ptrs,
        mask,
        cos_l,
        cos_r,
        sin_l,
        sin_r,
        EMB_DIM,
        COMPUTE_DTYPE,
        REMOVE_INTERLEAVING,
        FMA_1,
        FMA_2,
        BLOCK_H,
    )
    tl.debug_barrier()
    tl.store(ptrs + tl.arange(0, EMB_DIM)[None, :], out.to(g_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=RUNTIME_INTS)
def mla_rope_q_bwd_copy_kernel(
    g_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    cu_seqlens,
    position_ids,
    head_num,
    batch_size,
    seq_num,
    n_rope_rows,
    cp_rank,
    cp_size,
    stride_s,
    stride_b,
    stride_h,
    rope_offset,
    stride_cos,
    stride_sin,
    stride_out_row,
    stride_out_h,
    EMB_DIM: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    INVERSE: tl.constexpr,
    REMOVE_INTERLEAVING: tl.constexpr,
    FMA_1: tl.constexpr,
    FMA_2: tl.constexpr,
    QK_BLOCK: tl.constexpr,
    SEQ_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """:func:`mla_rope_q_bwd_kernel` into a new tensor, in one pass: each head's first
    ``rope_offset`` elements are copied and its RoPE elements rotated back, ``g`` only read.

    For a gradient the caller still holds; a clone followed by the in-place kernel would read and
    write the RoPE elements twice. The RoPE tile is the in-place kernel's, so are its bits.
    """
    ptrs, mask, cos_l, cos_r, sin_l, sin_r = _q_setup(
        g_ptr,
        cos_ptr,
        sin_ptr,
        cu_seqlens,
        position_ids,
        head_num,
        batch_size,
        seq_num,
        n_rope_rows,
        cp_rank,
        cp_size,
        stride_s,
        stride_b,
        stride_h,
        rope_offset,
        stride_cos,
        stride_sin,
        EMB_DIM,
        COMPUTE_DTYPE,
        INVERSE,
        SEQ_BLOCK,
        BLOCK_H,
    )
    row = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    out_row = out_ptr + row.to(tl.int64) * stride_out_row + heads[:, None] * stride_out_h
    cols = tl.arange(0, QK_BLOCK)[None, :]
    qk_mask = mask & (cols < rope_offset)
    nope = tl.load(ptrs - rope_offset + cols, mask=qk_mask)
    tl.store(out_row + cols, nope, mask=qk_mask)
    out = _q_bwd_tile(
        ptrs,
        mask,
        cos_l,
        cos_r,
        sin_l,
        sin_r,
        EMB_DIM,
        COMPUTE_DTYPE,
        REMOVE_INTERLEAVING,
        FMA_1,
        FMA_2,
        BLOCK_H,
    )
    dims = tl.arange(0, EMB_DIM)[None, :]
    tl.store(out_row + rope_offset + dims, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=RUNTIME_INTS)
def mla_rope_kv_fwd_kernel(
    kv_ptr,
    emb_ptr,
    key_ptr,
    value_ptr,
    cos_ptr,
    sin_ptr,
    cu_seqlens,
    position_ids,
    head_num,
    batch_size,
    seq_num,
    n_rope_rows,
    cp_rank,
    cp_size,
    stride_kv_s,
    stride_kv_b,
    stride_kv_h,
    stride_emb_s,
    stride_emb_b,
    stride_key_row,
    stride_key_h,
    stride_value_row,
    stride_value_h,
    stride_cos,
    stride_sin,
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    K_BLOCK: tl.constexpr,
    V_BLOCK: tl.constexpr,
    EMB_DIM: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    REMOVE_INTERLEAVING: tl.constexpr,
    FMA_1: tl.constexpr,
    FMA_2: tl.constexpr,
    SEQ_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """key = [kv[..., :K_DIM] | rope(k_pos_emb)] per head; value = kv[..., K_DIM:]."""
    row = tl.program_id(0)
    pos = _rope_row(
        row,
        batch_size,
        cu_seqlens,
        seq_num,
        position_ids,
        cp_rank,
        cp_size,
        n_rope_rows,
        SEQ_BLOCK,
    )
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = (heads < head_num)[:, None]
    s_idx = row // batch_size
    b_idx = row - s_idx * batch_size
    kv_row = kv_ptr + s_idx.to(tl.int64) * stride_kv_s + b_idx.to(tl.int64) * stride_kv_b
    kv_row += heads[:, None] * stride_kv_h
    key_row = key_ptr + row.to(tl.int64) * stride_key_row + heads[:, None] * stride_key_h
    value_row = value_ptr + row.to(tl.int64) * stride_value_row + heads[:, None] * stride_value_h

    k_cols = tl.arange(0, K_BLOCK)[None, :]
    k_mask = hmask & (k_cols < K_DIM)
    tl.store(key_row + k_cols, tl.load(kv_row + k_cols, mask=k_mask), mask=k_mask)
    v_cols = tl.arange(0, V_BLOCK)[None, :]
    v_mask = hmask & (v_cols < V_DIM)
    tl.store(value_row + v_cols, tl.load(kv_row + K_DIM + v_cols, mask=v_mask), mask=v_mask)

    # One rotation per token, shared by all heads.
    cos_l, cos_r, sin_l, sin_r = _load_cos_sin(
        cos_ptr, sin_ptr, pos, stride_cos, stride_sin, EMB_DIM, COMPUTE_DTYPE
    )
    emb_row = emb_ptr + s_idx.to(tl.int64) * stride_emb_s + b_idx.to(tl.int64) * stride_emb_b
    x = tl.load(emb_row + tl.arange(0, EMB_DIM))
    x1, x2 = tl.split(tl.reshape(x, (EMB_DIM // 2, 2)))
    left, right = _rotate_fwd(
        x1.to(COMPUTE_DTYPE), x2.to(COMPUTE_DTYPE), cos_l, cos_r, sin_l, sin_r, FMA_1, FMA_2
    )
    out_ty = key_ptr.dtype.element_ty
    rope_row = key_row + K_DIM
    if REMOVE_INTERLEAVING:
        out = tl.reshape(tl.join(left, right), (EMB_DIM,)).to(out_ty)
        dims = tl.arange(0, EMB_DIM)[None, :]
        tl.store(rope_row + dims, tl.broadcast_to(out[None, :], (BLOCK_H, EMB_DIM)), mask=hmask)
    else:
        half = tl.arange(0, EMB_DIM // 2)[None, :]
        left = tl.broadcast_to(left.to(out_ty)[None, :], (BLOCK_H, EMB_DIM // 2))
        right = tl.broadcast_to(right.to(out_ty)[None, :], (BLOCK_H, EMB_DIM // 2))
        tl.store(rope_row + half, left, mask=hmask)
        tl.store(rope_row + EMB_DIM // 2 + half, right, mask=hmask)


@triton.jit
def _kv_bwd_copy(
    dkey_row,
    dvalue_row,
    dkv_row,
    heads,
    head_num,
    stride_dkey_h,
    stride_dvalue_h,
    stride_dkv_h,
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    K_BLOCK: tl.constexpr,
    V_BLOCK: tl.constexpr,
):
    """dkv = [dkey[..., :K_DIM] | dvalue] for the heads ``heads`` of one token."""
    hmask = (heads < head_num)[:, None]
    dkv_row += heads[:, None] * stride_dkv_h
    k_cols = tl.arange(0, K_BLOCK)[None, :]
    k_mask = hmask & (k_cols < K_DIM)
    dk = tl.load(dkey_row + heads[:, None] * stride_dkey_h + k_cols, mask=k_mask)
    tl.store(dkv_row + k_cols, dk, mask=k_mask)
    v_cols = tl.arange(0, V_BLOCK)[None, :]
    v_mask = hmask & (v_cols < V_DIM)
    dv = tl.load(dvalue_row + heads[:, None] * stride_dvalue_h + v_cols, mask=v_mask)
    tl.store(dkv_row + K_DIM + v_cols, dv, mask=v_mask)


@triton.jit
def _kv_bwd_emb(
    dkey_row,
    demb_ptr,
    cos_ptr,
    sin_ptr,
    cu_seqlens,
    position_ids,
    head_num,
    batch_size,
    seq_num,
    n_rope_rows,
    cp_rank,
    cp_size,
    stride_dkey_h,
    stride_demb_row,
    stride_cos,
    stride_sin,
    K_DIM: tl.constexpr,
    EMB_DIM: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    REMOVE_INTERLEAVING: tl.constexpr,
    FMA_1: tl.constexpr,
    FMA_2: tl.constexpr,
    SEQ_BLOCK: tl.constexpr,
    HEAD_UNROLL: tl.constexpr,
):
    """d_emb of one token: the heads' RoPE gradients summed in head order, rotated back.

    The heads are summed one after another in fp32: the order megatron-core uses at BLOCK_H=1, its
    one config whose result does not depend on the block shape. The HEAD_UNROLL loads of a step
    are independent of the sums, so they are in flight together. Masked heads add +0.0, which
    leaves the sum unchanged (it starts at +0.0 and so is never -0.0).
    """
    row = tl.program_id(0)
    rope_row = dkey_row + K_DIM
    if REMOVE_INTERLEAVING:
        dims = tl.arange(0, EMB_DIM)
        acc = tl.zeros((EMB_DIM,), dtype=tl.float32)
        for h0 in range(0, head_num, HEAD_UNROLL):
            for u in tl.static_range(HEAD_UNROLL):
                h = h0 + u
                live = (h + tl.zeros((EMB_DIM,), tl.int32)) < head_num
                g = tl.load(rope_row + h * stride_dkey_h + dims, mask=live, other=0.0)
                acc += g.to(tl.float32)
        g_l, g_r = tl.split(tl.reshape(acc.to(demb_ptr.dtype.element_ty), (EMB_DIM // 2, 2)))
    else:
        half = tl.arange(0, EMB_DIM // 2)
        acc_l = tl.zeros((EMB_DIM // 2,), dtype=tl.float32)
        acc_r = tl.zeros((EMB_DIM // 2,), dtype=tl.float32)
        for h0 in range(0, head_num, HEAD_UNROLL):
            for u in tl.static_range(HEAD_UNROLL):
                h = h0 + u
                head_row = rope_row + h * stride_dkey_h
                live = (h + tl.zeros((EMB_DIM // 2,), tl.int32)) < head_num
                g_l = tl.load(head_row + half, mask=live, other=0.0)
                g_r = tl.load(head_row + EMB_DIM // 2 + half, mask=live, other=0.0)
                acc_l += g_l.to(tl.float32)
                acc_r += g_r.to(tl.float32)
        g_l = acc_l.to(demb_ptr.dtype.element_ty)
        g_r = acc_r.to(demb_ptr.dtype.element_ty)
    pos = _rope_row(
        row,
        batch_size,
        cu_seqlens,
        seq_num,
        position_ids,
        cp_rank,
        cp_size,
        n_rope_rows,
        SEQ_BLOCK,
    )
    cos_l, cos_r, sin_l, sin_r = _load_cos_sin(
        cos_ptr, sin_ptr, pos, stride_cos, stride_sin, EMB_DIM, COMPUTE_DTYPE
    )
    g1, g2 = _rotate_bwd(
        g_l.to(COMPUTE_DTYPE), g_r.to(COMPUTE_DTYPE), cos_l, cos_r, sin_l, sin_r, FMA_1, FMA_2
    )
    out = tl.reshape(tl.join(g1, g2), (EMB_DIM,))
    demb_row = demb_ptr + row.to(tl.int64) * stride_demb_row
    tl.store(demb_row + tl.arange(0, EMB_DIM), out.to(demb_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=RUNTIME_INTS)
def mla_rope_kv_bwd_kernel(
    dkey_ptr,
    dvalue_ptr,
    dkv_ptr,
    demb_ptr,
    cos_ptr,
    sin_ptr,
    cu_seqlens,
    position_ids,
    head_num,
    batch_size,
    seq_num,
    n_rope_rows,
    cp_rank,
    cp_size,
    stride_dkey_row,
    stride_dkey_h,
    stride_dvalue_row,
    stride_dvalue_h,
    stride_dkv_row,
    stride_dkv_h,
    stride_demb_row,
    stride_cos,
    stride_sin,
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    K_BLOCK: tl.constexpr,
    V_BLOCK: tl.constexpr,
    EMB_DIM: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    REMOVE_INTERLEAVING: tl.constexpr,
    FMA_1: tl.constexpr,
    FMA_2: tl.constexpr,
    SEQ_BLOCK: tl.constexpr,
    HEAD_UNROLL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """dkv = [dkey[..., :K_DIM] | dvalue]; d_emb = rope^T(sum over heads of dkey's RoPE part).

    The first head block's program sums the token's heads after its copy. (A program of its own
    for the sum was 3% slower at 4096 tokens and 128 heads on an H200.)
    """
    row = tl.program_id(0)
    pid_h = tl.program_id(1)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    dkey_row = dkey_ptr + row.to(tl.int64) * stride_dkey_row
    dvalue_row = dvalue_ptr + row.to(tl.int64) * stride_dvalue_row
    dkv_row = dkv_ptr + row.to(tl.int64) * stride_dkv_row
    _kv_bwd_copy(
        dkey_row,
        dvalue_row,
        dkv_row,
        heads,
        head_num,
        stride_dkey_h,
        stride_dvalue_h,
        stride_dkv_h,
        K_DIM,
        V_DIM,
        K_BLOCK,
        V_BLOCK,
    )
    if pid_h == 0:
        _kv_bwd_emb(
            dkey_row,
            demb_ptr,
            cos_ptr,
            sin_ptr,
            cu_seqlens,
            position_ids,
            head_num,
            batch_size,
            seq_num,
            n_rope_rows,
            cp_rank,
            cp_size,
            stride_dkey_h,
            stride_demb_row,
            stride_cos,
            stride_sin,
            K_DIM,
            EMB_DIM,
            COMPUTE_DTYPE,
            REMOVE_INTERLEAVING,
            FMA_1,
            FMA_2,
            SEQ_BLOCK,
            HEAD_UNROLL,
        )
