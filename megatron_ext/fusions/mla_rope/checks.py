# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Input checks of the MLA RoPE kernels.

Everything here runs once per (shapes, strides, dtypes, devices, flags): the launch plans built
from what it returns (:mod:`megatron_ext.fusions.mla_rope.plans`) are cached, so these checks may
format messages freely. Nothing here reads a device tensor's values (no host sync); what can only be
checked that way is listed in :func:`megatron_ext.fusions.fused_mla_yarn_rope_apply.
fused_apply_mla_rope_for_q`.
"""

import os
from dataclasses import dataclass
from typing import Sequence, Tuple

import torch
import triton.language as tl

# Triton decides at decoration time whether kernels run in its CPU interpreter.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(name: str, x, dtypes: Sequence[torch.dtype]) -> None:
    """Raise TypeError unless ``x`` is a tensor of one of ``dtypes``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {names}; got {x.dtype}")


def check_int(name: str, value, minimum: int) -> int:
    """Raise unless ``value`` is an int (not a bool) of at least ``minimum``; return it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_emb_dim(emb_dim) -> int:
    """Raise unless ``emb_dim`` is a power of two >= 4 (it is a block size)."""
    check_int("emb_dim", emb_dim, 4)
    if emb_dim & (emb_dim - 1):
        raise ValueError(f"emb_dim must be a power of two >= 4 (a block size), got {emb_dim}")
    return emb_dim


def check_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    """Raise ValueError unless ``x`` is on ``device``."""
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, but the input is on {device}")


def check_runnable(name: str, x: torch.Tensor) -> None:
    """Raise ValueError for a device the kernels cannot run on, saying how to fix it.

    CUDA tensors run compiled; CPU tensors only in Triton's interpreter, which must be chosen
    before Triton is imported (Triton would otherwise fail with "0 active drivers").
    """
    if x.device.type == "cuda":
        return
    if x.device.type == "cpu" and INTERPRETED:
        return
    if x.device.type == "cpu":
        raise ValueError(
            f"{name} is on the CPU; megatron_ext's MLA RoPE kernels run on CUDA devices. Move the "
            "tensors to a GPU (.cuda()), or set TRITON_INTERPRET=1 in the environment before "
            "Python starts to run them in Triton's CPU interpreter (slow; meant for tests)"
        )
    raise ValueError(
        f"{name} is on {x.device}; megatron_ext's MLA RoPE kernels run on CUDA devices (or on the "
        "CPU with TRITON_INTERPRET=1)"
    )


def check_no_overlap(name: str, x: torch.Tensor) -> None:
    """Raise ValueError if two elements of ``x`` share memory (stride 0, overlapping views).

    The in-place kernels would rotate such elements several times, with a result that depends on
    the launch config. Sufficient test: with the dims of size > 1 sorted by stride, each stride
    must exceed the span of the dims before it. A few exotic non-overlapping layouts (dims whose
    strides interleave) fail it too and are refused: copy them with ``.contiguous()``.
    """
    span = 1
    for stride, size in sorted((st, sz) for sz, st in zip(x.shape, x.stride()) if sz > 1):
        if stride < span:
            raise ValueError(
                f"{name} (shape {tuple(x.shape)}, strides {tuple(x.stride())}) has elements that "
                "share memory (an expanded or overlapping view); an in-place kernel would rotate "
                "them more than once. Pass a tensor that owns its elements (e.g. .contiguous())"
            )
        span += stride * (size - 1)


def check_tables(
    cos, sin, emb_dim: int, device: torch.device, min_rows: int
) -> Tuple[int, int, int]:
    """Check cos/sin ([rows, emb_dim] or [rows, 1, ..., 1, emb_dim]); return rows, row strides."""
    check_tensor("cos", cos, SUPPORTED_DTYPES)
    check_tensor("sin", sin, SUPPORTED_DTYPES)
    if cos.dtype != sin.dtype:
        raise TypeError(f"cos and sin must have the same dtype; got {cos.dtype} and {sin.dtype}")
    for name, table in (("cos", cos), ("sin", sin)):
        check_device(name, table, device)
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


def compute_dtype(a: torch.dtype, b: torch.dtype) -> tl.dtype:
    """Triton's promotion for a binary op between q (or k_pos_emb) and cos/sin.

    megatron-core's kernels get it implicitly: fp32 if either is fp32, else fp16 if either is fp16
    (bf16 with fp16 computes in fp16), else bf16.
    """
    if torch.float32 in (a, b):
        return tl.float32
    if torch.float16 in (a, b):
        return tl.float16
    return tl.bfloat16


@dataclass(frozen=True)
class Layout:
    """How rows (tokens) and heads of a [s, b, h, d] or [t, h, d] tensor are addressed."""

    rows: int
    batch_size: int
    head_num: int
    head_dim: int
    stride_s: int
    stride_b: int
    stride_h: int
    thd: bool


def layout(name: str, x: torch.Tensor, thd: bool) -> Layout:
    """The :class:`Layout` of ``x`` (sbhd, or thd when cu_seqlens are given)."""
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
    # An empty tensor's strides are arbitrary (autograd hands expanded zeros) and never used.
    if x.stride(-1) != 1 and x.numel() > 0:
        raise ValueError(f"{name} must have unit stride in its last dimension")
    return Layout(rows, batch, heads, dim, *strides, thd)


def check_cu_seqlens(
    name: str, cu_seqlens, device: torch.device, cp_rank, cp_size
) -> Tuple[int, int, int]:
    """Check thd's cumulative lengths and the context-parallel rank; return seq_num, rank, size."""
    check_tensor(name, cu_seqlens, INDEX_DTYPES)
    check_device(name, cu_seqlens, device)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be 1-D with seq_num + 1 >= 2 entries")
    if not cu_seqlens.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    check_int("cp_size", cp_size, 1)
    check_int("cp_rank", cp_rank, 0)
    if cp_rank >= cp_size:
        raise ValueError(f"cp_rank must be < cp_size; got cp_rank={cp_rank}, cp_size={cp_size}")
    return cu_seqlens.numel() - 1, cp_rank, cp_size


