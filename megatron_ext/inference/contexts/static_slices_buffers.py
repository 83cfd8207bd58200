# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""A buffer shared by the static-active-slices contexts and controllers of every megatron-core
line: several small tensors packed into one allocation (:class:`PackedBuffer`)."""

from typing import Dict, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["PackedBuffer"]


class PackedBuffer:
    """Several 1D tensors of different dtypes carved out of one byte buffer.

    Lets a set of small per-request tensors move between host and device in a single copy.

    Args:
        fields (Sequence[Tuple[str, torch.dtype, int]]): (name, dtype, numel) of each view.
        device (torch.device): where to allocate.
        pin_memory (bool): pin a host allocation.
    """

    def __init__(
        self,
        fields: Sequence[Tuple[str, torch.dtype, int]],
        device: torch.device,
        pin_memory: bool = False,
    ) -> None:
        offsets = []
        offset = 0
        for _, dtype, numel in fields:
            # Align every view to 8 bytes so int64 views are legal after any field.
            offset = (offset + 7) // 8 * 8
            offsets.append(offset)
            offset += dtype.itemsize * numel
        self.buffer = torch.zeros(
            (offset + 7) // 8 * 8, dtype=torch.uint8, device=device, pin_memory=pin_memory
        )
        self.views: Dict[str, Tensor] = {}
        for (name, dtype, numel), start in zip(fields, offsets):
            self.views[name] = self.buffer[start : start + dtype.itemsize * numel].view(dtype)

    def __getitem__(self, name: str) -> Tensor:
        return self.views[name]
