# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Input checks shared by the paged MLA latent-cache kernels.

:mod:`megatron_ext.fusions.fused_mla_rope_cache_append` writes rows into a layer's paged latent
cache and :mod:`megatron_ext.fusions.mla_paged_latent_attention` reads them. Both take
megatron-core's ``DynamicInferenceContext`` tensors as they are and check them here, on the host,
before any launch. Nothing here reads a device tensor's values (no host synchronisation), so what
only the values can show (block ids, lengths, positions) is guarded inside the kernels instead.
"""

from typing import Sequence, Tuple

import torch

from megatron_ext.fusions.mla_rope.checks import (
    INDEX_DTYPES,
    INTERPRETED,
    SUPPORTED_DTYPES,
    check_device,
    check_tensor,
)

__all__ = [
    "FLOAT_DTYPES",
    "INDEX_DTYPES",
    "check_disjoint",
    "check_index_vector",
    "check_no_self_overlap",
    "check_paged_cache",
    "check_runnable",
    "check_unit_last_stride",
    "overlaps",
    "rows_of",
]

FLOAT_DTYPES = SUPPORTED_DTYPES


def check_runnable(function: str, name: str, x: torch.Tensor) -> None:
    """Raise ValueError unless ``x`` is on a device ``function``'s kernels run on.

    CUDA tensors run compiled; CPU tensors only in Triton's interpreter, which must be chosen
    before Triton is imported.
    """
    if x.device.type == "cuda" or (x.device.type == "cpu" and INTERPRETED):
        return
    raise ValueError(
        f"{function}: {name} is on {x.device}; its Triton kernels run on CUDA devices (or on the "
        "CPU with TRITON_INTERPRET=1 set before Python starts, for tests)"
    )


def check_unit_last_stride(name: str, x: torch.Tensor) -> None:
    """Raise ValueError unless the last dimension of a non-empty ``x`` has unit stride."""
    if x.numel() > 0 and x.stride(-1) != 1:
        raise ValueError(
            f"{name} must have unit stride in its last dimension; got strides {tuple(x.stride())}"
        )


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


def check_index_vector(name: str, x, length: int, device: torch.device) -> None:
    """Raise unless ``x`` is a contiguous int32/int64 vector of ``length`` entries on ``device``."""
    check_tensor(name, x, INDEX_DTYPES)
    check_device(name, x, device)
    if tuple(x.shape) != (length,):
        raise ValueError(f"{name} must have shape ({length},); got {tuple(x.shape)}")
    if length > 1 and x.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous; got stride {x.stride(0)}")


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


def _span(x: torch.Tensor) -> Tuple[int, int]:
    """The byte range [start, end) that a non-empty tensor's elements occupy (torch strides are
    never negative)."""
    extent = sum((n - 1) * s for n, s in zip(x.shape, x.stride()))
    return x.data_ptr(), x.data_ptr() + (extent + 1) * x.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory spans intersect (conservative for interleaved views)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False  # separate allocations never overlap: the span arithmetic only for views
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def check_disjoint(
    out_name: str, out: torch.Tensor, inputs: Sequence[Tuple[str, torch.Tensor]]
) -> None:
    """Raise ValueError if ``out`` shares memory with any of ``inputs`` (name, tensor)."""
    for name, tensor in inputs:
        if overlaps(out, tensor):
            raise ValueError(
                f"{out_name} overlaps {name}: the kernel would read what it writes. Pass "
                "separate tensors"
            )


def check_no_self_overlap(name: str, x: torch.Tensor) -> None:
    """Raise ValueError if two elements of the output ``x`` share memory (an expanded view).

    Two programs would write one address, and which write lands would depend on the schedule.
    Sufficient test: with the dims of size > 1 sorted by stride, each stride exceeds the span of
    the dims before it (a few exotic non-overlapping layouts fail it too).
    """
    span = 1
    for stride, size in sorted((st, sz) for sz, st in zip(x.shape, x.stride()) if sz > 1):
        if stride < span:
            raise ValueError(
                f"{name} (shape {tuple(x.shape)}, strides {tuple(x.stride())}) has elements that "
                "share memory (an expanded or overlapping view); pass a tensor that owns its "
                "elements"
            )
        span += stride * (size - 1)
