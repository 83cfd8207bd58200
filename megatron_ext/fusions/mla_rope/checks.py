# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The checks of an MLA RoPE call, and the plan a checked call gives.

A call is one kernel, the tensor(s) it reads and one argument record (:class:`QueryRope` or
:class:`KeyValueRope`, built once by the caller). :func:`plan` checks it and returns a
:class:`RopePlan`: the kernel's arguments by name, everything a launch needs but the data
pointers and the launch config. It runs once per call layout (shapes, strides, dtypes, devices,
flags): :mod:`megatron_ext.fusions.mla_rope.launch` prepares its launch and caches it, so the
checks may format messages freely. Bad input raises TypeError or ValueError before anything is
launched. Nothing here reads a device tensor's values (no host sync); what can only be checked
that way is listed in
:func:`megatron_ext.fusions.fused_mla_yarn_rope_apply.fused_apply_mla_rope_for_q`.

The generic tensor checks come from :mod:`megatron_ext.fusions.tensor_checks`.
"""

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from megatron_ext import internals
from megatron_ext.fusions.launch_plans import LaunchPlan
from megatron_ext.fusions.mla_rope import pairing
from megatron_ext.fusions.mla_rope.kernels import (
    HEAD_UNROLL,
    SEQ_BLOCK,
    mla_rope_kv_bwd_kernel,
    mla_rope_kv_fwd_kernel,
    mla_rope_q_bwd_copy_kernel,
    mla_rope_q_bwd_kernel,
    mla_rope_q_fwd_kernel,
)
from megatron_ext.fusions.tensor_checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_device,
    check_disjoint,
    check_int,
    check_no_self_overlap,
    check_runnable,
    check_tensor,
    span_bytes,
)

# What the device check's message calls the kernels.
KERNELS_NAME = "megatron_ext's MLA RoPE"


def check_emb_dim(emb_dim) -> int:
    """Raise unless ``emb_dim`` is a power of two >= 4 (it is a block size)."""
    check_int("emb_dim", emb_dim, 4)
    if emb_dim & (emb_dim - 1):
        raise ValueError(f"emb_dim must be a power of two >= 4 (a block size), got {emb_dim}")
    return emb_dim


def check_tables(
    cos, sin, emb_dim: int, device: torch.device, min_rows: int
) -> Tuple[int, int, int]:
    """Check cos/sin ([rows, emb_dim] or [rows, 1, ..., 1, emb_dim]); return rows, row strides."""
    check_tensor("cos", cos, FLOAT_DTYPES)
    check_tensor("sin", sin, FLOAT_DTYPES)
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


def check_layout(name: str, x: torch.Tensor, thd: bool) -> Layout:
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


def check_position_ids(position_ids, device: torch.device, shape) -> None:
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


# --------------------------------------------------------------------------------------------------
# The argument records of a call
# --------------------------------------------------------------------------------------------------


class QueryRope(NamedTuple):
    """The arguments of a query RoPE call besides the tensor it rotates; built once per call.

    The tensors come first: the launch cache key reads them by position. Meanings: as
    :func:`megatron_ext.fusions.fused_mla_yarn_rope_apply.fused_apply_mla_rope_for_q`.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    cu_seqlens: Optional[torch.Tensor]
    position_ids: Optional[torch.Tensor]
    qk_head_dim: int
    emb_dim: int
    cp_rank: int
    cp_size: int
    inverse: bool
    remove_interleaving: bool