def check_cp_sequence_lengths(lengths: Sequence[int], cp_size: int) -> None:
    """Raise ValueError unless every (padded) thd sequence splits into 2 * cp_size equal chunks.

    Context parallelism gives rank r chunks r and 2 * cp_size - 1 - r of each sequence; the kernels
    derive positions from that split. A length that is not a multiple of 2 * cp_size (cp 2 and a
    sequence of 6: local length 3) gives wrong positions, and the kernels cannot see it without
    reading ``cu_seqlens`` on the host. Call this where the lengths are on the host already.

    Args:
        lengths: the sequence lengths, as ``cu_seqlens_*_padded`` (or ``cu_seqlens_*``) describe
            them over the whole sequence (all context-parallel ranks together).
        cp_size: context-parallel size.
    """
    if cp_size <= 1:
        return
    bad = [(i, n) for i, n in enumerate(lengths) if n % (2 * cp_size)]
    if bad:
        i, n = bad[0]
        raise ValueError(
            f"context parallelism of size {cp_size} needs every thd sequence length to be a "
            f"multiple of 2 * cp_size = {2 * cp_size}; sequence {i} has length {n} ({len(bad)} of "
            f"{len(lengths)} sequences do not). Pad the sequences (cu_seqlens_*_padded)"
        )


def check_position_ids(position_ids, lay: Layout, device: torch.device, shape) -> None:
    """Check ``position_ids`` (one int32/int64 entry per token, shaped ``shape``)."""
    check_tensor("position_ids", position_ids, INDEX_DTYPES)
    check_device("position_ids", position_ids, device)
    if tuple(position_ids.shape) != tuple(shape):
        raise ValueError(
            f"position_ids must have shape {tuple(shape)} (one entry per token); "
            f"got {tuple(position_ids.shape)}"
        )


def check_flags(rotary_interleaved, **flags) -> None:
    """Refuse ``rotary_interleaved`` (as megatron-core does) and non-bool flags."""
    if rotary_interleaved:
        raise ValueError("rotary_interleaved=True is not supported (megatron-core neither)")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


@dataclass(frozen=True)
class Checked:
    """Checked inputs: rows x heads of one tensor, and the table and sequence arguments."""

    layout: Layout
    cos_rows: int
    stride_cos: int
    stride_sin: int
    seq_num: int
    cp_rank: int
    cp_size: int


def _check_common(
    name, x, lay, cos, sin, emb_dim, cu_seqlens, cu_name, cp_rank, cp_size, position_ids
) -> Checked:
    check_runnable(name, x)
    seq_num = 0
    if cu_seqlens is not None:
        seq_num, cp_rank, cp_size = check_cu_seqlens(
            cu_name, cu_seqlens, x.device, cp_rank, cp_size
        )
    else:
        # sbhd ignores context parallelism: the caller passes tables already sliced for its rank.
        cp_rank, cp_size = 0, 1
    if position_ids is not None:
        check_position_ids(position_ids, lay, x.device, x.shape[:-2])
    # Only sbhd without position_ids knows the largest position on the host: seq_len - 1.
    min_rows = x.shape[0] if (cu_seqlens is None and position_ids is None) else 1
    cos_rows, stride_cos, stride_sin = check_tables(cos, sin, emb_dim, x.device, min_rows)
    return Checked(lay, cos_rows, stride_cos, stride_sin, seq_num, cp_rank, cp_size)


