# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Two independent parts of a step at once: one on a side stream, one on the current stream.

Neither part of a 16-head mixed step fills the GPU on its own: a few requests' decode programs,
or one cuDNN call of a 512-token chunk (64 tiles of 128 queries on 132 SMs). Two users:

* the split step (:mod:`megatron_ext.transformer.mla_dynamic_inference`): the leading decodes in
  the absorbed form on a side stream, the chunk in the MHA form on the current one;
* the MHA form (:mod:`megatron_ext.fusions.mla_latent.mha_form`): a chunk's attention calls
  whose partials are merged (the queries over the cached rows, over their own rows) side by side.

The second runs inside the first's current-stream part, so each nesting level takes a side
stream of its own (a shared one would queue the inner side part behind the outer one's).

What the side part allocates comes from the side stream's pool. Tensors it returns are handed
over to the current stream (``record_stream``), so that the caching allocator does not give
their memory to later side-stream work while the current stream may still read it; under graph
capture the allocator defers that reuse to the capture's end.

The fork and the join are event edges: two events per side stream, made once and re-recorded
(a fork per chunk and layer is on an eager step's host path).
"""

import threading
from typing import Any, Callable, Tuple, TypeVar

import torch

__all__ = ["side_by_side"]

S = TypeVar("S")
T = TypeVar("T")

_local = threading.local()


def _side(
    device: torch.device, depth: int
) -> Tuple[torch.cuda.Stream, torch.cuda.Event, torch.cuda.Event]:
    """This thread's side stream of nesting level ``depth`` on ``device`` with its fork and join
    events (per thread, so that two threads stepping engines never order each other's work).
    The events are made once and re-recorded: a wait already queued keeps the record it saw."""
    slots = getattr(_local, "slots", None)
    if slots is None:
        slots = _local.slots = {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    slot = slots.get((index, depth))
    if slot is None:
        slot = slots[(index, depth)] = (
            torch.cuda.Stream(index),
            torch.cuda.Event(),
            torch.cuda.Event(),
        )
    return slot


def _side_stream(device: torch.device, depth: int = 0) -> torch.cuda.Stream:
    """This thread's side stream of nesting level ``depth`` on ``device``."""
    return _side(device, depth)[0]


def _hand_over(value: Any, stream: torch.cuda.Stream) -> None:
    """Mark the tensors of ``value`` (a tensor, or a tuple or list nesting them) as used on
    ``stream``."""
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            value.record_stream(stream)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _hand_over(item, stream)


def side_by_side(
    side: Callable[[], S], main: Callable[[], T], device: torch.device, overlap: bool = True
) -> Tuple[S, T]:
    """Run ``side`` on a side stream of ``device`` and ``main`` on the current stream, both
    after the current stream's work so far; the current stream then waits for both. Serial
    (``side`` then ``main``) off CUDA or with ``overlap`` False. Capture-safe: the fork and the
    join are event edges, which a CUDA graph records, and nothing synchronises the host.

    Args:
        side: the part on the side stream. It may return tensors (alone or in tuples or lists):
            they are handed over to the current stream.
        main: the other part.
        device: where both run.
        overlap: False runs the two in order on the current stream (the same bits: the parts
            are independent; for comparing the two in one process).

    Returns:
        Tuple[S, T]: what ``side`` and ``main`` return, both safe to use on the current stream
        after the call.

    Raises:
        TypeError: for a ``device`` that is not a torch.device, an ``overlap`` that is not a
            bool, or parts that are not callable, before either part runs.
    """
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device, got {type(device).__name__}")
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool, got {type(overlap).__name__}")
    for name, part in (("side", side), ("main", main)):
        if not callable(part):
            raise TypeError(f"{name} must be callable, got {type(part).__name__}")
    if not overlap or device.type != "cuda":
        side_result = side()
        return side_result, main()
    current = torch.cuda.current_stream(device)
    depth = getattr(_local, "depth", 0)
    stream, forked, joined = _side(device, depth)
    forked.record(current)
    stream.wait_event(forked)
    _local.depth = depth + 1
    try:
        # set_stream rather than the stream context: a fork per chunk and layer, on the host path.
        torch.cuda.set_stream(stream)
        try:
            side_result = side()
        finally:
            torch.cuda.set_stream(current)
        _hand_over(side_result, current)
        return side_result, main()
    finally:
        _local.depth = depth
        # Also on an error: the current stream's later work (and frees) come after the side's.
        joined.record(stream)
        current.wait_event(joined)
