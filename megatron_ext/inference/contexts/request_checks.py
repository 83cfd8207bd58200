# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Type and range checks of the values a request brings into a context or an engine, each
naming the value: used before megatron-core's ``add_request`` converts them (after it has
allocated the request's KV blocks), and before its engine queues a request, so that a bad value
changes nothing."""

import math
import numbers
import operator
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "as_bool",
    "as_int",
    "as_real",
    "check_generation_length",
    "check_log_prob_options",
    "check_metadata_value",
    "check_sampling_ranges",
    "check_stop_words",
    "describe",
    "prompt_token_ids",
]

# Largest token id a prompt may hold when no vocabulary is known: what int64 stores.
_INT64_END = 2**63


def _is_bool(value: Any) -> bool:
    return isinstance(value, (bool, np.bool_))


def as_int(name: str, value: Any) -> int:
    """``value`` as an int (Python or numpy integers; not a bool, float, str, None or tensor).

    A tensor of one integer converts to an index, but it is no count or id: it hashes by
    identity (megatron-core's engine keys its requests by id) and megatron-core computes with
    the value as given (on a GPU, every comparison would read it back).

    Raises:
        TypeError: naming ``name`` and the value.
    """
    if not (_is_bool(value) or isinstance(value, Tensor)):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")


def as_real(name: str, value: Any) -> float:
    """``value`` as a float (a real number, numpy's included; not a bool, str or None).

    Raises:
        TypeError: naming ``name`` and the value.
    """
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} ({value!r})")
    return float(value)


def as_bool(name: str, value: Any) -> bool:
    """``value`` as a bool (Python's or numpy's only: ``'False'`` is no bool).

    Raises:
        TypeError: naming ``name`` and the value.
    """
    if not _is_bool(value):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return bool(value)


def check_metadata_value(label: str, value: Any, dtype: torch.dtype) -> None:
    """Refuse a request-metadata value that megatron-core would fail to store as ``dtype``, or
    would store as something else: a str or None, a bool where a number belongs, a float in an
    integer label, an integer outside the dtype's range.

    Raises:
        TypeError, ValueError: naming the label and the value.
    """
    if dtype == torch.bool:
        as_bool(label, value)
    elif dtype.is_floating_point:
        as_real(label, value)
    else:
        number = as_int(label, value)
        info = torch.iinfo(dtype)
        if not info.min <= number <= info.max:
            raise ValueError(
                f"{label} ({number}) does not fit the context's {dtype} "
                f"([{info.min}, {info.max}])"
            )


def describe(value: Any) -> str:
    """A short description of ``value`` for messages (a tensor by its rank and dtype)."""
    if isinstance(value, Tensor):
        return f"a {value.dim()}-D {value.dtype} tensor"
    return type(value).__name__


def prompt_token_ids(
    name: str, tokens: Any, vocab_size: Optional[int] = None, check_values: bool = True
) -> Tensor:
    """``tokens`` as the int64 token ids megatron-core stores, after checking that they are ids.

    Accepted as megatron-core's context accepts them (it copies them into int64 buffers): any
    integer dtype, and floating ids whose values are integral and finite. Refused: what is no
    1-D tensor, bools, complex numbers, an empty prompt, non-integral or non-finite values, and
    ids outside ``[0, vocab_size)`` (an embedding lookup of such an id raises an IndexError on the
    CPU and is a device-side assert on a GPU, which ends the process's CUDA context).

    The checks read one reduction of the ids back to the host: on a GPU prompt that is one
    synchronisation where a request enters, outside any CUDA graph and before anything is
    allocated for it; the step never reads the ids back.

    Args:
        name: what the tensor is, for messages.
        tokens: the prompt's token ids.
        vocab_size: the model's vocabulary (the embedding's rows); None: only ``>= 0`` is checked.
        check_values: False skips the range check of integer ids (no host read); floating ids
            are always checked, since converting them needs integral values.

    Returns:
        Tensor: ``tokens`` itself when it is int64, else an int64 copy on the same device.

    Raises:
        TypeError: for something other than a 1-D tensor of real numbers (a bool tensor too, and
            a meta tensor).
        ValueError: for an empty prompt, and an id that is not integral, not finite, or outside
            the vocabulary (the message names the first such id and its position).
    """
    if not isinstance(tokens, Tensor) or tokens.dim() != 1:
        raise TypeError(f"{name} must be a 1-D tensor of token ids, got {describe(tokens)}")
    if tokens.is_meta:
        raise TypeError(f"{name} is a meta tensor: it holds no token ids")
    if tokens.dtype == torch.bool or tokens.is_complex():
        raise TypeError(f"{name} must hold integer token ids, got {describe(tokens)}")
    if tokens.numel() == 0:
        raise ValueError(f"{name} is empty: a request needs at least one prompt token")
    if not (check_values or tokens.is_floating_point()):
        return tokens if tokens.dtype == torch.int64 else tokens.to(torch.int64)
    end = _INT64_END if vocab_size is None else vocab_size
    if tokens.is_floating_point():
        values = tokens.double()
        bad = ~torch.isfinite(values) | (values != values.trunc()) | (values < 0) | (values >= end)
    else:
        bad = (tokens < 0) | (tokens >= end) if end < _INT64_END else tokens < 0
    if bad.any():  # the one host read on the accepted path
        position = int(bad.nonzero()[0, 0])
        value = tokens[position].item()
        if tokens.is_floating_point() and not (math.isfinite(value) and value == int(value)):
            raise ValueError(
                f"{name}[{position}] is {value!r}: token ids must be integral and finite"
            )
        where = "int64's range" if vocab_size is None else "the model's vocabulary"
        raise ValueError(
            f"{name}[{position}] is {value!r}: token ids must be in [0, {end}) ({where})"
        )
    return tokens if tokens.dtype == torch.int64 else tokens.to(torch.int64)


def check_sampling_ranges(sampling_params: Any) -> None:
    """Refuse sampling parameters outside the range where they mean something; megatron-core
    samples with most of them without a word (a negative ``top_k`` or ``top_p`` as if it were 0,
    a negative temperature from the least likely tokens).

    Args:
        sampling_params: the request's ``SamplingParams``.

    Raises:
        TypeError: for a field of the wrong type.
        ValueError: for ``top_k < 0``, ``top_p`` outside ``[0, 1]`` or NaN, a temperature that is
            negative or not finite, ``top_n_logprobs < 0``.
    """
    top_k = as_int("top_k", sampling_params.top_k)
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: no top-k filtering, 1: greedy), got {top_k}")
    top_p = as_real("top_p", sampling_params.top_p)
    if not 0.0 <= top_p <= 1.0:  # a NaN too, as megatron-core's assert refuses it
        raise ValueError(f"top_p must be in [0.0, 1.0] (0: no top-p filtering), got {top_p}")
    temperature = as_real("temperature", sampling_params.temperature)
    if not (math.isfinite(temperature) and temperature >= 0.0):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    top_n = getattr(sampling_params, "top_n_logprobs", 0)
    if top_n is not None and as_int("top_n_logprobs", top_n) < 0:
        raise ValueError(f"top_n_logprobs must be >= 0, got {top_n}")


def check_generation_length(sampling_params: Any, prompt_length: int, zero_allowed: bool) -> None:
    """Refuse a request whose generation length is not a count megatron-core's engine can use,
    where the engine reads it (it computes with the value and asserts on the combination).

    ``num_tokens_to_generate=None`` (and ``num_tokens_total=None``) is megatron-core's "up to
    the context's maximum sequence length". 0 is megatron-core's "score the prompt, generate
    nothing" (its static controller runs a prefill only; 0.19's dynamic engine trims the sampled
    token, keeping the prompt log-probs that echo requests need); megatron-core 0.16's dynamic
    engine does not honour it (it appends the sampled token), so ``zero_allowed`` is False there.

    Args:
        sampling_params: the request's ``SamplingParams``.
        prompt_length: the prompt's token count.
        zero_allowed: whether the engine honours 0 tokens to generate.

    Raises:
        TypeError: for a count that is not an int (a float such as 2.5 or a bool included).
        ValueError: for both counts set, and a count below 1 (below 0 where ``zero_allowed``).
    """
    to_generate = sampling_params.num_tokens_to_generate
    total = getattr(sampling_params, "num_tokens_total", None)
    if to_generate is not None and total is not None:
        raise ValueError(
            f"num_tokens_to_generate ({to_generate!r}) and num_tokens_total ({total!r}) cannot "
            "both be set (megatron-core asserts the same); set one of them"
        )
    low = 0 if zero_allowed else 1
    zero = (
        ""
        if zero_allowed
        else (
            " (0, megatron-core's 'score the prompt, generate nothing', is honoured by its 0.19 "
            "engine only; this release's dynamic engine would generate one token)"
        )
    )
    if total is not None:
        total = as_int("num_tokens_total", total)
        if total - prompt_length < low:
            raise ValueError(
                f"num_tokens_total ({total}) leaves {total - prompt_length} tokens to generate "
                f"after the prompt's {prompt_length}; it must leave at least {low}{zero}"
            )
    if to_generate is not None:
        to_generate = as_int("num_tokens_to_generate", to_generate)
        if to_generate < low:
            raise ValueError(f"num_tokens_to_generate must be >= {low}, got {to_generate}{zero}")


def check_log_prob_options(sampling_params: Any, last_token_logits_only: bool) -> None:
    """Refuse the log-prob options megatron-core's engine asserts on when it adds a request.

    Args:
        sampling_params: the request's ``SamplingParams``.
        last_token_logits_only: whether the forward pass materializes only last-token logits
            (``materialize_only_last_token_logits``).

    Raises:
        TypeError: for a field of the wrong type.
        ValueError: for ``top_n_logprobs > 0`` without ``return_log_probs``, and prompt log-probs
            (``return_log_probs`` without ``skip_prompt_log_probs``) from last-token logits only.
    """
    return_log_probs = as_bool("return_log_probs", sampling_params.return_log_probs)
    top_n = getattr(sampling_params, "top_n_logprobs", 0)
    top_n = 0 if top_n is None else as_int("top_n_logprobs", top_n)
    if top_n > 0 and not return_log_probs:
        raise ValueError(
            f"top_n_logprobs ({top_n}) needs return_log_probs=True (megatron-core asserts the same)"
        )
    skip_prompt = as_bool("skip_prompt_log_probs", sampling_params.skip_prompt_log_probs)
    if return_log_probs and not skip_prompt and last_token_logits_only:
        raise ValueError(
            "return_log_probs with skip_prompt_log_probs=False asks for prompt log-probs, which "
            "this context cannot give: it materializes only last-token logits "
            "(materialize_only_last_token_logits); set skip_prompt_log_probs=True"
        )


def check_stop_words(sampling_params: Any) -> None:
    """Refuse stop words that are not a list of strings: megatron-core's engine tokenizes each
    element after it has registered the request (a str would stop at each of its characters;
    anything else raises in the tokenizer, leaving the request registered).

    Args:
        sampling_params: the request's ``SamplingParams``.

    Raises:
        TypeError: for ``stop_words`` other than None or a list or tuple of str, naming the
            first element that is no str.
    """
    stop_words = getattr(sampling_params, "stop_words", None)
    if stop_words is None:
        return
    if not isinstance(stop_words, (list, tuple)):
        raise TypeError(
            f"stop_words must be a list of str, got {type(stop_words).__name__} ({stop_words!r})"
        )
    for position, word in enumerate(stop_words):
        if not isinstance(word, str):
            raise TypeError(
                f"stop_words[{position}] must be a str, got {type(word).__name__} ({word!r})"
            )
