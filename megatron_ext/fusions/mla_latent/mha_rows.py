# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Row arithmetic the MHA form's modules share: size buckets (:func:`bucket`), each row's place
in its sequence (:func:`offsets_within`) and the one asynchronous host-to-device copy of host
indices (:func:`to_device`)."""

import numpy as np
import torch
from torch import Tensor

__all__ = ["bucket", "offsets_within", "to_device"]


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
