# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""megatron-core's load-balanced context-parallel layout, and a key/value all-gather over it.

:func:`cp_chunk_positions` gives the global positions a context-parallel rank holds of one
sequence; :func:`all_gather_across_ranks` stacks every rank's tensor, with a backward that works on
every torch.distributed backend (gloo included). Used by ``SDPADotProductAttention``.
"""

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_gather_across_ranks", "cp_chunk_positions"]


def cp_chunk_positions(
    local_len: int, cp_size: int, cp_rank: int, device: Optional[torch.device] = None
) -> Tensor:
    """Global positions of the tokens a context-parallel rank holds of one sequence.

    megatron-core's load-balanced causal layout: the sequence is cut into ``2 * cp_size`` chunks
    and rank r holds chunks r and ``2 * cp_size - 1 - r``, in that order.

    Args:
        local_len: tokens of the sequence on this rank (two chunks).
        cp_size: context-parallel ranks.
        cp_rank: this rank.
        device: where the positions go.

    Returns:
        Tensor: ``[local_len]`` int64 positions.

    Raises:
        ValueError: if ``local_len`` is odd (two equal chunks cannot make it up).
    """
    if local_len % 2:
        raise ValueError(f"local_len must be even (two equal chunks), got {local_len}")
    chunk = local_len // 2
    first = torch.arange(chunk, device=device) + cp_rank * chunk
    second = torch.arange(chunk, device=device) + (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, second])


class _AllGatherAcrossRanks(torch.autograd.Function):
    """Stack every rank's tensor; the backward sums the gradients and keeps this rank's part.

    torch's and megatron-core's gathers reduce-scatter in backward, which gloo lacks; an all-reduce
    works on every backend (and, for two ranks, adds the same two numbers on both).
    """

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:  # pylint: disable=arguments-differ
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(group.size())]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: Tensor):  # pylint: disable=arguments-differ
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.group.rank()], None


def all_gather_across_ranks(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``[group.size(), *x.shape]``: every rank's ``x``, in rank order.

    The backward all-reduces the incoming gradient and keeps this rank's part.

    Args:
        x: this rank's tensor (same shape on every rank).
        group: the process group (the context-parallel group).

    Returns:
        Tensor: the stacked tensors.
    """
    return _AllGatherAcrossRanks.apply(x, group)
