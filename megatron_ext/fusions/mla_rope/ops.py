# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The MLA RoPE kernels as functions outside autograd: checked once, launched from the cache.

Each function looks its launch up in :data:`megatron_ext.fusions.mla_rope.launch.LAUNCHES` by
everything that decides it except the data pointers; a miss checks the inputs into a launch plan
(:mod:`megatron_ext.fusions.mla_rope.plans`) and prepares the launch from it. A hit does no more
than build the key, allocate the outputs and launch. Arguments and contract: as the drop-ins in
:mod:`megatron_ext.fusions.fused_mla_yarn_rope_apply`. Safe inside a CUDA graph once each shape has
been seen outside capture.
"""

from typing import Optional, Tuple

import torch

from megatron_ext.fusions.mla_rope import pairing, plans, probe
from megatron_ext.fusions.mla_rope.kernels import (
    mla_rope_kv_bwd_kernel,
    mla_rope_kv_fwd_kernel,
    mla_rope_q_bwd_copy_kernel,
    mla_rope_q_bwd_kernel,
    mla_rope_q_fwd_kernel,
)
from megatron_ext.fusions.mla_rope.launch import LAUNCHES, PINNED, prepare
from megatron_ext.fusions.mla_rope.plans import contiguous


def _tkey(x: Optional[torch.Tensor]) -> Optional[tuple]:
    """What a launch depends on of a tensor argument, besides its address.

    The address's alignment is included: Triton specialises pointers on 16-byte alignment.
    """
    if x is None:
        return None
    return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15)


# --------------------------------------------------------------------------------------------------
# Query
# --------------------------------------------------------------------------------------------------


def run_q(
    kernel, t, cos, sin, qk_head_dim, emb_dim, cu, cp_rank, cp_size, inverse, keep, pos, name="t"
) -> torch.Tensor:
    """Launch a query kernel on ``t``: the cached launch, or check, plan and prepare one.

    Returns:
        torch.Tensor: ``t`` (rotated in place), or the copy kernel's new tensor.
    """
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
            pairing.forced(),
        )
        launch = LAUNCHES.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: the checks say what
        key, launch = None, None
    plan = launch.plan if launch is not None else None
    if plan is None:
        plan = plans.plan_q(
            kernel,
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
        kind = "q_fwd" if kernel is mla_rope_q_fwd_kernel else "q_bwd"
        plan = plan.with_pairing(probe.pairing_for(kind, t.dtype, cos.dtype, t.device, inverse))
    out = [t.new_empty(shape) for shape in plan.outputs]
    tensors = (t, *out, cos, sin, cu, contiguous(pos))
    if launch is None:
        launch = prepare(key, plan, tensors, t.device)
    launch(*tensors)
    return out[0] if out else t


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
    """The query backward into a new tensor in one pass; ``grad`` is only read.

    Each head's first ``qk_head_dim`` elements are copied and its RoPE elements rotated back by
    one kernel, with the bits of :func:`mla_rope_q_bwd_`. ``grad`` may share elements between its
    indices (an expanded gradient); one without unit last stride is read through a copy.

    Args: as :func:`mla_rope_q_bwd_`.

    Returns:
        torch.Tensor: a new contiguous tensor, the gradient of the forward's input.
    """
    if isinstance(grad, torch.Tensor) and grad.dim() and grad.stride(-1) != 1 and grad.numel():
        grad = grad.contiguous()
    return run_q(
        mla_rope_q_bwd_copy_kernel,
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


# --------------------------------------------------------------------------------------------------
# Key and value
# --------------------------------------------------------------------------------------------------


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
            pairing.forced(),
        )
    except (AttributeError, TypeError):  # not tensors: the checks say what
        return None


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
    plan = launch.plan if launch is not None else None
    if plan is None:
        plan = plans.plan_kv_fwd(
            kv, k_pos_emb, cos, sin, emb_dim, k_dim, v_dim, cu, cp_rank, cp_size, keep, pos
        )
        plan = plan.with_pairing(
            probe.pairing_for("kv_fwd", k_pos_emb.dtype, cos.dtype, kv.device, False)
        )
    key_out, value_out = (kv.new_empty(shape) for shape in plan.outputs)
    tensors = (kv, k_pos_emb, key_out, value_out, cos, sin, cu, contiguous(pos))
    if launch is None:
        launch = prepare(key, plan, tensors, kv.device)
    launch(*tensors)
    return key_out, value_out


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
    plan = launch.plan if launch is not None else None
    if plan is None:
        plan = plans.plan_kv_bwd(
            dkey, dvalue, cos, sin, emb_dim, k_dim, v_dim, cu, cp_rank, cp_size, keep, pos
        )
        plan = plan.with_pairing(
            probe.pairing_for("kv_bwd", dkey.dtype, cos.dtype, dkey.device, False)
        )
    d_kv, d_emb = (dkey.new_empty(shape) for shape in plan.outputs)
    tensors = (contiguous(dkey), contiguous(dvalue), d_kv, d_emb, cos, sin, cu, contiguous(pos))
    if launch is None:
        launch = prepare(key, plan, tensors, dkey.device)
    launch(*tensors)
    return d_kv, d_emb
