# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Dynamic inference context with static-address active slices.

megatron-core's ``DynamicInferenceContext`` keeps per-request state in tensors of ``max_requests``
rows laid out as ``[paused | active | finished]``. The active requests are the rows
``[paused_request_count, total_request_count)``: a window whose start and length change every
step, so any kernel that reads "the active requests" sees a different address and shape each
step and cannot be captured in a CUDA graph.

:class:`StaticSlicesInferenceContext` adds fixed-address copies of the active window. Every step,
``initialize_attention_state`` calls :meth:`~StaticSlicesInferenceContext.build_active_slices`
with the padded active request count, which copies rows ``[paused, paused + padded)`` of every
per-request tensor into rows ``[0, padded)`` of its static copy, then
:meth:`~StaticSlicesInferenceContext.pad_active_slices`, which overwrites the padding rows
``[active, padded)`` with neutral values. Kernels that read rows ``[0, padded)`` of the static
copies (sampling, log-probs, termination checks) then see the same addresses every step and can
be captured once and replayed.

The static copies, allocated once:

* ``active_request_metadata[label]`` for every request-metadata label (temperature, top_k, top_p,
  termination_id, return_log_probs, skip_prompt_log_probs, top_n_logprobs, and any custom label);
* ``active_request_ids``, ``active_request_query_lengths``, ``active_request_kv_length_offsets``,
  ``active_request_output_lengths``;
* ``active_request_last_token_idxs``: the row of each request's last token in the packed token
  batch, computed on the device.

