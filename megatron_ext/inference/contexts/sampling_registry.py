# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Host-side record of what the requests in a context need from a sampling step, so that a
sampler picks its kernels without reading request metadata back from the device."""

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional, Tuple

import torch

from megatron_ext.inference.contexts.request_checks import (
    as_bool,
    as_int,
    as_real,
    check_sampling_ranges,
)

__all__ = [
    "RequestSamplingRegistry",
    "SamplingLimits",
    "SamplingRequirements",
    "min_sampling_temperature",
    "request_features",
    "top_k_cap_for",
]


@dataclass(frozen=True)
class SamplingRequirements:
    """What the requests currently held by a context need from a sampling step.

    The defaults describe a context that holds no request.

    Attributes:
        sample (bool): some request samples (``top_k != 1``); otherwise every request is greedy.
        top_k_cap (int): a power of two >= every ``top_k > 1`` in use; 0 when none is in use.
        top_p (bool): some request uses nucleus (top-p) filtering.
        log_probs (bool): some request wants log-probs (or top-n log-probs).
        greedy (bool): some request is greedy (``top_k == 1``).
        full_vocab (bool): some request samples from the whole vocabulary (``top_k < 1`` and
            ``top_p == 0``).
        max_top_k (int): the largest ``top_k`` in use (checked against the vocabulary; plans,
            which key the CUDA graph cache, leave it at 0).
    """

    sample: bool = False
    top_k_cap: int = 0
    top_p: bool = False
    log_probs: bool = False
    greedy: bool = False
    full_vocab: bool = False
    max_top_k: int = 0


def top_k_cap_for(max_top_k: int) -> int:
    """The power of two >= ``max_top_k`` (0 when ``max_top_k <= 1``: no top-k filtering)."""
    return 0 if max_top_k <= 1 else 1 << (max_top_k - 1).bit_length()


def min_sampling_temperature(dtype: torch.dtype = torch.float32) -> float:
    """The smallest temperature whose reciprocal is finite in ``dtype``, computed from
    :func:`torch.finfo` (float32: about 2.94e-39, a subnormal number).

    A smaller positive temperature stored in ``dtype`` is subnormal or 0, so ``logits /
    temperature`` is +-inf for every logit and the softmax NaN: no distribution to sample.

    Args:
        dtype (torch.dtype): the floating dtype the context stores temperatures in.

    Returns:
        float: the bound, a value of ``dtype``.
    """
    return _min_sampling_temperature(dtype)


@functools.lru_cache(maxsize=None)
def _min_sampling_temperature(dtype: torch.dtype) -> float:
    one = torch.ones((), dtype=dtype)
    up = torch.tensor(float("inf"), dtype=dtype)
    bound = torch.tensor(1.0 / torch.finfo(dtype).max, dtype=torch.float64).to(dtype)
    # 1 / max rounds to a value whose reciprocal may still overflow: step up to the first that
    # does not (one step in float32).
    while not torch.isfinite(one / bound):
        bound = torch.nextafter(bound, up)
    return float(bound)


@dataclass(frozen=True)
class SamplingLimits:
    """What the sampler of a context can honour, set by the controller that samples from it.

    Attributes:
        max_top_k (Optional[int]): the largest ``top_k`` (megatron-core 0.16: the logits' width;
            0.19: one less than the vocabulary); None while no controller has said.
        max_top_n_logprobs (Optional[int]): the largest ``top_n_logprobs`` (the logits' width).
        temperature_dtype (torch.dtype): the dtype temperatures are stored in.
    """

    max_top_k: Optional[int] = None
    max_top_n_logprobs: Optional[int] = None
    temperature_dtype: torch.dtype = torch.float32


def request_features(
    sampling_params: Any, limits: SamplingLimits = SamplingLimits()
) -> Tuple[int, bool, bool, bool]:
    """(top_k, uses top-p, wants log-probs, samples the whole vocabulary) of one request,
    following megatron-core's rule: greedy for ``top_k == 1``, top-k filtering for ``top_k > 1``,
    top-p filtering only when ``top_k < 1``.

    Args:
        sampling_params: the request's ``SamplingParams``.
        limits (SamplingLimits): what the sampler can honour.

    Raises:
        TypeError: for a field of the wrong type (a str, None, a bool where a number belongs, a
            float ``top_k``).
        ValueError: for what megatron-core's sampler refuses with an assert or fails on (top-k
            and top-p together, top-p above 1 or NaN, temperature 0 when sampling, ``top_k``
            above the limit), for values outside their range
            (:func:`~megatron_ext.inference.contexts.request_checks.check_sampling_ranges`:
            negative ``top_k``, ``top_p`` or temperature, a temperature that is not finite), and
            for values no sampler can use (a temperature whose reciprocal overflows,
            ``top_n_logprobs`` above the logits' width).
    """
    if sampling_params is None:
        raise TypeError("sampling_params must be a SamplingParams, got None")
    check_sampling_ranges(sampling_params)
    top_k = as_int("top_k", sampling_params.top_k)
    top_p = as_real("top_p", sampling_params.top_p)
    temperature = as_real("temperature", sampling_params.temperature)
    return_log_probs = as_bool("return_log_probs", sampling_params.return_log_probs)
    top_n = getattr(sampling_params, "top_n_logprobs", 0)
    top_n = 0 if top_n is None else as_int("top_n_logprobs", top_n)
    if top_k > 0 and top_p > 0.0:
        raise ValueError(
            f"top_k ({top_k}) and top_p ({top_p}) cannot both be greater than zero "
            "(megatron-core's sampler asserts the same)"
        )
    if limits.max_top_k is not None and top_k > limits.max_top_k:
        raise ValueError(
            f"top_k ({top_k}) is larger than the sampler allows ({limits.max_top_k}: the "
            "vocabulary of the logits)"
        )
    if top_k != 1:
        if not temperature > 0.0:
            raise ValueError(
                f"temperature must be > 0 when sampling (top_k={top_k}), got {temperature}; "
                "use top_k=1 for greedy decoding"
            )
        smallest = min_sampling_temperature(limits.temperature_dtype)
        if temperature < smallest:
            raise ValueError(
                f"temperature ({temperature!r}) is too small to sample with (top_k={top_k}): "
                f"1 / temperature overflows {limits.temperature_dtype}, so every scaled logit "
                f"is infinite; the smallest is {smallest!r} (use top_k=1 for greedy decoding)"
            )
    if limits.max_top_n_logprobs is not None and top_n > limits.max_top_n_logprobs:
        raise ValueError(
            f"top_n_logprobs ({top_n}) is larger than the vocabulary of the logits "
            f"({limits.max_top_n_logprobs})"
        )
    uses_top_p = top_k < 1 and top_p > 0.0
    full_vocab = top_k < 1 and top_p <= 0.0
    return top_k, uses_top_p, return_log_probs or top_n > 0, full_vocab


class RequestSamplingRegistry:
    """Host-side index of the sampling features of the requests held by a context.

    Entries are added when a request is added to the context and removed when the request
    leaves it (finished or evicted); counters keep :meth:`requirements` O(number of distinct
    top_k values).
    """

    def __init__(self) -> None:
        self._features: Dict[int, Tuple[int, bool, bool, bool]] = {}
        self._top_k_counts: Counter = Counter()
        self._counts = Counter()

    def __len__(self) -> int:
        return len(self._features)

    def __contains__(self, request_id: int) -> bool:
        return int(request_id) in self._features

    def add(
        self, request_id: int, sampling_params: Any, limits: SamplingLimits = SamplingLimits()
    ) -> None:
        """Record (or replace) a request's sampling features (TypeError, ValueError: see
        :func:`request_features`; nothing is recorded then)."""
        features = request_features(sampling_params, limits)
        self.discard((request_id,))
        self._features[int(request_id)] = features
        self._update(features, +1)

    def _update(self, features: Tuple[int, bool, bool, bool], sign: int) -> None:
        top_k, uses_top_p, wants_log_probs, full_vocab = features
        self._top_k_counts[top_k] += sign
        if self._top_k_counts[top_k] == 0:
            del self._top_k_counts[top_k]
        self._counts["non_greedy"] += sign * (top_k != 1)
        self._counts["greedy"] += sign * (top_k == 1)
        self._counts["top_p"] += sign * uses_top_p
        self._counts["log_probs"] += sign * wants_log_probs
        self._counts["full_vocab"] += sign * full_vocab

    def discard(self, request_ids: Iterable[int]) -> None:
        """Forget requests; unknown ids are ignored."""
        for request_id in request_ids:
            features = self._features.pop(int(request_id), None)
            if features is not None:
                self._update(features, -1)

    def clear(self) -> None:
        """Forget every request."""
        self.__init__()

    def requirements(self) -> SamplingRequirements:
        """What the recorded requests need, aggregated."""
        max_top_k = max(self._top_k_counts, default=0)
        return SamplingRequirements(
            sample=self._counts["non_greedy"] > 0,
            top_k_cap=top_k_cap_for(max_top_k),
            top_p=self._counts["top_p"] > 0,
            log_probs=self._counts["log_probs"] > 0,
            greedy=self._counts["greedy"] > 0,
            full_vocab=self._counts["full_vocab"] > 0,
            max_top_k=max_top_k,
        )
