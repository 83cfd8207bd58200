# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""A buffer shared by the static-active-slices contexts and controllers of every megatron-core
line: several small tensors packed into one allocation (:class:`PackedBuffer`)."""

from typing import Any, Dict, List, Sequence, Tuple

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
        self._fields = tuple(fields)
        size = _layout(self._fields)[1]
        self.buffer = torch.zeros(size, dtype=torch.uint8, device=device, pin_memory=pin_memory)
        self._link_views()

    def _link_views(self) -> None:
        self.views: Dict[str, Tensor] = {}
        offsets, _ = _layout(self._fields)
        for (name, dtype, numel), start in zip(self._fields, offsets):
            self.views[name] = self.buffer[start : start + dtype.itemsize * numel].view(dtype)

    def __getstate__(self) -> Dict[str, Any]:
        # pickle copies views apart from the tensor they view: the views are made again from the
        # copy's buffer.
        return {"_fields": self._fields, "buffer": self.buffer}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._link_views()

    def __getitem__(self, name: str) -> Tensor:
        return self.views[name]


def _layout(fields: Sequence[Tuple[str, torch.dtype, int]]) -> Tuple[List[int], int]:
    """Each view's byte offset (8-byte aligned, so that int64 views are legal after any field)
    and the buffer's size."""
    offsets = []
    offset = 0
    for _, dtype, numel in fields:
        offset = (offset + 7) // 8 * 8
        offsets.append(offset)
        offset += dtype.itemsize * numel
    return offsets, (offset + 7) // 8 * 8
