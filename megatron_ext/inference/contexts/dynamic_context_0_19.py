# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""``StaticSlicesInferenceContext`` for megatron-core 0.19.x.

megatron-core 0.19 already builds ``active_request_metadata`` and the last-token indices itself,
in pinned host memory that it publishes to the GPU once per step. This class reuses upstream's
``build_active_slices``/``pad_active_slices``, adds the request tensors upstream does not slice,
pads every label (upstream pads only the sampling parameters) and publishes its additions to the
GPU in one copy, next to upstream's own bookkeeping transfer.
"""

from typing import Any, List, Optional, Tuple

import torch
from megatron.core.inference.config import AsyncScheduleMode
from torch import Tensor

from megatron_ext.inference.contexts.static_slices_buffers import PackedBuffer
from megatron_ext.inference.contexts.static_slices_context_base import (
    ACTIVE_REQUEST_PAD_VALUES,
    REQUEST_SLICE_FIELDS,
    ActiveSlices,
    StaticSlicesContextBase,
    pad_value,
)

__all__ = ["StaticSlicesInferenceContext"]


class StaticSlicesInferenceContext(StaticSlicesContextBase):
    """``DynamicInferenceContext`` with static-address active slices (megatron-core 0.19.x).

    Takes exactly the arguments of megatron-core's ``DynamicInferenceContext``. Upstream already
    slices and pads the request metadata (host side) and the last-token indices; this class adds
    the request ids and lengths to the host slices, pads every metadata label, and mirrors all of
    them on the device with one copy per step.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._init_static_slices_state()
        # When False, the additions to upstream's slicing (host copies, padding, the device
        # copy) wait until device_active_slices is read: a controller that samples with
        # megatron-core's own sampler reads none of them, and must not pay for them every step.
        # A plain attribute so that the constructor keeps megatron-core's exact signature.
        self.publish_static_slices_every_step = True
        # (paused count, batch size, active count, padded count) of a deferred step.
        self._pending_static_slices: Optional[Tuple[int, int, int, int]] = None
        super().__init__(*args, **kwargs)

    def initialize_all_tensors(self) -> None:
        """Allocate megatron-core's tensors, then the static active slices."""
        was_allocated = self.is_tensor_state_allocated
        super().initialize_all_tensors()
        if self.is_tensor_state_allocated and not was_allocated:
            self._allocate_static_slices()

    def _allocate_static_slices(self) -> None:
        rows = self.max_requests
        device = self.gpu_view._buf.device
        fields: List[Tuple[str, torch.dtype, int]] = [
            (f"metadata:{label}", dtype, rows) for label, dtype, *_ in self.request_metadata_types
        ]
        fields += [(name, torch.int32, rows) for name, _, _ in REQUEST_SLICE_FIELDS]
        self._ext_host = PackedBuffer(fields, torch.device("cpu"), pin_memory=True)
        self._ext_device = PackedBuffer(fields, device)

        # Re-home upstream's host metadata slices into the packed buffer so the whole set crosses
        # to the device in one copy; upstream reads them through the dict.
        for label in list(self.active_request_metadata):
            view = self._ext_host[f"metadata:{label}"]
            view.copy_(self.active_request_metadata[label])
            self.active_request_metadata[label] = view
        for name, attr, _ in REQUEST_SLICE_FIELDS:
            setattr(self, attr, self._ext_host[name])
        self._pad_all_rows()

        metadata = {
            label: self._ext_device[f"metadata:{label}"] for label in self.active_request_metadata
        }
        self._device_active_slices = ActiveSlices(
            request_ids=self._ext_device["request_ids"],
            query_lengths=self._ext_device["query_lengths"],
            kv_length_offsets=self._ext_device["kv_length_offsets"],
            output_lengths=self._ext_device["output_lengths"],
            last_token_idxs=self.gpu_view.active_request_last_token_idxs,
            metadata=metadata,
        )
        self.static_slices_generation += 1

    def _pad_rows(self, pad: slice) -> None:
        for label, view in self.active_request_metadata.items():
            view[pad] = pad_value(label, view.dtype)
        for name, attr, _ in REQUEST_SLICE_FIELDS:
            getattr(self, attr)[pad] = ACTIVE_REQUEST_PAD_VALUES[name]

    def _pad_all_rows(self) -> None:
        self._pad_rows(slice(0, self.max_requests))
        self.active_request_last_token_idxs.zero_()

    def build_active_slices(self, batch_size: int) -> None:
        """Upstream's slicing (metadata and last-token indices), plus the request ids and
        lengths. Host-side on this release (the bookkeeping lives in pinned host memory).

        With ``publish_static_slices_every_step`` False, the request ids and lengths are copied
        when ``device_active_slices`` is next read, before ``update_requests``.

        Args:
            batch_size (int): rows to copy: at least the active request count.

        Raises:
            TypeError: if batch_size is not an int.
            ValueError: if batch_size is below the active request count or reads past the
                request tensors.
        """
        self._require_static_slices("build_active_slices")
        self._check_build_batch_size(batch_size)
        super().build_active_slices(batch_size)
        if not self.publish_static_slices_every_step:
            self._pending_static_slices = (self.paused_request_count, batch_size, 0, 0)
            return
        self._copy_request_slices(self.paused_request_count, batch_size)

    def _copy_request_slices(self, paused: int, batch_size: int) -> None:
        src = slice(paused, paused + batch_size)
        for _, attr, source in REQUEST_SLICE_FIELDS:
            getattr(self, attr)[:batch_size] = getattr(self, source)[src]

    def pad_active_slices(self) -> None:
        """Upstream's padding of the sampling parameters, plus every other label and the request
        ids and lengths (see ``ACTIVE_METADATA_PAD_VALUES``); deferred like
        ``build_active_slices``."""
        self._require_static_slices("pad_active_slices")
        super().pad_active_slices()
        active = self._active_request_count()
        padded = min(self.padded_active_request_count, self.max_requests)
        pending = self._pending_static_slices
        if pending is not None:
            self._pending_static_slices = (pending[0], pending[1], active, padded)
            return
        if padded > active:
            self._pad_rows(slice(active, padded))

    def _publish_pending_static_slices(self) -> None:
        """Do a deferred step's additions now: the same host copies and padding as
        ``build_active_slices``/``pad_active_slices``, then the device copy."""
        pending, self._pending_static_slices = self._pending_static_slices, None
        if pending is None:
            return
        paused, batch_size, active, padded = pending
        self._copy_request_slices(paused, batch_size)
        if padded > active:
            self._pad_rows(slice(active, padded))
        self._ext_device.buffer.copy_(self._ext_host.buffer)

    def transfer_bookkeeping_to_gpu(self, *args: Any, **kwargs: Any) -> Any:
        """Publish the static slices to the device (unless deferred), then upstream's
        bookkeeping.

        Our copy is enqueued first so that the event upstream may record after its own transfer
        also covers it.
        """
        deferred = self._pending_static_slices is not None
        if not deferred and self.config.async_sched_mode == AsyncScheduleMode.LEGACY:
            # The pinned source is rewritten only by the next step's build_active_slices, which
            # runs after this step's sampled tokens were read back (a stream sync).
            self._ext_device.buffer.copy_(self._ext_host.buffer, non_blocking=True)
        elif not deferred:
            # Async scheduling re-stages the host buffers while copies are in flight.
            self._ext_device.buffer.copy_(self._ext_host.buffer)
        return super().transfer_bookkeeping_to_gpu(*args, **kwargs)

    def update_requests(self, *args: Any, **kwargs: Any) -> Any:
        """megatron-core's ``update_requests`` (see the mixin); a deferred step's additions are
        dropped, since the request tensors they would copy from change here."""
        self._pending_static_slices = None
        return super().update_requests(*args, **kwargs)

    def last_token_logits(self, logits: Tensor) -> Tensor:
        """Upstream's last-token gather, with bad shapes rejected by ValueError.

        Args:
            logits (Tensor): ``[1, padded_active_token_count, H]``.

        Returns:
            Tensor: ``[num_last_token_logits, H]``.
        """
        self._check_logits_shape(logits)
        return super().last_token_logits(logits)

    def reset(self, *args: Any, **kwargs: Any) -> None:
        """megatron-core's ``reset``, then forget every request and re-pad the slices."""
        super().reset(*args, **kwargs)
        self._pending_static_slices = None
        self._sampling_registry.clear()
        if self._device_active_slices is not None:
            self._pad_all_rows()