class KeyValueRope(NamedTuple):
    """The arguments of a key/value RoPE call besides its two tensors (kv and k_pos_emb, or the
    gradients of key and value); built once per call, tensors first as in :class:`QueryRope`.
    Meanings: as :func:`megatron_ext.fusions.fused_mla_yarn_rope_apply.fused_apply_mla_rope_for_kv`.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    cu_seqlens: Optional[torch.Tensor]
    position_ids: Optional[torch.Tensor]
    emb_dim: int
    k_dim: int
    v_dim: int
    cp_rank: int
    cp_size: int
    remove_interleaving: bool


# The leading tensor fields of both records.
RECORD_TENSORS = 4


# --------------------------------------------------------------------------------------------------
# Checks of a call
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Checked:
    """A checked call: rows x heads of its tensor, and the table and sequence arguments."""

    layout: Layout
    cos_rows: int
    stride_cos: int
    stride_sin: int
    seq_num: int
    cp_rank: int
    cp_size: int


def _check_sequences(name: str, x, layout: Layout, rope, cu_name: str) -> Checked:
    """The checks the query and key/value calls share: device, cu_seqlens, positions, tables."""
    check_runnable(KERNELS_NAME, name, x)
    seq_num, cp_rank, cp_size = 0, rope.cp_rank, rope.cp_size
    if rope.cu_seqlens is not None:
        seq_num, cp_rank, cp_size = check_cu_seqlens(
            cu_name, rope.cu_seqlens, x.device, cp_rank, cp_size
        )
    else:
        # sbhd ignores context parallelism: the caller passes tables already sliced for its rank.
        cp_rank, cp_size = 0, 1
    if rope.position_ids is not None:
        check_position_ids(rope.position_ids, x.device, x.shape[:-2])
    # Only sbhd without position_ids knows the largest position on the host: seq_len - 1.
    min_rows = x.shape[0] if (rope.cu_seqlens is None and rope.position_ids is None) else 1
    cos_rows, stride_cos, stride_sin = check_tables(
        rope.cos, rope.sin, rope.emb_dim, x.device, min_rows
    )
    return Checked(layout, cos_rows, stride_cos, stride_sin, seq_num, cp_rank, cp_size)


def check_query(name: str, x, rope: QueryRope, in_place: bool = True) -> Checked:
    """Check a query kernel's call: ``x`` is rotated in place, or only read when not
    ``in_place`` (its elements may then share memory); ``name`` is what messages call it."""
    check_flags(False, inverse=rope.inverse, remove_interleaving=rope.remove_interleaving)
    check_tensor(name, x, FLOAT_DTYPES)
    check_int("qk_head_dim", rope.qk_head_dim, 0)
    check_emb_dim(rope.emb_dim)
    layout = check_layout(name, x, thd=rope.cu_seqlens is not None)
    if layout.head_dim != rope.qk_head_dim + rope.emb_dim:
        raise ValueError(
            f"{name}'s head dim is {layout.head_dim}, but qk_head_dim + emb_dim = "
            f"{rope.qk_head_dim} + {rope.emb_dim}"
        )
    if in_place:
        check_no_self_overlap(name, x)
    checked = _check_sequences(name, x, layout, rope, "cu_seqlens_q")
    if in_place:
        check_in_place_disjoint(name, x, rope)
    return checked


def check_in_place_disjoint(name: str, x: torch.Tensor, rope: QueryRope) -> None:
    """Raise ValueError if the query an in-place kernel rotates shares memory with a tensor the
    kernel reads (cos, sin, cu_seqlens, position_ids): its programs would read what others
    write, an answer that depends on the schedule. Checked on every call (the layout cannot
    tell; a cached layout compares the data pointers with its :attr:`RopePlan.read_spans`).

    Args:
        name: what the message calls ``x``.
        x: the tensor the kernel writes in place.
        rope: the call's argument record.

    Raises:
        ValueError: naming the tensor ``x`` meets.
    """
    read = (
        ("cos", rope.cos),
        ("sin", rope.sin),
        ("cu_seqlens_q", rope.cu_seqlens),
        ("position_ids", rope.position_ids),
    )
    check_disjoint(name, x, read)


def read_spans_of(x: torch.Tensor, rope: QueryRope) -> Tuple[int, ...]:
    """The byte spans (:func:`~megatron_ext.fusions.tensor_checks.span_bytes`) of an in-place
    query and of the tensors its kernel reads, in the order cos, sin, cu_seqlens, position_ids.

    Args:
        x: the query rotated in place.
        rope: the call's argument record.

    Returns:
        Tuple[int, ...]: five spans (0 for an absent or empty tensor).
    """
    read = (x, rope.cos, rope.sin, rope.cu_seqlens, rope.position_ids)
    return tuple(span_bytes(t) for t in read)


def _check_key_value_dims(rope: KeyValueRope, *tensors: Tuple[str, Any]) -> None:
    check_flags(False, remove_interleaving=rope.remove_interleaving)
    for name, x in tensors:
        check_tensor(name, x, FLOAT_DTYPES)
    check_emb_dim(rope.emb_dim)
    check_int("k_dim", rope.k_dim, 1)
    check_int("v_dim", rope.v_dim, 1)


def check_key_value(kv, k_pos_emb, rope: KeyValueRope) -> Checked:
    """Check the key/value forward's call."""
    _check_key_value_dims(rope, ("kv", kv), ("k_pos_emb", k_pos_emb))
    emb_dim, k_dim, v_dim = rope.emb_dim, rope.k_dim, rope.v_dim
    layout = check_layout("kv", kv, thd=rope.cu_seqlens is not None)
    if layout.head_dim != k_dim + v_dim:
        raise ValueError(f"kv's head dim is {layout.head_dim}, but k_dim + v_dim = {k_dim + v_dim}")
    check_device("k_pos_emb", k_pos_emb, kv.device)
    lead = tuple(kv.shape[:-2])
    if tuple(k_pos_emb.shape) not in (lead + (1, emb_dim), lead + (emb_dim,)):
        raise ValueError(
            f"k_pos_emb must have shape {lead + (1, emb_dim)}; got {tuple(k_pos_emb.shape)}"
        )
    if k_pos_emb.stride(-1) != 1:
        raise ValueError("k_pos_emb must have unit stride in its last dimension")
    return _check_sequences("kv", kv, layout, rope, "cu_seqlens_kv")