megatron-core 0.19 already builds ``active_request_metadata`` and the last-token indices itself,
in pinned host memory that it publishes to the GPU once per step. On 0.19 this class reuses
upstream's ``build_active_slices``/``pad_active_slices``, adds the request tensors upstream does
not slice, pads every label (upstream pads only the sampling parameters) and publishes its
additions to the GPU in one copy. :attr:`~StaticSlicesInferenceContext.device_active_slices` gives
the device-resident static buffers on both releases.
"""

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from torch import Tensor

from megatron_ext.utils import is_megatron_core_min_version

logger = logging.getLogger(__name__)

# megatron-core 0.19 keeps request bookkeeping in pinned host memory and already has
# build_active_slices/pad_active_slices; earlier releases keep it on the device and have neither.
UPSTREAM_HAS_ACTIVE_SLICES = is_megatron_core_min_version("0.19.0")

INT32_MAX = torch.iinfo(torch.int32).max

# Neutral values for the padding rows [active, padded_active) of the active metadata slices. A
# padded row must never change real state: it samples from an untouched distribution, its
# termination id cannot match a sampled token (token ids are >= 0), and it asks for no log-probs.
ACTIVE_METADATA_PAD_VALUES: Dict[str, Any] = {
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 0.0,
    "termination_id": -1,
    "return_log_probs": False,
    "skip_prompt_log_probs": False,
    "top_n_logprobs": 0,
}

# Neutral values for the request tensors. With a query length and kv offset of 0 and an output
# length of INT32_MAX, a padded row's sequence length never reaches its output length, so it can
# never be marked finished; its request id of -1 matches no request.
ACTIVE_REQUEST_PAD_VALUES: Dict[str, int] = {
    "request_ids": -1,
    "query_lengths": 0,
    "kv_length_offsets": 0,
    "output_lengths": INT32_MAX,
    "last_token_idxs": 0,
}

# (name, static attribute, source attribute) for the request tensors sliced on every release.
_REQUEST_SLICE_FIELDS: Tuple[Tuple[str, str, str], ...] = (
    ("request_ids", "active_request_ids", "request_ids"),
    ("query_lengths", "active_request_query_lengths", "request_query_lengths"),
    ("kv_length_offsets", "active_request_kv_length_offsets", "request_kv_length_offsets"),
    ("output_lengths", "active_request_output_lengths", "request_output_lengths"),
)


@dataclass(frozen=True)
class ActiveSlices:
    """Device-resident static buffers of the active requests.

    Every tensor has ``max_requests`` rows and a fixed address for the lifetime of the context's
    tensor state; rows ``[0, padded_active_request_count)`` are valid after
    ``initialize_attention_state`` (active rows first, then neutral padding rows).

    Attributes:
        request_ids (Tensor): int32 request ids; -1 in padding rows.
        query_lengths (Tensor): int32 tokens each request feeds this step.
        kv_length_offsets (Tensor): int32 tokens already in each request's KV cache.
        output_lengths (Tensor): int32 length at which each request finishes.
        last_token_idxs (Tensor): int32 row of each request's last token in the packed batch.
        metadata (Dict[str, Tensor]): one tensor per request-metadata label.
    """

    request_ids: Tensor
    query_lengths: Tensor
    kv_length_offsets: Tensor
    output_lengths: Tensor
    last_token_idxs: Tensor
    metadata: Dict[str, Tensor]


@dataclass(frozen=True)
class SamplingRequirements:
    """What the requests currently held by a context need from a sampling step.

    Derived on the host from each request's sampling parameters when it is added, so that a
    sampler can pick a kernel variant without reading metadata back from the device.

    Attributes:
        sample (bool): some request samples (``top_k != 1``); otherwise every request is greedy.
        top_k_cap (int): a power of two >= every ``top_k > 1`` in use; 0 when none is in use.
        top_p (bool): some request uses nucleus (top-p) filtering.
        log_probs (bool): some request wants log-probs (or top-n log-probs).
    """

    sample: bool = False
    top_k_cap: int = 0
    top_p: bool = False
    log_probs: bool = False


class _RequestSamplingRegistry:
    """Host-side index of the sampling features of the requests held by a context.

    Entries are added when a request is added to the context and removed when the request
    leaves it; keeping counters makes :meth:`requirements` O(number of distinct top_k values).
    """

    def __init__(self) -> None:
        self._features: Dict[int, Tuple[int, bool, bool]] = {}
        self._top_k_counts: Counter = Counter()
        self._non_greedy = 0
        self._top_p = 0
        self._log_probs = 0

    def __len__(self) -> int:
        return len(self._features)

    def add(self, request_id: int, sampling_params: Any) -> None:
        """Record (or replace) a request's sampling features."""
        top_k = int(sampling_params.top_k)
        top_p = float(sampling_params.top_p)
        # megatron-core samples greedily for top_k == 1, filters by top-k for top_k > 1 and by
        # top-p only when top_k < 1 (see TextGenerationController._torch_sampling_func).
        uses_top_p = top_k < 1 and top_p > 0.0
        wants_log_probs = bool(sampling_params.return_log_probs) or (
            int(getattr(sampling_params, "top_n_logprobs", 0) or 0) > 0
        )
        self.discard((request_id,))
        self._features[request_id] = (top_k, uses_top_p, wants_log_probs)
        self._top_k_counts[top_k] += 1
        self._non_greedy += top_k != 1
        self._top_p += uses_top_p
        self._log_probs += wants_log_probs

    def discard(self, request_ids: Iterable[int]) -> None:
        """Forget requests; unknown ids are ignored."""
        for request_id in request_ids:
            features = self._features.pop(int(request_id), None)
            if features is None:
                continue
            top_k, uses_top_p, wants_log_probs = features
            self._top_k_counts[top_k] -= 1
            if self._top_k_counts[top_k] == 0:
                del self._top_k_counts[top_k]
            self._non_greedy -= top_k != 1
            self._top_p -= uses_top_p
            self._log_probs -= wants_log_probs

    def clear(self) -> None:
        """Forget every request."""
        self.__init__()

    def requirements(self) -> SamplingRequirements:
        """Aggregate the recorded features."""
        max_top_k = max((k for k in self._top_k_counts if k > 1), default=0)
        top_k_cap = 0 if max_top_k == 0 else 1 << (max_top_k - 1).bit_length()
        return SamplingRequirements(
            sample=self._non_greedy > 0,
            top_k_cap=top_k_cap,
            top_p=self._top_p > 0,
            log_probs=self._log_probs > 0,
        )


def _pad_value(label: str, dtype: torch.dtype) -> Any:
    """Neutral padding value for a metadata label (0 / False for labels we do not know)."""
    value = ACTIVE_METADATA_PAD_VALUES.get(label, 0)
    return bool(value) if dtype == torch.bool else value


class _PackedBuffer:
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


class _SliceTable:
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


