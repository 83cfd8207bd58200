# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Contiguous-load Triton kernels that apply YaRN RoPE to MLA's query, key and value.

Drop-in replacements for ``megatron.core.fusions.fused_mla_yarn_rope_apply``'s
``fused_apply_mla_rope_for_q`` and ``fused_apply_mla_rope_for_kv``, with the same signatures and,
wherever megatron-core's output is defined, bit-identical results. Differences:

* The query forward loads the ``emb_dim`` RoPE elements of each head with one contiguous load and
  splits even/odd elements in registers; the query backward writes its interleaved result with one
  contiguous store. megatron-core uses two stride-2 loads (forward) and two stride-2 stores
  (backward), which move the same bytes in twice as many, half-used, transactions.
* The products are paired into FMAs explicitly, with the pairing megatron-core's kernels compile
  to, so the output is the same at every ``BLOCK_H``/``num_warps`` the autotuner can choose.
* Heads are masked by their global index. megatron-core masks by the index inside the head block,
  so when ``head_num % BLOCK_H != 0`` its last block rotates and writes heads of the next token and,
  for the last token, memory past the end of the tensor.
* ``head_num`` is a runtime argument (one compiled kernel serves every head count), ``cos``/``sin``
  may have any row stride, the sbhd sequence and batch strides are independent, and in thd the
  sequence lookup is a vector scan rather than one load per sequence.
