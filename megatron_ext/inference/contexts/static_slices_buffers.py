# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Buffers shared by the static-active-slices contexts and controllers of every megatron-core
line: several small tensors packed into one allocation (:class:`PackedBuffer`), and batched row
copies between per-request tensors and their static copies (:class:`SliceTable`)."""

from typing import Dict, List, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["PackedBuffer", "SliceTable"]


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


# Element type used to copy a field bit for bit, by element width. 8-byte fields are copied as
# pairs of 4-byte words so that they share one multi-tensor copy with the 4-byte fields.
_COPY_VIEW_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int32}


def _bits(tensor: Tensor) -> Tensor:
    """``tensor`` reinterpreted as the integer type its fields are copied as."""
    return tensor.view(_COPY_VIEW_DTYPES[tensor.dtype.itemsize])


class SliceTable:
    """Row copies between per-request tensors and their static copies, batched.

    Fields are grouped by element width and copied as raw bits, so that a step's copies take one
    multi-tensor copy kernel per group (two for the standard fields) rather than one per field.
    The row views of each (source rows, count) pair are cached: in steady decoding the same
    views serve every step.

    Args:
        statics (List[Tensor]): the static copies (1D, ``max_requests`` rows).
        templates (List[Tensor]): their neutral values, same shapes and dtypes.
    """

    _MAX_CACHED_VIEWS = 64

    def __init__(self, statics: List[Tensor], templates: List[Tensor]) -> None:
        groups: Dict[torch.dtype, List[int]] = {}
        for index, static in enumerate(statics):
            groups.setdefault(_COPY_VIEW_DTYPES[static.dtype.itemsize], []).append(index)
        self._groups = list(groups.values())
        self._statics = [_bits(static) for static in statics]
        self._templates = [_bits(template) for template in templates]
        self._factors = [
            static.dtype.itemsize // _bits(static).dtype.itemsize for static in statics
        ]
        self._views: Dict[Tuple, List[Tuple[List[Tensor], List[Tensor]]]] = {}

    def _cached(self, key: Tuple, make) -> List[Tuple[List[Tensor], List[Tensor]]]:
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= self._MAX_CACHED_VIEWS:
                self._views.clear()
            views = self._views[key] = make()
        return views

    def copy_rows(self, sources: List[Tensor], start: int, count: int) -> None:
        """Rows ``[start, start + count)`` of each source into rows ``[0, count)`` of its static
        copy; ``sources[i]`` feeds ``statics[i]``, and statics past the sources are left alone.
        Device-only."""
        # Views keep their base alive, so a source's id cannot be reused while it is cached.
        key = ("copy", start, count, tuple(map(id, sources)))

        def make():
            views = []
            for group in self._groups:
                # Static copies past the sources (computed fields) are not copied.
                group = [i for i in group if i < len(sources)]
                dst = [self._statics[i][: count * self._factors[i]] for i in group]
                src = [
                    _bits(sources[i])[start * self._factors[i] : (start + count) * self._factors[i]]
                    for i in group
                ]
                if group:
                    views.append((dst, src))
            return views

        for dst, src in self._cached(key, make):
            torch._foreach_copy_(dst, src)

    def fill_rows(self, start: int, stop: int) -> None:
        """Neutral values into rows ``[start, stop)`` of every static copy. Device-only."""

        def make():
            views = []
            for group in self._groups:
                rows = [slice(start * self._factors[i], stop * self._factors[i]) for i in group]
                dst = [self._statics[i][r] for i, r in zip(group, rows)]
                src = [self._templates[i][r] for i, r in zip(group, rows)]
                views.append((dst, src))
            return views

        for dst, src in self._cached(("fill", start, stop), make):
            torch._foreach_copy_(dst, src)