def check_key_value_grad(dkey, dvalue, rope: KeyValueRope) -> Checked:
    """Check the key/value backward's call (row-major copies of dkey/dvalue are launched)."""
    _check_key_value_dims(rope, ("dkey", dkey), ("dvalue", dvalue))
    emb_dim, k_dim, v_dim = rope.emb_dim, rope.k_dim, rope.v_dim
    lead = tuple(dkey.shape[:-2])
    if dkey.dim() < 3 or dkey.shape[-1] != k_dim + emb_dim:
        raise ValueError(f"dkey must be [..., head_num, {k_dim + emb_dim}]")
    if tuple(dvalue.shape) != lead + (dkey.shape[-2], v_dim):
        raise ValueError(f"dvalue must have shape {lead + (dkey.shape[-2], v_dim)}")
    check_device("dvalue", dvalue, dkey.device)
    # Rows are addressed with one stride: the launch uses contiguous copies where needed.
    layout = check_layout("dkey", dkey.contiguous(), thd=rope.cu_seqlens is not None)
    return _check_sequences("dkey", dkey, layout, rope, "cu_seqlens_kv")


# --------------------------------------------------------------------------------------------------
# The launch plan of a checked call
# --------------------------------------------------------------------------------------------------

# The pointer parameters every kernel ends its pointer list with: tables, then sequence indices.
_TABLE_POINTERS = RECORD_TENSORS  # cos, sin, cu_seqlens, position_ids


@dataclass(frozen=True, eq=False)
class RopePlan(LaunchPlan):
    """One checked call of one RoPE kernel: its arguments but the data pointers, the outputs a
    call allocates, and (once configured) its prepared launch.

    Args:
        kernel: the Triton JIT kernel.
        rows: programs along grid axis 0 (tokens).
        head_num: heads; grid axis 1 has ``cdiv(head_num, BLOCK_H)`` programs.
        pointers: how many leading kernel parameters are tensors (passed per call).
        args: every other kernel parameter but ``BLOCK_H``, by name.
        in_place: whether the kernel writes its first pointer argument.
        outputs: shapes of the new tensors a call allocates and passes among its pointers.
        contiguous_inputs: whether the tensors read are launched as contiguous copies (rows
            addressed with one stride).
        options: Triton compile options of the launch (FP fusion off for an unfused pairing).
        launch: the configured launch (:func:`megatron_ext.fusions.mla_rope.launch.configure`),
            called with the pointers; None until configured.
        read_spans: for an in-place kernel, the byte spans of the tensor it writes and of cos,
            sin, cu_seqlens and position_ids (:func:`read_spans_of`), so that a cached call
            tests them for shared memory with data pointers only; empty otherwise.
    """

    kernel: Any
    rows: int
    head_num: int
    pointers: int
    args: Mapping[str, Any]
    in_place: bool
    outputs: Tuple[Tuple[int, ...], ...] = ()
    contiguous_inputs: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)
    launch: Optional[LaunchPlan] = None
    read_spans: Tuple[int, ...] = ()

    def __post_init__(self):
        names = internals.triton_kernel_arg_names(self.kernel)
        if names is None:  # unknown to this Triton: the JIT launch names what is wrong
            return
        expected = set(names[self.pointers :]) - {"BLOCK_H"}
        if set(self.args) != expected or "BLOCK_H" not in names:
            raise RuntimeError(
                f"launch plan of {self.kernel.__name__} names {sorted(self.args)}; the kernel "
                f"takes {sorted(expected)} after its {self.pointers} pointers"
            )

    def __call__(self, *pointers: Optional[torch.Tensor]) -> None:
        """Launch with these pointer arguments (tensors or None, in the kernel's order)."""
        self.launch(*pointers)

    def with_pairing(self, fma: pairing.Pairing) -> "RopePlan":
        """This plan with the rotation's products paired as ``fma`` says."""
        return dataclasses.replace(
            self, args={**self.args, **fma.kernel_args}, options=fma.compile_options
        )

    def grid(self, block_h: int) -> Optional[Tuple[int, int, int]]:
        """The launch grid at ``block_h`` heads per program, or None for an empty launch."""
        if not (self.rows and self.head_num):
            return None
        return (self.rows, triton.cdiv(self.head_num, block_h), 1)

    def constexprs(self) -> Dict[str, Any]:
        """The constexpr arguments (each value compiles another variant; every argument where
        the kernel's annotations cannot be read)."""
        names = _constexpr_names(self.kernel)
        if names is None:
            return dict(self.args)
        return {name: self.args[name] for name in names if name in self.args}


