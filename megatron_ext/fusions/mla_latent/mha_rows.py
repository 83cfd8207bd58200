# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Row arithmetic the MHA form's modules share: size buckets (:func:`bucket`), each row's place
in its sequence (:func:`offsets_within`), the one asynchronous host-to-device copy of host
indices (:func:`to_device`), and the keeping of what a step's layers share (:func:`kept_for_step`:
built once from the step's host lengths, with such copies in it)."""

from typing import Callable, Hashable, TypeVar

import numpy as np
import torch
from torch import Tensor

from megatron_ext import internals
from megatron_ext.fusions.launch_plans import PlanCache

__all__ = ["bucket", "kept_for_step", "offsets_within", "to_device"]

Kept = TypeVar("Kept")


def bucket(value: int, minimum: int = 16) -> int:
    """``value`` rounded up to ``m * 2**k`` with ``m`` in 4..7 (at most 25% more), at least
    ``minimum``: few distinct sizes, so that a backend that plans per shape replans rarely.

    Args:
        value: a size >= 0.
        minimum: the smallest bucket.

    Returns:
        int: the bucket.
    """
    value = max(int(value), minimum)
    shift = max(value.bit_length() - 3, 0)
    return -(-value >> shift) << shift


def offsets_within(lengths: np.ndarray) -> np.ndarray:
    """0..length-1 for each length, concatenated."""
    total = int(lengths.sum())
    starts = np.cumsum(lengths) - lengths
    return np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)


def to_device(array: np.ndarray, device: torch.device) -> Tensor:
    """One int32 host-to-device copy (pinned and asynchronous on CUDA: no host synchronisation)."""
    host = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def kept_for_step(
    cache: PlanCache, key: Hashable, device: torch.device, build: Callable[[], Kept]
) -> Kept:
    """``cache``'s entry for ``key`` on the current stream, built by ``build`` on a miss.

    What is kept holds device arrays written by copies queued on the stream current when it was
    built (:func:`to_device`) and only read after; the stream is part of the key, so another
    stream builds its own.

    Args:
        cache: where the step's entries are kept.
        key: what the entry depends on (the step's lengths and the layout), hashable.
        device: where the step runs.
        build: makes the entry.

    Returns:
        the entry.
    """
    stream = None
    if device.type == "cuda":
        # The raw stream handle, without the public call's Stream object (a few microseconds
        # per layer, with each cache's lookup).
        index = device.index if device.index is not None else internals.cuda_current_device()
        stream = internals.cuda_current_raw_stream(index)
    full_key = (key, device, stream)
    kept = cache.get(full_key)
    if kept is None:
        kept = cache.put(full_key, build())
    return kept
