# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The MHA form's merge of partial attentions: a query's attentions over disjoint keys combined
by their log-sum-exps.

* :func:`merge_partials`: the merge in torch (any device and dtype; fp64 included), the
  reference.
* :func:`merge_partials_into`: a call's partial merged into the step's accumulator in place, for
  the call's tokens (a slice or an index), or, for a call after which its tokens have no other,
  written straight into the result in its dtype. On CUDA with an fp32 accumulator it is one
  kernel that reads each accumulator row only where an earlier call wrote it (the accumulator
  needs no zeroing, only its log-sum-exps set to -inf) and writes each row once; the torch
  merge reads and writes it about ten times over (at 1024 tokens, 128 heads and 128 value
  columns a merge moves 64 MiB per pass), which made a chunk's split calls slower than one
  bottom-right call. Elsewhere the torch merge.

The kernel is graph-safe (no host synchronisation; its grid is the call's token count and the
heads) and writes only the call's tokens' rows: of the accumulator and its log-sum-exps, or of
the result.
"""

import math
from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl
from torch import Tensor

from megatron_ext.fusions.direct_launch import KernelLaunches, PreparedLaunch
from megatron_ext.fusions.launch_math import next_power_of_2
from megatron_ext.fusions.launch_plans import NO_LAUNCH, LaunchPlan, PlanCache, layout_key
from megatron_ext.fusions.tensor_checks import (
    check_device,
    check_disjoint,
    check_index_vector,
    check_no_self_overlap,
    span_bytes,
    spans_meet,
)

__all__ = ["MERGE_LAUNCHES", "merge_partials", "merge_partials_into"]

# Elements of one program's tile (heads x value columns): 4 per thread of 4 warps.
_TILE_ELEMENTS = 512


def merge_partials(
    out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor
) -> Tuple[Tensor, Tensor]:
    """Softmax-weighted merge of two attentions of the same queries over disjoint keys.

    Args:
        out_a, out_b: [tokens, heads, v] the two partial outputs.
        lse_a, lse_b: [tokens, heads] their log-sum-exps (-inf where a query attended nothing).

    Returns:
        Tuple[Tensor, Tensor]: the merged output in ``out_a``'s dtype and its log-sum-exp.
    """
    top = torch.maximum(lse_a, lse_b)
    # Either side, or both, may be -inf (a query with no keys in a chunk, or none so far).
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = w_a + w_b
    dtype = out_a.dtype
    merged = out_a * w_a[..., None].to(dtype) + out_b.to(dtype) * w_b[..., None].to(dtype)
    merged = torch.where(total[..., None] > 0, merged / total[..., None].to(dtype), 0.0)
    return merged, top + torch.log(total)


@triton.jit
def _merge_partials_kernel(
    acc_ptr,
    acc_lse_ptr,
    part_ptr,
    part_lse_ptr,
    tokens_ptr,
    out_ptr,
    first_token,
    heads,
    v_dim,
    acc_token_stride,
    acc_head_stride,
    acc_lse_token_stride,
    acc_lse_head_stride,
    part_token_stride,
    part_head_stride,
    part_lse_token_stride,
    part_lse_head_stride,
    out_token_stride,
    out_head_stride,
    HAS_INDEX: tl.constexpr,
    WRITE_OUT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    if HAS_INDEX:
        token = tl.load(tokens_ptr + i).to(tl.int64)
    else:
        token = first_token + i
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_V)
    live = h < heads
    lse_a = tl.load(
        acc_lse_ptr + token * acc_lse_token_stride + h * acc_lse_head_stride,
        mask=live,
        other=-float("inf"),
    )
    lse_b = tl.load(
        part_lse_ptr + i * part_lse_token_stride + h * part_lse_head_stride,
        mask=live,
        other=-float("inf"),
    )
    # The torch merge's arithmetic, in its order (fp32).
    top = tl.maximum(lse_a, lse_b)
    top = tl.where(top == -float("inf"), 0.0, top)
    w_a = tl.exp(lse_a - top)
    w_b = tl.exp(lse_b - top)
    total = w_a + w_b
    inside = live[:, None] & (cols < v_dim)[None, :]
    acc_at = acc_ptr + token * acc_token_stride + h[:, None] * acc_head_stride + cols[None, :]
    # A row no earlier call wrote (its log-sum-exp still -inf) is not read: its weight is 0.
    acc = tl.load(acc_at, mask=inside & (lse_a > -float("inf"))[:, None], other=0.0)
    acc = acc.to(tl.float32)  # a first call's output standing as the accumulator: 16-bit
    part_at = part_ptr + i * part_token_stride + h[:, None] * part_head_stride + cols[None, :]
    part = tl.load(part_at, mask=inside, other=0.0).to(tl.float32)
    merged = acc * w_a[:, None] + part * w_b[:, None]
    merged = tl.where(total[:, None] > 0, merged / total[:, None], 0.0)
    if WRITE_OUT:  # the tokens' last call: the result, in its dtype (the accumulator's cast)
        out_at = out_ptr + token * out_token_stride + h[:, None] * out_head_stride + cols[None, :]
        tl.store(out_at, merged.to(out_ptr.dtype.element_ty), mask=inside)
    else:
        tl.store(acc_at, merged, mask=inside)
        lse_at = acc_lse_ptr + token * acc_lse_token_stride + h * acc_lse_head_stride
        tl.store(lse_at, top + tl.log(total), mask=live)


# Triton's JIT on a specialisation's first call, then the direct launch.
MERGE_LAUNCHES = KernelLaunches(_merge_partials_kernel)
# Call layouts -> their prepared launches and the tensors' byte spans (for the per-call test that
# the written tensors share memory with no other): a step's layers merge with the same layouts.
_PLANS: PlanCache[Tuple[LaunchPlan, Tuple[int, ...]]] = PlanCache()


def _plan(
    acc: Tensor,
    acc_lse: Tensor,
    part: Tensor,
    part_lse: Tensor,
    index: Optional[Tensor],
    out: Optional[Tensor],
    first: int,
) -> LaunchPlan:
    count, heads, v_dim = part.shape
    if count == 0 or heads == 0:
        return NO_LAUNCH
    block_v = next_power_of_2(v_dim)
    block_h = min(next_power_of_2(heads), max(1, _TILE_ELEMENTS // block_v))
    args = dict(
        acc_ptr=acc,
        acc_lse_ptr=acc_lse,
        part_ptr=part,
        part_lse_ptr=part_lse,
        tokens_ptr=index,
        out_ptr=out,
        first_token=first,
        heads=heads,
        v_dim=v_dim,
        acc_token_stride=acc.stride(0),
        acc_head_stride=acc.stride(1),
        acc_lse_token_stride=acc_lse.stride(0),
        acc_lse_head_stride=acc_lse.stride(1),
        part_token_stride=part.stride(0),
        part_head_stride=part.stride(1),
        part_lse_token_stride=part_lse.stride(0),
        part_lse_head_stride=part_lse.stride(1),
        out_token_stride=0 if out is None else out.stride(0),
        out_head_stride=0 if out is None else out.stride(1),
        HAS_INDEX=index is not None,
        WRITE_OUT=out is not None,
        BLOCK_H=block_h,
        BLOCK_V=block_v,
    )
    grid = (count, triton.cdiv(heads, block_h))
    return PreparedLaunch(MERGE_LAUNCHES, grid, args, dict(num_warps=4), tensors=6)


def _kernel_takes(
    acc: Tensor, acc_lse: Tensor, part: Tensor, part_lse: Tensor, out: Optional[Tensor]
) -> bool:
    """Whether the kernel merges this call: CUDA, fp32 log-sum-exps, an fp32 accumulator (or,
    where the merge writes the result and only reads it, a 16-bit one: a first call's output),
    and unit column strides."""
    read_only = out is not None and acc.dtype in (torch.float16, torch.bfloat16)
    return (
        acc.is_cuda
        and (acc.dtype == torch.float32 or read_only)
        and acc_lse.dtype == torch.float32
        and part_lse.dtype == torch.float32
        and acc.stride(2) == 1
        and part.stride(2) == 1
        and (out is None or out.stride(2) == 1)
    )


def merge_partials_into(
    acc: Tensor,
    acc_lse: Tensor,
    part: Tensor,
    part_lse: Tensor,
    tokens: Union[slice, Tensor],
    out: Optional[Tensor] = None,
) -> None:
    """Merge a call's partial attention into the step's accumulator, in place, for the call's
    tokens; or, with ``out``, write the merged rows into ``out`` (in its dtype) and leave the
    accumulator as it was. Graph-safe. Rows of other tokens are not touched.

    Args:
        acc: [used, heads, v] fp32 (fp64 for fp64 inputs) accumulated outputs (anything where no
            call has written yet: such rows are not read); with ``out``, which leaves it as it
            was, any float dtype (a first call's output standing as the accumulator).
        acc_lse: [used, heads] fp32 accumulated log-sum-exps (-inf where no call has written),
            any strides.
        part: [count, heads, v] the call's outputs (any float dtype; strided views welcome).
        part_lse: [count, heads] fp32 the call's log-sum-exps.
        tokens: the call's tokens: a slice of ``count`` consecutive ones, or ``count`` int32 or
            int64 indices on ``acc``'s device, distinct and in ``[0, used)``: the step's plan
            builds them, and their values are not read on the host (graph-safe).
        out: [>= used, heads, v], the result, for a call after which none of its tokens is in
            another; None: merge into the accumulator.

    Raises:
        TypeError, ValueError: for an index of another dtype or not contiguous, tensors on other
            devices, shapes that do not match, or a written tensor (the accumulator and its
            log-sum-exps, or ``out``) that shares memory with another or within itself, before
            any launch.
    """
    count = part.shape[0]
    if acc.dim() != 3 or part.shape[1:] != acc.shape[1:] or acc_lse.shape != acc.shape[:2]:
        raise ValueError(
            f"acc {tuple(acc.shape)}, acc_lse {tuple(acc_lse.shape)} and part "
            f"{tuple(part.shape)} must be [used, heads, v], [used, heads] and [count, heads, v]"
        )
    if part_lse.shape != part.shape[:2]:
        raise ValueError(f"part_lse must be {tuple(part.shape[:2])}; got {tuple(part_lse.shape)}")
    if out is not None and (
        out.dim() != 3 or out.shape[0] < acc.shape[0] or out.shape[1:] != acc.shape[1:]
    ):
        raise ValueError(
            f"out must be [>= {acc.shape[0]}, {acc.shape[1]}, {acc.shape[2]}]; got "
            f"{tuple(out.shape)}"
        )
    if out is None and acc.dtype not in (torch.float32, torch.float64):
        raise TypeError(
            f"acc must be float32 or float64 where the merge writes it (no out); got {acc.dtype}"
        )
    for name, x in (("acc_lse", acc_lse), ("part", part), ("part_lse", part_lse), ("out", out)):
        if x is not None:
            check_device(name, x, acc.device)
    if isinstance(tokens, slice):
        start, stop, step = tokens.indices(acc.shape[0])
        if step != 1 or stop - start != count:
            raise ValueError(f"tokens {tokens} must be {count} consecutive rows of acc")
        index, first = None, start
    else:
        # The kernel reads the indices as a contiguous vector.
        check_index_vector("tokens", tokens, count, acc.device)
        index, first = tokens, 0
    tensors = (acc, acc_lse, part, part_lse, index, out)
    if not _kernel_takes(acc, acc_lse, part, part_lse, out):
        _check_written_apart(tensors)
        seen = acc_lse[tokens]
        # Rows no call wrote are not read (as in the kernel): whatever they hold weighs 0.
        wide = torch.float64 if torch.float64 in (acc.dtype, part.dtype) else torch.float32
        earlier = torch.where((seen == -math.inf)[..., None], 0.0, acc[tokens].to(wide))
        merged, merged_lse = merge_partials(earlier, seen, part, part_lse)
        if out is None:
            acc[tokens], acc_lse[tokens] = merged, merged_lse
        else:
            out[tokens] = merged.to(out.dtype)
        return
    key = layout_key(tensors, (first,))
    kept = _PLANS.get(key)
    if kept is None:
        _check_written_apart(tensors)
        spans = tuple(span_bytes(x) for x in tensors)
        kept = _PLANS.put(key, (_plan(acc, acc_lse, part, part_lse, index, out, first), spans))
    launch, spans = kept
    # What the layout cannot tell: whether this call's written tensors share memory with the
    # others (only the data pointers are read; the full check names the tensor).
    if any(spans_meet(tensors, spans, w) for w in _written(out)):
        _check_written_apart(tensors)
    launch(acc, acc_lse, part, part_lse, index, out)


_NAMES = ("acc", "acc_lse", "part", "part_lse", "tokens", "out")


def _written(out: Optional[Tensor]) -> Tuple[int, ...]:
    """The places in a call's tensors of those the merge writes."""
    return (5,) if out is not None else (0, 1)


def _check_written_apart(tensors: Tuple[Optional[Tensor], ...]) -> None:
    """Raise ValueError where a tensor the merge writes has elements that share memory, or
    shares memory with another of the call's tensors."""
    for w in _written(tensors[5]):
        check_no_self_overlap(_NAMES[w], tensors[w])
        others = [(name, x) for i, (name, x) in enumerate(zip(_NAMES, tensors)) if i != w]
        check_disjoint(_NAMES[w], tensors[w], others)
