# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The MHA form's decompression weights: ``linear_kv_up_proj``'s weight laid out so that two GEMMs
write the keys and the values at their final widths (:func:`up_projections`), built once per
weight and kept while it is unchanged (:func:`cached_up_projections`).
"""

import threading
import weakref
from typing import Dict, Tuple

import torch
from torch import Tensor

from megatron_ext import internals

__all__ = [
    "cached_up_projections",
    "clear_up_projections",
    "kept_up_projections",
    "up_projections",
]

# id(weight) -> (a weak reference to it, what the entry was built from, the two GEMM weights).
# An entry goes when its weight does (the reference's callback) or is replaced when the weight
# changes.
_UP_WEIGHTS: Dict[int, tuple] = {}
_UP_WEIGHTS_LOCK = threading.Lock()


def up_projections(
    kv_up_weight: Tensor, heads: int, qk_dim: int, rope_dim: int, key_width: int, value_width: int
) -> Tuple[Tensor, Tensor]:
    """``linear_kv_up_proj``'s weight as two GEMM weights whose outputs are the keys and the
    values in the attention's layout. The keys' GEMM reads whole cache rows (latent and RoPE
    part): per head, W_UK's rows (zero on the RoPE columns), an identity that copies the row's
    RoPE part, then zero rows to ``key_width``. The values' GEMM reads the latent part: per head,
    W_UV's rows, then zero rows to ``value_width``.

    The extra rows and columns cost GEMM work (at DeepSeek-V3's widths 320 output columns per head
    where W_UK and W_UV have 256, 384 at FlashAttention's one head size) but no copy: the keys
    and values come out packed at their final width, where concatenating the RoPE part, packing
    the values and padding them took three copies of every row. The identity is exact: one
    product by 1.0 and sums of zeros (TF32 GEMMs of fp32 inputs round the RoPE part as they
    round the rest).

    Args:
        kv_up_weight: [heads * (qk + v), latent].
        heads: the query heads.
        qk_dim: the non-rotated key width per head.
        rope_dim: the key's rotated width.
        key_width: the keys' width per head (at least ``qk_dim + rope_dim``).
        value_width: the values' width per head (at least ``v``).

    Returns:
        Tuple[Tensor, Tensor]: [heads * key_width, latent + rope] and
        [heads * value_width, latent].
    """
    latent_dim = kv_up_weight.shape[1]
    v_dim = kv_up_weight.shape[0] // heads - qk_dim
    per_head = kv_up_weight.view(heads, qk_dim + v_dim, latent_dim)
    keys = kv_up_weight.new_zeros(heads, key_width, latent_dim + rope_dim)
    keys[:, :qk_dim, :latent_dim] = per_head[:, :qk_dim]
    keys[:, qk_dim : qk_dim + rope_dim, latent_dim:].diagonal(dim1=1, dim2=2).fill_(1)
    values = kv_up_weight.new_zeros(heads, value_width, latent_dim)
    values[:, :v_dim] = per_head[:, qk_dim:]
    return keys.view(-1, latent_dim + rope_dim), values.view(-1, latent_dim)


def _forget(weight_id: int) -> None:
    # A weak reference's callback may run inside any allocation, the lock's holder's too: a
    # dict's pop is atomic on its own.
    _UP_WEIGHTS.pop(weight_id, None)


def cached_up_projections(
    kv_up_weight: Tensor, heads: int, qk_dim: int, rope_dim: int, key_width: int, value_width: int
) -> Tuple[Tensor, Tensor]:
    """:func:`up_projections`, built once per weight and reused while the weight is unchanged
    (same storage, no in-place write since: its version counter; a torch without one never
    reuses). A write the counter does not see (through ``.data``, numpy or a collective into the
    parameter's buffer, as megatron-core's distributed optimizer updates parameters) needs
    :func:`clear_up_projections`; megatron_ext's inference context calls it at each ``reset``,
    which an engine runs when it starts and when it resumes after training.

    Laying the weight out costs a zero fill and copies of about 1.7x the weight per call (at 128
    heads, about 50 MB written and five launches); a model calls with the same weights every
    step. The kept weights cost that memory per layer while the layer's weight lives (at
    DeepSeek-V3's widths, 0.4 MB per head and layer: 6.6 MB per layer at 16 heads). Under
    autograd (a weight that requires grad, grad mode on) nothing is kept: a kept result would
    carry an old graph.

    Args:
        kv_up_weight, heads, qk_dim, rope_dim, key_width, value_width: as
            :func:`up_projections`.

    Returns:
        Tuple[Tensor, Tensor]: as :func:`up_projections` (shared: read-only to the caller).
    """
    if kv_up_weight.requires_grad and torch.is_grad_enabled():
        return up_projections(kv_up_weight, heads, qk_dim, rope_dim, key_width, value_width)
    built_from = (
        kv_up_weight.data_ptr(),
        internals.tensor_version(kv_up_weight),
        kv_up_weight.shape,
        kv_up_weight.stride(),
        kv_up_weight.dtype,
        kv_up_weight.device,
        heads,
        qk_dim,
        rope_dim,
        key_width,
        value_width,
    )
    entry = _UP_WEIGHTS.get(id(kv_up_weight))
    if entry is not None and entry[0]() is kv_up_weight and entry[1] == built_from:
        return entry[2]
    weights = up_projections(kv_up_weight, heads, qk_dim, rope_dim, key_width, value_width)
    weight_id = id(kv_up_weight)
    with _UP_WEIGHTS_LOCK:
        _UP_WEIGHTS[weight_id] = (
            weakref.ref(kv_up_weight, lambda _: _forget(weight_id)),
            built_from,
            weights,
        )
    return weights


def clear_up_projections() -> None:
    """Forget every kept layout (their memory goes with the last reference)."""
    with _UP_WEIGHTS_LOCK:
        _UP_WEIGHTS.clear()


def kept_up_projections() -> int:
    """How many weights' layouts are kept now."""
    return len(_UP_WEIGHTS)
