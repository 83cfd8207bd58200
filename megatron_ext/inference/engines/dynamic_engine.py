# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""megatron-core's ``DynamicInferenceEngine`` failing one bad request alone (mirrors
``megatron.core.inference.engines.dynamic_engine``).

megatron-core's engine queues a request when it is added and hands it to the context when it is
scheduled; a request the extension's context refuses there (top-k with top-p, a temperature too
small to sample with, an id the context cannot store, ...) would stay at the head of the queue,
and every later step would raise on it. A token id outside the vocabulary gets as far as the
embedding (an IndexError on the CPU; on a GPU a device-side assert, which ends the process's
CUDA context), an empty prompt wedges the scheduler, and a few option combinations meet bare
asserts in megatron-core's ``_add_request``. And a request whose logits row is not finite has no
distribution to sample from, which the graph-safe sampling region can only report (it cannot
raise). While the inference flag is applied (:data:`megatron_ext.patches.PATCHES`,
``inference_static_active_slices``), the engine wrapped here:

* ``_add_request``: fails a request the context refuses when it enters
  (``StaticSlicesContextBase.check_new_request``, with the vocabulary of the engine's controller
  and the ids the engine holds; and stop words the controller's tokenizer must be able to
  tokenize into at least one token), as megatron-core fails a request longer than the context
  (status ``FAILED``, a non-transient error event whose message is the reason), so it never
  reaches the scheduler and nothing is allocated for it. A request whose id another request in
  the engine holds is answered with a future that is already done (the engine's table is keyed
  by id, so it cannot take it); the request it collides with is not touched;
* ``async_bookkeep``: takes the requests the controller reports under
  :data:`FAILED_REQUESTS_KEY` out of the step's outputs (their rows have already left the
  context) and fails them the same way; the others are post-processed as megatron-core does.

The error is megatron-core's own ``ContextOverflowError`` (non-transient), which its request
events serialise. Engines around megatron-core's own context are unchanged.
"""

import functools
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from megatron.core.inference.contexts.dynamic_context import ContextOverflowError
from megatron.core.inference.inference_request import DynamicInferenceRequestRecord, Status
from megatron.core.inference.sampling_params import SamplingParams

from megatron_ext.inference.contexts.request_checks import prompt_token_ids
from megatron_ext.inference.contexts.static_slices_context_base import StaticSlicesContextBase
from megatron_ext.utils import is_megatron_core_min_version

# megatron-core 0.19's controller tokenizes with a static method that takes the tokenizer first.
TOKENIZE_TAKES_TOKENIZER = is_megatron_core_min_version("0.19.0")

__all__ = [
    "FAILED_REQUESTS_KEY",
    "checked_add_request",
    "engine_fails_requests",
    "failing_bookkeep",
    "model_vocab_size",
]

# Key of the controller's step result holding {request id: reason} of requests to fail.
FAILED_REQUESTS_KEY = "megatron_ext_failed_requests"

# Marks the wrapped bookkeeping, so that a controller can tell whether the engine fails requests.
_MARKER = "_megatron_ext_fails_requests"


def _add_error(request: Any, reason: str) -> None:
    """megatron-core's non-transient error event on ``request``, saying ``reason``."""
    request_id = getattr(request, "request_id", None)
    request.add_event_error_nontransient(
        ContextOverflowError(request_id, reason, is_transient=False)
    )


def _fail(engine: Any, request_id: int, reason: str) -> None:
    """Fail one request the engine holds: megatron-core's error event, then its own failure
    path (0.19's ``_handle_failed_request``; 0.16 resolves ``failed_request_ids`` in its
    bookkeeping)."""
    request = engine.get_request(request_id)
    _add_error(request, reason)
    handle = getattr(engine, "_handle_failed_request", None)
    if handle is not None:
        handle(request_id)
    else:
        request.status = Status.FAILED
        engine.failed_request_ids.append(request_id)


