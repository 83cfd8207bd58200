# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""``StaticSlicesInferenceContext`` for megatron-core 0.19.x.

megatron-core 0.19 already builds ``active_request_metadata`` and the last-token indices itself,
in pinned host memory that it publishes to the GPU once per step. This class reuses upstream's
``build_active_slices``/``pad_active_slices`` unchanged and does its own additions (the request
tensors upstream does not slice, padding of every label where upstream pads only the sampling
parameters, one copy of the whole set to the GPU) in ``publish_active_slices``, which its caller
runs after ``initialize_attention_state``. A step whose consumer reads none of the slices (the
engine sampling with megatron-core's own sampler) skips it and costs what stock costs.
"""

from typing import Any, Dict, List, Optional, Tuple

import torch
from megatron.core.inference.config import AsyncScheduleMode
from torch import Tensor

from megatron_ext.inference.contexts.latent_cache import (
    check_latent_cache_request,
    latent_cache_request_0_19,
)
from megatron_ext.inference.contexts.static_slices_buffers import PackedBuffer
from megatron_ext.inference.contexts.static_slices_context_base import (
    ACTIVE_REQUEST_PAD_VALUES,
    REQUEST_SLICE_FIELDS,
    ActiveSlices,
    StaticSlicesContextBase,
    pad_value,
)

__all__ = ["StaticSlicesInferenceContext"]

# megatron-core's attribute holding the event its bookkeeping copy records.
_BOOKKEEPING_EVENT = "_bookkeeping_h2d_done_event"


class StaticSlicesInferenceContext(StaticSlicesContextBase):
    """``DynamicInferenceContext`` with static-address active slices (megatron-core 0.19.x).

    Takes exactly the arguments of megatron-core's ``DynamicInferenceContext``. Upstream already
    slices and pads the request metadata (host side) and the last-token indices; this class adds
    the request ids and lengths to the host slices, pads every metadata label, and mirrors all of
    them on the device with one copy per step.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._latent_cache_any_block_size = check_latent_cache_request(
            latent_cache_request_0_19(args, kwargs)
        )
        self._init_static_slices_state()
        # (build_active_slices' batch size, whether pad_active_slices ran) of the step built last,
        # until it is published; None once update_requests has changed the rows it would copy.
        # The paused, active and padded counts it needs do not change before update_requests.
        self._built_step: Optional[Tuple[int, bool]] = None
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
        for label, values in self.active_request_metadata.items():
            self._ext_host[f"metadata:{label}"].copy_(values)
        self._link_static_slices()
        self._pad_all_rows()
        self._ext_device.buffer.copy_(self._ext_host.buffer)
        self.static_slices_generation += 1

    def _link_static_slices(self) -> None:
        """Point upstream's host metadata slices, the request slices and the device slices at
        the packed buffers' views."""
        for label in list(self.active_request_metadata):
            self.active_request_metadata[label] = self._ext_host[f"metadata:{label}"]
        for name, attr, _ in REQUEST_SLICE_FIELDS:
            setattr(self, attr, self._ext_host[name])
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

    def __getstate__(self) -> Dict[str, Any]:
        # megatron-core's event marking its bookkeeping copy is a CUDA event, which does not
        # pickle (so on CUDA its own context does not either): the copy gets a fresh one.
        state = self.__dict__.copy()
        if _BOOKKEEPING_EVENT in state:
            state[_BOOKKEEPING_EVENT] = None
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # pickle copies views apart from the tensor they view: the packed buffers make their
        # views again (PackedBuffer), and the slices are pointed at them. (megatron-core's own
        # ContextGPUView is views of one buffer too, which its pickled copy loses.)
        self.__dict__.update(state)
        if _BOOKKEEPING_EVENT in state:
            # As megatron-core's constructor makes it. Unrecorded, as the copy has no step of
            # its own in flight: a step records it before anything waits on it.
            setattr(self, _BOOKKEEPING_EVENT, torch.cuda.Event())
        if self._device_active_slices is not None:
            self._link_static_slices()

    def _pad_rows(self, pad: slice) -> None:
        for label, view in self.active_request_metadata.items():
            view[pad] = pad_value(label, view.dtype)
        for name, attr, _ in REQUEST_SLICE_FIELDS:
            getattr(self, attr)[pad] = ACTIVE_REQUEST_PAD_VALUES[name]

    def _pad_all_rows(self) -> None:
        self._pad_rows(slice(0, self.max_requests))
        self.active_request_last_token_idxs.zero_()

    def build_active_slices(self, batch_size: int) -> None:
        """Upstream's slicing (metadata and last-token indices, host-side on this release); the
        request ids and lengths follow in :meth:`publish_active_slices`.

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
        self._built_step = (batch_size, False)
        self._active_slices_published = False

    def pad_active_slices(self) -> None:
        """Upstream's padding of the sampling parameters; every other label and the request ids
        and lengths are padded in :meth:`publish_active_slices` (see
        ``ACTIVE_METADATA_PAD_VALUES``)."""
        self._require_static_slices("pad_active_slices")
        super().pad_active_slices()
        if self._built_step is not None:
            self._built_step = (self._built_step[0], True)

    def _publish_active_slices(self) -> None:
        """The request ids and lengths into the host slices, every label's padding, then one
        copy of the whole set to the device."""
        if self._built_step is None:
            raise RuntimeError(
                "publish_active_slices: update_requests() ran after this step's "
                "build_active_slices(), so its rows are gone; publish before update_requests()"
            )
        batch_size, padded_too = self._built_step
        paused = self.paused_request_count
        src = slice(paused, paused + batch_size)
        for _, attr, source in REQUEST_SLICE_FIELDS:
            getattr(self, attr)[:batch_size] = getattr(self, source)[src]
        active = self._active_request_count()
        padded = min(self.padded_active_request_count, self.max_requests)
        if padded_too and padded > active:
            self._pad_rows(slice(active, padded))
        # In legacy scheduling the pinned source is rewritten only by the next step's
        # build_active_slices, after this step's sampled tokens were read back (a stream sync);
        # async scheduling re-stages the host buffers while copies are in flight.
        legacy = self.config.async_sched_mode == AsyncScheduleMode.LEGACY
        self._ext_device.buffer.copy_(self._ext_host.buffer, non_blocking=legacy)

    def update_requests(self, *args: Any, **kwargs: Any) -> Any:
        """megatron-core's ``update_requests`` (see the mixin); an unpublished step can no longer
        be published, since the request tensors it would copy from change here."""
        self._built_step = None
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
        self._built_step = None
        self._sampling_registry.clear()
        if self._device_active_slices is not None:
            self._pad_all_rows()
            self._ext_device.buffer.copy_(self._ext_host.buffer)
        self._active_slices_published = True