* Keyword-only extras from upstream Megatron-LM main: ``inverse`` (rotate by ``-theta``),
  ``remove_interleaving`` (write the result back in the input's interleaved layout) and
  ``position_ids`` (explicit cos/sin rows per token).

Launch configs (``BLOCK_H`` heads per program, ``num_warps``) are autotuned on first use for each
compiled variant, head count and power-of-two bucket of the token count: every config in
:data:`AUTOTUNE_CONFIGS` is timed once (the in-place kernels on a scratch copy) and the fastest
kept. The output is the same for all of them. :func:`pinned_kernel_config` pins one config instead
(tests, benchmarks, and the Triton interpreter, which cannot time anything). Tune before capturing
a CUDA graph: a variant first seen during capture runs with ``KernelConfig(16, 4)``.
"""

import contextlib
import contextvars
import os
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

__all__ = [
    "KernelConfig",
    "pinned_kernel_config",
    "clear_autotune_cache",
    "autotuned_configs",
    "fused_apply_mla_rope_for_q",
    "fused_apply_mla_rope_for_kv",
    "mla_rope_q_fwd_",
    "mla_rope_q_bwd_",
    "mla_rope_kv_fwd",
    "mla_rope_kv_bwd",
]

# Triton decides at decoration time whether kernels run in its CPU interpreter.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)
BLOCK_H_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128)
# cu_seqlens entries compared per step of the thd sequence lookup.
_SEQ_BLOCK = 128
# Heads whose loads are issued together in the kv backward's ordered head sum.
_HEAD_UNROLL = 4
# Token counts share an autotuning result within a power-of-two bucket up to this size.
_MAX_TUNE_ROWS = 1 << 15


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration of the kernels in this module.

    Args:
        block_h: heads per program, a power of two from 1 to 128.
        num_warps: warps per program, a power of two from 1 to 32.
    """

    block_h: int
    num_warps: int = 4

    def __post_init__(self):
        if self.block_h not in BLOCK_H_CHOICES:
            raise ValueError(f"block_h must be one of {BLOCK_H_CHOICES}, got {self.block_h}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"num_warps must be a power of two from 1 to 32, got {self.num_warps}")


# The autotuner's search space. The output does not depend on which one it picks.
AUTOTUNE_CONFIGS: Tuple[KernelConfig, ...] = (
    KernelConfig(1, 1),
    KernelConfig(2, 1),
    KernelConfig(4, 1),
    KernelConfig(8, 2),
    KernelConfig(16, 4),
    KernelConfig(32, 4),
    KernelConfig(64, 4),
    KernelConfig(128, 4),
    KernelConfig(128, 8),
)
# What the interpreter runs when nothing is pinned.
_INTERPRETER_DEFAULT = KernelConfig(4, 1)

_PINNED: contextvars.ContextVar[Optional[KernelConfig]] = contextvars.ContextVar(
    "megatron_ext_mla_rope_pinned_config", default=None
)


@contextlib.contextmanager
def pinned_kernel_config(block_h: int, num_warps: int = 4) -> Iterator[KernelConfig]:
    """Run every kernel of this module with one fixed config instead of autotuning.

    The autograd functions record the pinned config in their forward pass, so a backward run later,
    outside the ``with`` block, uses the same config. Autotuning is impossible under the Triton
    interpreter (``TRITON_INTERPRET=1``); there, unpinned launches use ``KernelConfig(4, 1)``.

    Args:
        block_h: heads per program, a power of two from 1 to 128.
        num_warps: warps per program.

    Returns:
        A context manager yielding the pinned :class:`KernelConfig`.
    """
    config = KernelConfig(block_h, num_warps)
    token = _PINNED.set(config)
    try:
        yield config
    finally:
        _PINNED.reset(token)


def _current_config() -> Optional[KernelConfig]:
    pinned = _PINNED.get()
    if pinned is None and _INTERPRETED:
        return _INTERPRETER_DEFAULT
    return pinned


# Tuned configs, keyed by kernel, compiled variant (dtypes, flags, None-ness) and problem size.
_TUNED: Dict[tuple, KernelConfig] = {}
# Used while a CUDA graph is captured and no tuned config exists yet (timing is impossible there).
_CAPTURE_DEFAULT = KernelConfig(16, 4)


def clear_autotune_cache() -> None:
    """Forget every autotuned config (benchmarks re-tune per shape with this)."""
    _TUNED.clear()


def autotuned_configs() -> Dict[tuple, KernelConfig]:
    """The configs chosen so far: {(kernel name, ..., head_num, token bucket): config}."""
    return dict(_TUNED)


def _benchmark_us(launch: Callable[[], None]) -> float:
    return triton.testing.do_bench(launch, warmup=5, rep=20, return_mode="median") * 1e3


def _tuned_config(kernel, rows: int, head_num: int, args: tuple, meta: dict, in_place: bool):
    """Time each config once per (variant, size) and keep the fastest.

    Unlike ``triton.autotune`` with ``restore_value``, which clones and restores the in-place
    tensor inside every timed call (for a one-token launch that copy costs as much as the kernel
    and made its choice noise), in-place kernels are timed on a scratch tensor with the same
    strides, and nothing but the kernel is timed.
    """
    variant = tuple(
        (str(a.dtype), a.stride()) if isinstance(a, torch.Tensor) else a is None for a in args
    )
    name = getattr(kernel, "__name__", repr(kernel))
    key = (name, variant, tuple(sorted((k, str(v)) for k, v in meta.items())))
    key += (head_num, min(triton.next_power_of_2(max(rows, 1)), _MAX_TUNE_ROWS))
    config = _TUNED.get(key)
    if config is not None:
        return config
    if args[0].is_cuda and torch.cuda.is_current_stream_capturing():
        return _CAPTURE_DEFAULT
    if in_place:
        x = args[0]
        scratch = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)
        args = (scratch.copy_(x),) + tuple(args[1:])
    # Blocks wider than the head count only add masked lanes.
    limit = triton.next_power_of_2(max(1, head_num))
    candidates = [c for c in AUTOTUNE_CONFIGS if c.block_h <= limit] or [AUTOTUNE_CONFIGS[0]]
    timings = {}
    for candidate in candidates:
        grid = (rows, triton.cdiv(head_num, candidate.block_h))

        def launch(c=candidate, grid=grid):
            kernel[grid](*args, **meta, BLOCK_H=c.block_h, num_warps=c.num_warps)

        timings[candidate] = _benchmark_us(launch)
    config = min(timings, key=timings.get)
    _TUNED[key] = config
    return config


# Integer arguments whose value would otherwise be specialised into extra compiled variants
# (Triton specialises integers equal to 1 and multiples of 16). Strides and the RoPE offset stay
# specialised: their divisibility is what lets the compiler emit 16-byte loads and stores.
_RUNTIME_INTS = [
    "head_num",
    "batch_size",
    "seq_num",
    "n_rope_rows",
    "cp_rank",
    "cp_size",
]


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


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
    cos_ptr, sin_ptr, pos, stride_cos, stride_sin, EMB_DIM: tl.constexpr, CT: tl.constexpr
):
    half = tl.arange(0, EMB_DIM // 2)
    cos_row = cos_ptr + pos * stride_cos
    sin_row = sin_ptr + pos * stride_sin
    cos_l = tl.load(cos_row + half).to(CT)
    cos_r = tl.load(cos_row + EMB_DIM // 2 + half).to(CT)
    sin_l = tl.load(sin_row + half).to(CT)
    sin_r = tl.load(sin_row + EMB_DIM // 2 + half).to(CT)
    return cos_l, cos_r, sin_l, sin_r


@triton.jit
def _rotate_fwd(x1, x2, cos_l, cos_r, sin_l, sin_r, RIGHT_FMA_ON_COS: tl.constexpr):
    """(x1 * cos_l - x2 * sin_l, x2 * cos_r + x1 * sin_r) with megatron-core's FMA pairing.

    megatron-core's two-load kernel writes the two sums unfused; the compiler contracts each into
    one FMA, and this is the pairing it chose. Writing it out keeps the result independent of the
    block shape, which otherwise changes how the compiler contracts. RIGHT_FMA_ON_COS selects the
    pairing the two-load kernel compiles to for an inverse rotation with some mixed dtypes (see
    _INVERSE_RIGHT_FMA_ON_COS; for fp32 q its output changes at larger BLOCK_H, and upstream kept
    the small-BLOCK_H one).
    """
    left = tl.fma(x1, cos_l, -(x2 * sin_l))
    if RIGHT_FMA_ON_COS:
        right = tl.fma(x2, cos_r, x1 * sin_r)
    else:
        right = tl.fma(x1, sin_r, x2 * cos_r)
    return left, right


@triton.jit
def _rotate_bwd(g_l, g_r, cos_l, cos_r, sin_l, sin_r):
    """(g_l * cos_l + g_r * sin_r, -g_l * sin_l + g_r * cos_r), megatron-core's backward pairing."""
    g1 = tl.fma(g_l, cos_l, g_r * sin_r)
    g2 = tl.fma(-g_l, sin_l, g_r * cos_r)
    return g1, g2


@triton.jit
def _q_row_base(q_ptr, row, batch_size, stride_s, stride_b, rope_offset):
    s_idx = row // batch_size
    b_idx = row - s_idx * batch_size
    return q_ptr + s_idx.to(tl.int64) * stride_s + b_idx.to(tl.int64) * stride_b + rope_offset


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _mla_rope_q_fwd_kernel(
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
    CT: tl.constexpr,
    INVERSE: tl.constexpr,
    KEEP_INTERLEAVED: tl.constexpr,
    RIGHT_FMA_ON_COS: tl.constexpr,
    SEQ_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """In-place RoPE on the last EMB_DIM elements of each head of one token (grid: rows x heads).

    The input pairs are interleaved (x1 = even, x2 = odd elements). The rotated halves are written
    as [left | right], or interleaved again when KEEP_INTERLEAVED.
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
        cos_ptr, sin_ptr, pos, stride_cos, stride_sin, EMB_DIM, CT
    )
    if INVERSE:
        sin_l = -sin_l
        sin_r = -sin_r

    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (heads < head_num)[:, None]
    ptrs = _q_row_base(q_ptr, row, batch_size, stride_s, stride_b, rope_offset)
    ptrs += heads[:, None] * stride_h
    dims = tl.arange(0, EMB_DIM)[None, :]
    x = tl.load(ptrs + dims, mask=mask)
    x1, x2 = tl.split(tl.reshape(x, (BLOCK_H, EMB_DIM // 2, 2)))
    left, right = _rotate_fwd(
        x1.to(CT),
        x2.to(CT),
        tl.broadcast_to(cos_l[None, :], (BLOCK_H, EMB_DIM // 2)),
        tl.broadcast_to(cos_r[None, :], (BLOCK_H, EMB_DIM // 2)),
        tl.broadcast_to(sin_l[None, :], (BLOCK_H, EMB_DIM // 2)),
        tl.broadcast_to(sin_r[None, :], (BLOCK_H, EMB_DIM // 2)),
        RIGHT_FMA_ON_COS,
    )
    out_ty = q_ptr.dtype.element_ty
    if KEEP_INTERLEAVED:
        out = tl.reshape(tl.join(left, right), (BLOCK_H, EMB_DIM))
        tl.store(ptrs + dims, out.to(out_ty), mask=mask)
    else:
        half = tl.arange(0, EMB_DIM // 2)[None, :]
        tl.store(ptrs + half, left.to(out_ty), mask=mask)
        tl.store(ptrs + EMB_DIM // 2 + half, right.to(out_ty), mask=mask)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _mla_rope_q_bwd_kernel(
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
    CT: tl.constexpr,
    INVERSE: tl.constexpr,
    KEEP_INTERLEAVED: tl.constexpr,
    RIGHT_FMA_ON_COS: tl.constexpr,  # forward only; the backward's pairing never changed
    SEQ_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """In-place gradient of :func:`_mla_rope_q_fwd_kernel`: reads the forward's output layout and
    writes the interleaved input layout with one contiguous store."""
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
        cos_ptr, sin_ptr, pos, stride_cos, stride_sin, EMB_DIM, CT
    )
    if INVERSE:
        sin_l = -sin_l
        sin_r = -sin_r

    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (heads < head_num)[:, None]
    ptrs = _q_row_base(g_ptr, row, batch_size, stride_s, stride_b, rope_offset)
    ptrs += heads[:, None] * stride_h
    dims = tl.arange(0, EMB_DIM)[None, :]
    if KEEP_INTERLEAVED:
        g = tl.load(ptrs + dims, mask=mask)
        g_l, g_r = tl.split(tl.reshape(g, (BLOCK_H, EMB_DIM // 2, 2)))
    else:
        half = tl.arange(0, EMB_DIM // 2)[None, :]
        g_l = tl.load(ptrs + half, mask=mask)
        g_r = tl.load(ptrs + EMB_DIM // 2 + half, mask=mask)
    g1, g2 = _rotate_bwd(
        g_l.to(CT),
        g_r.to(CT),
        tl.broadcast_to(cos_l[None, :], (BLOCK_H, EMB_DIM // 2)),
        tl.broadcast_to(cos_r[None, :], (BLOCK_H, EMB_DIM // 2)),
        tl.broadcast_to(sin_l[None, :], (BLOCK_H, EMB_DIM // 2)),
        tl.broadcast_to(sin_r[None, :], (BLOCK_H, EMB_DIM // 2)),
    )
    out = tl.reshape(tl.join(g1, g2), (BLOCK_H, EMB_DIM))
    tl.store(ptrs + dims, out.to(g_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _mla_rope_kv_fwd_kernel(
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
    CT: tl.constexpr,
    KEEP_INTERLEAVED: tl.constexpr,
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
        cos_ptr, sin_ptr, pos, stride_cos, stride_sin, EMB_DIM, CT
    )
    emb_row = emb_ptr + s_idx.to(tl.int64) * stride_emb_s + b_idx.to(tl.int64) * stride_emb_b
    x = tl.load(emb_row + tl.arange(0, EMB_DIM))
    x1, x2 = tl.split(tl.reshape(x, (EMB_DIM // 2, 2)))
    left, right = _rotate_fwd(x1.to(CT), x2.to(CT), cos_l, cos_r, sin_l, sin_r, False)
    out_ty = key_ptr.dtype.element_ty
    rope_row = key_row + K_DIM
    if KEEP_INTERLEAVED:
        out = tl.reshape(tl.join(left, right), (EMB_DIM,)).to(out_ty)
        dims = tl.arange(0, EMB_DIM)[None, :]
        tl.store(rope_row + dims, tl.broadcast_to(out[None, :], (BLOCK_H, EMB_DIM)), mask=hmask)
    else:
        half = tl.arange(0, EMB_DIM // 2)[None, :]
        left = tl.broadcast_to(left.to(out_ty)[None, :], (BLOCK_H, EMB_DIM // 2))
        right = tl.broadcast_to(right.to(out_ty)[None, :], (BLOCK_H, EMB_DIM // 2))
        tl.store(rope_row + half, left, mask=hmask)
        tl.store(rope_row + EMB_DIM // 2 + half, right, mask=hmask)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _mla_rope_kv_bwd_kernel(
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
    CT: tl.constexpr,
    KEEP_INTERLEAVED: tl.constexpr,
    SEQ_BLOCK: tl.constexpr,
    HEAD_UNROLL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """dkv = [dkey[..., :K_DIM] | dvalue]; d_emb = rope^T(sum over heads of dkey's RoPE part)."""
    row = tl.program_id(0)
    pid_h = tl.program_id(1)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = (heads < head_num)[:, None]
    dkey_row = dkey_ptr + row.to(tl.int64) * stride_dkey_row
    dvalue_row = dvalue_ptr + row.to(tl.int64) * stride_dvalue_row
    dkv_row = dkv_ptr + row.to(tl.int64) * stride_dkv_row + heads[:, None] * stride_dkv_h

    k_cols = tl.arange(0, K_BLOCK)[None, :]
    k_mask = hmask & (k_cols < K_DIM)
    dk = tl.load(dkey_row + heads[:, None] * stride_dkey_h + k_cols, mask=k_mask)
    tl.store(dkv_row + k_cols, dk, mask=k_mask)
    v_cols = tl.arange(0, V_BLOCK)[None, :]
    v_mask = hmask & (v_cols < V_DIM)
    dv = tl.load(dvalue_row + heads[:, None] * stride_dvalue_h + v_cols, mask=v_mask)
    tl.store(dkv_row + K_DIM + v_cols, dv, mask=v_mask)

    if pid_h == 0:
        # Sum the heads one after another in fp32: the order megatron-core uses at BLOCK_H=1, its
        # one config whose result does not depend on the block shape. Masked heads add +0.0, which
        # leaves the sum unchanged (it starts at +0.0 and so is never -0.0).
        rope_row = dkey_row + K_DIM
        if KEEP_INTERLEAVED:
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
            cos_ptr, sin_ptr, pos, stride_cos, stride_sin, EMB_DIM, CT
        )
        g1, g2 = _rotate_bwd(g_l.to(CT), g_r.to(CT), cos_l, cos_r, sin_l, sin_r)
        out = tl.reshape(tl.join(g1, g2), (EMB_DIM,))
        demb_row = demb_ptr + row.to(tl.int64) * stride_demb_row
        tl.store(demb_row + tl.arange(0, EMB_DIM), out.to(demb_ptr.dtype.element_ty))


# --------------------------------------------------------------------------------------------------
# Validation and launch
# --------------------------------------------------------------------------------------------------


def _check_tensor(name: str, x, dtypes: Sequence[torch.dtype]) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {names}; got {x.dtype}")


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_emb_dim(emb_dim) -> int:
    _check_int("emb_dim", emb_dim, 4)
    if emb_dim & (emb_dim - 1):
        raise ValueError(f"emb_dim must be a power of two >= 4 (a block size), got {emb_dim}")
    return emb_dim


def _check_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, but the input is on {device}")


def _check_tables(
    cos, sin, emb_dim: int, device: torch.device, min_rows: int
) -> Tuple[int, int, int]:
    """Check cos/sin ([rows, emb_dim] or [rows, 1, ..., 1, emb_dim]); return rows, row strides."""
    _check_tensor("cos", cos, _SUPPORTED_DTYPES)
    _check_tensor("sin", sin, _SUPPORTED_DTYPES)
    if cos.dtype != sin.dtype:
        raise TypeError(f"cos and sin must have the same dtype; got {cos.dtype} and {sin.dtype}")
    for name, table in (("cos", cos), ("sin", sin)):
        _check_device(name, table, device)
        if table.dim() < 2 or table.shape[-1] != emb_dim or any(d != 1 for d in table.shape[1:-1]):
            raise ValueError(
                f"{name} must have shape [max_seq_len, emb_dim] or [max_seq_len, 1, ..., 1, "
                f"emb_dim] with emb_dim={emb_dim}; got {tuple(table.shape)}"
            )
        if table.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dimension")
    if cos.shape[0] != sin.shape[0]:
        raise ValueError(f"cos and sin have {cos.shape[0]} and {sin.shape[0]} rows")
    if cos.shape[0] < max(1, min_rows):
        raise ValueError(
            f"cos/sin have {cos.shape[0]} rows, fewer than the {max(1, min_rows)} positions the "
            "input needs"
        )
    return cos.shape[0], cos.stride(0), sin.stride(0)


def _compute_dtype(a: torch.dtype, b: torch.dtype) -> tl.dtype:
    # Triton's promotion for a binary op between q (or k_pos_emb) and cos/sin, which megatron-core's
    # kernels get implicitly: fp32 if either is fp32, else fp16 if either is fp16 (bf16 with fp16
    # computes in fp16), else bf16.
    if torch.float32 in (a, b):
        return tl.float32
    if torch.float16 in (a, b):
        return tl.float16
    return tl.bfloat16


@dataclass(frozen=True)
class _Layout:
    """How rows (tokens) and heads of a [s, b, h, d] or [t, h, d] tensor are addressed."""

    rows: int
    batch_size: int
    head_num: int
    head_dim: int
    stride_s: int
    stride_b: int
    stride_h: int
    thd: bool


def _layout(name: str, x: torch.Tensor, thd: bool) -> _Layout:
    if thd:
        if x.dim() != 3:
            raise ValueError(
                f"{name} must be [total_seq_len, head_num, head_dim] (thd, cu_seqlens given); "
                f"got {x.dim()} dims"
            )
        rows, heads, dim = x.shape
        strides = (x.stride(0), 0, x.stride(1))
        batch = 1
    else:
        if x.dim() != 4:
            raise ValueError(
                f"{name} must be [seq_len, batch_size, head_num, head_dim] (sbhd, no cu_seqlens); "
                f"got {x.dim()} dims"
            )
        seq, batch, heads, dim = x.shape
        rows = seq * batch
        strides = (x.stride(0), x.stride(1), x.stride(2))
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension")
    return _Layout(rows, batch, heads, dim, *strides, thd)


def _check_cu_seqlens(
    name: str, cu_seqlens, device: torch.device, cp_rank, cp_size
) -> Tuple[int, int, int]:
    _check_tensor(name, cu_seqlens, _INDEX_DTYPES)
    _check_device(name, cu_seqlens, device)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be 1-D with seq_num + 1 >= 2 entries")
    if not cu_seqlens.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    _check_int("cp_size", cp_size, 1)
    _check_int("cp_rank", cp_rank, 0)
    if cp_rank >= cp_size:
        raise ValueError(f"cp_rank must be < cp_size; got cp_rank={cp_rank}, cp_size={cp_size}")
    return cu_seqlens.numel() - 1, cp_rank, cp_size


def _check_position_ids(position_ids, layout: _Layout, device: torch.device, shape) -> torch.Tensor:
    _check_tensor("position_ids", position_ids, _INDEX_DTYPES)
    _check_device("position_ids", position_ids, device)
    if tuple(position_ids.shape) != tuple(shape):
        raise ValueError(
            f"position_ids must have shape {tuple(shape)} (one entry per token); "
            f"got {tuple(position_ids.shape)}"
        )
    # One entry per flattened row; a copy only for non-contiguous input, never a sync.
    return position_ids.reshape(layout.rows)


def _check_flags(rotary_interleaved, **flags) -> None:
    if rotary_interleaved:
        raise ValueError("rotary_interleaved=True is not supported (megatron-core neither)")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _launch(kernel, rows: int, head_num: int, config: Optional[KernelConfig], device, args, meta):
    if rows == 0 or head_num == 0:
        return
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        if config is None:
            in_place = kernel in (_mla_rope_q_fwd_kernel, _mla_rope_q_bwd_kernel)
            config = _tuned_config(kernel, rows, head_num, args, meta, in_place)
        grid = (rows, triton.cdiv(head_num, config.block_h))
        kernel[grid](*args, **meta, BLOCK_H=config.block_h, num_warps=config.num_warps)


@dataclass(frozen=True)
class _QPlan:
    layout: _Layout
    cos_rows: int
    stride_cos: int
    stride_sin: int
    seq_num: int
    cp_rank: int
    cp_size: int
    position_ids: Optional[torch.Tensor]


def _plan_q(
    t, cos, sin, qk_head_dim, emb_dim, cu_seqlens, cp_rank, cp_size, position_ids, name="t"
) -> _QPlan:
    _check_tensor(name, t, _SUPPORTED_DTYPES)
    _check_int("qk_head_dim", qk_head_dim, 0)
    _check_emb_dim(emb_dim)
    layout = _layout(name, t, thd=cu_seqlens is not None)
    if layout.head_dim != qk_head_dim + emb_dim:
        raise ValueError(
            f"{name}'s head dim is {layout.head_dim}, but qk_head_dim + emb_dim = "
            f"{qk_head_dim} + {emb_dim}"
        )
    seq_num = 0
    if cu_seqlens is not None:
        seq_num, cp_rank, cp_size = _check_cu_seqlens(
            "cu_seqlens_q", cu_seqlens, t.device, cp_rank, cp_size
        )
    else:
        # sbhd ignores context parallelism: the caller passes tables already sliced for its rank.
        cp_rank, cp_size = 0, 1
    if position_ids is not None:
        position_ids = _check_position_ids(position_ids, layout, t.device, t.shape[:-2])
    # Only sbhd without position_ids knows the largest position on the host: seq_len - 1.
    min_rows = t.shape[0] if (cu_seqlens is None and position_ids is None) else 1
    cos_rows, stride_cos, stride_sin = _check_tables(cos, sin, emb_dim, t.device, min_rows)
    return _QPlan(layout, cos_rows, stride_cos, stride_sin, seq_num, cp_rank, cp_size, position_ids)


# (q dtype, cos/sin dtype) pairs for which the two-load kernel, at inverse=True, pairs the right
# half's FMA on x2 * cos (measured on an H200 with triton 3.6; for fp32 q at BLOCK_H 1-4, for bf16 q
# with fp32 tables at every BLOCK_H). Equal dtypes and fp16 q with fp32 tables pair it like the
# non-inverse rotation; bf16 with fp16 tables (either order) was not measured.
_INVERSE_RIGHT_FMA_ON_COS = {
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.float32),
}


def _right_fma_on_cos(x_dtype: torch.dtype, table_dtype: torch.dtype, inverse: bool) -> bool:
    return bool(inverse and (x_dtype, table_dtype) in _INVERSE_RIGHT_FMA_ON_COS)


def _q_args(x, cos, sin, qk_head_dim, emb_dim, cu_seqlens, plan: _QPlan, inverse, keep):
    """Positional arguments and constexprs of a query kernel launch (x is the tensor rotated)."""
    lay = plan.layout
    args = (
        x,
        cos,
        sin,
        cu_seqlens,
        plan.position_ids,
        lay.head_num,
        lay.batch_size,
        plan.seq_num,
        plan.cos_rows,
        plan.cp_rank,
        plan.cp_size,
        lay.stride_s,
        lay.stride_b,
        lay.stride_h,
        qk_head_dim,
        plan.stride_cos,
        plan.stride_sin,
    )
    meta = dict(
        EMB_DIM=emb_dim,
        CT=_compute_dtype(x.dtype, cos.dtype),
        INVERSE=inverse,
        KEEP_INTERLEAVED=keep,
        RIGHT_FMA_ON_COS=_right_fma_on_cos(x.dtype, cos.dtype, inverse),
        SEQ_BLOCK=_SEQ_BLOCK,
    )
    return args, meta


def _run_q(kernel, x, cos, sin, qk_head_dim, emb_dim, cu_seqlens, plan: _QPlan, inverse, keep):
    args, meta = _q_args(x, cos, sin, qk_head_dim, emb_dim, cu_seqlens, plan, inverse, keep)
    lay = plan.layout
    _launch(kernel, lay.rows, lay.head_num, _current_config(), x.device, args, meta)


def mla_rope_q_fwd_(
    t: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    qk_head_dim: int,
    emb_dim: int,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    *,
    inverse: bool = False,
    remove_interleaving: bool = False,
    position_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Launch the query forward kernel on ``t`` in place, outside autograd.

    Args: as :func:`fused_apply_mla_rope_for_q`.

    Returns:
        torch.Tensor: ``t``.
    """
    _check_flags(False, inverse=inverse, remove_interleaving=remove_interleaving)
    plan = _plan_q(t, cos, sin, qk_head_dim, emb_dim, cu_seqlens_q, cp_rank, cp_size, position_ids)
    _run_q(
        _mla_rope_q_fwd_kernel,
        t,
        cos,
        sin,
        qk_head_dim,
        emb_dim,
        cu_seqlens_q,
        plan,
        inverse,
        remove_interleaving,
    )
    return t


def mla_rope_q_bwd_(
    grad: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    qk_head_dim: int,
    emb_dim: int,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    *,
    inverse: bool = False,
    remove_interleaving: bool = False,
    position_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Launch the query backward kernel on ``grad`` in place, outside autograd.

    Args: as :func:`fused_apply_mla_rope_for_q`, with ``grad`` the gradient of its output.

    Returns:
        torch.Tensor: ``grad``, now the gradient of the forward's input.
    """
    _check_flags(False, inverse=inverse, remove_interleaving=remove_interleaving)
    plan = _plan_q(
        grad, cos, sin, qk_head_dim, emb_dim, cu_seqlens_q, cp_rank, cp_size, position_ids, "grad"
    )
    _run_q(
        _mla_rope_q_bwd_kernel,
        grad,
        cos,
        sin,
        qk_head_dim,
        emb_dim,
        cu_seqlens_q,
        plan,
        inverse,
        remove_interleaving,
    )
    return grad


class _FusedMLARoPEQ(torch.autograd.Function):
    """In-place RoPE on the query's last emb_dim elements; the backward works in place too."""

    @staticmethod
    def forward(
        ctx,
        t,
        cos,
        sin,
        qk_head_dim,
        emb_dim,
        cu_seqlens_q,
        cp_rank,
        cp_size,
        inverse,
        remove_interleaving,
        position_ids,
    ):
        """Rotate ``t`` in place and return it. Args: as :func:`fused_apply_mla_rope_for_q`."""
        plan = _plan_q(
            t, cos, sin, qk_head_dim, emb_dim, cu_seqlens_q, cp_rank, cp_size, position_ids
        )
        _run_q(
            _mla_rope_q_fwd_kernel,
            t,
            cos,
            sin,
            qk_head_dim,
            emb_dim,
            cu_seqlens_q,
            plan,
            inverse,
            remove_interleaving,
        )
        # Autograd must know t changed: anything that saved it for backward then fails loudly
        # instead of silently using rotated values.
        ctx.mark_dirty(t)
        ctx.save_for_backward(cos, sin, cu_seqlens_q, position_ids)
        ctx.args = (qk_head_dim, emb_dim, cp_rank, cp_size, inverse, remove_interleaving)
        ctx.config = _PINNED.get()
        return t

    @staticmethod
    def backward(ctx, grad):
        """Rotate ``grad`` back in place (after a copy only if it is not contiguous)."""
        cos, sin, cu_seqlens_q, position_ids = ctx.saved_tensors
        qk_head_dim, emb_dim, cp_rank, cp_size, inverse, remove_interleaving = ctx.args
        if not grad.is_contiguous():
            grad = grad.contiguous()
        token = _PINNED.set(ctx.config)
        try:
            mla_rope_q_bwd_(
                grad,
                cos,
                sin,
                qk_head_dim,
                emb_dim,
                cu_seqlens_q,
                cp_rank,
                cp_size,
                inverse=inverse,
                remove_interleaving=remove_interleaving,
                position_ids=position_ids,
            )
        finally:
            _PINNED.reset(token)
        return (grad,) + (None,) * 10


def fused_apply_mla_rope_for_q(
    t: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    qk_head_dim: int,
    emb_dim: int,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    rotary_interleaved: bool = False,
    *,
    inverse: bool = False,
    remove_interleaving: bool = False,
    position_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Apply YaRN RoPE in place to the last ``emb_dim`` elements of each head of MLA's query.

    Same signature and results as megatron-core's function, plus keyword-only options of upstream
    Megatron-LM main. The first ``qk_head_dim`` elements of each head are not touched. The RoPE
    elements are read as interleaved pairs (even, odd) and written as [rotated even | rotated odd],
    or, with ``remove_interleaving``, as interleaved pairs again.

    Unlike megatron-core's, the function marks ``t`` as modified in place for autograd, so it
    raises (as any in-place op does) for a leaf tensor that requires grad. The backward rotates the
    incoming gradient in place, as megatron-core's does.

    Not checked (each would need a device-to-host sync): that ``cu_seqlens_q`` is non-decreasing,
    that cos/sin have a row for every thd position, and that ``position_ids`` lie inside cos/sin.
    Positions outside the tables are clamped to their first or last row rather than read out of
    bounds; thd rows past ``cu_seqlens_q[-1]`` (CUDA-graph padding) use row 0.

    Args:
        t: [seq_len, batch_size, head_num, qk_head_dim + emb_dim] (sbhd) or
            [total_seq_len, head_num, qk_head_dim + emb_dim] (thd, with ``cu_seqlens_q``); fp32,
            fp16 or bf16, unit stride in the last dim (other strides are free).
        cos: [max_seq_len, emb_dim] or [max_seq_len, 1, 1, emb_dim], fp32/fp16/bf16, unit last
            stride; its dtype may differ from ``t``'s (mixed dtypes compute in fp32).
        sin: like ``cos``, with ``cos``'s dtype and row count.
        qk_head_dim: elements of each head before the RoPE part.
        emb_dim: RoPE elements per head, a power of two >= 4.
        cu_seqlens_q: [seq_num + 1] int32/int64 cumulative sequence lengths (thd), or None.
        cp_rank: context-parallel rank (thd only).
        cp_size: context-parallel size (thd only).
        rotary_interleaved: must be False, as in megatron-core.
        inverse: rotate by -theta (undoes the forward).
        remove_interleaving: write the rotated pairs back interleaved (upstream main's flag).
        position_ids: int32/int64 cos/sin row per token, shaped like ``t.shape[:-2]``; replaces
            the sbhd row / thd sequence (and context-parallel) position.

    Returns:
        torch.Tensor: ``t``, modified in place.
    """
    _check_flags(rotary_interleaved, inverse=inverse, remove_interleaving=remove_interleaving)
    return _FusedMLARoPEQ.apply(
        t,
        cos,
        sin,
        qk_head_dim,
        emb_dim,
        cu_seqlens_q,
        cp_rank,
        cp_size,
        inverse,
        remove_interleaving,
        position_ids,
    )


@dataclass(frozen=True)
class _KVPlan:
    layout: _Layout
    emb_stride_s: int
    emb_stride_b: int
    cos_rows: int
    stride_cos: int
    stride_sin: int
    seq_num: int
    cp_rank: int
    cp_size: int
    position_ids: Optional[torch.Tensor]


def _plan_kv(
    kv, k_pos_emb, cos, sin, emb_dim, k_dim, v_dim, cu_seqlens, cp_rank, cp_size, position_ids
) -> _KVPlan:
    _check_tensor("kv", kv, _SUPPORTED_DTYPES)
    _check_tensor("k_pos_emb", k_pos_emb, _SUPPORTED_DTYPES)
    _check_emb_dim(emb_dim)
    _check_int("k_dim", k_dim, 1)
    _check_int("v_dim", v_dim, 1)
    layout = _layout("kv", kv, thd=cu_seqlens is not None)
    if layout.head_dim != k_dim + v_dim:
        raise ValueError(f"kv's head dim is {layout.head_dim}, but k_dim + v_dim = {k_dim + v_dim}")
    _check_device("k_pos_emb", k_pos_emb, kv.device)
    lead = tuple(kv.shape[:-2])
    if tuple(k_pos_emb.shape) not in (lead + (1, emb_dim), lead + (emb_dim,)):
        raise ValueError(
            f"k_pos_emb must have shape {lead + (1, emb_dim)}; got {tuple(k_pos_emb.shape)}"
        )
    if k_pos_emb.stride(-1) != 1:
        raise ValueError("k_pos_emb must have unit stride in its last dimension")
    emb_stride_s = k_pos_emb.stride(0)
    emb_stride_b = 0 if layout.thd else k_pos_emb.stride(1)
    seq_num = 0
    if cu_seqlens is not None:
        seq_num, cp_rank, cp_size = _check_cu_seqlens(
            "cu_seqlens_kv", cu_seqlens, kv.device, cp_rank, cp_size
        )
    else:
        cp_rank, cp_size = 0, 1
    if position_ids is not None:
        position_ids = _check_position_ids(position_ids, layout, kv.device, kv.shape[:-2])
    min_rows = kv.shape[0] if (cu_seqlens is None and position_ids is None) else 1
    cos_rows, stride_cos, stride_sin = _check_tables(cos, sin, emb_dim, kv.device, min_rows)
    return _KVPlan(
        layout,
        emb_stride_s,
        emb_stride_b,
        cos_rows,
        stride_cos,
        stride_sin,
        seq_num,
        cp_rank,
        cp_size,
        position_ids,
    )


def _kv_meta(emb_dim: int, k_dim: int, v_dim: int, compute: tl.dtype, keep: bool) -> dict:
    return dict(
        K_DIM=k_dim,
        V_DIM=v_dim,
        K_BLOCK=triton.next_power_of_2(k_dim),
        V_BLOCK=triton.next_power_of_2(v_dim),
        EMB_DIM=emb_dim,
        CT=compute,
        KEEP_INTERLEAVED=keep,
        SEQ_BLOCK=_SEQ_BLOCK,
    )


def mla_rope_kv_fwd(
    kv: torch.Tensor,
    k_pos_emb: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    emb_dim: int,
    k_dim: int,
    v_dim: int,
    cu_seqlens_kv: Optional[torch.Tensor] = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    *,
    remove_interleaving: bool = False,
    position_ids: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch the key/value forward kernel outside autograd.

    Args: as :func:`fused_apply_mla_rope_for_kv`.

    Returns:
        Tuple[torch.Tensor, torch.Tensor]: key and value, as :func:`fused_apply_mla_rope_for_kv`.
    """
    _check_flags(False, remove_interleaving=remove_interleaving)
    plan = _plan_kv(
        kv,
        k_pos_emb,
        cos,
        sin,
        emb_dim,
        k_dim,
        v_dim,
        cu_seqlens_kv,
        cp_rank,
        cp_size,
        position_ids,
    )
    lay = plan.layout
    key = kv.new_empty(*kv.shape[:-2], lay.head_num, k_dim + emb_dim)
    value = kv.new_empty(*kv.shape[:-2], lay.head_num, v_dim)
    key_rows = key.view(lay.rows, lay.head_num, k_dim + emb_dim)
    value_rows = value.view(lay.rows, lay.head_num, v_dim)
    _launch(
        _mla_rope_kv_fwd_kernel,
        lay.rows,
        lay.head_num,
        _current_config(),
        kv.device,
        (
            kv,
            k_pos_emb,
            key_rows,
            value_rows,
            cos,
            sin,
            cu_seqlens_kv,
            plan.position_ids,
            lay.head_num,
            lay.batch_size,
            plan.seq_num,
            plan.cos_rows,
            plan.cp_rank,
            plan.cp_size,
            lay.stride_s,
            lay.stride_b,
            lay.stride_h,
            plan.emb_stride_s,
            plan.emb_stride_b,
            key_rows.stride(0),
            key_rows.stride(1),
            value_rows.stride(0),
            value_rows.stride(1),
            plan.stride_cos,
            plan.stride_sin,
        ),
        _kv_meta(
            emb_dim, k_dim, v_dim, _compute_dtype(k_pos_emb.dtype, cos.dtype), remove_interleaving
        ),
    )
    return key, value


def mla_rope_kv_bwd(
    dkey: torch.Tensor,
    dvalue: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    emb_dim: int,
    k_dim: int,
    v_dim: int,
    cu_seqlens_kv: Optional[torch.Tensor] = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    *,
    remove_interleaving: bool = False,
    position_ids: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch the key/value backward kernel outside autograd.

    Args:
        dkey: gradient of the key, [..., head_num, k_dim + emb_dim].
        dvalue: gradient of the value, [..., head_num, v_dim].
        others: as :func:`fused_apply_mla_rope_for_kv`.

    Returns:
        Tuple[torch.Tensor, torch.Tensor]: the gradients of kv ([..., head_num, k_dim + v_dim])
        and of k_pos_emb ([..., 1, emb_dim]), in ``dkey``'s dtype as in megatron-core.
    """
    _check_flags(False, remove_interleaving=remove_interleaving)
    _check_tensor("dkey", dkey, _SUPPORTED_DTYPES)
    _check_tensor("dvalue", dvalue, _SUPPORTED_DTYPES)
    _check_emb_dim(emb_dim)
    _check_int("k_dim", k_dim, 1)
    _check_int("v_dim", v_dim, 1)
    lead = tuple(dkey.shape[:-2])
    if dkey.dim() < 3 or dkey.shape[-1] != k_dim + emb_dim:
        raise ValueError(f"dkey must be [..., head_num, {k_dim + emb_dim}]")
    if tuple(dvalue.shape) != lead + (dkey.shape[-2], v_dim):
        raise ValueError(f"dvalue must have shape {lead + (dkey.shape[-2], v_dim)}")
    _check_device("dvalue", dvalue, dkey.device)
    # Rows are addressed with one stride, so views that do not flatten get copied.
    dkey = dkey if dkey.is_contiguous() else dkey.contiguous()
    dvalue = dvalue if dvalue.is_contiguous() else dvalue.contiguous()
    layout = _layout("dkey", dkey, thd=cu_seqlens_kv is not None)
    heads = layout.head_num
    seq_num = 0
    if cu_seqlens_kv is not None:
        seq_num, cp_rank, cp_size = _check_cu_seqlens(
            "cu_seqlens_kv", cu_seqlens_kv, dkey.device, cp_rank, cp_size
        )
    else:
        cp_rank, cp_size = 0, 1
    if position_ids is not None:
        position_ids = _check_position_ids(position_ids, layout, dkey.device, lead)
    min_rows = dkey.shape[0] if (cu_seqlens_kv is None and position_ids is None) else 1
    cos_rows, stride_cos, stride_sin = _check_tables(cos, sin, emb_dim, dkey.device, min_rows)
    rows = layout.rows
    dkey_rows = dkey.view(rows, heads, k_dim + emb_dim)
    dvalue_rows = dvalue.view(rows, heads, v_dim)
    d_kv = dkey.new_empty(*lead, heads, k_dim + v_dim)
    d_emb = dkey.new_empty(*lead, 1, emb_dim)
    d_kv_rows = d_kv.view(rows, heads, k_dim + v_dim)
    d_emb_rows = d_emb.view(rows, emb_dim)
    meta = _kv_meta(
        emb_dim, k_dim, v_dim, _compute_dtype(dkey.dtype, cos.dtype), remove_interleaving
    )
    _launch(
        _mla_rope_kv_bwd_kernel,
        rows,
        heads,
        _current_config(),
        dkey.device,
        (
            dkey_rows,
            dvalue_rows,
            d_kv_rows,
            d_emb_rows,
            cos,
            sin,
            cu_seqlens_kv,
            position_ids,
            heads,
            layout.batch_size,
            seq_num,
            cos_rows,
            cp_rank,
            cp_size,
            dkey_rows.stride(0),
            dkey_rows.stride(1),
            dvalue_rows.stride(0),
            dvalue_rows.stride(1),
            d_kv_rows.stride(0),
            d_kv_rows.stride(1),
            d_emb_rows.stride(0),
            stride_cos,
            stride_sin,
        ),
        dict(meta, HEAD_UNROLL=_HEAD_UNROLL),
    )
    return d_kv, d_emb


class _FusedMLARoPEKV(torch.autograd.Function):
    """Split kv into key and value and append the rotated k_pos_emb to every head of the key."""

    @staticmethod
    def forward(
        ctx,
        kv,
        k_pos_emb,
        cos,
        sin,
        emb_dim,
        k_dim,
        v_dim,
        cu_seqlens_kv,
        cp_rank,
        cp_size,
        remove_interleaving,
        position_ids,
    ):
        """Return (key, value). Args: as :func:`fused_apply_mla_rope_for_kv`."""
        key, value = mla_rope_kv_fwd(
            kv,
            k_pos_emb,
            cos,
            sin,
            emb_dim,
            k_dim,
            v_dim,
            cu_seqlens_kv,
            cp_rank,
            cp_size,
            remove_interleaving=remove_interleaving,
            position_ids=position_ids,
        )
        ctx.save_for_backward(cos, sin, cu_seqlens_kv, position_ids)
        ctx.args = (emb_dim, k_dim, v_dim, cp_rank, cp_size, remove_interleaving)
        ctx.emb_shape = k_pos_emb.shape
        ctx.config = _PINNED.get()
        return key, value

    @staticmethod
    def backward(ctx, dkey, dvalue):
        """Return the gradients of kv and k_pos_emb."""
        cos, sin, cu_seqlens_kv, position_ids = ctx.saved_tensors
        emb_dim, k_dim, v_dim, cp_rank, cp_size, remove_interleaving = ctx.args
        token = _PINNED.set(ctx.config)
        try:
            d_kv, d_emb = mla_rope_kv_bwd(
                dkey,
                dvalue,
                cos,
                sin,
                emb_dim,
                k_dim,
                v_dim,
                cu_seqlens_kv,
                cp_rank,
                cp_size,
                remove_interleaving=remove_interleaving,
                position_ids=position_ids,
            )
        finally:
            _PINNED.reset(token)
        return (d_kv, d_emb.view(ctx.emb_shape)) + (None,) * 10


def fused_apply_mla_rope_for_kv(
    kv: torch.Tensor,
    k_pos_emb: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    emb_dim: int,
    k_dim: int,
    v_dim: int,
    cu_seqlens_kv: Optional[torch.Tensor] = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    rotary_interleaved: bool = False,
    *,
    remove_interleaving: bool = False,
    position_ids: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Split MLA's kv into key and value and append the rotated ``k_pos_emb`` to each key head.

    Same signature and, wherever megatron-core's output is defined, the same bits as
    megatron-core's function. The gradient of ``k_pos_emb`` sums the heads in head order in fp32
    (megatron-core's order at ``BLOCK_H=1``; its other block sizes sum in other orders). Unchecked
    inputs and clamping: as :func:`fused_apply_mla_rope_for_q`.

    Args:
        kv: [seq_len, batch_size, head_num, k_dim + v_dim] (sbhd) or
            [total_seq_len, head_num, k_dim + v_dim] (thd); unit last stride.
        k_pos_emb: [seq_len, batch_size, 1, emb_dim] or [total_seq_len, 1, emb_dim], its RoPE
            pairs interleaved; unit last stride.
        cos: [max_seq_len, emb_dim] or [max_seq_len, 1, 1, emb_dim].
        sin: like ``cos``.
        emb_dim: RoPE elements, a power of two >= 4.
        k_dim: non-RoPE key elements per head.
        v_dim: value elements per head.
        cu_seqlens_kv: [seq_num + 1] int32/int64 cumulative sequence lengths (thd), or None.
        cp_rank: context-parallel rank (thd only).
        cp_size: context-parallel size (thd only).
        rotary_interleaved: must be False, as in megatron-core.
        remove_interleaving: write the key's rotated pairs interleaved (upstream main's flag).
        position_ids: int32/int64 cos/sin row per token, shaped like ``kv.shape[:-2]``.

    Returns:
        Tuple[torch.Tensor, torch.Tensor]: key [..., head_num, k_dim + emb_dim] and value
        [..., head_num, v_dim], new contiguous tensors in kv's dtype.
    """
    _check_flags(rotary_interleaved, remove_interleaving=remove_interleaving)
    return _FusedMLARoPEKV.apply(
        kv,
        k_pos_emb,
        cos,
        sin,
        emb_dim,
        k_dim,
        v_dim,
        cu_seqlens_kv,
        cp_rank,
        cp_size,
        remove_interleaving,
        position_ids,
    )
