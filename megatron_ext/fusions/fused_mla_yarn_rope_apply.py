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
* The in-place kernels are race-free (see :mod:`megatron_ext.fusions.mla_rope.kernels`);
  megatron-core's query backward is not. The query backward never modifies a gradient that autograd
  does not hand over exclusively (:func:`_owns`); megatron-core's rotates it in place regardless.
* Inputs whose elements overlap (expanded views) are refused, as torch's in-place ops refuse them.
* A launch costs a few microseconds of host time: everything but the data pointers is checked and
  computed once per (shapes, strides, dtypes, devices, flags) and the compiled kernel is launched
  directly (:mod:`megatron_ext.fusions.mla_rope.launch`).
* ``head_num`` is a runtime argument (one compiled kernel serves every head count), ``cos``/``sin``
  may have any row stride, the sbhd sequence and batch strides are independent, and in thd the
  sequence lookup is a vector scan rather than one load per sequence.
* Keyword-only extras from upstream Megatron-LM main: ``inverse`` (rotate by ``-theta``),
  ``remove_interleaving`` (write the result back in the input's interleaved layout) and
  ``position_ids`` (explicit cos/sin rows per token).

Launch configs: :func:`pinned_kernel_config`, :data:`AUTOTUNE_CONFIGS` and the tuner in
:mod:`megatron_ext.fusions.mla_rope.launch`.

Graph safety: every function here is safe to capture in a CUDA graph (no host sync), once each
shape has been seen outside capture (the first call of a shape tunes the launch config).
"""

import sys
from typing import Dict, List, Optional, Tuple

import torch

from megatron_ext.fusions.mla_rope import checks
from megatron_ext.fusions.mla_rope.launch import (  # noqa: F401 (re-exported)
    AUTOTUNE_CONFIGS,
    BLOCK_H_CHOICES,
    PINNED,
    KernelConfig,
    autotuned_configs,
    clear_autotune_cache,
    pinned_kernel_config,
)
from megatron_ext.fusions.mla_rope.ops import (  # noqa: F401 (re-exported)
    mla_rope_kv_bwd,
    mla_rope_kv_fwd,
    mla_rope_q_bwd,
    mla_rope_q_bwd_,
    mla_rope_q_fwd_,
)

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


def _refuse_functorch(*tensors) -> None:
    """torch.func transforms would hand the kernels tensors without storage: say so instead."""
    for x in tensors:
        if isinstance(x, torch.Tensor) and _is_functorch_wrapped(x):
            raise TypeError(
                "megatron_ext's MLA RoPE kernels do not support torch.func transforms (vmap, "
                "grad, jvp); call them on plain tensors"
            )


_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _refuse_double_backward(*grads) -> None:
    """The backward kernels are not differentiable: refuse a graph of the backward
    (``create_graph=True``) before returning a gradient whose own derivative would be wrong."""
    if torch.is_grad_enabled() and any(g is not None and g.requires_grad for g in grads):
        raise RuntimeError(
            "megatron_ext's MLA RoPE backward is not differentiable: a backward with "
            "create_graph=True (double backward, gradient penalties) through it is not supported"
        )


def _owns(grad: torch.Tensor, python_refs: int) -> bool:
    """Whether a gradient handed to a backward is ours alone to overwrite.

    True only when nothing else can see its memory: no more references to it than a gradient
    that autograd hands over exclusively has on this device (measured once per device type by
    :func:`_calibrate_ownership`): Python references (a hook that stashed it adds one), C++
    references to its tensor (a caller's ``backward(g)`` or a second branch of the graph holds
    one) and references to its storage (a live view of it, or it a view of another); and its
    storage allocated by torch (foreign memory wrapped from NumPy or DLPack is not resizable),
    contiguous (its elements do not overlap), not requiring grad (a double backward may save it).
    """
    exclusive = _EXCLUSIVE_REFS.get(grad.device.type)
    if exclusive is None or grad.requires_grad or grad._base is not None:
        return False
    if python_refs > exclusive[0] or grad._use_count() > exclusive[1]:
        return False
    if not grad.is_contiguous():
        return False
    storage = grad.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) <= exclusive[2] and storage.resizable()


class _ExclusiveRefsProbe(torch.autograd.Function):
    """Counts the references to a gradient that autograd hands over exclusively."""

    seen: List[Tuple[int, int, int]] = []

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        python_refs = sys.getrefcount(grad)  # counted as _FusedMLARoPEQ.backward counts
        storage = grad.untyped_storage()
        storage_uses = torch._C._storage_Use_Count(storage._cdata)
        _ExclusiveRefsProbe.seen.append((python_refs, grad._use_count(), storage_uses))
        return grad


# Device type -> (Python refs, tensor uses, storage uses) of an exclusively held gradient.
_EXCLUSIVE_REFS: Dict[str, Tuple[int, int, int]] = {}


def _calibrate_ownership(device: torch.device) -> None:
    """Measure what an exclusively held gradient looks like on ``device``'s type, once.

    The counts depend on the interpreter, torch and the autograd engine's path for the device
    (CPU backward runs on the calling thread, CUDA backward on a device thread), so each device
    type is measured with a gradient that comes fresh from ``* 2``'s backward, as in a training
    step. Not measured during CUDA-graph capture (a backward there would be captured too): until
    measured, the backward copies the gradient.
    """
    if not (hasattr(torch.Tensor, "_use_count") and hasattr(torch._C, "_storage_Use_Count")):
        return
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    with torch.enable_grad():
        x = torch.zeros(2, device=device, requires_grad=True)
        (_ExclusiveRefsProbe.apply(x) * 2).sum().backward()
    _EXCLUSIVE_REFS[device.type] = _ExclusiveRefsProbe.seen.pop()


class _FusedMLARoPEQ(torch.autograd.Function):
    """In-place RoPE on the query's last emb_dim elements."""

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
        mla_rope_q_fwd_(
            t,
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
        # Autograd must know t changed: anything that saved it for backward then fails loudly
        # instead of silently using rotated values.
        ctx.mark_dirty(t)
        ctx.save_for_backward(cos, sin, cu_seqlens_q, position_ids)
        ctx.args = (qk_head_dim, emb_dim, cp_rank, cp_size, inverse, remove_interleaving)
        ctx.config = PINNED.get()
        return t

    @staticmethod
    def backward(ctx, grad):
        """Rotate ``grad`` back: in place when :func:`_owns` says it is ours, else into a copy."""
        _refuse_double_backward(grad)
        cos, sin, cu_seqlens_q, position_ids = ctx.saved_tensors
        qk_head_dim, emb_dim, cp_rank, cp_size, inverse, keep = ctx.args
        python_refs = sys.getrefcount(grad)  # first, as in _ExclusiveRefsProbe.backward
        if not _owns(grad, python_refs):
            grad = grad.clone(memory_format=torch.contiguous_format)
        token = PINNED.set(ctx.config)
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
                remove_interleaving=keep,
                position_ids=position_ids,
            )
        finally:
            PINNED.reset(token)
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

    Unlike megatron-core's, the function marks ``t`` as modified in place for autograd, so an op
    that saved ``t`` for its backward fails loudly there instead of using rotated values
    (Megatron-LM issue #5412). For a leaf that requires grad, which no in-place op may modify, it
    rotates and returns a copy: the same output and leaf gradient as megatron-core's, whose kernel
    rotates the leaf's data behind autograd's back, while the leaf keeps its values. A ``t`` whose
    elements overlap (an expanded view) is refused. A backward with ``create_graph=True`` through it
    raises instead of giving a wrong second derivative; torch.func transforms are refused. The
    backward rotates the incoming gradient in place only when autograd hands it over exclusively
    (see :func:`_owns`: in a training step the gradient comes fresh from the next op); otherwise,
    such as a gradient that autograd also passes to another branch or a caller's ``backward(g)``,
    it writes a copy and leaves ``g`` as it was.
    megatron-core's backward overwrites it in every case.

    Not checked (each would need a device-to-host sync): that ``cu_seqlens_q`` is non-decreasing,
    that cos/sin have a row for every thd position, that ``position_ids`` lie inside cos/sin, and
    that under context parallelism (``cp_size > 1``) every sequence length in ``cu_seqlens_q`` is a
    multiple of ``2 * cp_size``: an odd local length (cp 2 and a sequence of 6) gives wrong
    positions (rank 0 gets [0, 4, 5], rank 1 [1, 3, 4]). Callers that have the lengths on the host
    check the last with
    :func:`megatron_ext.fusions.mla_rope.checks.check_cp_sequence_lengths` (the MLA module does
    when ``cu_seqlens`` live on the CPU; ``examples/pretrain_mla.py`` does). Positions
    outside the tables are clamped to their first or last row rather than read out of bounds; thd
    rows past ``cu_seqlens_q[-1]`` (CUDA-graph padding) use row 0.

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
        torch.Tensor: ``t``, modified in place (a rotated copy for a leaf that requires grad).
    """
    if rotary_interleaved:
        checks.check_flags(rotary_interleaved)
    _refuse_functorch(t, cos, sin)
    if not (torch.is_grad_enabled() and isinstance(t, torch.Tensor) and t.requires_grad):
        # Nothing to record for autograd: launch directly, and bump t's version as any in-place
        # op does, so a backward that saved t fails loudly instead of using rotated values.
        mla_rope_q_fwd_(
            t,
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
        torch.autograd.graph.increment_version(t)
        return t
    if t.device.type not in _EXCLUSIVE_REFS:
        _calibrate_ownership(t.device)
    if t.is_leaf:
        # No in-place op may modify a leaf that requires grad; megatron-core rotates its data
        # behind autograd's back. Rotating a copy gives the same output and leaf gradient.
        t = t.clone()
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


# --------------------------------------------------------------------------------------------------
# Key and value
# --------------------------------------------------------------------------------------------------


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
        ctx.config = PINNED.get()
        return key, value

    @staticmethod
    def backward(ctx, dkey, dvalue):
        """Return the gradients of kv and k_pos_emb (new tensors; dkey and dvalue are only read)."""
        _refuse_double_backward(dkey, dvalue)
        cos, sin, cu_seqlens_kv, position_ids = ctx.saved_tensors
        emb_dim, k_dim, v_dim, cp_rank, cp_size, remove_interleaving = ctx.args
        token = PINNED.set(ctx.config)
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
            PINNED.reset(token)
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
    if rotary_interleaved:
        checks.check_flags(rotary_interleaved)
    _refuse_functorch(kv, k_pos_emb, cos, sin)
    grads = isinstance(kv, torch.Tensor) and isinstance(k_pos_emb, torch.Tensor)
    if not (torch.is_grad_enabled() and grads and (kv.requires_grad or k_pos_emb.requires_grad)):
        return mla_rope_kv_fwd(
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