def check_q(
    t,
    cos,
    sin,
    qk_head_dim,
    emb_dim,
    cu_seqlens,
    cp_rank,
    cp_size,
    position_ids,
    name,
    in_place=True,
    **flags,
) -> Checked:
    """Check a query kernel's inputs and its bool ``flags`` (``t`` is rotated in place, or only
    read when not ``in_place``: its elements may then share memory)."""
    check_flags(False, **flags)
    check_tensor(name, t, SUPPORTED_DTYPES)
    check_int("qk_head_dim", qk_head_dim, 0)
    check_emb_dim(emb_dim)
    lay = layout(name, t, thd=cu_seqlens is not None)
    if lay.head_dim != qk_head_dim + emb_dim:
        raise ValueError(
            f"{name}'s head dim is {lay.head_dim}, but qk_head_dim + emb_dim = "
            f"{qk_head_dim} + {emb_dim}"
        )
    if in_place:
        check_no_overlap(name, t)
    return _check_common(
        name, t, lay, cos, sin, emb_dim, cu_seqlens, "cu_seqlens_q", cp_rank, cp_size, position_ids
    )


def check_kv(
    kv, k_pos_emb, cos, sin, emb_dim, k_dim, v_dim, cu_seqlens, cp_rank, cp_size, position_ids, keep
) -> Checked:
    """Check the key/value forward's inputs and its ``remove_interleaving`` flag (``keep``)."""
    check_flags(False, remove_interleaving=keep)
    check_tensor("kv", kv, SUPPORTED_DTYPES)
    check_tensor("k_pos_emb", k_pos_emb, SUPPORTED_DTYPES)
    check_emb_dim(emb_dim)
    check_int("k_dim", k_dim, 1)
    check_int("v_dim", v_dim, 1)
    lay = layout("kv", kv, thd=cu_seqlens is not None)
    if lay.head_dim != k_dim + v_dim:
        raise ValueError(f"kv's head dim is {lay.head_dim}, but k_dim + v_dim = {k_dim + v_dim}")
    check_device("k_pos_emb", k_pos_emb, kv.device)
    lead = tuple(kv.shape[:-2])
    if tuple(k_pos_emb.shape) not in (lead + (1, emb_dim), lead + (emb_dim,)):
        raise ValueError(
            f"k_pos_emb must have shape {lead + (1, emb_dim)}; got {tuple(k_pos_emb.shape)}"
        )
    if k_pos_emb.stride(-1) != 1:
        raise ValueError("k_pos_emb must have unit stride in its last dimension")
    return _check_common(
        "kv",
        kv,
        lay,
        cos,
        sin,
        emb_dim,
        cu_seqlens,
        "cu_seqlens_kv",
        cp_rank,
        cp_size,
        position_ids,
    )


def check_kv_bwd(
    dkey, dvalue, cos, sin, emb_dim, k_dim, v_dim, cu_seqlens, cp_rank, cp_size, position_ids, keep
) -> Checked:
    """Check the key/value backward's inputs (row-major copies of dkey/dvalue are launched)."""
    check_flags(False, remove_interleaving=keep)
    check_tensor("dkey", dkey, SUPPORTED_DTYPES)
    check_tensor("dvalue", dvalue, SUPPORTED_DTYPES)
    check_emb_dim(emb_dim)
    check_int("k_dim", k_dim, 1)
    check_int("v_dim", v_dim, 1)
    lead = tuple(dkey.shape[:-2])
    if dkey.dim() < 3 or dkey.shape[-1] != k_dim + emb_dim:
        raise ValueError(f"dkey must be [..., head_num, {k_dim + emb_dim}]")
    if tuple(dvalue.shape) != lead + (dkey.shape[-2], v_dim):
        raise ValueError(f"dvalue must have shape {lead + (dkey.shape[-2], v_dim)}")
    check_device("dvalue", dvalue, dkey.device)
    # Rows are addressed with one stride: the launch uses contiguous copies where needed.
    lay = layout("dkey", dkey.contiguous(), thd=cu_seqlens is not None)
    return _check_common(
        "dkey",
        dkey,
        lay,
        cos,
        sin,
        emb_dim,
        cu_seqlens,
        "cu_seqlens_kv",
        cp_rank,
        cp_size,
        position_ids,
    )
