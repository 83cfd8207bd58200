# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The MHA form's gather of latent cache rows through the block table: each packed row's block
id read from the table, kept inside the cache, and the row copied, in one kernel on CUDA
(:func:`gather_cache_rows`).

In torch the gather takes four launches (the ids' gather, their clamp, the flat row numbers and
the rows' gather), each costing host time per layer in steps that run eagerly; the kernel is one
direct launch. Off CUDA (the CPU, the interpreter when asked) the torch gather runs; both copy
the same rows, so their results are the same bits.

The kernel is graph-safe (no host synchronisation; its grid is the row count) and reads only
inside its inputs: a block id outside the cache is clamped into it, as the torch gather clamps
it (the table's -1 padding reads block 0: only ever bucket padding, which no query attends), and
a place outside the table or the block is clamped into it.
"""

from typing import Optional, Tuple

import triton
import triton.language as tl
from torch import Tensor

from megatron_ext.fusions.direct_launch import KernelLaunches, PreparedLaunch
from megatron_ext.fusions.launch_math import next_power_of_2
from megatron_ext.fusions.launch_plans import NO_LAUNCH, LaunchPlan, PlanCache, layout_key
from megatron_ext.fusions.tensor_checks import (
    INDEX_DTYPES,
    check_device,
    check_disjoint,
    check_index_vector,
    check_no_self_overlap,
    check_tensor,
    check_unit_last_stride,
)

__all__ = ["GATHER_LAUNCHES", "gather_cache_rows", "gather_cache_rows_torch"]


def gather_cache_rows_torch(
    kv_cache: Tensor, block_table: Tensor, places: Tuple[Tensor, Tensor]
) -> Tensor:
    """:func:`gather_cache_rows` in torch (any device; the reference)."""
    blocks, block_size, _ = kv_cache.shape
    ids = block_table.view(-1).index_select(0, places[0]).clamp_(0, blocks - 1)
    if kv_cache.stride(0) == block_size * kv_cache.stride(1):
        # One gather of whole rows from the cache seen as [blocks * block_size, width] (a view).
        return kv_cache.flatten(0, 1).index_select(0, places[1].add(ids, alpha=block_size))
    return kv_cache[ids, places[1]]


@triton.jit
def _gather_rows_kernel(
    cache_ptr,
    table_ptr,
    table_places_ptr,
    block_places_ptr,
    out_ptr,
    num_blocks,
    block_size,
    table_entries,
    width,
    cache_stride_b,
    cache_stride_o,
    out_stride,
    BLOCK_W: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    place = tl.load(table_places_ptr + row).to(tl.int64)
    place = tl.minimum(tl.maximum(place, 0), table_entries - 1)
    block = tl.load(table_ptr + place).to(tl.int64)
    block = tl.minimum(tl.maximum(block, 0), num_blocks - 1)
    within = tl.load(block_places_ptr + row).to(tl.int64)
    within = tl.minimum(tl.maximum(within, 0), block_size - 1)
    cols = tl.arange(0, BLOCK_W)
    inside = cols < width
    src = cache_ptr + block * cache_stride_b + within * cache_stride_o + cols
    tl.store(out_ptr + row * out_stride + cols, tl.load(src, mask=inside), mask=inside)


# Triton's JIT on a specialisation's first call, then the direct launch.
GATHER_LAUNCHES = KernelLaunches(_gather_rows_kernel)
# Call layouts -> their prepared launches: a step's layers gather with the same layouts.
_PLANS: PlanCache[LaunchPlan] = PlanCache()


def _plan(
    kv_cache: Tensor, table: Tensor, places: Tuple[Tensor, Tensor], out: Tensor
) -> LaunchPlan:
    rows, width = out.shape
    if rows == 0:
        return NO_LAUNCH
    args = dict(
        cache_ptr=kv_cache,
        table_ptr=table,
        table_places_ptr=places[0],
        block_places_ptr=places[1],
        out_ptr=out,
        num_blocks=kv_cache.shape[0],
        block_size=kv_cache.shape[1],
        table_entries=table.numel(),
        width=width,
        cache_stride_b=kv_cache.stride(0),
        cache_stride_o=kv_cache.stride(1),
        out_stride=out.stride(0),
        BLOCK_W=next_power_of_2(width),
    )
    return PreparedLaunch(GATHER_LAUNCHES, (rows,), args, dict(num_warps=4), tensors=5)


def _kernel_takes(kv_cache: Tensor, block_table: Tensor) -> bool:
    """Whether the kernel gathers: a CUDA cache of unit column stride and a table with entries."""
    return kv_cache.is_cuda and kv_cache.stride(2) == 1 and block_table.numel() > 0


def gather_cache_rows(
    kv_cache: Tensor,
    block_table: Tensor,
    places: Tuple[Tensor, Tensor],
    out: Optional[Tensor] = None,
) -> Tensor:
    """Copies of the cache rows at ``places``: row ``r`` is
    ``kv_cache[block_table.view(-1)[places[0][r]], places[1][r]]``, a block id outside the cache
    clamped into it. Graph-safe.

    Args:
        kv_cache: [blocks, block_size, width], unit column stride.
        block_table: [requests, max_blocks] int32 or int64, contiguous.
        places: each row's place in the flattened table and in its block ([rows] int32 or
            int64 each, on the cache's device; the step's plan builds them, and their values
            are not read on the host).
        out: [rows, width] in the cache's dtype, unit column stride, to write the rows into (a
            view of a larger buffer welcome: nothing else of it is written); None: a new tensor.

    Returns:
        Tensor: [rows, width] in the cache's dtype (``out`` where given).

    Raises:
        TypeError, ValueError: for index dtypes, devices, shapes or strides that do not fit, or
            an ``out`` that shares memory with an input or within itself, before any launch.
    """
    if kv_cache.dim() != 3 or block_table.dim() != 2 or not block_table.is_contiguous():
        raise ValueError(
            f"kv_cache must be [blocks, block_size, width] and block_table a contiguous "
            f"[requests, max_blocks]; got {tuple(kv_cache.shape)} and {tuple(block_table.shape)}"
        )
    check_tensor("block_table", block_table, INDEX_DTYPES)
    check_device("block_table", block_table, kv_cache.device)
    if places[0].dim() != 1:
        raise ValueError(f"places must be two [rows] vectors; got {tuple(places[0].shape)}")
    rows = places[0].shape[0]
    # The kernel reads the places as contiguous vectors.
    check_index_vector("places[0]", places[0], rows, kv_cache.device)
    check_index_vector("places[1]", places[1], rows, kv_cache.device)
    if out is not None:
        if out.shape != (rows, kv_cache.shape[2]) or out.dtype != kv_cache.dtype:
            raise ValueError(
                f"out must be [{rows}, {kv_cache.shape[2]}] {kv_cache.dtype}; got "
                f"{tuple(out.shape)} {out.dtype}"
            )
        check_device("out", out, kv_cache.device)
        check_unit_last_stride("out", out)
        check_no_self_overlap("out", out)
        read = (("kv_cache", kv_cache), ("block_table", block_table))
        check_disjoint("out", out, read + (("places[0]", places[0]), ("places[1]", places[1])))
    if not _kernel_takes(kv_cache, block_table):
        rows_read = gather_cache_rows_torch(kv_cache, block_table, places)
        return rows_read if out is None else out.copy_(rows_read)
    if out is None:
        out = kv_cache.new_empty(rows, kv_cache.shape[2])
    key = layout_key((kv_cache, block_table, places[0], places[1], out), ())
    launch = _PLANS.get(key)
    if launch is None:
        launch = _PLANS.put(key, _plan(kv_cache, block_table, places, out))
    launch(kv_cache, block_table, places[0], places[1], out)
    return out
