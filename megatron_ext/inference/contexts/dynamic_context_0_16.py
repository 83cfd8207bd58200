# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""``StaticSlicesInferenceContext`` for megatron-core 0.16.x, which has no active slices.

The static copies (allocated once, ``max_requests`` rows): ``active_request_metadata[label]``,
``active_request_ids``, ``..._query_lengths``, ``..._kv_length_offsets``, ``..._output_lengths``
and ``active_request_last_token_idxs`` (computed on the device).

One implementation writes them, :meth:`StaticSlicesInferenceContext._write_slices`: copy some
rows from the per-request tensors, fill others with neutral values, leave the rest, with the row
counts read from a device tensor, so that one captured CUDA graph serves every call whatever the
counts. Upstream's ``build_active_slices`` and ``pad_active_slices`` are two uses of it; each
step (``initialize_attention_state``) is a third, both in one pass.

The attention metadata that megatron-core's ``initialize_attention_state`` updates is rebuilt as
``attention_context.mha_metadata_0_16``'s classes, so that a decode-only step sets it up from a
CUDA graph too, without the two read-backs of megatron-core's non-graphed metadata.
"""

from typing import Any, Dict, List

import torch
from torch import Tensor

from megatron_ext import internals
from megatron_ext.inference.contexts.attention_context.mha_metadata_0_16 import (
    with_device_counts,
)
from megatron_ext.inference.contexts.graph_replay import DeviceCounts, replay_or_run
from megatron_ext.inference.contexts.latent_cache import (
    check_latent_cache_request,
    latent_cache_request_0_16,
)
from megatron_ext.inference.contexts.static_slices_context_base import (
    ACTIVE_REQUEST_PAD_VALUES,
    REQUEST_SLICE_FIELDS,
    ActiveSlices,
    StaticSlicesContextBase,
    pad_value,
)

__all__ = ["StaticSlicesInferenceContext"]

# Integer type each field is gathered as, by element width (a bit-for-bit copy).
_BITS_BY_ITEMSIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class StaticSlicesInferenceContext(StaticSlicesContextBase):
    """``DynamicInferenceContext`` with static-address active slices (megatron-core 0.16.x).

    Takes megatron-core's arguments. Graph-safe (no host synchronisation):
    ``build_active_slices``, ``pad_active_slices``, each step's slices, and the attention
    metadata's update in decode-only steps and its reset (``mha_metadata_0_16``), replayed from
    CUDA graphs unless ``cuda_graph_active_slices`` is set to False.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._latent_cache_any_block_size = check_latent_cache_request(
            latent_cache_request_0_16(kwargs)
        )
        self._init_static_slices_state()
        self._slices_graph = None
        # An attribute, not an argument, so that the constructor keeps megatron-core's signature.
        self.cuda_graph_active_slices = True
        super().__init__(*args, **kwargs)
        with_device_counts([self.graph_attn_metadata, self.non_graph_attn_metadata], self)

    def __getstate__(self) -> Dict[str, Any]:
        # A captured CUDA graph does not pickle (the copy recaptures on first use, as after an
        # allocation), and pickle copies views apart from their tensors: the gather groups are
        # views, linked again to the copy's own tensors when it is unpickled.
        state = self.__dict__.copy()
        state["_slices_graph"] = None
        state["_gather_groups"] = None
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._device_active_slices is not None:
            self._link_gather_groups()

    @property
    def cuda_graph_active_slices(self) -> bool:
        """Whether the slices' and the attention metadata's writes replay from CUDA graphs on
        CUDA devices (default True). Setting it False runs them as launches from then on and
        frees the graphs captured so far (the allocation already captured the slices' one)."""
        return self._cuda_graph_active_slices

    @cuda_graph_active_slices.setter
    def cuda_graph_active_slices(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"cuda_graph_active_slices must be a bool, got {type(value).__name__}")
        self._cuda_graph_active_slices = value
        if not value:
            self._slices_graph = None
            self._drop_metadata_graphs()

    # ---------------------------------------------------------------------- allocation

    def allocate_all_tensors(self, *, is_init: bool) -> None:
        """Allocate megatron-core's tensors, then the static active slices."""
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
            self._slices_graph = None
            self._gather_groups = None
            self._drop_metadata_graphs()

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

        # _write_slices' inputs: [paused, copy, pad start, pad stop] on the device, the row
        # numbers, and the copied fields grouped by element width (_link_gather_groups).
        self._slice_counts = DeviceCounts(4, device)
        self._row_numbers = torch.arange(rows, dtype=torch.int64, device=device)
        self._link_gather_groups()
        self._slices_graph = None
        self._drop_metadata_graphs()

        self._device_active_slices = ActiveSlices(
            request_ids=self.active_request_ids,
            query_lengths=self.active_request_query_lengths,
            kv_length_offsets=self.active_request_kv_length_offsets,
            output_lengths=self.active_request_output_lengths,
            last_token_idxs=self.active_request_last_token_idxs,
            metadata=self.active_request_metadata,
        )
        self.static_slices_generation += 1
        self._write_slices(0, 0, 0, rows)

    def _link_gather_groups(self) -> None:
        """The copied fields grouped by element width, as views of the static copies, their
        neutral values and their sources (gathered as raw bits, one gather per group), in a
        fixed order (that of _slice_sources); the last-token indices are computed, not copied.
        The sources are megatron-core's tensors, allocated with ours and never rebound until the
        next allocation, which also drops the graph captured over them."""
        statics: List[Tensor] = [getattr(self, attr) for _, attr, _ in REQUEST_SLICE_FIELDS]
        templates = [
            torch.full_like(static, ACTIVE_REQUEST_PAD_VALUES[name])
            for (name, _, _), static in zip(REQUEST_SLICE_FIELDS, statics)
        ]
        for label, static in self.active_request_metadata.items():
            statics.append(static)
            templates.append(torch.full_like(static, pad_value(label, static.dtype)))
        groups = {}
        for static, template, source in zip(statics, templates, self._slice_sources()):
            groups.setdefault(static.dtype.itemsize, []).append((static, template, source))
        self._gather_groups = []
        for itemsize, members in groups.items():
            bits = _BITS_BY_ITEMSIZE[itemsize]
            self._gather_groups.append(
                (
                    [static.view(bits) for static, _, _ in members],
                    torch.stack([template.view(bits) for _, template, _ in members]),
                    [source.view(bits) for _, _, source in members],
                )
            )

    def _drop_metadata_graphs(self) -> None:
        # Graphs captured over the request tensors that an allocation replaces. During
        # megatron-core's __init__ the metadata tables do not exist yet.
        for table in (
            getattr(self, "graph_attn_metadata", {}),
            getattr(self, "non_graph_attn_metadata", {}),
        ):
            drop = getattr(table.get("mha_metadata"), "drop_graphs", None)
            if drop is not None:
                drop()

    def _slice_sources(self) -> List[Tensor]:
        # Looked up on every call rather than kept: megatron-core owns these attributes.
        sources = [getattr(self, source) for _, _, source in REQUEST_SLICE_FIELDS]
        sources += [self.request_metadata[label] for label in self.active_request_metadata]
        return sources

    # ---------------------------------------------------------------------- per-step slices

    def build_active_slices(self, batch_size: int) -> None:
        """Copy rows ``[paused, paused + batch_size)`` of every per-request tensor into rows
        ``[0, batch_size)`` of its static copy, and compute the last-token indices.

        Rows past ``batch_size`` keep what they held until :meth:`pad_active_slices`.

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
        self._slices_neutral_past_active = False
        self._write_slices(self.paused_request_count, batch_size, 0, 0)

    def pad_active_slices(self) -> None:
        """Fill rows ``[active, padded_active)`` of every static copy with neutral values
        (``ACTIVE_METADATA_PAD_VALUES``, ``ACTIVE_REQUEST_PAD_VALUES``).

        Raises:
            RuntimeError: if the tensor state is deallocated.
        """
        self._require_static_slices("pad_active_slices")
        active = self._active_request_count()
        padded = min(self.padded_active_request_count, self.max_requests)
        if padded > active:
            self._write_slices(self.paused_request_count, 0, active, padded)

    def initialize_attention_state(self, *args: Any, **kwargs: Any) -> None:
        """megatron-core's attention-state set-up, then this step's slices in one pass: what
        ``build_active_slices(active)`` and ``pad_active_slices()`` up to ``max_requests`` leave."""
        super().initialize_attention_state(*args, **kwargs)
        self._require_static_slices("initialize_attention_state")
        active = self._active_request_count()
        self._write_slices(self.paused_request_count, active, active, self.max_requests)
        self._slices_neutral_past_active = True

    def _pad_device_slices(self, start: int, stop: int) -> None:
        # extend_active_padding's fill, through the one implementation.
        self._write_slices(self.paused_request_count, 0, start, stop)

    def _write_slices(self, paused: int, copy: int, pad_start: int, pad_stop: int) -> None:
        """Rows ``[0, copy)`` of each static copy from rows ``paused..`` of its source, rows
        ``[pad_start, pad_stop)`` neutral, the others unchanged (``copy <= pad_start`` where both
        are given). Replays the one graph of :meth:`_write_slices_from_device_counts` on CUDA."""
        self._slice_counts.write(paused, copy, pad_start, pad_stop)
        self._slices_graph = replay_or_run(
            self._write_slices_from_device_counts,
            self._slices_graph,
            self._slice_counts.tensor.device,
            self.cuda_graph_active_slices,
        )

    def _write_slices_from_device_counts(self) -> None:
        """GRAPH-SAFE body of :meth:`_write_slices`: every shape is ``max_requests`` rows, and
        the counts are read from ``_slice_counts`` on the device."""
        paused, copy, pad_start, pad_stop = self._slice_counts.tensor.unbind(0)
        rows = self._row_numbers
        copied = rows < copy
        padded = (rows >= pad_start) & (rows < pad_stop)
        # Rows that are not copied read a clamped, in-bounds row and discard it.
        index = torch.clamp(rows + paused, max=self.max_requests - 1)
        for statics, templates, sources in self._gather_groups:
            gathered = torch.stack(sources).index_select(1, index)
            kept = torch.where(padded, templates, torch.stack(statics))
            internals.foreach_copy_(statics, torch.where(copied, gathered, kept).unbind(0))
        lengths = torch.where(copied, self.request_query_lengths.index_select(0, index), 0)
        last = torch.cumsum(lengths, dim=0, dtype=torch.int32).sub_(1)
        neutral = ACTIVE_REQUEST_PAD_VALUES["last_token_idxs"]
        kept = torch.where(padded, neutral, self.active_request_last_token_idxs)
        self.active_request_last_token_idxs.copy_(torch.where(copied, last, kept))

    # ---------------------------------------------------------------------- logits rows

    @property
    def num_last_token_logits(self) -> int:
        """Rows returned by :meth:`last_token_logits`: one per active request, as megatron-core."""
        return self._active_request_count()

    def last_token_logits(self, logits: Tensor) -> Tensor:
        """megatron-core's rows of ``logits``, gathered with ``active_request_last_token_idxs``.

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
            self._write_slices(0, 0, 0, self.max_requests)
