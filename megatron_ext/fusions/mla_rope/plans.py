# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Launch plans of the MLA RoPE kernels: one checked call shape, its kernel arguments by name.

A :class:`LaunchPlan` is built once per call shape, on a launch-cache miss, from inputs that
:mod:`megatron_ext.fusions.mla_rope.checks` accepted. It holds everything a launch needs except the
data pointers: the kernel, the grid and every other kernel argument under its parameter name, so
only the kernel's signature fixes their order (a plan whose names differ from the signature is
refused when it is built). :class:`megatron_ext.fusions.mla_rope.launch.CachedLaunch` consumes it.
"""

import dataclasses
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
import triton
import triton.language as tl

from megatron_ext.fusions.mla_rope import checks, pairing
from megatron_ext.fusions.mla_rope.kernels import (
    HEAD_UNROLL,
    SEQ_BLOCK,
    mla_rope_kv_bwd_kernel,
    mla_rope_kv_fwd_kernel,
    mla_rope_q_bwd_copy_kernel,
    mla_rope_q_fwd_kernel,
)

# The pointer parameters every kernel ends its pointer list with: tables, then sequence indices.
_TABLE_POINTERS = 4  # cos, sin, cu_seqlens, position_ids


@dataclass(frozen=True, eq=False)
class LaunchPlan:
    """One checked launch of one kernel, without its data pointers.

    Args:
        kernel: the Triton JIT kernel.
        rows: programs along grid axis 0 (tokens).
        head_num: heads; grid axis 1 has ``cdiv(head_num, BLOCK_H)`` programs.
        pointers: how many leading kernel parameters are tensors (passed per call).
        args: every other kernel parameter but ``BLOCK_H``, by name.
        in_place: whether the kernel writes its first pointer argument.
        outputs: shapes of the new tensors a call allocates and passes among its pointers.
        options: Triton compile options of the launch (FP fusion off for an unfused pairing).
    """

    kernel: Any
    rows: int
    head_num: int
    pointers: int
    args: Mapping[str, Any]
    in_place: bool
    outputs: Tuple[Tuple[int, ...], ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        names = tuple(self.kernel.arg_names)
        expected = set(names[self.pointers :]) - {"BLOCK_H"}
        if set(self.args) != expected or "BLOCK_H" not in names:
            raise RuntimeError(
                f"launch plan of {self.kernel.__name__} names {sorted(self.args)}; the kernel "
                f"takes {sorted(expected)} after its {self.pointers} pointers"
            )

    def with_pairing(self, fma: pairing.Pairing) -> "LaunchPlan":
        """This plan with the rotation's products paired as ``fma`` says."""
        return dataclasses.replace(
            self, args={**self.args, **fma.constexprs()}, options=fma.options()
        )

    def grid(self, block_h: int) -> Optional[Tuple[int, int, int]]:
        """The launch grid at ``block_h`` heads per program, or None for an empty launch."""
        if not (self.rows and self.head_num):
            return None
        return (self.rows, triton.cdiv(self.head_num, block_h), 1)

    def tail(self, block_h: int) -> tuple:
        """Every argument after the pointers, in the kernel's order, ``BLOCK_H`` included."""
        values = dict(self.args, BLOCK_H=block_h)
        return tuple(values[name] for name in self.kernel.arg_names[self.pointers :])

    def constexprs(self) -> Dict[str, Any]:
        """The constexpr arguments (each value compiles another variant)."""
        return {
            name: self.args[name] for name in _constexpr_names(self.kernel) if name in self.args
        }


@functools.lru_cache(maxsize=None)
def _constexpr_names(kernel) -> Tuple[str, ...]:
    # Read from the Python function's annotations: the compiled and the interpreted kernel both
    # keep it as ``fn``.
    params = inspect.signature(kernel.fn).parameters.values()
    return tuple(p.name for p in params if p.annotation is tl.constexpr)


def _sequence_args(checked: checks.Checked) -> Dict[str, Any]:
    lay = checked.layout
    return dict(
        head_num=lay.head_num,
        batch_size=lay.batch_size,
        seq_num=checked.seq_num,
        n_rope_rows=checked.cos_rows,
        cp_rank=checked.cp_rank,
        cp_size=checked.cp_size,
        stride_cos=checked.stride_cos,
        stride_sin=checked.stride_sin,
        SEQ_BLOCK=SEQ_BLOCK,
    )


