# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""megatron-core 0.16's attention metadata, updated without host synchronisation in decode steps.

megatron-core 0.16's ``MHAMetadata.update`` copies and pads five buffers with about twenty
launches whose shapes depend on the request counts, and its non-graphed variant then reads two
maxima back to the host (``.item()``). :class:`DeviceCountsMHAMetadataMixin` writes the same five
buffers in decode-only steps with fixed-shape kernels that read the counts from a device tensor,
replayed from one CUDA graph, and reports what megatron-core's graphed metadata reports: query
length 1 and the context's ``max_sequence_length`` as ``max_seqlen_k``. megatron-core's decode
attention (flash-attn's paged decode, FlashMLA) reads neither maximum, so what the layers compute
is unchanged; only the one host integer differs from the non-graphed class's exact maximum. Every
other step is megatron-core's ``update`` unchanged.
"""

import weakref
from typing import Any, Callable, Dict, List, Optional, Type

import torch
from megatron.core.inference.contexts.attention_context.mha_metadata import (
    GraphedMHAMetadata,
    MHAMetadata,
    NonGraphedMHAMetadata,
)
from torch import Tensor

from megatron_ext.inference.contexts.graph_replay import DeviceCounts, replay_or_run

__all__ = [
    "DeviceCountsGraphedMHAMetadata",
    "DeviceCountsMHAMetadataMixin",
    "DeviceCountsNonGraphedMHAMetadata",
    "with_device_counts",
]


class DeviceCountsMHAMetadataMixin:
    """``update`` and ``reset`` of megatron-core 0.16's ``MHAMetadata`` replayed from CUDA graphs.

    Bound to a context with :meth:`bind_context`; the context's ``paused_request_count`` and its
    request tensors are the rows a decode step's ``update`` reads. Graph-safe (no host
    synchronisation, fixed shapes): ``update`` in decode-only steps and ``reset``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        device = self._block_table_buf.device
        # [paused, real, padded] request counts.
        self._counts = DeviceCounts(3, device)
        self._rows = torch.arange(self.max_bs, dtype=torch.int64, device=device)
        self._context_ref: Optional[Callable[[], Any]] = None
        self._update_graph: Optional["torch.cuda.CUDAGraph"] = None
        self._reset_graph: Optional["torch.cuda.CUDAGraph"] = None

    def __getstate__(self) -> Dict[str, Any]:
        # A weak reference does not pickle: the context goes in as itself (pickle keeps it one
        # object with the context that owns this), and the graphs, which do not pickle either,
        # are recaptured on first use.
        state = self.__dict__.copy()
        state["_context_ref"] = self._context_ref() if self._context_ref is not None else None
        state["_update_graph"] = state["_reset_graph"] = None
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        context = state.pop("_context_ref")
        self.__dict__.update(state)
        self._context_ref = weakref.ref(context) if context is not None else None

    def bind_context(self, context: Any) -> None:
        """Read decode steps' rows from ``context`` (held weakly: the context owns this object).

        Args:
            context: a megatron-core 0.16 ``DynamicInferenceContext``.
        """
        self._context_ref = weakref.ref(context)
        self.drop_graphs()

    def _use_graph(self) -> bool:
        # The bound context's switch for its slices' graphs covers these too.
        context = self._context_ref() if self._context_ref is not None else None
        return bool(getattr(context, "cuda_graph_active_slices", True))

    def drop_graphs(self) -> None:
        """Forget the captured graphs: the context's request tensors were reallocated."""
        self._update_graph = None
        self._reset_graph = None

    def _decode_rows_source(
        self, query_lengths: Tensor, kv_offsets: Tensor, block_ids: Tensor
    ) -> Optional[Any]:
        """The bound context when the three views are its request tensors from the paused row on
        (what its ``initialize_attention_state`` passes), else None."""
        context = self._context_ref() if self._context_ref is not None else None
        if context is None:
            return None
        paused = context.paused_request_count
        for view, full in (
            (query_lengths, context.request_query_lengths),
            (kv_offsets, context.request_kv_length_offsets),
            (block_ids, context.request_to_kv_block_ids),
        ):
            # Storage and offset rather than data_ptr(), which is 0 for an empty view.
            same_storage = view.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
            offset = full.storage_offset() + paused * full.stride(0)
            if (
                not same_storage
                or view.storage_offset() != offset
                or view.stride() != full.stride()
            ):
                return None
        return context

    def update(
        self,
        request_query_lengths: Tensor,
        request_kv_length_offsets: Tensor,
        request_to_kv_block_ids: Tensor,
        batch_dimensions: Any,
        padded_batch_dimensions: Any,
    ) -> None:
        """megatron-core's ``update``; in a decode-only step of the bound context, the same
        buffers from device-side counts (see the module docstring).

        Args:
            request_query_lengths (Tensor): ``[real]`` view of the context's query lengths.
            request_kv_length_offsets (Tensor): ``[real]`` view of its KV length offsets.
            request_to_kv_block_ids (Tensor): ``[real, max_kv_blocks]`` view of its block ids.
            batch_dimensions: the step's real ``InferenceBatchDimensions``.
            padded_batch_dimensions: its padded ``InferenceBatchDimensions``.

        Raises:
            ValueError: if the request counts do not fit the buffers or the views.
        """
        # A step without requests keeps megatron-core's maxima (0 rather than 1).
        decode = batch_dimensions.req_count > 0 and batch_dimensions.prefill_req_count == 0
        decode = decode and padded_batch_dimensions.prefill_req_count == 0
        context = None
        if decode:
            context = self._decode_rows_source(
                request_query_lengths, request_kv_length_offsets, request_to_kv_block_ids
            )
        if context is None:
            super().update(
                request_query_lengths,
                request_kv_length_offsets,
                request_to_kv_block_ids,
                batch_dimensions,
                padded_batch_dimensions,
            )
            return
        real, padded = batch_dimensions.req_count, padded_batch_dimensions.req_count
        if not real <= padded <= self.max_bs:
            raise ValueError(
                f"attention metadata: need requests ({real}) <= padded requests ({padded}) "
                f"<= max_requests ({self.max_bs})"
            )
        for view in (request_query_lengths, request_kv_length_offsets, request_to_kv_block_ids):
            if view.shape[0] != real:
                raise ValueError(
                    f"attention metadata: a request view has {view.shape[0]} rows, the step has "
                    f"{real} requests"
                )
        self._counts.write(context.paused_request_count, real, padded)
        self._update_graph = replay_or_run(
            lambda: self._write_decode_buffers(context),
            self._update_graph,
            self._counts.tensor.device,
            self._use_graph(),
        )
        # megatron-core's graphed update reports these two; its decode attention reads neither.
        self._max_seqlen_q = 1
        self._max_seqlen_k = self.max_seqlen
        # The same views megatron-core's update publishes (host-side slicing, no launch).
        self.state_data = {
            "query_lengths": self._query_lengths_buf[:padded],
            "cu_query_seq_lengths": self._cu_query_seq_lengths_buf[: padded + 1],
            "cu_kv_seq_lengths": self._cu_kv_seq_lengths_buf[: padded + 1],
            "kv_seq_lengths": self._kv_seq_lengths_buf[:padded],
            "block_table": self._block_table_buf[0:padded, :],
            "max_seqlen_q": self._max_seqlen_q,
            "max_seqlen_k": self._max_seqlen_k,
        }

    def _write_decode_buffers(self, context: Any) -> None:
        """GRAPH-SAFE: rows ``[0, real)`` of the buffers from the context's rows ``paused..``,
        rows ``[real, padded)`` padded as megatron-core pads them, later rows unchanged; the
        cumulative buffers' entry 0 is 0 and their padding repeats the total."""
        paused, real, padded = self._counts.tensor.unbind(0)
        rows = self._rows
        copied = rows < real
        live = rows < padded
        index = torch.clamp(rows + paused, max=context.request_query_lengths.shape[0] - 1)
        query = torch.where(copied, context.request_query_lengths.index_select(0, index), 0)
        offsets = context.request_kv_length_offsets.index_select(0, index)
        kv = torch.where(copied, offsets + query, 0)
        blocks = context.request_to_kv_block_ids.index_select(0, index)
        table = torch.where(copied.unsqueeze(1), blocks, -1)
        self._block_table_buf.copy_(torch.where(live.unsqueeze(1), table, self._block_table_buf))
        for buffer, cumulative, values in (
            (self._query_lengths_buf, self._cu_query_seq_lengths_buf, query),
            (self._kv_seq_lengths_buf, self._cu_kv_seq_lengths_buf, kv),
        ):
            buffer.copy_(torch.where(live, values, buffer))
            total = torch.cumsum(values, dim=0, dtype=cumulative.dtype)
            cumulative[:1].zero_()
            cumulative[1:].copy_(torch.where(live, total, cumulative[1:]))

    def reset(self) -> None:
        """megatron-core's ``reset`` (five zero fills), replayed from a CUDA graph."""
        self._reset_graph = replay_or_run(
            lambda: MHAMetadata.reset(self),
            self._reset_graph,
            self._counts.tensor.device,
            self._use_graph(),
        )
        # Host-side part of megatron-core's reset, which a replay does not repeat.
        self._max_seqlen_q = 0
        self._max_seqlen_k = 0