@functools.lru_cache(maxsize=None)
def _constexpr_names(kernel) -> Optional[Tuple[str, ...]]:
    # The Python function's annotations: the compiled and the interpreted kernel both keep it.
    return internals.triton_kernel_constexpr_names(kernel)


# Which pairing each kernel's rotation uses (pairing.KINDS); the copy kernel is a query backward.
PAIRING_KIND = {
    mla_rope_q_fwd_kernel: "q_fwd",
    mla_rope_q_bwd_kernel: "q_bwd",
    mla_rope_q_bwd_copy_kernel: "q_bwd",
    mla_rope_kv_fwd_kernel: "kv_fwd",
    mla_rope_kv_bwd_kernel: "kv_bwd",
}


def _sequence_args(checked: Checked, kernel) -> Dict[str, Any]:
    """The arguments every kernel takes: heads, sequences, tables and the default pairing (which
    :meth:`RopePlan.with_pairing` replaces by the one chosen for the installed Triton)."""
    return dict(
        head_num=checked.layout.head_num,
        batch_size=checked.layout.batch_size,
        seq_num=checked.seq_num,
        n_rope_rows=checked.cos_rows,
        cp_rank=checked.cp_rank,
        cp_size=checked.cp_size,
        stride_cos=checked.stride_cos,
        stride_sin=checked.stride_sin,
        SEQ_BLOCK=SEQ_BLOCK,
        **pairing.DEFAULTS[PAIRING_KIND[kernel]].kernel_args,
    )


def plan_query(kernel, x, rope: QueryRope, name: str = "t") -> RopePlan:
    """Check a query launch and plan it.

    Args:
        kernel: ``mla_rope_q_fwd_kernel`` or ``mla_rope_q_bwd_kernel`` (in place on ``x``), or
            ``mla_rope_q_bwd_copy_kernel`` (``x`` only read; a new contiguous tensor written).
        x: the query, or the gradient of the forward's output.
        rope: the call's other arguments.
        name: what error messages call ``x``.

    Returns:
        RopePlan: pointers ``x`` (then the output, for the copy kernel), cos, sin, cu_seqlens,
        position_ids.
    """
    copy = kernel is mla_rope_q_bwd_copy_kernel
    checked = check_query(name, x, rope, in_place=not copy)
    layout = checked.layout
    args = dict(
        **_sequence_args(checked, kernel),
        stride_s=layout.stride_s,
        stride_b=layout.stride_b,
        stride_h=layout.stride_h,
        rope_offset=rope.qk_head_dim,
        EMB_DIM=rope.emb_dim,
        COMPUTE_DTYPE=compute_dtype(x.dtype, rope.cos.dtype),
        INVERSE=rope.inverse,
        REMOVE_INTERLEAVING=rope.remove_interleaving,
    )
    if not copy:
        plan = RopePlan(kernel, layout.rows, layout.head_num, 1 + _TABLE_POINTERS, args, True)
        return dataclasses.replace(plan, read_spans=read_spans_of(x, rope))
    args.update(
        stride_out_row=layout.head_num * layout.head_dim,
        stride_out_h=layout.head_dim,
        QK_BLOCK=triton.next_power_of_2(max(1, rope.qk_head_dim)),
    )
    outputs = (tuple(x.shape),)
    return RopePlan(kernel, layout.rows, layout.head_num, 2 + _TABLE_POINTERS, args, False, outputs)