def _check_batch_size(batch_size: Any, limit: int) -> int:
    """Validate a build_active_slices batch size."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise TypeError(f"batch_size must be an int, got {type(batch_size).__name__}")
    if not 0 <= batch_size <= limit:
        raise ValueError(
            f"batch_size ({batch_size}) must be in [0, {limit}] "
            "(max_requests - paused_request_count)"
        )
    return batch_size


class _StaticSlicesMixin:
    """Release-independent part of :class:`StaticSlicesInferenceContext`."""

    def _init_static_slices_state(self) -> None:
        """Host-side state; set before megatron-core's constructor allocates tensors."""
        self._sampling_registry = _RequestSamplingRegistry()
        # Bumped whenever the static buffers are (re)allocated, so that consumers holding CUDA
        # graphs over the old addresses know to recapture.
        self.static_slices_generation = 0
        self._device_active_slices: Optional[ActiveSlices] = None

    @property
    def device_active_slices(self) -> ActiveSlices:
        """Device-resident static buffers of the active requests (see :class:`ActiveSlices`)."""
        if self._device_active_slices is None:
            raise RuntimeError(
                "the context's tensor state is not allocated (suspended engine?); "
                "active slices are unavailable"
            )
        return self._device_active_slices

    @property
    def max_logit_rows(self) -> int:
        """Most last-token logit rows a step can produce: one per request slot."""
        return self.max_requests

    @property
    def materializes_only_last_token_logits(self) -> bool:
        """Whether the forward pass returns only last-token logits (the setting moved into
        ``context.config`` in megatron-core 0.19)."""
        config = getattr(self, "config", None)
        if config is not None and hasattr(config, "materialize_only_last_token_logits"):
            return bool(config.materialize_only_last_token_logits)
        return bool(self.materialize_only_last_token_logits)

    def sampling_requirements(self) -> SamplingRequirements:
        """Sampling features needed by the requests now in the context (active or paused).

        Host-only: no device access.

        Returns:
            SamplingRequirements: the aggregate over every request added and not yet released.
        """
        return self._sampling_registry.requirements()

    def release_request_sampling_state(self, request_ids: Iterable[int]) -> None:
        """Tell the context that requests have left it (finished), for
        :meth:`sampling_requirements`. Ids still held (e.g. the chunked-prefill request) are kept.

        Args:
            request_ids (Iterable[int]): ids of requests that left the context.
        """
        keep = self.chunked_prefill_request_id
        self._sampling_registry.discard(rid for rid in request_ids if int(rid) != keep)

    def extend_active_padding(self, rows: int) -> None:
        """Pad the device slices' rows ``[padded_active, rows)`` with neutral values too.

        For consumers that process a fixed number of rows every step (one CUDA graph for all
        batch sizes) rather than the padded active request count. Device-only: no host
        synchronisation. A no-op when ``rows`` does not exceed the padded count.

        Args:
            rows (int): rows that must be valid (active or neutral).

        Raises:
            TypeError: if rows is not an int.
            ValueError: if rows is outside [0, max_requests].
        """
        _check_batch_size(rows, self.max_requests)
        start = max(self.padded_active_request_count, self._active_request_count())
        if rows <= start:
            return
        pad = slice(start, rows)
        slices = self.device_active_slices
        for name, _, _ in _REQUEST_SLICE_FIELDS:
            getattr(slices, name)[pad].fill_(ACTIVE_REQUEST_PAD_VALUES[name])
        slices.last_token_idxs[pad].fill_(ACTIVE_REQUEST_PAD_VALUES["last_token_idxs"])
        for label, tensor in slices.metadata.items():
            tensor[pad].fill_(_pad_value(label, tensor.dtype))

    def _check_logits_shape(self, logits: Tensor) -> None:
        if not isinstance(logits, Tensor):
            raise TypeError(f"logits must be a Tensor, got {type(logits).__name__}")
        if logits.dim() != 3 or logits.size(0) != 1:
            raise ValueError(f"expected logits of shape [1, S, H], got {tuple(logits.shape)}")
        if logits.size(1) != self.padded_active_token_count:
            raise ValueError(
                f"logits.size(1) ({logits.size(1)}) != padded_active_token_count "
                f"({self.padded_active_token_count})"
            )

    def add_request(self, req: Any, *args: Any, **kwargs: Any) -> None:
        """megatron-core's ``add_request``, then record the request's sampling features.

        Args:
            req (DynamicInferenceRequest): the request.
            *args: forwarded to megatron-core (the prefill chunk length).
            **kwargs: forwarded to megatron-core.
        """
        super().add_request(req, *args, **kwargs)
        self._register_request_sampling(req)

    def _register_request_sampling(self, req: Any) -> None:
        self._sampling_registry.add(int(req.request_id), req.sampling_params)

    def _active_request_count(self) -> int:
        return self.total_request_count - self.paused_request_count


