# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Replaying a fixed-shape piece of bookkeeping from a CUDA graph captured on first use."""

import gc
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor


class DeviceCounts:
    """Integers a captured graph reads from the device, with a host copy of what they hold so
    that a call fills only the ones that changed (in steady decoding, usually none)."""

    def __init__(self, count: int, device: torch.device) -> None:
        self.tensor: Tensor = torch.zeros(count, dtype=torch.int64, device=device)
        self._written: List[int] = [0] * count

    def write(self, *values: int) -> None:
        """Set the counts (one value each, in order); no host synchronisation."""
        for index, value in enumerate(values):
            if self._written[index] != value:
                self.tensor[index].fill_(value)
                self._written[index] = value


def capture_graph(
    body: Callable[[], None],
    device: torch.device,
    *,
    pool: Optional[Tuple[int, int]] = None,
    generator: Optional[torch.Generator] = None,
) -> "torch.cuda.CUDAGraph":
    """Capture ``body`` (fixed shapes, no host synchronisation) in a CUDA graph.

    One eager run on a side stream first keeps lazy initialisation out of the capture; it writes
    what the first replay will write. The capture runs on that side stream too, and the current
    stream waits for it before anything else: torch resets the seed and offset tensors of every
    generator a graph reads on the capture stream just before capturing, and the first replay
    sets them on the current stream; unordered, a late reset made that replay draw from offset 0
    (only under load, as when other processes share the GPU).

    Args:
        body (Callable[[], None]): the kernels to capture.
        device (torch.device): the CUDA device they run on.
        pool (Optional[Tuple[int, int]]): a memory pool shared with other graphs
            (``torch.cuda.graph_pool_handle()``), or None for the graph's own.
        generator (Optional[torch.Generator]): a CUDA generator ``body`` draws from: the warm-up
            leaves its state as it was, and replays advance it as eager calls would.

    Returns:
        torch.cuda.CUDAGraph: the captured graph.

    Raises:
        RuntimeError: if a generator is given and torch cannot register it with a graph.
    """
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(current)
    state = generator.get_state() if generator is not None else None
    with torch.cuda.stream(side):
        body()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    if generator is not None:
        generator.set_state(state)  # the warm-up draws nothing
        register = getattr(graph, "register_generator_state", None)
        if register is None:
            raise RuntimeError(
                "capturing random draws needs torch.cuda.CUDAGraph.register_generator_state "
                "(torch >= 2.5)"
            )
        register(generator)
    # As megatron-core's own graphs: a CUDA call from another thread of the process (a serving
    # loop, a data thread) must not invalidate this capture, which only this thread's calls feed.
    # Nor may this thread's garbage collector: a finalizer it runs mid-capture (an old graph, its
    # memory pool) could make a call that capture forbids. torch collects just before capturing.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
            body()
    finally:
        if collecting:
            gc.enable()
    current.wait_stream(side)
    return graph


def replay_or_run(
    body: Callable[[], None],
    graph: Optional["torch.cuda.CUDAGraph"],
    device: torch.device,
    use_graph: bool,
) -> Optional["torch.cuda.CUDAGraph"]:
    """Run ``body`` once: from its graph on a CUDA device (capturing it on first use), eagerly
    elsewhere or inside someone else's capture (where its kernels join that graph).

    Args:
        body (Callable[[], None]): the kernels.
        graph (Optional[torch.cuda.CUDAGraph]): the graph captured by an earlier call, or None.
        device (torch.device): where the tensors ``body`` touches live.
        use_graph (bool): False runs eagerly even on CUDA.

    Returns:
        Optional[torch.cuda.CUDAGraph]: the graph to pass next time (None when run eagerly).
    """
    if not use_graph or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        body()
        return graph
    if graph is None:
        graph = capture_graph(body, device)
    graph.replay()
    return graph