def _key_value_dims(rope: KeyValueRope, compute) -> Dict[str, Any]:
    return dict(
        K_DIM=rope.k_dim,
        V_DIM=rope.v_dim,
        K_BLOCK=triton.next_power_of_2(rope.k_dim),
        V_BLOCK=triton.next_power_of_2(rope.v_dim),
        EMB_DIM=rope.emb_dim,
        COMPUTE_DTYPE=compute,
        REMOVE_INTERLEAVING=rope.remove_interleaving,
    )


def plan_key_value(kv, k_pos_emb, rope: KeyValueRope) -> RopePlan:
    """Check and plan the key/value forward; pointers kv, k_pos_emb, key, value, cos, sin,
    cu_seqlens, position_ids. The outputs are new contiguous tensors: their row and head strides
    follow from the shape."""
    checked = check_key_value(kv, k_pos_emb, rope)
    layout, emb_dim, k_dim, v_dim = checked.layout, rope.emb_dim, rope.k_dim, rope.v_dim
    heads, lead = layout.head_num, tuple(kv.shape[:-2])
    args = dict(
        **_sequence_args(checked, mla_rope_kv_fwd_kernel),
        **_key_value_dims(rope, compute_dtype(k_pos_emb.dtype, rope.cos.dtype)),
        stride_kv_s=layout.stride_s,
        stride_kv_b=layout.stride_b,
        stride_kv_h=layout.stride_h,
        stride_emb_s=k_pos_emb.stride(0),
        stride_emb_b=0 if layout.thd else k_pos_emb.stride(1),
        stride_key_row=heads * (k_dim + emb_dim),
        stride_key_h=k_dim + emb_dim,
        stride_value_row=heads * v_dim,
        stride_value_h=v_dim,
    )
    outputs = (lead + (heads, k_dim + emb_dim), lead + (heads, v_dim))
    return RopePlan(
        mla_rope_kv_fwd_kernel, layout.rows, heads, 4 + _TABLE_POINTERS, args, False, outputs
    )


def plan_key_value_grad(dkey, dvalue, rope: KeyValueRope) -> RopePlan:
    """Check and plan the key/value backward; pointers dkey, dvalue, d_kv, d_emb, cos, sin,
    cu_seqlens, position_ids, with dkey and dvalue launched as contiguous tensors."""
    checked = check_key_value_grad(dkey, dvalue, rope)
    layout, emb_dim, k_dim, v_dim = checked.layout, rope.emb_dim, rope.k_dim, rope.v_dim
    heads, lead = layout.head_num, tuple(dkey.shape[:-2])
    args = dict(
        **_sequence_args(checked, mla_rope_kv_bwd_kernel),
        **_key_value_dims(rope, compute_dtype(dkey.dtype, rope.cos.dtype)),
        stride_dkey_row=heads * (k_dim + emb_dim),
        stride_dkey_h=k_dim + emb_dim,
        stride_dvalue_row=heads * v_dim,
        stride_dvalue_h=v_dim,
        stride_dkv_row=heads * (k_dim + v_dim),
        stride_dkv_h=k_dim + v_dim,
        stride_demb_row=emb_dim,
        HEAD_UNROLL=min(HEAD_UNROLL, triton.next_power_of_2(heads)),
    )
    outputs = (lead + (heads, k_dim + v_dim), lead + (1, emb_dim))
    return RopePlan(
        mla_rope_kv_bwd_kernel, layout.rows, heads, 4 + _TABLE_POINTERS, args, False, outputs, True
    )


def plan(kernel, x, y, rope, name: str = "t") -> RopePlan:
    """Check a call of ``kernel`` and plan its launch (default pairing).

    Args:
        kernel: one of the five kernels of :mod:`megatron_ext.fusions.mla_rope.kernels`.
        x: the tensor a query kernel rotates, kv or dkey.
        y: None for a query kernel, else k_pos_emb or dvalue.
        rope: the call's :class:`QueryRope` or :class:`KeyValueRope`.
        name: what a query kernel's messages call ``x``.

    Returns:
        RopePlan: the plan.
    """
    if kernel is mla_rope_kv_fwd_kernel:
        return plan_key_value(x, y, rope)
    if kernel is mla_rope_kv_bwd_kernel:
        return plan_key_value_grad(x, y, rope)
    return plan_query(kernel, x, rope, name)
