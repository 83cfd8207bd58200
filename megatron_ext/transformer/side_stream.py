# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Two independent parts of a step at once: one on a side stream, one on the current stream.

A mixed step's split (:mod:`megatron_ext.transformer.mla_prefill`) runs its leading decodes in the
absorbed form and its chunk in the MHA form. Neither part fills the GPU at 16 heads (a few
requests' decode programs; a chunk's cuDNN tiles), and neither reads what the other writes, so
the decodes run on a side stream while the chunk's host work and kernels go on the current one.

The side callable must write only into tensors allocated before the fork (its temporaries are
allocated and freed on the side stream, where the caching allocator keeps them) and return
nothing: a tensor it allocated and handed back would be freed later into the side stream's pool
while the current stream may still read it.
"""

import threading
from typing import Callable, TypeVar

import torch

__all__ = ["side_by_side"]

T = TypeVar("T")

_local = threading.local()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's side stream on ``device`` (one per thread, so that two threads stepping
    engines never order each other's work)."""
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = streams.get(index)
    if stream is None:
        stream = streams[index] = torch.cuda.Stream(index)
    return stream


def side_by_side(
    side: Callable[[], None], main: Callable[[], T], device: torch.device, overlap: bool = True
) -> T:
    """Run ``side`` on a side stream of ``device`` and ``main`` on the current stream, both
    after the current stream's work so far; the current stream then waits for both. Serial
    (``side`` then ``main``) off CUDA or with ``overlap`` False. Capture-safe: the fork and the
    join are event edges, which a CUDA graph records.

    Args:
        side: writes into tensors allocated before the call; returns nothing.
        main: the other part.
        device: where both run.
        overlap: False runs the two in order on the current stream (the same bits: the parts
            are independent; for comparing the two in one process).

    Returns:
        T: what ``main`` returns (allocated on the current stream: safe to use after the call).
    """
    if not overlap or device.type != "cuda":
        side()
        return main()
    current = torch.cuda.current_stream(device)
    stream = _side_stream(device)
    stream.wait_stream(current)
    try:
        with torch.cuda.stream(stream):
            side()
        return main()
    finally:
        # Also on an error: the current stream's later work (and frees) come after the side's.
        current.wait_stream(stream)