if not UPSTREAM_HAS_ACTIVE_SLICES:

    class StaticSlicesInferenceContext(_StaticSlicesMixin, DynamicInferenceContext):
        """``DynamicInferenceContext`` with static-address active slices (megatron-core 0.16.x).

        Takes exactly the arguments of megatron-core's ``DynamicInferenceContext``. See the
        module docstring for the buffers and the per-step protocol.

        All static buffers live on the context's device. ``build_active_slices`` and
        ``pad_active_slices`` are device-only (no host synchronisation); their launch
        parameters (row counts) are host integers, so they run eagerly once per step outside
        any captured region.
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._init_static_slices_state()
            super().__init__(*args, **kwargs)

        # ------------------------------------------------------------------ allocation

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
                # The base class deletes tensor attributes only; drop the containers too so
                # that a suspended engine actually frees the memory.
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
            for _, attr, _ in _REQUEST_SLICE_FIELDS:
                setattr(self, attr, torch.empty(rows, dtype=torch.int32, device=device))
            self.active_request_last_token_idxs = torch.zeros(
                rows, dtype=torch.int32, device=device
            )

            # The static copies in a fixed order, with their neutral values; the last-token
            # indices are computed, not copied, so they are padded but have no source.
            statics: List[Tensor] = [getattr(self, attr) for _, attr, _ in _REQUEST_SLICE_FIELDS]
            templates = [
                torch.full_like(static, ACTIVE_REQUEST_PAD_VALUES[name])
                for (name, _, _), static in zip(_REQUEST_SLICE_FIELDS, statics)
            ]
            for label, static in self.active_request_metadata.items():
                statics.append(static)
                templates.append(torch.full_like(static, _pad_value(label, static.dtype)))
            statics.append(self.active_request_last_token_idxs)
            templates.append(torch.zeros_like(self.active_request_last_token_idxs))
            self._slice_table = _SliceTable(statics, templates)
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
            sources = [getattr(self, source) for _, _, source in _REQUEST_SLICE_FIELDS]
            sources += [self.request_metadata[label] for label in self.active_request_metadata]
            return sources

        # ------------------------------------------------------------------ per-step slices

        def build_active_slices(self, batch_size: int) -> None:
            """Copy rows ``[paused, paused + batch_size)`` of every per-request tensor into rows
            ``[0, batch_size)`` of its static copy, and compute the last-token indices.

            Device-only: no host synchronisation. Run every step by
            ``initialize_attention_state`` with the padded active request count, clamped to
            ``max_requests - paused_request_count``; rows past the active requests hold stale
            data until :meth:`pad_active_slices` overwrites them.

            Args:
                batch_size (int): rows to copy.

            Raises:
                TypeError: if batch_size is not an int.
                ValueError: if batch_size is negative or reads past the request tensors.
            """
            paused = self.paused_request_count
            _check_batch_size(batch_size, self.max_requests - paused)
            if batch_size == 0:
                return
            self._slice_table.copy_rows(self._slice_sources(), paused, batch_size)
            src = slice(paused, paused + batch_size)
            last_token_idxs = self.active_request_last_token_idxs[:batch_size]
            torch.cumsum(
                self.request_query_lengths[src], dim=0, dtype=torch.int32, out=last_token_idxs
            )
            last_token_idxs.sub_(1)

        def pad_active_slices(self) -> None:
            """Fill rows ``[active, padded_active)`` of every static copy with neutral values.

            Device-only: no host synchronisation. See ``ACTIVE_METADATA_PAD_VALUES`` and
            ``ACTIVE_REQUEST_PAD_VALUES`` for the values.
            """
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

        # ------------------------------------------------------------------ logits rows

        @property
        def num_last_token_logits(self) -> int:
            """Rows returned by :meth:`last_token_logits` this step: one per active request.

            On 0.16.x the model forward is not captured past the decoder layers, so the logits
            keep megatron-core's active-request row count (on 0.19.x upstream pads it to the
            captured batch size when the step replays a CUDA graph).
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
            rows = self.active_request_last_token_idxs[: self.num_last_token_logits]
            return logits.squeeze(0).index_select(0, rows)

        # ------------------------------------------------------------------ requests

        def reset(self, *args: Any, **kwargs: Any) -> None:
            """megatron-core's ``reset``, then forget every request and re-pad the slices."""
            super().reset(*args, **kwargs)
            self._sampling_registry.clear()
            if self._device_active_slices is not None:
                self._slice_table.fill_rows(0, self.max_requests)

