# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The MLA RoPE kernels as functions outside autograd: checked once, launched from the cache.

Each function looks its launch up in :data:`megatron_ext.fusions.mla_rope.launch.LAUNCHES` by
everything that decides it except the data pointers; a miss checks the inputs
(:mod:`megatron_ext.fusions.mla_rope.checks`) and prepares the launch. A hit does no more than build
the key, allocate the outputs and launch. Arguments and contract: as the drop-ins in
:mod:`megatron_ext.fusions.fused_mla_yarn_rope_apply`. Safe inside a CUDA graph once each shape has
been seen outside capture.
"""

from typing import Optional, Tuple

import torch
import triton

from megatron_ext.fusions.mla_rope import checks
from megatron_ext.fusions.mla_rope.kernels import (
    HEAD_UNROLL,
    SEQ_BLOCK,
    mla_rope_kv_bwd_kernel,
    mla_rope_kv_fwd_kernel,
    mla_rope_q_bwd_kernel,
    mla_rope_q_fwd_kernel,
)
from megatron_ext.fusions.mla_rope.launch import LAUNCHES, PINNED, prepare


def _tkey(x: Optional[torch.Tensor]) -> Optional[tuple]:
    """What a launch depends on of a tensor argument, besides its address.

    The address's alignment is included: Triton specialises pointers on 16-byte alignment.
    """
    if x is None:
        return None
    return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15)


def _flat_position_ids(position_ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    # The kernels index position ids by flattened row; a copy only for non-contiguous ids.
    if position_ids is None or position_ids.is_contiguous():
        return position_ids
    return position_ids.contiguous()


# --------------------------------------------------------------------------------------------------
# Query
# --------------------------------------------------------------------------------------------------


def q_launch_args(
    t, cos, sin, qk_head_dim, emb_dim, cu, cp_rank, cp_size, inverse, keep, pos, name
):
    """Check a query launch; return (rows, heads, pointer arguments, other arguments, constexprs).

    The pointer arguments are this call's; everything else holds for every call with the same key.
    """
    checks.check_flags(False, inverse=inverse, remove_interleaving=keep)
    plan = checks.plan_q(t, cos, sin, qk_head_dim, emb_dim, cu, cp_rank, cp_size, pos, name)
    lay = plan.layout
    scalars = (
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
        CT=checks.compute_dtype(t.dtype, cos.dtype),
        INVERSE=inverse,
        KEEP_INTERLEAVED=keep,
        RIGHT_FMA_ON_COS=checks.right_fma_on_cos(t.dtype, cos.dtype, inverse),
        SEQ_BLOCK=SEQ_BLOCK,
    )
    tensors = (t, cos, sin, cu, _flat_position_ids(pos))
    return lay.rows, lay.head_num, tensors, scalars, meta


def run_q(
    kernel, t, cos, sin, qk_head_dim, emb_dim, cu, cp_rank, cp_size, inverse, keep, pos, name="t"
) -> None:
    """Launch a query kernel on ``t`` in place: the cached launch, or check and prepare one."""
    try:
        key = (
            kernel,
            _tkey(t),
            _tkey(cos),
            _tkey(sin),
            _tkey(cu),
            _tkey(pos),
            qk_head_dim,
            emb_dim,
            cp_rank,
            cp_size,
            inverse,
            keep,
            # 8.0 == 8 and True == 1: the types keep such calls on the checked path.
            type(qk_head_dim),
            type(emb_dim),
            type(cp_rank),
            type(cp_size),
            type(inverse),
            type(keep),
            PINNED.get(),
        )
        launch = LAUNCHES.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: the checks say what
        key, launch = None, None
    if launch is None:
        rows, heads, tensors, scalars, meta = q_launch_args(
            t,
            cos,
            sin,
            qk_head_dim,
            emb_dim,
            cu,
            cp_rank,
            cp_size,
            inverse,
            keep,
            pos,
            name,
        )
        launch = prepare(key, kernel, rows, heads, tensors, scalars, meta, t.device, True)
    launch(t, cos, sin, cu, _flat_position_ids(pos))


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
    run_q(
        mla_rope_q_fwd_kernel,
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

    The caller must own ``grad``: nothing else may read it afterwards expecting the old values.

    Args: as :func:`fused_apply_mla_rope_for_q`, with ``grad`` the gradient of its output.

    Returns:
        torch.Tensor: ``grad``, now the gradient of the forward's input.
    """
    run_q(
        mla_rope_q_bwd_kernel,
        grad,
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
        "grad",
    )
    return grad


