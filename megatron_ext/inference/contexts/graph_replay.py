# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Replaying a fixed-shape piece of bookkeeping from a CUDA graph captured on first use."""

from typing import Callable, List, Optional

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


def capture_graph(body: Callable[[], None], device: torch.device) -> "torch.cuda.CUDAGraph":
    """Capture ``body`` (fixed shapes, no host synchronisation) in a CUDA graph.

    One eager run on a side stream first keeps lazy initialisation out of the capture; it writes
    what the first replay will write.

    Args:
        body (Callable[[], None]): the kernels to capture.
        device (torch.device): the CUDA device they run on.

    Returns:
        torch.cuda.CUDAGraph: the captured graph.
    """
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        body()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # As megatron-core's own graphs: a CUDA call from another thread of the process (a serving
    # loop, a data thread) must not invalidate this capture, which only this thread's calls feed.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        body()
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