class DeviceCountsGraphedMHAMetadata(DeviceCountsMHAMetadataMixin, GraphedMHAMetadata):
    """megatron-core's ``GraphedMHAMetadata`` with :class:`DeviceCountsMHAMetadataMixin`."""


class DeviceCountsNonGraphedMHAMetadata(DeviceCountsMHAMetadataMixin, NonGraphedMHAMetadata):
    """megatron-core's ``NonGraphedMHAMetadata`` with :class:`DeviceCountsMHAMetadataMixin`."""


_REPLACEMENTS: Dict[Type[MHAMetadata], Type[MHAMetadata]] = {
    GraphedMHAMetadata: DeviceCountsGraphedMHAMetadata,
    NonGraphedMHAMetadata: DeviceCountsNonGraphedMHAMetadata,
}


def with_device_counts(tables: List[Dict[str, Any]], context: Any) -> None:
    """Rebuild the ``"mha_metadata"`` entry of each table as its device-counts class, bound to
    ``context``; an entry of any other class (a subclass megatron-core did not define) is kept.

    Args:
        tables (List[Dict[str, Any]]): the context's ``graph_attn_metadata`` and
            ``non_graph_attn_metadata``.
        context: the megatron-core 0.16 ``DynamicInferenceContext`` that owns them.
    """
    for table in tables:
        stock = table.get("mha_metadata")
        replacement = _REPLACEMENTS.get(type(stock))
        if replacement is None:
            continue
        metadata = replacement(
            block_count_total=stock.max_blocks,
            max_kv_block_count=stock.max_kv_blocks,
            max_requests=stock.max_bs,
            block_size_tokens=context.block_size_tokens,
            max_seqlen=stock.max_seqlen,
        )
        metadata.bind_context(context)
        table["mha_metadata"] = metadata