def mla_rope_q_bwd(
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
    """The query backward into a new tensor; ``grad`` is left as it was.

    Args: as :func:`mla_rope_q_bwd_`.

    Returns:
        torch.Tensor: a new contiguous tensor, the gradient of the forward's input.
    """
    if not isinstance(grad, torch.Tensor):
        checks.check_tensor("grad", grad, checks.SUPPORTED_DTYPES)
    return mla_rope_q_bwd_(
        grad.clone(memory_format=torch.contiguous_format),
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


# --------------------------------------------------------------------------------------------------
# Key and value
# --------------------------------------------------------------------------------------------------


def _kv_meta(emb_dim: int, k_dim: int, v_dim: int, compute, keep: bool) -> dict:
    return dict(
        K_DIM=k_dim,
        V_DIM=v_dim,
        K_BLOCK=triton.next_power_of_2(k_dim),
        V_BLOCK=triton.next_power_of_2(v_dim),
        EMB_DIM=emb_dim,
        CT=compute,
        KEEP_INTERLEAVED=keep,
        SEQ_BLOCK=SEQ_BLOCK,
    )


def _kv_key(kernel, a, b, cos, sin, cu, pos, emb_dim, k_dim, v_dim, cp_rank, cp_size, keep):
    """The launch cache key of a key/value kernel (a, b: kv and k_pos_emb, or dkey and dvalue)."""
    try:
        return (
            kernel,
            _tkey(a),
            _tkey(b),
            _tkey(cos),
            _tkey(sin),
            _tkey(cu),
            _tkey(pos),
            emb_dim,
            k_dim,
            v_dim,
            cp_rank,
            cp_size,
            keep,
            type(emb_dim),
            type(k_dim),
            type(v_dim),
            type(cp_rank),
            type(cp_size),
            type(keep),
            PINNED.get(),
        )
    except (AttributeError, TypeError):  # not tensors: the checks say what
        return None


def _prepare_kv_fwd(
    key, kv, k_pos_emb, cos, sin, emb_dim, k_dim, v_dim, cu, cp_rank, cp_size, keep, pos
):
    checks.check_flags(False, remove_interleaving=keep)
    plan = checks.plan_kv(kv, k_pos_emb, cos, sin, emb_dim, k_dim, v_dim, cu, cp_rank, cp_size, pos)
    lay = plan.layout
    lead = tuple(kv.shape[:-2])
    key_shape = lead + (lay.head_num, k_dim + emb_dim)
    value_shape = lead + (lay.head_num, v_dim)
    # The outputs are new contiguous tensors: their row and head strides are fixed by the shape.
    scalars = (
        lay.head_num,
        lay.batch_size,
        plan.seq_num,
        plan.cos_rows,
        plan.cp_rank,
        plan.cp_size,
        lay.stride_s,
        lay.stride_b,
        lay.stride_h,
        k_pos_emb.stride(0),
        0 if lay.thd else k_pos_emb.stride(1),
        lay.head_num * (k_dim + emb_dim),
        k_dim + emb_dim,
        lay.head_num * v_dim,
        v_dim,
        plan.stride_cos,
        plan.stride_sin,
    )
    meta = _kv_meta(emb_dim, k_dim, v_dim, checks.compute_dtype(k_pos_emb.dtype, cos.dtype), keep)
    outputs = (key_shape, value_shape)
    tensors = (
        kv,
        k_pos_emb,
        kv.new_empty(key_shape),
        kv.new_empty(value_shape),
        cos,
        sin,
        cu,
        _flat_position_ids(pos),
    )
    return prepare(
        key,
        mla_rope_kv_fwd_kernel,
        lay.rows,
        lay.head_num,
        tensors,
        scalars,
        meta,
        kv.device,
        False,
        outputs,
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
    cu, pos, keep = cu_seqlens_kv, position_ids, remove_interleaving
    key = _kv_key(
        mla_rope_kv_fwd_kernel,
        kv,
        k_pos_emb,
        cos,
        sin,
        cu,
        pos,
        emb_dim,
        k_dim,
        v_dim,
        cp_rank,
        cp_size,
        keep,
    )
    launch = LAUNCHES.get(key) if key is not None else None
    if launch is None:
        launch = _prepare_kv_fwd(
            key, kv, k_pos_emb, cos, sin, emb_dim, k_dim, v_dim, cu, cp_rank, cp_size, keep, pos
        )
    key_shape, value_shape = launch.extra
    key_out = kv.new_empty(key_shape)
    value_out = kv.new_empty(value_shape)
    launch(kv, k_pos_emb, key_out, value_out, cos, sin, cu, _flat_position_ids(pos))
    return key_out, value_out


def _prepare_kv_bwd(
    key, dkey, dvalue, cos, sin, emb_dim, k_dim, v_dim, cu, cp_rank, cp_size, keep, pos
):
    checks.check_flags(False, remove_interleaving=keep)
    plan = checks.plan_kv_bwd(
        dkey, dvalue, cos, sin, emb_dim, k_dim, v_dim, cu, cp_rank, cp_size, pos
    )
    lay = plan.layout
    lead = tuple(dkey.shape[:-2])
    heads = lay.head_num
    # Rows are addressed with one stride: dkey and dvalue are launched as contiguous tensors.
    scalars = (
        heads,
        lay.batch_size,
        plan.seq_num,
        plan.cos_rows,
        plan.cp_rank,
        plan.cp_size,
        heads * (k_dim + emb_dim),
        k_dim + emb_dim,
        heads * v_dim,
        v_dim,
        heads * (k_dim + v_dim),
        k_dim + v_dim,
        emb_dim,
        plan.stride_cos,
        plan.stride_sin,
    )
    meta = dict(
        _kv_meta(emb_dim, k_dim, v_dim, checks.compute_dtype(dkey.dtype, cos.dtype), keep),
        HEAD_UNROLL=HEAD_UNROLL,
    )
    outputs = (lead + (heads, k_dim + v_dim), lead + (1, emb_dim))
    tensors = (
        dkey.contiguous(),
        dvalue.contiguous(),
        dkey.new_empty(outputs[0]),
        dkey.new_empty(outputs[1]),
        cos,
        sin,
        cu,
        _flat_position_ids(pos),
    )
    return prepare(
        key,
        mla_rope_kv_bwd_kernel,
        lay.rows,
        heads,
        tensors,
        scalars,
        meta,
        dkey.device,
        False,
        outputs,
    )


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
    cu, pos, keep = cu_seqlens_kv, position_ids, remove_interleaving
    key = _kv_key(
        mla_rope_kv_bwd_kernel,
        dkey,
        dvalue,
        cos,
        sin,
        cu,
        pos,
        emb_dim,
        k_dim,
        v_dim,
        cp_rank,
        cp_size,
        keep,
    )
    launch = LAUNCHES.get(key) if key is not None else None
    if launch is None:
        launch = _prepare_kv_bwd(
            key, dkey, dvalue, cos, sin, emb_dim, k_dim, v_dim, cu, cp_rank, cp_size, keep, pos
        )
    d_kv_shape, d_emb_shape = launch.extra
    d_kv = dkey.new_empty(d_kv_shape)
    d_emb = dkey.new_empty(d_emb_shape)
    launch(
        dkey if dkey.is_contiguous() else dkey.contiguous(),
        dvalue if dvalue.is_contiguous() else dvalue.contiguous(),
        d_kv,
        d_emb,
        cos,
        sin,
        cu,
        _flat_position_ids(pos),
    )
    return d_kv, d_emb