def plan_q(
    kernel, t, cos, sin, qk_head_dim, emb_dim, cu, cp_rank, cp_size, inverse, keep, pos, name
) -> LaunchPlan:
    """Check a query launch and plan it.

    Args:
        kernel: ``mla_rope_q_fwd_kernel`` or ``mla_rope_q_bwd_kernel`` (in place on ``t``), or
            ``mla_rope_q_bwd_copy_kernel`` (``t`` only read; a new contiguous tensor written).
        t: the query, or the gradient of the forward's output.
        name: what error messages call ``t``.
        others: as :func:`megatron_ext.fusions.fused_mla_yarn_rope_apply.
            fused_apply_mla_rope_for_q` (``keep`` is ``remove_interleaving``).

    Returns:
        LaunchPlan: pointers ``t`` (then the output, for the copy kernel), cos, sin, cu, pos.
    """
    copy = kernel is mla_rope_q_bwd_copy_kernel
    checked = checks.check_q(
        t,
        cos,
        sin,
        qk_head_dim,
        emb_dim,
        cu,
        cp_rank,
        cp_size,
        pos,
        name,
        in_place=not copy,
        inverse=inverse,
        remove_interleaving=keep,
    )
    lay = checked.layout
    args = dict(
        **_sequence_args(checked),
        stride_s=lay.stride_s,
        stride_b=lay.stride_b,
        stride_h=lay.stride_h,
        rope_offset=qk_head_dim,
        EMB_DIM=emb_dim,
        CT=checks.compute_dtype(t.dtype, cos.dtype),
        INVERSE=inverse,
        KEEP_INTERLEAVED=keep,
        # Replaced by the pairing chosen for the installed Triton (LaunchPlan.with_pairing).
        **pairing.DEFAULTS["q_fwd" if kernel is mla_rope_q_fwd_kernel else "q_bwd"].constexprs(),
    )
    if copy:
        args.update(
            stride_out_row=lay.head_num * lay.head_dim,
            stride_out_h=lay.head_dim,
            QK_BLOCK=triton.next_power_of_2(max(1, qk_head_dim)),
        )
        return LaunchPlan(
            kernel, lay.rows, lay.head_num, 2 + _TABLE_POINTERS, args, False, (tuple(t.shape),)
        )
    return LaunchPlan(kernel, lay.rows, lay.head_num, 1 + _TABLE_POINTERS, args, True)


def _kv_dims(emb_dim: int, k_dim: int, v_dim: int, compute, keep: bool) -> Dict[str, Any]:
    return dict(
        K_DIM=k_dim,
        V_DIM=v_dim,
        K_BLOCK=triton.next_power_of_2(k_dim),
        V_BLOCK=triton.next_power_of_2(v_dim),
        EMB_DIM=emb_dim,
        CT=compute,
        KEEP_INTERLEAVED=keep,
    )


def _kv_pairing(kind: str) -> Dict[str, int]:
    # Replaced by the pairing chosen for the installed Triton (LaunchPlan.with_pairing).
    return pairing.DEFAULTS[kind].constexprs()


def plan_kv_fwd(
    kv, k_pos_emb, cos, sin, emb_dim, k_dim, v_dim, cu, cp_rank, cp_size, keep, pos
) -> LaunchPlan:
    """Check and plan the key/value forward; pointers kv, k_pos_emb, key, value, cos, sin, cu, pos.

    The outputs are new contiguous tensors: their row and head strides follow from the shape.
    """
    checked = checks.check_kv(
        kv, k_pos_emb, cos, sin, emb_dim, k_dim, v_dim, cu, cp_rank, cp_size, pos, keep
    )
    lay = checked.layout
    heads, lead = lay.head_num, tuple(kv.shape[:-2])
    args = dict(
        **_sequence_args(checked),
        **_kv_dims(emb_dim, k_dim, v_dim, checks.compute_dtype(k_pos_emb.dtype, cos.dtype), keep),
        stride_kv_s=lay.stride_s,
        stride_kv_b=lay.stride_b,
        stride_kv_h=lay.stride_h,
        stride_emb_s=k_pos_emb.stride(0),
        stride_emb_b=0 if lay.thd else k_pos_emb.stride(1),
        stride_key_row=heads * (k_dim + emb_dim),
        stride_key_h=k_dim + emb_dim,
        stride_value_row=heads * v_dim,
        stride_value_h=v_dim,
        **_kv_pairing("kv_fwd"),
    )
    outputs = (lead + (heads, k_dim + emb_dim), lead + (heads, v_dim))
    return LaunchPlan(
        mla_rope_kv_fwd_kernel, lay.rows, heads, 4 + _TABLE_POINTERS, args, False, outputs
    )


def plan_kv_bwd(
    dkey, dvalue, cos, sin, emb_dim, k_dim, v_dim, cu, cp_rank, cp_size, keep, pos
) -> LaunchPlan:
    """Check and plan the key/value backward; pointers dkey, dvalue, d_kv, d_emb, cos, sin, cu,
    pos, with dkey and dvalue launched as contiguous tensors (rows addressed with one stride)."""
    checked = checks.check_kv_bwd(
        dkey, dvalue, cos, sin, emb_dim, k_dim, v_dim, cu, cp_rank, cp_size, pos, keep
    )
    lay = checked.layout
    heads, lead = lay.head_num, tuple(dkey.shape[:-2])
    args = dict(
        **_sequence_args(checked),
        **_kv_dims(emb_dim, k_dim, v_dim, checks.compute_dtype(dkey.dtype, cos.dtype), keep),
        stride_dkey_row=heads * (k_dim + emb_dim),
        stride_dkey_h=k_dim + emb_dim,
        stride_dvalue_row=heads * v_dim,
        stride_dvalue_h=v_dim,
        stride_dkv_row=heads * (k_dim + v_dim),
        stride_dkv_h=k_dim + v_dim,
        stride_demb_row=emb_dim,
        HEAD_UNROLL=min(HEAD_UNROLL, triton.next_power_of_2(heads)),
        **_kv_pairing("kv_bwd"),
    )
    outputs = (lead + (heads, k_dim + v_dim), lead + (1, emb_dim))
    return LaunchPlan(
        mla_rope_kv_bwd_kernel, lay.rows, heads, 4 + _TABLE_POINTERS, args, False, outputs
    )


def contiguous(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``x`` with unit-stride rows (the kernels index position ids and kv gradients by flat row)."""
    if x is None or x.is_contiguous():
        return x
    return x.contiguous()
