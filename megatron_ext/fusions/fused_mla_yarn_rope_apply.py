# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Contiguous-load Triton kernels that apply YaRN RoPE to MLA's query, key and value.

Drop-ins for megatron-core's ``fused_apply_mla_rope_for_q`` / ``fused_apply_mla_rope_for_kv``:
same signatures and, wherever megatron-core's output is defined, the same bits at every launch
config. What differs, and why:

* The query forward reads each head's RoPE elements with one contiguous load and splits even/odd
  in registers; the backward writes them with one contiguous store (megatron-core: two stride-2
  loads or stores, each transaction half used). The FMAs are paired as megatron-core's kernels
  compile them, which is what keeps the bits equal at every ``BLOCK_H``/``num_warps``.
* Heads are masked by their global index (megatron-core's mask writes past the last head when
  ``head_num % BLOCK_H != 0``, Megatron-LM #7103); the in-place kernels are race-free
  (megatron-core's query backward is not, PR #5963).
* Autograd is told about the in-place write (#5412), a gradient shared with another branch is
  never overwritten (:func:`megatron_ext.internals.owns_gradient`), overlapping inputs, double
  backward and torch.func are refused with clear errors.
* Host cost: each call builds its argument record once (:class:`~megatron_ext.fusions.mla_rope.
  checks.QueryRope`, :class:`~megatron_ext.fusions.mla_rope.checks.KeyValueRope`) and hands it
  to :func:`megatron_ext.fusions.mla_rope.launch.run`, the one run path of every kernel: a cached
  call runs Python in this file, that one and its plan's prepared launch
  (:class:`megatron_ext.fusions.direct_launch.PreparedLaunch`) only; a call shape's first call
  also checks it (:mod:`megatron_ext.fusions.mla_rope.checks`).
  ``scripts/trace_rope_call_path.py`` prints the path; a unit test bounds it.
* Keyword-only extras of upstream Megatron-LM main: ``inverse``, ``remove_interleaving``,
  ``position_ids``.

Below the drop-ins, the same kernels outside autograd (``mla_rope_q_fwd_`` and the others), for
callers that manage gradients themselves (benchmarks, inference).

Graph safety: every function here can be captured in a CUDA graph once its call shape has been
seen outside capture (the first call of a shape tunes the launch config).
"""

from typing import Optional, Tuple

import torch

from megatron_ext import internals
from megatron_ext.fusions.mla_rope.checks import (
    RECORD_TENSORS,
    KeyValueRope,
    QueryRope,
    check_flags,
)
from megatron_ext.fusions.mla_rope.kernels import (
    mla_rope_kv_bwd_kernel,
    mla_rope_kv_fwd_kernel,
    mla_rope_q_bwd_copy_kernel,
    mla_rope_q_bwd_kernel,
    mla_rope_q_fwd_kernel,
)
from megatron_ext.fusions.mla_rope.launch import (  # noqa: F401 (re-exported)
    AUTOTUNE_CONFIGS,
    BLOCK_H_CHOICES,
    PINNED,
    KernelConfig,
    autotuned_configs,
    clear_autotune_cache,
    pinned_kernel_config,
    run,
)
from megatron_ext.internals import EXCLUSIVE_GRADIENT_REFERENCES
from megatron_ext.internals import is_functorch_wrapped_tensor as _is_functorch_wrapped
from megatron_ext.internals import tensor_base, tensor_is_view

__all__ = [
    "KernelConfig",
    "AUTOTUNE_CONFIGS",
    "BLOCK_H_CHOICES",
    "pinned_kernel_config",
    "clear_autotune_cache",
    "autotuned_configs",
    "fused_apply_mla_rope_for_q",
    "fused_apply_mla_rope_for_kv",
    "mla_rope_q_fwd_",
    "mla_rope_q_bwd_",
    "mla_rope_q_bwd",
    "mla_rope_kv_fwd",
    "mla_rope_kv_bwd",
]


# Builds an argument record from a tuple of its fields in the record's order without a Python
# frame (a named tuple's own constructor is a Python function: about 0.4 us per call).
_record = tuple.__new__


def _refuse_functorch(*tensors) -> None:
    """torch.func transforms would hand the kernels tensors without storage: say so instead."""
    for x in tensors:
        if isinstance(x, torch.Tensor) and _is_functorch_wrapped(x):
            raise TypeError(
                "megatron_ext's MLA RoPE kernels do not support torch.func transforms (vmap, "
                "grad, jvp); call them on plain tensors"
            )


def _refuse_double_backward(*grads) -> None:
    """The backward kernels are not differentiable: refuse a graph of the backward
    (``create_graph=True``) before returning a gradient whose own derivative would be wrong."""
    if torch.is_grad_enabled() and any(g is not None and g.requires_grad for g in grads):
        raise RuntimeError(
            "megatron_ext's MLA RoPE backward is not differentiable: a backward with "
            "create_graph=True (double backward, gradient penalties) through it is not supported"
        )


def _save_record(ctx, rope) -> None:
    """Keep ``rope`` for the backward: its tensors through ``save_for_backward`` (so an in-place
    change of cos or sin before the backward fails loudly), the rest as they are."""
    ctx.save_for_backward(*rope[:RECORD_TENSORS])
    ctx.scalars = rope[RECORD_TENSORS:]
    ctx.config = PINNED.get()


def _query_grad(grad: torch.Tensor, rope: QueryRope, in_place: bool) -> torch.Tensor:
    """The query backward: in place on ``grad``, or into a new tensor (``grad`` only read; one
    without unit last stride is read through a copy)."""
    if in_place:
        run(mla_rope_q_bwd_kernel, grad, None, rope, "grad")
        return grad
    if isinstance(grad, torch.Tensor) and grad.dim() and grad.stride(-1) != 1 and grad.numel():
        grad = grad.contiguous()
    return run(mla_rope_q_bwd_copy_kernel, grad, None, rope, "grad")[0]


# --------------------------------------------------------------------------------------------------
# Query
# --------------------------------------------------------------------------------------------------


class _FusedMLARoPEQ(torch.autograd.Function):
    """In-place RoPE on the query's last emb_dim elements."""

    @staticmethod
    def forward(ctx, t, rope):
        """Rotate ``t`` in place and return it. Args: ``t`` and the call's :class:`QueryRope`."""
        # Decided before the write: afterwards the creation metadata still answers the same, but
        # a refusal must never arrive once t is rotated. Only a view can be refused.
        behind_autograd = tensor_is_view(t) and internals.autograd_refuses_in_place(t)
        run(mla_rope_q_fwd_kernel, t, None, rope)
        if behind_autograd:
            # A view autograd cannot rebase onto this Function: Transformer Engine's linears
            # return their output as a view made inside their own Function. Rotate behind
            # autograd's back as megatron-core does; the version bump still makes a backward
            # that saved t (or anything sharing its storage) fail loudly.
            torch.autograd.graph.increment_version(t)
        else:
            # Autograd must know t changed: anything that saved it for backward then fails
            # loudly instead of silently using rotated values.
            ctx.mark_dirty(t)
        _save_record(ctx, rope)
        return t

    @staticmethod
    def backward(ctx, grad):
        """Rotate ``grad`` back: in place when :func:`megatron_ext.internals.owns_gradient` says
        it is ours, else into a new tensor."""
        python_refs = internals.python_references(grad)  # first, as the calibration's probe
        _refuse_double_backward(grad)
        rope = QueryRope(*ctx.saved_tensors, *ctx.scalars)
        in_place = internals.owns_gradient(grad, python_refs)
        token = PINNED.set(ctx.config)
        try:
            grad = _query_grad(grad, rope, in_place)
        finally:
            PINNED.reset(token)
        return grad, None


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

    The RoPE elements are read as interleaved (even, odd) pairs and written as
    [rotated even | rotated odd], or interleaved again with ``remove_interleaving``. A leaf that
    requires grad, or a view of one (which no in-place op may modify; megatron-core rotates its
    data behind autograd's back), gets a rotated copy: megatron-core's output and leaf gradient,
    the leaf unchanged. A view autograd refuses to modify in place (one made inside a custom
    Function, such as Transformer Engine's linear layers return) is rotated in place with autograd
    told only of the version change, as megatron-core does. The backward rotates the incoming
    gradient in place only when autograd hands it over exclusively; otherwise (a caller's
    ``backward(g)``, a second branch) one kernel reads it and writes the result into a new tensor.

    Not checked, since each needs a device-to-host sync: that ``cu_seqlens_q`` is non-decreasing,
    that cos/sin cover every position, and that with ``cp_size > 1`` every sequence length is a
    multiple of ``2 * cp_size`` (otherwise positions are wrong; callers with host lengths use
    :func:`megatron_ext.fusions.mla_rope.checks.check_cp_sequence_lengths`, as the MLA module
    does). Positions outside the tables are clamped to their first or last row, never read out of
    bounds; thd rows past ``cu_seqlens_q[-1]`` (graph padding) use row 0.

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
        inverse: rotate by -theta. It undoes a forward only when both calls pass
            ``remove_interleaving=True`` (otherwise each call de-interleaves its output).
        remove_interleaving: write the rotated pairs back interleaved (upstream main's flag).
        position_ids: int32/int64 cos/sin row per token, shaped like ``t.shape[:-2]`` ([s, b] in
            sbhd, [t] in thd); replaces the sbhd row / thd sequence (and context-parallel)
            position.

    Returns:
        torch.Tensor: ``t``, modified in place (a rotated copy for a leaf that requires grad or a
        view of one).
    """
    if rotary_interleaved:
        check_flags(rotary_interleaved)
    _refuse_functorch(t, cos, sin)
    rope = _record(
        QueryRope,
        (
            cos,
            sin,
            cu_seqlens_q,
            position_ids,
            qk_head_dim,
            emb_dim,
            cp_rank,
            cp_size,
            inverse,
            remove_interleaving,
        ),
    )
    if not (torch.is_grad_enabled() and isinstance(t, torch.Tensor) and t.requires_grad):
        # Nothing to record for autograd: launch directly, and bump t's version as any in-place
        # op does, so a backward that saved t fails loudly instead of using rotated values.
        run(mla_rope_q_fwd_kernel, t, None, rope)
        torch.autograd.graph.increment_version(t)
        return t
    if t.device.type not in EXCLUSIVE_GRADIENT_REFERENCES:
        internals.calibrate_gradient_ownership(t.device)
    base = tensor_base(t)
    if t.is_leaf or (base is not None and base.is_leaf and base.requires_grad):
        # No in-place op may modify a leaf that requires grad, or a view of one (autograd refuses
        # it, after the write); megatron-core rotates their data behind autograd's back. Rotating
        # a copy gives the same output and leaf gradient, and leaves the caller's leaf as it was.
        # (A view made inside a custom Function has a base that does not require grad.)
        t = t.clone()
    return _FusedMLARoPEQ.apply(t, rope)


# --------------------------------------------------------------------------------------------------
# Key and value
# --------------------------------------------------------------------------------------------------


class _FusedMLARoPEKV(torch.autograd.Function):
    """Split kv into key and value and append the rotated k_pos_emb to every head of the key."""

    @staticmethod
    def forward(ctx, kv, k_pos_emb, rope):
        """Return (key, value). Args: kv, k_pos_emb and the call's :class:`KeyValueRope`."""
        key, value = run(mla_rope_kv_fwd_kernel, kv, k_pos_emb, rope)
        _save_record(ctx, rope)
        ctx.emb_shape = k_pos_emb.shape
        return key, value

    @staticmethod
    def backward(ctx, dkey, dvalue):
        """Return the gradients of kv and k_pos_emb (new tensors; dkey and dvalue are only read)."""
        _refuse_double_backward(dkey, dvalue)
        rope = KeyValueRope(*ctx.saved_tensors, *ctx.scalars)
        token = PINNED.set(ctx.config)
        try:
            d_kv, d_emb = run(mla_rope_kv_bwd_kernel, dkey, dvalue, rope)
        finally:
            PINNED.reset(token)
        return d_kv, d_emb.view(ctx.emb_shape), None


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

    The gradient of ``k_pos_emb`` sums the heads in head order in fp32 (megatron-core's order at
    ``BLOCK_H=1``). Unchecked inputs and clamping: as :func:`fused_apply_mla_rope_for_q`.

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
    if rotary_interleaved:
        check_flags(rotary_interleaved)
    _refuse_functorch(kv, k_pos_emb, cos, sin)
    rope = _record(
        KeyValueRope,
        (
            cos,
            sin,
            cu_seqlens_kv,
            position_ids,
            emb_dim,
            k_dim,
            v_dim,
            cp_rank,
            cp_size,
            remove_interleaving,
        ),
    )
    grads = isinstance(kv, torch.Tensor) and isinstance(k_pos_emb, torch.Tensor)
    if not (torch.is_grad_enabled() and grads and (kv.requires_grad or k_pos_emb.requires_grad)):
        key, value = run(mla_rope_kv_fwd_kernel, kv, k_pos_emb, rope)
        return key, value
    return _FusedMLARoPEKV.apply(kv, k_pos_emb, rope)


# --------------------------------------------------------------------------------------------------
# The kernels outside autograd
# --------------------------------------------------------------------------------------------------


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
    rope = _record(
        QueryRope,
        (
            cos,
            sin,
            cu_seqlens_q,
            position_ids,
            qk_head_dim,
            emb_dim,
            cp_rank,
            cp_size,
            inverse,
            remove_interleaving,
        ),
    )
    run(mla_rope_q_fwd_kernel, t, None, rope)
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
    rope = _record(
        QueryRope,
        (
            cos,
            sin,
            cu_seqlens_q,
            position_ids,
            qk_head_dim,
            emb_dim,
            cp_rank,
            cp_size,
            inverse,
            remove_interleaving,
        ),
    )
    return _query_grad(grad, rope, in_place=True)


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
    rope = _record(
        QueryRope,
        (
            cos,
            sin,
            cu_seqlens_q,
            position_ids,
            qk_head_dim,
            emb_dim,
            cp_rank,
            cp_size,
            inverse,
            remove_interleaving,
        ),
    )
    return _query_grad(grad, rope, in_place=False)


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
    rope = _record(
        KeyValueRope,
        (
            cos,
            sin,
            cu_seqlens_kv,
            position_ids,
            emb_dim,
            k_dim,
            v_dim,
            cp_rank,
            cp_size,
            remove_interleaving,
        ),
    )
    key, value = run(mla_rope_kv_fwd_kernel, kv, k_pos_emb, rope)
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
    rope = _record(
        KeyValueRope,
        (
            cos,
            sin,
            cu_seqlens_kv,
            position_ids,
            emb_dim,
            k_dim,
            v_dim,
            cp_rank,
            cp_size,
            remove_interleaving,
        ),
    )
    d_kv, d_emb = run(mla_rope_kv_bwd_kernel, dkey, dvalue, rope)
    return d_kv, d_emb