def _without_requests(result: Dict[str, Any], failed: Dict[int, str]) -> Dict[str, Any]:
    """The step result without the rows of ``failed`` (every per-row entry, in both
    megatron-core lines' layouts), and without them among the finished requests."""
    result = dict(result)
    ids = result["active_request_ids"]
    keep = [row for row, rid in enumerate(ids.tolist()) if rid not in failed]
    index = torch.tensor(keep, dtype=torch.long)
    for key in ("active_request_ids", "sample", "accepted_tokens"):
        value = result.get(key)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            result[key] = value[index.to(value.device)]
    if result.get("log_probs"):
        result["log_probs"] = [result["log_probs"][row] for row in keep]
    top_n = result.get("top_n_logprobs")
    if top_n:
        result["top_n_logprobs"] = {new: top_n[old] for new, old in enumerate(keep) if old in top_n}
    finished = result["finished_request_ids"]
    dropped = torch.tensor(sorted(failed), dtype=finished.dtype, device=finished.device)
    result["finished_request_ids"] = finished[~torch.isin(finished, dropped)]
    routing = result.get("finished_routing_block_ids")
    if routing:
        result["finished_routing_block_ids"] = {
            rid: blocks for rid, blocks in routing.items() if rid not in failed
        }
    return result


def model_vocab_size(controller: Any) -> Optional[int]:
    """The vocabulary of the model behind ``controller`` (the rows of its embedding, the width of
    its logits), or None where the controller does not say.

    megatron_ext's controllers read it when they are built (``_vocab_size``); megatron-core 0.19's
    own controller keeps it as ``vocab_size``, 0.16's reads it from the wrapped model's
    ``inference_wrapper_config.padded_vocab_size``.
    """
    for value in (
        getattr(controller, "_vocab_size", None),
        getattr(controller, "vocab_size", None),
        getattr(
            getattr(
                getattr(controller, "inference_wrapped_model", None),
                "inference_wrapper_config",
                None,
            ),
            "padded_vocab_size",
            None,
        ),
    ):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _last_token_logits_only(engine: Any) -> bool:
    """What megatron-core's ``_add_request`` asserts prompt log-probs against: 0.19's engine keeps
    the setting itself, 0.16's reads its context's."""
    value = getattr(engine, "materialize_only_last_token_logits", None)
    if value is None:
        return engine.context.materializes_only_last_token_logits
    return bool(value)


def _tokenized(controller: Any, text: str) -> Any:
    """``text`` tokenized as megatron-core's engine tokenizes a stop word: 0.19's
    ``tokenize_prompt`` is a static method that takes the tokenizer, 0.16's a method."""
    if TOKENIZE_TAKES_TOKENIZER:
        return controller.tokenize_prompt(controller.tokenizer, text, add_BOS=False)
    return controller.tokenize_prompt(text, add_BOS=False)


def _stop_words_refusal(engine: Any, request: Any) -> Optional[str]:
    """Why megatron-core could not use ``request``'s stop words (their types checked already),
    or None. It tokenizes them only after registering the request, in the engine loop's task:
    a word its tokenizer rejects would end that loop, and every request with it."""
    for position, word in enumerate(getattr(request.sampling_params, "stop_words", None) or ()):
        try:
            ids = _tokenized(engine.controller, word)
        except Exception as error:  # noqa: BLE001 (a tokenizer raises whatever it raises)
            return (
                f"ValueError: stop_words[{position}] ({word!r}) cannot be tokenized: "
                f"{type(error).__name__}: {error}"
            )
        if len(ids) == 0:
            return (
                f"ValueError: stop_words[{position}] ({word!r}) tokenizes to no tokens: a stop "
                "word must be at least one token"
            )
    return None


def _refusal(engine: Any, request: Any) -> Tuple[Optional[str], Any]:
    """(The reason megatron_ext's context refuses ``request`` or None, the prompt as int64
    ids)."""
    try:
        tokens = engine.context.check_new_request(
            request,
            vocab_size=model_vocab_size(engine.controller),
            ids_in_use=engine.requests,
            last_token_logits_only=_last_token_logits_only(engine),
        )
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}", None
    return _stop_words_refusal(engine, request), tokens


def _readable_prompt(engine: Any, request: Any) -> bool:
    """Whether megatron-core can count ``request``'s prompt and turn it back into text: ids the
    entry checks accept (a tokenizer raises on an id it does not know)."""
    try:
        prompt_token_ids(
            "prompt_tokens", request.prompt_tokens, model_vocab_size(engine.controller)
        )
    except (TypeError, ValueError):
        return False
    return True


