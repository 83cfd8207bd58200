# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""What the static-active-slices contexts of every megatron-core line share: the neutral padding
values, the :class:`ActiveSlices` view of the device buffers, input checks and
:class:`StaticSlicesContextBase` (sampling registry, request checks, extra padding).

The release-specific classes live in ``dynamic_context_0_16`` and ``dynamic_context_0_19``;
``dynamic_context`` picks one for the installed megatron-core.
"""

from dataclasses import dataclass
from typing import Any, Container, Dict, Iterable, List, Optional, Tuple

import torch
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from torch import Tensor

from megatron_ext.fusions.mla_latent.mha_weights import clear_up_projections
from megatron_ext.inference.contexts.request_checks import (
    as_int,
    check_generation_length,
    check_log_prob_options,
    check_metadata_value,
    check_stop_words,
    describe,
    prompt_token_ids,
)
from megatron_ext.inference.contexts.sampling_registry import (
    RequestSamplingRegistry,
    SamplingLimits,
    SamplingRequirements,
    request_features,
)
from megatron_ext.utils import is_megatron_core_min_version

__all__ = [
    "ACTIVE_METADATA_PAD_VALUES",
    "ACTIVE_REQUEST_PAD_VALUES",
    "ActiveSlices",
    "StaticSlicesContextBase",
    "UPSTREAM_HAS_ACTIVE_SLICES",
    "check_row_count",
]

# num_tokens_to_generate=0 is megatron-core's "score the prompt, generate nothing"; from 0.19 its
# dynamic engine honours it (it trims the sampled token), 0.16's appends one token.
ZERO_TOKENS_TO_GENERATE_HONOURED = is_megatron_core_min_version("0.19.0")

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
REQUEST_SLICE_FIELDS: Tuple[Tuple[str, str, str], ...] = (
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


def pad_value(label: str, dtype: torch.dtype) -> Any:
    """Neutral padding value for a metadata label (0 / False for labels we do not know)."""
    value = ACTIVE_METADATA_PAD_VALUES.get(label, 0)
    return bool(value) if dtype == torch.bool else value


def check_row_count(name: str, value: Any, low: int, high: int, why: str) -> int:
    """``value`` if it is an int (not a bool) in ``[low, high]``; else TypeError / ValueError
    naming ``name`` and ``why`` (what the bounds are)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} ({value}) must be in [{low}, {high}] ({why})")
    return value


