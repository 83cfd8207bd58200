# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""``StaticSlicesInferenceContext`` for megatron-core 0.16.x.

megatron-core 0.16's ``DynamicInferenceContext`` keeps per-request state on the device in
tensors of ``max_requests`` rows laid out as ``[paused | active | finished]``; it has no active
slices. This class adds fixed-address device copies of the active window: every step,
``initialize_attention_state`` calls :meth:`StaticSlicesInferenceContext.build_active_slices`
with the padded active request count, which copies rows ``[paused, paused + padded)`` of every
per-request tensor into rows ``[0, padded)`` of its static copy, then
:meth:`StaticSlicesInferenceContext.pad_active_slices`, which overwrites the padding rows
``[active, padded)`` with neutral values.

The static copies, allocated once: ``active_request_metadata[label]`` for every request-metadata
label; ``active_request_ids``, ``active_request_query_lengths``,
``active_request_kv_length_offsets``, ``active_request_output_lengths``; and
``active_request_last_token_idxs``, the row of each request's last token in the packed token
batch, computed on the device.
"""

from typing import Any, List

import torch
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from torch import Tensor

from megatron_ext.inference.contexts.static_slices_base import (
    ACTIVE_REQUEST_PAD_VALUES,
    REQUEST_SLICE_FIELDS,
    ActiveSlices,
    StaticSlicesContextMixin,
    pad_value,
)
from megatron_ext.inference.contexts.static_slices_buffers import SliceTable

__all__ = ["StaticSlicesInferenceContext"]


class StaticSlicesInferenceContext(StaticSlicesContextMixin, DynamicInferenceContext):
    """``DynamicInferenceContext`` with static-address active slices (megatron-core 0.16.x).

    Takes exactly the arguments of megatron-core's ``DynamicInferenceContext``. See the module
    docstring for the buffers and the per-step protocol.

    All static buffers live on the context's device. ``build_active_slices`` and
    ``pad_active_slices`` are device-only (no host synchronisation) and graph-safe for a fixed
    ``(paused, batch_size, active)`` triple; their row counts are host integers that change from
    step to step, so the context runs them eagerly once per step, as batched multi-tensor copies
    (four kernels and a cumulative sum).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._init_static_slices_state()
        super().__init__(*args, **kwargs)

    # ---------------------------------------------------------------------- allocation

    def allocate_all_tensors(self, *, is_init: bool) -> None:
        """Allocate megatron-core's tensors, then the static active slices.

        Args:
            is_init (bool): True when called from ``__init__``.
        """
        was_allocated = self.is_tensor_state_allocated
        super().allocate_all_tensors(is_init=is_init)
        if self.is_tensor_state_allocated and not was_allocated:
            self._allocate_static_slices()

    def deallocate_all_tensors(self) -> None:
        """Release megatron-core's tensors and the static active slices."""
        super().deallocate_all_tensors()
        if not self.is_tensor_state_allocated:
            # The base class deletes tensor attributes only; drop the containers too so that a
            # suspended engine actually frees the memory.
            self.active_request_metadata = None
            self._device_active_slices = None
            self._slice_table = None

    def _allocate_static_slices(self) -> None:
        device = self.request_ids.device
        rows = self.max_requests
        self.active_request_metadata = {
            label: torch.empty(rows, dtype=dtype, device=device)
            for label, dtype, *_ in self.request_metadata_types
        }
        for _, attr, _ in REQUEST_SLICE_FIELDS:
            setattr(self, attr, torch.empty(rows, dtype=torch.int32, device=device))
        self.active_request_last_token_idxs = torch.zeros(rows, dtype=torch.int32, device=device)

        # The static copies in a fixed order, with their neutral values; the last-token indices
        # are computed, not copied, so they are padded but have no source.
        statics: List[Tensor] = [getattr(self, attr) for _, attr, _ in REQUEST_SLICE_FIELDS]
        templates = [
            torch.full_like(static, ACTIVE_REQUEST_PAD_VALUES[name])
            for (name, _, _), static in zip(REQUEST_SLICE_FIELDS, statics)
        ]
        for label, static in self.active_request_metadata.items():
            statics.append(static)
            templates.append(torch.full_like(static, pad_value(label, static.dtype)))
        statics.append(self.active_request_last_token_idxs)
        templates.append(torch.zeros_like(self.active_request_last_token_idxs))
        self._slice_table = SliceTable(statics, templates)
        self._slice_table.fill_rows(0, rows)

        self._device_active_slices = ActiveSlices(
            request_ids=self.active_request_ids,
            query_lengths=self.active_request_query_lengths,
            kv_length_offsets=self.active_request_kv_length_offsets,
            output_lengths=self.active_request_output_lengths,
            last_token_idxs=self.active_request_last_token_idxs,
            metadata=self.active_request_metadata,
        )
        self.static_slices_generation += 1

    def _slice_sources(self) -> List[Tensor]:
        # Looked up on every call rather than kept: megatron-core owns these attributes.
        sources = [getattr(self, source) for _, _, source in REQUEST_SLICE_FIELDS]
        sources += [self.request_metadata[label] for label in self.active_request_metadata]
        return sources

    # ---------------------------------------------------------------------- per-step slices

    def build_active_slices(self, batch_size: int) -> None:
        """Copy rows ``[paused, paused + batch_size)`` of every per-request tensor into rows
        ``[0, batch_size)`` of its static copy, and compute the last-token indices.

        Device-only: no host synchronisation. Run every step by ``initialize_attention_state``
        with the padded active request count, clamped to ``max_requests - paused_request_count``;
        rows past the active requests hold stale data until :meth:`pad_active_slices`
        overwrites them.

        Args:
            batch_size (int): rows to copy: at least the active request count.

        Raises:
            TypeError: if batch_size is not an int.
            ValueError: if batch_size is below the active request count or reads past the
                request tensors.
            RuntimeError: if the tensor state is deallocated.
        """
        self._require_static_slices("build_active_slices")
        self._check_build_batch_size(batch_size)
        if batch_size == 0:
            return
        paused = self.paused_request_count
        self._slice_table.copy_rows(self._slice_sources(), paused, batch_size)
        src = slice(paused, paused + batch_size)
        last_token_idxs = self.active_request_last_token_idxs[:batch_size]
        torch.cumsum(self.request_query_lengths[src], dim=0, dtype=torch.int32, out=last_token_idxs)
        last_token_idxs.sub_(1)

    def pad_active_slices(self) -> None:
        """Fill rows ``[active, padded_active)`` of every static copy with neutral values.

        Device-only: no host synchronisation. See ``ACTIVE_METADATA_PAD_VALUES`` and
        ``ACTIVE_REQUEST_PAD_VALUES`` for the values.

        Raises:
            RuntimeError: if the tensor state is deallocated.
        """
        self._require_static_slices("pad_active_slices")
        active = self._active_request_count()
        padded = min(self.padded_active_request_count, self.max_requests)
        if padded <= active:
            return
        self._slice_table.fill_rows(active, padded)

    def initialize_attention_state(self, *args: Any, **kwargs: Any) -> None:
        """megatron-core's attention-state set-up, then this step's active slices.

        Args:
            *args: forwarded to ``DynamicInferenceContext.initialize_attention_state``.
            **kwargs: forwarded to ``DynamicInferenceContext.initialize_attention_state``.
        """
        super().initialize_attention_state(*args, **kwargs)
        self.build_active_slices(
            min(self.padded_active_request_count, self.max_requests - self.paused_request_count)
        )
        self.pad_active_slices()

    # ---------------------------------------------------------------------- logits rows

    @property
    def num_last_token_logits(self) -> int:
        """Rows returned by :meth:`last_token_logits` this step: one per active request.

        On 0.16.x the model forward is not captured past the decoder layers, so the logits keep
        megatron-core's active-request row count.
        """
        return self._active_request_count()

    def last_token_logits(self, logits: Tensor) -> Tensor:
        """Rows of ``logits`` at each active request's last token.

        Same values as megatron-core's version, gathered with the device-computed
        ``active_request_last_token_idxs`` instead of a fresh cumulative sum.

        Args:
            logits (Tensor): ``[1, padded_active_token_count, H]``.

        Returns:
            Tensor: ``[num_last_token_logits, H]``.
        """
        self._check_logits_shape(logits)
        self._require_static_slices("last_token_logits")
        rows = self.active_request_last_token_idxs[: self.num_last_token_logits]
        return logits.squeeze(0).index_select(0, rows)

    # ---------------------------------------------------------------------- requests

    def reset(self, *args: Any, **kwargs: Any) -> None:
        """megatron-core's ``reset``, then forget every request and re-pad the slices."""
        super().reset(*args, **kwargs)
        self._sampling_registry.clear()
        if self._device_active_slices is not None:
            self._slice_table.fill_rows(0, self.max_requests)