else:
    from megatron.core.inference.config import AsyncScheduleMode

    class StaticSlicesInferenceContext(_StaticSlicesMixin, DynamicInferenceContext):
        """``DynamicInferenceContext`` with static-address active slices (megatron-core 0.19.x).

        Takes exactly the arguments of megatron-core's ``DynamicInferenceContext``. Upstream
        already slices and pads the request metadata (host side) and the last-token indices;
        this class adds the request ids and lengths to the host slices, pads every metadata
        label, and mirrors all of them on the device with one copy per step, published next
        to upstream's own bookkeeping transfer.
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._init_static_slices_state()
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
                (f"metadata:{label}", dtype, rows)
                for label, dtype, *_ in self.request_metadata_types
            ]
            fields += [(name, torch.int32, rows) for name, _, _ in _REQUEST_SLICE_FIELDS]
            self._ext_host = _PackedBuffer(fields, torch.device("cpu"), pin_memory=True)
            self._ext_device = _PackedBuffer(fields, device)

            # Re-home upstream's host metadata slices into the packed buffer so the whole set
            # crosses to the device in one copy; upstream reads them through the dict.
            for label in list(self.active_request_metadata):
                view = self._ext_host[f"metadata:{label}"]
                view.copy_(self.active_request_metadata[label])
                self.active_request_metadata[label] = view
            for name, attr, _ in _REQUEST_SLICE_FIELDS:
                setattr(self, attr, self._ext_host[name])
            self._pad_all_rows()

            metadata = {
                label: self._ext_device[f"metadata:{label}"]
                for label in self.active_request_metadata
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
                view[pad] = _pad_value(label, view.dtype)
            for name, attr, _ in _REQUEST_SLICE_FIELDS:
                getattr(self, attr)[pad] = ACTIVE_REQUEST_PAD_VALUES[name]

        def _pad_all_rows(self) -> None:
            self._pad_rows(slice(0, self.max_requests))
            self.active_request_last_token_idxs.zero_()

        def build_active_slices(self, batch_size: int) -> None:
            """Upstream's slicing (metadata and last-token indices), plus the request ids and
            lengths. Host-side on this release (the bookkeeping lives in pinned host memory).

            Args:
                batch_size (int): rows to copy.

            Raises:
                TypeError: if batch_size is not an int.
                ValueError: if batch_size is negative or reads past the request tensors.
            """
            paused = self.paused_request_count
            _check_batch_size(batch_size, self.max_requests - paused)
            super().build_active_slices(batch_size)
            src = slice(paused, paused + batch_size)
            for _, attr, source in _REQUEST_SLICE_FIELDS:
                getattr(self, attr)[:batch_size] = getattr(self, source)[src]

        def pad_active_slices(self) -> None:
            """Upstream's padding of the sampling parameters, plus every other label and the
            request ids and lengths (see ``ACTIVE_METADATA_PAD_VALUES``)."""
            super().pad_active_slices()
            active = self._active_request_count()
            padded = min(self.padded_active_request_count, self.max_requests)
            if padded > active:
                self._pad_rows(slice(active, padded))

        def transfer_bookkeeping_to_gpu(self, *args: Any, **kwargs: Any) -> Any:
            """Publish the static slices to the device, then upstream's bookkeeping.

            Our copy is enqueued first so that the event upstream may record after its own
            transfer also covers it.
            """
            if self.config.async_sched_mode == AsyncScheduleMode.LEGACY:
                # The pinned source is rewritten only by the next step's build_active_slices,
                # which runs after this step's sampled tokens were read back (a stream sync).
                self._ext_device.buffer.copy_(self._ext_host.buffer, non_blocking=True)
            else:
                # Async scheduling re-stages the host buffers while copies are in flight.
                self._ext_device.buffer.copy_(self._ext_host.buffer)
            return super().transfer_bookkeeping_to_gpu(*args, **kwargs)

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
            self._sampling_registry.clear()
            if self._device_active_slices is not None:
                self._pad_all_rows()


__all__ = [
    "ACTIVE_METADATA_PAD_VALUES",
    "ACTIVE_REQUEST_PAD_VALUES",
    "ActiveSlices",
    "SamplingRequirements",
    "StaticSlicesInferenceContext",
    "UPSTREAM_HAS_ACTIVE_SLICES",
]