class StaticSlicesContextBase(DynamicInferenceContext):
    """Release-independent part of ``StaticSlicesInferenceContext``.

    A subclass (not a mixin) so that the chain stays single: the flag's constructor redirect
    (``megatron_ext.inference.redirect``) needs a layout-compatible ``__class__`` assignment.
    """

    # Set before megatron-core's constructor runs (latent_cache.check_latent_cache_request).
    _latent_cache_any_block_size = False

    @property
    def cache_mla_latent(self) -> bool:
        """Whether the KV cache holds MLA latents: megatron-core's value, except that its
        FlashMLA block-size assert does not see it on megatron_ext's path (any block size).

        Both supported releases read this attribute for that assert right after setting it and
        before setting ``block_size_tokens`` (0.16: ``dynamic_context.py:301-305``; 0.19:
        ``:294-300``), and next only after it (0.16: ``:397``; 0.19: ``:408``). So while
        megatron_ext's path is on and ``block_size_tokens`` is not set yet, it reads False.
        """
        value = self.__dict__.get("_cache_mla_latent_value", False)
        if value and self._latent_cache_any_block_size and "block_size_tokens" not in vars(self):
            return False
        return value

    @cache_mla_latent.setter
    def cache_mla_latent(self, value: bool) -> None:
        self._cache_mla_latent_value = value

    def reset(self, *args: Any, **kwargs: Any) -> None:
        """megatron-core's ``reset``; then the MHA form's kept decompression weights are
        forgotten and rebuilt from the weights at the next prefill step.

        A kept layout is reused while its weight's version counter is unchanged, but an update
        through ``.data`` (megatron-core's distributed optimizer copies its main parameters that
        way) or a collective into the parameter buffer does not count as a write. Each serving
        run starts with a reset: the engine's constructor, ``engine.reset()``, and ``resume()``
        after training (reinforcement learning's suspend, train, resume).
        """
        super().reset(*args, **kwargs)
        clear_up_projections()

    def _init_static_slices_state(self) -> None:
        """Host-side state; set before megatron-core's constructor allocates tensors."""
        self._sampling_registry = RequestSamplingRegistry()
        # What the sampler can honour; the controller that samples from the context sets it.
        self._sampling_limits = SamplingLimits()
        # Bumped whenever the static buffers are (re)allocated, so that consumers holding CUDA
        # graphs over the old addresses know to recapture.
        self.static_slices_generation = 0
        self._device_active_slices: Optional[ActiveSlices] = None
        # True while every row past the active requests is known to hold neutral values (set by
        # a context that refreshes all rows each step), so extend_active_padding has no work.
        self._slices_neutral_past_active = False
        # False between a build_active_slices whose rows have not reached the device slices yet
        # and the publish_active_slices that puts them there (0.19 only; see that method).
        self._active_slices_published = True

    def _require_static_slices(self, what: str) -> None:
        if self._device_active_slices is None:
            raise RuntimeError(
                f"{what}: the context's tensor state is not allocated (deallocate_all_tensors() "
                "was called, e.g. by a suspended engine); call allocate_all_tensors(is_init=False) "
                "or resume the engine first"
            )

    @property
    def device_active_slices(self) -> ActiveSlices:
        """Device-resident static buffers of the active requests (see :class:`ActiveSlices`).

        They hold this step's rows once :meth:`publish_active_slices` has run.

        Raises:
            RuntimeError: if the tensor state is deallocated, or this step's slices were built
                and not yet published.
        """
        self._require_published("device_active_slices")
        return self._device_active_slices

    def publish_active_slices(self) -> None:
        """Put this step's active slices into ``device_active_slices``.

        The order of a step: ``initialize_attention_state`` (which builds and pads the slices),
        then this method, then readers of ``device_active_slices`` (forward pass, sampling), then
        ``update_requests``. On megatron-core 0.16 building and padding write the device slices
        directly, so this only checks the order and is graph-safe. On 0.19 upstream builds its
        slices in pinned host memory; this method adds the request ids and lengths and the padding
        there and copies the whole set to the device once. Called at most once per step: later
        calls in the same step do nothing.

        Raises:
            RuntimeError: if the tensor state is deallocated, or ``update_requests`` ran after
                this step's ``build_active_slices`` (the rows to publish are gone).
        """
        self._require_static_slices("publish_active_slices")
        if not self._active_slices_published:
            self._publish_active_slices()
            self._active_slices_published = True

    def _publish_active_slices(self) -> None:
        """Hook: a context that builds its slices off the device copies them there (0.19)."""

    def _require_published(self, what: str) -> None:
        self._require_static_slices(what)
        if not self._active_slices_published:
            raise RuntimeError(
                f"{what}: this step's active slices are built but not published; call "
                "publish_active_slices() after initialize_attention_state() and before "
                "update_requests()"
            )

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
        """Sampling features of the requests added and not yet released (host-only)."""
        return self._sampling_registry.requirements()

    @property
    def sampling_limits(self) -> SamplingLimits:
        """What the sampler of this context can honour (``top_k``, ``top_n_logprobs``, the
        temperature's dtype); requests asking for more are refused by :meth:`add_request`."""
        return self._sampling_limits

    def set_sampling_limits(
        self, max_top_k: Optional[int] = None, max_top_n_logprobs: Optional[int] = None
    ) -> None:
        """Set what the sampler can honour (the controller calls it when it is built).

        Args:
            max_top_k (Optional[int]): the largest ``top_k``; None: no limit known.
            max_top_n_logprobs (Optional[int]): the largest ``top_n_logprobs``.

        Raises:
            TypeError, ValueError: for a limit that is not a positive int.
        """
        for name, value in (("max_top_k", max_top_k), ("max_top_n_logprobs", max_top_n_logprobs)):
            if value is not None:
                check_row_count(name, value, 1, INT32_MAX, "a vocabulary size")
        dtype = dict((label, dtype) for label, dtype, *_ in self.request_metadata_types)
        self._sampling_limits = SamplingLimits(
            max_top_k=max_top_k,
            max_top_n_logprobs=max_top_n_logprobs,
            temperature_dtype=dtype.get("temperature", torch.float32),
        )

    def check_request(self, req: Any) -> int:
        """Refuse a request this context could not hold or sample correctly; changes nothing.

        Checked: the request id (an int in ``[0, INT32_MAX]``: the context stores int32 ids), every
        tracked sampling parameter against the dtype the context stores it in, and the sampling
        rules of :func:`request_features` against :attr:`sampling_limits`. megatron-core's engine,
        while the inference flag is applied, fails a request this refuses alone, with the reason
        (``megatron_ext.inference.engines.dynamic_engine``).

        Args:
            req: a ``DynamicInferenceRequest``.

        Returns:
            int: the request id.

        Raises:
            TypeError, ValueError: naming the parameter and its value.
        """
        request_id = as_int("request_id", getattr(req, "request_id", None))
        if not 0 <= request_id <= INT32_MAX:
            raise ValueError(
                f"request_id ({request_id}) must be in [0, {INT32_MAX}] (the context stores "
                "request ids as int32; -1 marks padding rows)"
            )
        params = getattr(req, "sampling_params", None)
        if params is None:
            raise TypeError(f"request {request_id}: sampling_params must be a SamplingParams")
        for label, dtype, *_ in self.request_metadata_types:
            value = getattr(params, label, None)
            if label == "termination_id" and value is None:
                continue  # megatron-core's request reads it as -1
            check_metadata_value(label, value, dtype)
        request_features(params, self._sampling_limits)
        return request_id

    def check_new_request(
        self,
        req: Any,
        *,
        vocab_size: Optional[int] = None,
        ids_in_use: Container = (),
        last_token_logits_only: Optional[bool] = None,
    ) -> Tensor:
        """Refuse a request that cannot run, where it enters megatron-core's engine (before the
        engine queues it or this context allocates anything); changes nothing.

        Checked: :meth:`check_request`; the prompt (:func:`prompt_token_ids`: a non-empty 1-D
        tensor of integral ids in ``[0, vocab_size)``); the generation length
        (:func:`check_generation_length`: 0 only where megatron-core's engine honours it); the
        log-prob options megatron-core's engine asserts on (:func:`check_log_prob_options`); the
        stop words' types (:func:`check_stop_words`); and that no request the engine holds has
        the same id.

        Args:
            req: a ``DynamicInferenceRequest``, as megatron-core's engine builds it.
            vocab_size: the model's vocabulary (None: ids are checked to be >= 0 only).
            ids_in_use: ids of the requests the engine holds (queued, running or paused).
            last_token_logits_only: whether the forward pass materializes only last-token logits
                (default: this context's setting).

        Returns:
            Tensor: the prompt as int64 ids (the request's own tensor when it is int64).

        Raises:
            TypeError, ValueError: naming the field and its value.
        """
        request_id = self.check_request(req)
        if request_id in ids_in_use:
            raise ValueError(
                f"request_id {request_id} is in use by a request the engine has not finished; "
                "request ids must be unique among the requests an engine holds"
            )
        tokens = prompt_token_ids("prompt_tokens", req.prompt_tokens, vocab_size)
        params = req.sampling_params
        check_generation_length(params, tokens.numel(), ZERO_TOKENS_TO_GENERATE_HONOURED)
        if last_token_logits_only is None:
            last_token_logits_only = self.materializes_only_last_token_logits
        check_log_prob_options(params, last_token_logits_only)
        check_stop_words(params)
        return tokens

    def _check_added_tokens(self, req: Any, args: Tuple, kwargs: Dict[str, Any]) -> Tensor:
        """The prompt tokens, and the chunk and output lengths megatron-core's ``add_request``
        stores (int32), checked before it allocates anything; returns the tokens as int64."""
        tokens = req.remaining_prompt_tokens
        # Integer ids on a GPU were range-checked where the request entered the engine
        # (check_new_request); reading them back again here would synchronise once per added
        # chunk, inside the engine's scheduling.
        on_device = isinstance(tokens, Tensor) and tokens.device.type != "cpu"
        tokens = prompt_token_ids(
            f"request {req.request_id}'s remaining prompt tokens",
            tokens,
            check_values=not on_device,
        )
        remaining = tokens.numel()
        chunk = args[0] if args else kwargs.get("chunk_length", kwargs.get("prefill_chunk_length"))
        if chunk is not None:
            check_row_count(
                "chunk_length", chunk, 1, remaining, "the request's remaining prompt tokens"
            )
        # A numpy integer is accepted where the request enters (as_int); megatron-core computes
        # num_tokens_total's conversion with it too.
        to_generate = as_int("num_tokens_to_generate", req.sampling_params.num_tokens_to_generate)
        done = int(getattr(req, "finished_chunk_token_count", 0) or 0)
        check_row_count(
            "num_tokens_to_generate",
            to_generate,
            0,
            INT32_MAX - done - remaining,
            "the request's output length is stored as int32",
        )
        return tokens

    def release_request_sampling_state(self, request_ids: Iterable[int]) -> None:
        """Tell the context that requests have left it (finished), for
        :meth:`sampling_requirements`. Unknown ids are ignored.

        Reads the ids the context holds (a device read on megatron-core 0.16); the controller's
        own step releases its finished requests without it.

        Args:
            request_ids (Iterable[int]): ids of requests that left the context.

        Raises:
            TypeError: for something other than an iterable of ints (bools included).
            ValueError: for an id the context still holds (active, paused or the chunked-prefill
                request): its sampling features are still needed. Nothing is released then.
        """
        ids = _request_id_list(request_ids)
        held = set(self.request_ids[: self.total_request_count].tolist())
        still_held = sorted(set(ids) & held)
        if still_held:
            raise ValueError(
                f"request ids {still_held} are still in the context (active or paused); "
                "release only requests that left it (finished or evicted)"
            )
        self._sampling_registry.discard(ids)

    def _release_finished_requests(self, request_ids: List[int]) -> None:
        """Forget requests the step just finished (the chunked-prefill request, which a step
        never finishes, is kept). Host-only; for the controllers' steps."""
        keep = self.chunked_prefill_request_id
        self._sampling_registry.discard(rid for rid in request_ids if rid != keep)

    def _check_build_batch_size(self, batch_size: Any) -> int:
        """build_active_slices' argument: every active row, and no row past the tensors."""
        paused = self.paused_request_count
        return check_row_count(
            "batch_size",
            batch_size,
            self._active_request_count(),
            self.max_requests - paused,
            "at least the active request count, at most max_requests - paused_request_count; "
            "a smaller batch leaves active rows stale",
        )

    def extend_active_padding(self, rows: int) -> None:
        """Pad the device slices' rows ``[padded_active, rows)`` with neutral values too, for
        consumers that process a fixed row count every step. Graph-safe (device-only).

        Args:
            rows (int): rows that must be valid (active or neutral).

        Raises:
            TypeError: if rows is not an int.
            ValueError: if rows is outside [0, max_requests].
            RuntimeError: if the tensor state is deallocated.
        """
        check_row_count("rows", rows, 0, self.max_requests, "the context's max_requests")
        self._require_published("extend_active_padding")
        start = max(self.padded_active_request_count, self._active_request_count())
        if rows > start and not self._slices_neutral_past_active:
            self._pad_device_slices(start, rows)

    def _pad_device_slices(self, start: int, stop: int) -> None:
        """Neutral values into rows ``[start, stop)`` of the device slices."""
        pad = slice(start, stop)
        slices = self._device_active_slices
        for name, _, _ in REQUEST_SLICE_FIELDS:
            getattr(slices, name)[pad].fill_(ACTIVE_REQUEST_PAD_VALUES[name])
        slices.last_token_idxs[pad].fill_(ACTIVE_REQUEST_PAD_VALUES["last_token_idxs"])
        for label, tensor in slices.metadata.items():
            tensor[pad].fill_(pad_value(label, tensor.dtype))

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
        """megatron-core's ``add_request``, after :meth:`check_request`, then record the
        request's sampling features.

        Raises:
            TypeError, ValueError: for what :meth:`check_request` refuses, prompt tokens that
                are not a non-empty 1-D tensor of integral ids >= 0 (floating ids with integral
                values are stored as int64, as megatron-core stores them; integer ids on a GPU
                are range-checked where the request enters the engine, not here, where the read
                would synchronise in the engine's scheduling), a chunk length or
                ``num_tokens_to_generate`` megatron-core could not store, and a request whose id
                is already in the context (megatron-core would hold two rows with one id;
                finishing either would then be ambiguous), except for a later chunk of a
                chunked-prefill request. All before megatron-core changes anything.
        """
        request_id = self.check_request(req)
        tokens = self._check_added_tokens(req, args, kwargs)
        # A later chunk of a chunked prefill comes back under its id (finished_chunk_token_count
        # counts the chunks already added).
        continuing = int(getattr(req, "finished_chunk_token_count", 0) or 0) > 0
        if request_id in self._sampling_registry and not continuing:
            raise ValueError(
                f"request id {request_id} is already in the context; request ids must be unique "
                "among the requests a context holds"
            )
        if tokens is not req.remaining_prompt_tokens:
            # Ids of another dtype (floats with integral values, as megatron-core's own tests
            # pass them): megatron-core stores them as int64; the request then holds them so.
            _as_int64_prompt(req, tokens)
        super().add_request(req, *args, **kwargs)
        self._sampling_registry.add(request_id, req.sampling_params, self._sampling_limits)

    def update_requests(self, *args: Any, **kwargs: Any) -> Any:
        """megatron-core's ``update_requests``; evicted requests leave the sampling registry
        (the engine adds them again later, under the same id)."""
        result = super().update_requests(*args, **kwargs)
        evicted = result.get("evict_request_ids") if isinstance(result, dict) else None
        if evicted is not None and len(evicted):
            # Eviction is rare and megatron-core's engine reads these ids back itself.
            self._sampling_registry.discard(evicted.tolist())
        return result

    def _active_request_count(self) -> int:
        return self.total_request_count - self.paused_request_count


def _as_int64_prompt(req: Any, remaining: Tensor) -> None:
    """Give ``req`` its checked int64 remaining prompt, and its whole prompt as int64 too (the
    engine concatenates generated tokens to it)."""
    prompt = req.prompt_tokens
    if isinstance(prompt, Tensor) and prompt.dtype != torch.int64:
        req.prompt_tokens = prompt.to(torch.int64)  # not megatron-core state: the caller's
    req.remaining_prompt_tokens = remaining  # not megatron-core state: the caller's request


def _request_id_list(request_ids: Any) -> List[int]:
    if (
        isinstance(request_ids, (str, bytes))
        or not hasattr(request_ids, "__iter__")
        or (isinstance(request_ids, Tensor) and request_ids.dim() != 1)
    ):
        raise TypeError(f"request_ids must be an iterable of ints, got {describe(request_ids)}")
    if isinstance(request_ids, Tensor):  # its elements are tensors, which as_int refuses
        request_ids = request_ids.tolist()
    return [as_int(f"request_ids[{i}]", rid) for i, rid in enumerate(request_ids)]
