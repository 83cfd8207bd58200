# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Input checks of the paged MLA latent cache's layout.

:mod:`megatron_ext.fusions.fused_mla_rope_cache_append` writes rows into a layer's paged latent
cache and :mod:`megatron_ext.fusions.mla_paged_latent_attention` reads them. Both take
megatron-core's ``DynamicInferenceContext`` tensors as they are and check them on the host,
before any launch: with the generic checks of :mod:`megatron_ext.fusions.tensor_checks`, and with
these for the layouts only the paged cache has. Nothing here reads a device tensor's values (no
host synchronisation), so what only the values can show (block ids, lengths, positions) is
guarded inside the kernels instead.
"""

from typing import Tuple

import torch

from megatron_ext.fusions.tensor_checks import (
    FLOAT_DTYPES,
    check_device,
    check_tensor,
    check_unit_last_stride,
)

__all__ = ["check_paged_cache", "rows_of"]


def rows_of(name: str, x: torch.Tensor) -> Tuple[int, int, int]:
    """(rows, row stride, width) of a [rows, width] or [rows, 1, ..., 1, width] tensor.

    megatron-core's dynamic step hands its per-token tensors as [tokens, 1, width] (sbhd with a
    batch of one); any unit dimensions between the first and the last are accepted as views.
    """
    if x.dim() < 2 or any(d != 1 for d in x.shape[1:-1]):
        raise ValueError(
            f"{name} must be [tokens, width] or [tokens, 1, ..., 1, width]; got {tuple(x.shape)}"
        )
    check_unit_last_stride(name, x)
    return x.shape[0], x.stride(0), x.shape[-1]


def check_paged_cache(name: str, cache, device: torch.device) -> Tuple[int, int, int]:
    """Check one layer's paged latent cache; return (blocks, block size, row width).

    The cache is [num_blocks, block_size, width] (``memory_buffer[layer]`` of megatron-core's
    ``DynamicInferenceContext`` with ``cache_mla_latent``): any strides but a unit last one.
    """
    check_tensor(name, cache, FLOAT_DTYPES)
    check_device(name, cache, device)
    if cache.dim() != 3:
        raise ValueError(
            f"{name} must be [num_blocks, block_size, width] (one layer of the latent cache); got "
            f"shape {tuple(cache.shape)}"
        )
    if cache.shape[1] < 1:
        raise ValueError(f"{name} must have a block size >= 1; got shape {tuple(cache.shape)}")
    check_unit_last_stride(name, cache)
    return cache.shape[0], cache.shape[1], cache.shape[2]