def _is_resumed(engine: Any, request: Any) -> bool:
    """Whether ``request`` is the engine's own request, added again when the engine resumes
    (checked when it first entered; its prompt now holds its generated tokens too)."""
    try:
        entry = engine.requests.get(getattr(request, "request_id", None))
    except TypeError:  # an unhashable id: not one the engine holds
        return False
    return entry is not None and entry.record[-1] is request


def _already_failed(engine: Any, request: Any) -> Any:
    """A done future holding ``request``'s record, for a request the engine cannot register."""
    request.add_event_fail()
    future = engine._loop.create_future()
    future.set_result(DynamicInferenceRequestRecord.from_request(request))
    return future


def checked_add_request(original: Callable) -> Callable:
    """``DynamicInferenceEngine._add_request`` that fails a request the context refuses.

    Args:
        original: megatron-core's ``_add_request``.

    Returns:
        Callable: the replacement.
    """

    @functools.wraps(original)
    def _add_request(self, request: Any) -> Any:
        # megatron-core's own context checks nothing here; a resumed request was checked once.
        if not isinstance(self.context, StaticSlicesContextBase) or _is_resumed(self, request):
            return original(self, request)
        reason, tokens = _refusal(self, request)
        if reason is None:
            if tokens is not None and tokens is not request.prompt_tokens:
                # Integral ids of another dtype, checked: megatron-core computes with int64 ids.
                prompt = tokens
                request.prompt_tokens = prompt  # not megatron-core state: the caller's request
                request.remaining_prompt_tokens = prompt  # not megatron-core state: likewise
            return original(self, request)
        request.status = Status.FAILED  # not megatron-core state: the caller's request
        _add_error(request, reason)
        try:
            in_use = request.request_id in self.requests
        except TypeError:  # an unhashable id: megatron-core could not key it either
            in_use = True
        if in_use:
            return _already_failed(self, request)
        # megatron-core's own convention for a request that can never run: its _add_request
        # registers it and routes a FAILED request to the failed ones, not the queue. It asserts
        # on some of the very options refused here before it reads the status, and computes with
        # the counts, so it runs with neutral sampling parameters; the request keeps its own.
        params, prompt_tokens = request.sampling_params, request.prompt_tokens
        neutral = SamplingParams(num_tokens_to_generate=1, termination_id=-1)
        request.sampling_params = neutral  # not megatron-core state: the caller's request
        if not _readable_prompt(self, request):
            # megatron-core counts the prompt (len) as it registers the request, and its
            # bookkeeping detokenizes a failed request's prompt unless it has its text: it counts
            # an empty prompt here, and the request's text stays empty unless it came with one.
            if request.prompt is None:
                request.prompt = ""  # not megatron-core state: the caller's request
            empty = torch.empty(0, dtype=torch.int64)
            request.prompt_tokens = empty  # not megatron-core state: likewise
        try:
            return original(self, request)
        finally:
            request.sampling_params = params  # not megatron-core state: put back
            request.prompt_tokens = prompt_tokens  # not megatron-core state: put back

    return _add_request


def failing_bookkeep(original: Callable) -> Callable:
    """``DynamicInferenceEngine.async_bookkeep`` that fails the requests the controller
    reports under :data:`FAILED_REQUESTS_KEY`.

    Args:
        original: megatron-core's ``async_bookkeep``.

    Returns:
        Callable: the replacement.
    """

    @functools.wraps(original)
    async def async_bookkeep(self, step_result: Any, *args: Any, **kwargs: Any) -> Any:
        failed = None
        if isinstance(step_result, dict):
            failed = step_result.get(FAILED_REQUESTS_KEY)
            step_result = {k: v for k, v in step_result.items() if k != FAILED_REQUESTS_KEY}
        if failed:
            step_result = _without_requests(step_result, failed)
            for request_id, reason in failed.items():
                _fail(self, request_id, reason)
        return await original(self, step_result, *args, **kwargs)

    setattr(async_bookkeep, _MARKER, True)
    return async_bookkeep


def engine_fails_requests() -> bool:
    """Whether megatron-core's engine fails the requests a controller reports (the inference
    flag's patch is applied).

    Returns:
        bool: True while ``DynamicInferenceEngine.async_bookkeep`` is :func:`failing_bookkeep`'s.
    """
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine

    return bool(getattr(DynamicInferenceEngine.async_bookkeep, _MARKER, False))
