# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Unit tests of megatron_ext.inference.engines.dynamic_engine: the engine's wrapped methods take
out exactly the failed requests' rows, and leave engines around megatron-core's own context
alone; a bad request (prompt ids, counts, sampling ranges, option combinations, an id in use)
fails alone where it enters megatron-core's engine, with good ones in flight, which finish as
without it, and the context is left as it was. The sampling edges and the request whose logits
are not finite are in text_generation_controllers/test_text_generation_controller.py."""

import functools
from types import SimpleNamespace
from typing import Dict, List, Tuple, Union

import numpy as np
import pytest
import torch
from megatron.core.inference.inference_request import DynamicInferenceRequest, Status
from megatron.core.inference.sampling_params import SamplingParams

import megatron_ext.inference as inference_switch
from megatron_ext.inference.contexts.static_slices_context_base import (
    ZERO_TOKENS_TO_GENERATE_HONOURED,
)
from megatron_ext.inference.engines import dynamic_engine
from megatron_ext.testing.synthetic import build_engine, build_synthetic_stack, cpu_torch_compat
from tests.unit_tests.inference.engine_testlib import (
    add_to_engine,
    completed,
    failure_reason,
    inference_flag,
    step_until_done,
)


def _result(ids, **extra):
    rows = len(ids)
    result = {
        "active_request_ids": torch.tensor(ids, dtype=torch.int32),
        "finished_request_ids": torch.tensor([ids[0], ids[2]], dtype=torch.int32),
        "sample": torch.arange(rows) * 10,
        "log_probs": [[float(r)] for r in range(rows)],
        "top_n_logprobs": {1: "one", 2: "two", 3: "three"},
        "cuda_graph_request_count": 8,
    }
    result.update(extra)
    return result


@pytest.mark.parametrize("line", ["0.16", "0.19"])
def test_the_failed_rows_leave_every_per_row_entry(line):
    ids = [5, 9, 2, 7]
    extra = {}
    if line == "0.19":
        extra = dict(accepted_tokens=None, finished_routing_block_ids={5: [1], 2: [3, 4]})
    result = _result(ids, **extra)
    kept = dynamic_engine._without_requests(result, {2: "why", 9: "why"})
    assert kept["active_request_ids"].tolist() == [5, 7]
    assert kept["sample"].tolist() == [0, 30]
    assert kept["log_probs"] == [[0.0], [3.0]]
    assert kept["top_n_logprobs"] == {1: "three"}  # re-keyed by the new row
    assert kept["finished_request_ids"].tolist() == [5]
    assert kept["cuda_graph_request_count"] == 8
    if line == "0.19":
        assert kept["accepted_tokens"] is None
        assert kept["finished_routing_block_ids"] == {5: [1]}
    # The engine's own result is not modified.
    assert result["active_request_ids"].tolist() == ids and len(result["log_probs"]) == 4


def test_the_flag_switches_the_engines_failure_path():
    assert not dynamic_engine.engine_fails_requests()
    inference_switch.enable_static_active_slices()
    try:
        assert dynamic_engine.engine_fails_requests()
    finally:
        inference_switch.disable_static_active_slices()
    assert not dynamic_engine.engine_fails_requests()


def test_engines_around_megatron_cores_own_context_are_unchanged():
    """Only the extension's context refuses requests; megatron-core's keeps its behaviour."""
    request = DynamicInferenceRequest(
        request_id=1,
        prompt_tokens=torch.tensor([1, 2]),
        sampling_params=SamplingParams(top_k=5, top_p=0.9),
    )
    calls = []
    wrapped = dynamic_engine.checked_add_request(lambda engine, req: calls.append(req) or "future")
    assert wrapped(SimpleNamespace(context=object()), request) == "future"
    assert calls == [request] and request.status is None and request.events == []


# ------------------------------------------------------------------------------ bad requests

VOCAB = 64
BAD_ID = 7
# Three greedy requests in flight when the bad one arrives; none finishes in the first step.
GOOD = {
    0: ([5, 9, 2, 7], 9),
    1: ([11, 3, 60, 1, 1, 8, 30, 2, 44, 9, 13], 12),
    2: ([63, 0], 10),
}


def _params(num_tokens_to_generate: int = 6, **overrides) -> SamplingParams:
    fields = dict(num_tokens_to_generate=num_tokens_to_generate, termination_id=-1, top_k=1)
    return SamplingParams(**dict(fields, **overrides))


# name -> (prompt, sampling overrides, what the failure message must say). Each one used to make
# the engine's steps raise from then on (the prompt ids: an IndexError in the embedding on the
# CPU, a device-side assert on a GPU), meet a bare assert in megatron-core's add_request, or
# generate although the value means nothing. Stop words: megatron-core tokenizes each element
# after it has registered the request (a str's characters, each one a stop word; an int raised
# in the tokenizer, the request left registered with a future never done).
BAD_REQUESTS = {
    "token_id_negative": ([3, -1, 4], {}, "ValueError: prompt_tokens[1] is -1: token ids must"),
    "token_id_vocab": (
        [3, VOCAB],
        {},
        f"prompt_tokens[1] is {VOCAB}: token ids must be in [0, 64)",
    ),
    "token_id_10**6": ([10**6], {}, "prompt_tokens[0] is 1000000: token ids must be in [0, 64)"),
    "empty_prompt": ([], {}, "ValueError: prompt_tokens is empty"),
    "num_tokens_2.5": (
        [3, 4],
        dict(num_tokens_to_generate=2.5),
        "TypeError: num_tokens_to_generate must be an int, got float (2.5)",
    ),
    "num_tokens_total_beside_num_tokens": (
        [3, 4],
        dict(num_tokens_total=10),
        "num_tokens_to_generate (6) and num_tokens_total (10) cannot both be set",
    ),
    "top_n_logprobs_without_return_log_probs": (
        [3, 4],
        dict(top_n_logprobs=2),
        "top_n_logprobs (2) needs return_log_probs=True",
    ),
    "prompt_log_probs_from_last_token_logits": (
        [3, 4],
        dict(return_log_probs=True, skip_prompt_log_probs=False),
        "materializes only last-token logits (materialize_only_last_token_logits)",
    ),
    "top_k_-1": ([3, 4], dict(top_k=-1), "top_k must be >= 0"),
    "top_p_-0.1": ([3, 4], dict(top_k=0, top_p=-0.1), "top_p must be in [0.0, 1.0]"),
    "temperature_inf": ([3, 4], dict(temperature=float("inf")), "temperature must be finite"),
    "temperature_-1": ([3, 4], dict(temperature=-1.0), "temperature must be finite and >= 0"),
    "temperature_nan": ([3, 4], dict(temperature=float("nan")), "temperature must be finite"),
    "num_tokens_tensor": (
        [3, 4],
        dict(num_tokens_to_generate=torch.tensor(3)),
        "TypeError: num_tokens_to_generate must be an int, got Tensor",
    ),
    "num_tokens_total_tensor": (
        [3, 4],
        dict(num_tokens_to_generate=None, num_tokens_total=torch.tensor(8)),
        "TypeError: num_tokens_total must be an int, got Tensor",
    ),
    "top_k_tensor": ([3, 4], dict(top_k=torch.tensor(1)), "TypeError: top_k must be an int"),
    "stop_words_str": (
        [3, 4],
        dict(stop_words="stop"),
        "TypeError: stop_words must be a list of str, got str ('stop')",
    ),
    "stop_words_ints": (
        [3, 4],
        dict(stop_words=[1, 2]),
        "TypeError: stop_words[0] must be a str, got int (1)",
    ),
    # megatron-core tokenizes stop words in the engine loop's task after registering the
    # request: the synthetic tokenizer (space-separated integers) rejects "hello" and makes no
    # tokens of "".
    "stop_words_untokenizable": (
        [3, 4],
        dict(stop_words=["7", "hello"]),
        "ValueError: stop_words[1] ('hello') cannot be tokenized: ValueError: invalid literal",
    ),
    "stop_words_empty": (
        [3, 4],
        dict(stop_words=[" "]),
        "ValueError: stop_words[0] (' ') tokenizes to no tokens",
    ),
    "prompt_2-D": (
        [[3, 4]],
        {},
        "TypeError: prompt_tokens must be a 1-D tensor of token ids, got a 2-D torch.int64 tensor",
    ),
}
if not ZERO_TOKENS_TO_GENERATE_HONOURED:
    BAD_REQUESTS["num_tokens_0"] = (
        [3, 4],
        dict(num_tokens_to_generate=0),
        "num_tokens_to_generate must be >= 1, got 0 (0, megatron-core's 'score the prompt",
    )


@pytest.fixture(autouse=True)
def _cpu_compat():
    with cpu_torch_compat():
        yield


def _context_state(context) -> tuple:
    """What a request holds in the context: request and token counts, free KV blocks, sampling
    records."""
    allocator = getattr(context, "kv_block_allocator", None) or context.block_allocator
    return (
        context.total_request_count,
        context.paused_request_count,
        context.active_token_count,
        allocator.total_avail,
        len(context._sampling_registry),
    )


def _stack():
    """A small context (the defaults' blocks, no paused reserve) around a 64-token model."""
    return build_synthetic_stack(extension=True, max_requests=16, vocab_size=VOCAB)


def _serve(
    bad: Union[None, Tuple[int, List[int], SamplingParams], DynamicInferenceRequest] = None,
    refused: bool = True,
):
    """The GOOD requests through megatron-core's engine (flag applied); after their first step,
    the ``bad`` request (id, prompt, params; or a built request, added as the engine adds it),
    if any. Returns the finished records by id and the bad request's future; checks that adding
    it changed nothing in the context and that the context is back to its fresh state at the
    end."""
    with inference_flag():
        stack = _stack()
        engine, context = build_engine(stack), stack.context
        fresh = _context_state(context)
        add_to_engine(engine, {k: (p, _params(n)) for k, (p, n) in GOOD.items()})
        engine.step_modern()
        future = None
        if bad is not None:
            before = _context_state(context)
            if isinstance(bad, DynamicInferenceRequest):
                bad_id, future = bad.request_id, engine._add_request(bad)
            else:
                bad_id, future = bad[0], engine.add_request(*bad)
            assert _context_state(context) == before
            # A refused request never reaches the scheduler.
            assert (bad_id not in engine.waiting_request_ids) == refused
        bad_id = None if bad is None else bad_id
        wanted = set(GOOD) | ({bad_id} if bad_id is not None and bad_id not in GOOD else set())
        records = step_until_done(engine, wanted)
        assert _context_state(context) == fresh
    return records, future


@functools.lru_cache(maxsize=1)
def _clean_tokens() -> Dict[int, List[int]]:
    records, _ = _serve()
    return {k: list(records[k].generated_tokens) for k in GOOD}


def _assert_good_ones_unchanged(records) -> None:
    for request_id, tokens in _clean_tokens().items():
        assert completed(records[request_id]), request_id
        assert list(records[request_id].generated_tokens) == tokens, request_id
        assert len(tokens) == GOOD[request_id][1]


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_a_bad_request_fails_alone_and_the_engine_serves_the_others(case):
    prompt, overrides, reason = BAD_REQUESTS[case]
    records, future = _serve((BAD_ID, prompt, _params(**overrides)))
    assert reason in failure_reason(records[BAD_ID])
    assert records[BAD_ID].generated_tokens == []
    assert future.done() and future.result().merge().status == Status.FAILED
    _assert_good_ones_unchanged(records)


def test_a_request_id_in_use_fails_alone_and_the_request_holding_it_finishes():
    """The engine keys its requests by id: the second request with id 1 is answered at once,
    failed; the first one with that id runs on untouched."""
    records, future = _serve((1, [3, 4], _params()))
    assert future.done()
    second = future.result().merge()
    assert "request_id 1 is in use by a request the engine has not finished" in failure_reason(
        second
    )
    assert second.generated_tokens == [] and second.prompt_tokens.tolist() == [3, 4]
    _assert_good_ones_unchanged(records)


def test_zero_tokens_to_generate_is_megatron_cores_prompt_only_request_where_honoured():
    """megatron-core gives 0 the meaning 'score the prompt, generate nothing'; its 0.19 engine
    honours it (no token comes back), 0.16's would generate one token, so it is refused there."""
    honoured = ZERO_TOKENS_TO_GENERATE_HONOURED
    records, _ = _serve((BAD_ID, [3, 4], _params(0)), refused=not honoured)
    if honoured:
        assert completed(records[BAD_ID]) and records[BAD_ID].generated_tokens == []
    else:
        assert "num_tokens_to_generate must be >= 1, got 0" in failure_reason(records[BAD_ID])
    _assert_good_ones_unchanged(records)


# name -> (the request's prompt_tokens, what the failure message must say). A request built
# by hand (as megatron-core's own tests and servers build them) reaches the engine's
# _add_request with whatever its prompt is: megatron-core counts the prompt there (len) after it
# has registered the request, and turns a failed request's ids back into text in the step's
# bookkeeping, so such a prompt used to raise there (the request left registered, or every good
# request finishing in that step lost with it).
BAD_PROMPTS = {
    "0-D": (lambda: torch.tensor(3), "prompt_tokens must be a 1-D tensor of token ids, got a 0-D"),
    "None": (lambda: None, "prompt_tokens must be a 1-D tensor of token ids, got NoneType"),
    "list": (lambda: [3, 4], "prompt_tokens must be a 1-D tensor of token ids, got list"),
    "2-D": (lambda: torch.tensor([[3, 4]]), "1-D tensor of token ids, got a 2-D torch.int64"),
    "nan": (lambda: torch.tensor([3.0, float("nan")]), "prompt_tokens[1] is nan"),
    "complex": (lambda: torch.tensor([3 + 0j]), "prompt_tokens must hold integer token ids"),
    "meta": (lambda: torch.tensor([3, 4], device="meta"), "prompt_tokens is a meta tensor"),
}


@pytest.mark.parametrize("case", list(BAD_PROMPTS))
def test_a_request_built_with_a_bad_prompt_fails_alone(case):
    """The request fails with the reason, keeps the prompt it came with, and the others finish
    as without it."""
    tokens, reason = BAD_PROMPTS[case]
    request = DynamicInferenceRequest(
        request_id=BAD_ID, prompt_tokens=tokens(), sampling_params=_params()
    )
    records, future = _serve(request)
    assert reason in failure_reason(records[BAD_ID])
    assert records[BAD_ID].generated_tokens == []
    assert future.done() and future.result().merge().status == Status.FAILED
    _assert_good_ones_unchanged(records)


def test_refused_prompt_ids_are_never_turned_back_into_text(monkeypatch):
    """megatron-core detokenizes a finished request's prompt in the step's bookkeeping; a real
    tokenizer raises on an id it does not know (a negative one, one past its vocabulary). The
    refused request's ids are not handed to it, so the step serves the others."""
    from megatron_ext.testing.synthetic import SyntheticTokenizer

    detokenize = SyntheticTokenizer.detokenize

    def strict(self, tokens, **kwargs):
        if any(not 0 <= int(token) < self.vocab_size for token in tokens):
            raise OverflowError("out of range integral type conversion attempted")
        return detokenize(self, tokens, **kwargs)

    monkeypatch.setattr(SyntheticTokenizer, "detokenize", strict)
    for prompt in ([3, -1, 4], [VOCAB]):
        records, _ = _serve((BAD_ID, prompt, _params()))
        assert "token ids must be in [0, 64)" in failure_reason(records[BAD_ID])
        _assert_good_ones_unchanged(records)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(num_tokens_to_generate=np.int64(3)),
        dict(num_tokens_to_generate=None, num_tokens_total=np.int32(5)),
    ],
    ids=["num_tokens_to_generate", "num_tokens_total"],
)
def test_numpy_generation_lengths_are_served(overrides):
    """The entry accepts numpy integers, as it does for the other counts; the context, where the
    engine schedules the request, used to refuse them, raising in every step from then on."""
    records, _ = _serve((BAD_ID, [3, 4], _params(**overrides)), refused=False)
    assert completed(records[BAD_ID]) and len(records[BAD_ID].generated_tokens) == 3
    _assert_good_ones_unchanged(records)


def test_a_tensor_request_id_fails_alone():
    """A 0-D tensor converts to an index but hashes by identity: the engine, which keys its
    requests by id, used to lose the request (a KeyError in every step from then on)."""
    with inference_flag():
        stack = _stack()
        engine = build_engine(stack)
        add_to_engine(engine, {k: (p, _params(n)) for k, (p, n) in GOOD.items()})
        engine.step_modern()
        request_id = torch.tensor(BAD_ID)
        future = engine.add_request(request_id, [3, 4], _params())
        records = step_until_done(engine, set(GOOD) | {request_id})
    assert "TypeError: request_id must be an int, got Tensor" in failure_reason(records[request_id])
    assert future.done()
    _assert_good_ones_unchanged(records)


def test_integral_float_prompt_ids_are_served_as_int64():
    """A request built with float ids of integral values (as megatron-core's own tests build
    them) runs as with int64 ids."""
    good = {k: (p, _params(n)) for k, (p, n) in GOOD.items()}
    with inference_flag():
        engine = build_engine(_stack())
        for request_id, (prompt, params) in good.items():
            engine._add_request(
                DynamicInferenceRequest(
                    request_id=request_id,
                    prompt_tokens=torch.tensor(prompt, dtype=torch.float32),
                    sampling_params=params,
                )
            )
        records = step_until_done(engine, set(good))
    for request_id, tokens in _clean_tokens().items():
        assert records[request_id].prompt_tokens.dtype == torch.int64
        assert list(records[request_id].generated_tokens) == tokens


def test_the_vocabulary_comes_from_the_controller_on_either_line():
    ours = SimpleNamespace(_vocab_size=5, vocab_size=6)
    stock_0_19 = SimpleNamespace(vocab_size=6)
    config = SimpleNamespace(padded_vocab_size=7)
    stock_0_16 = SimpleNamespace(
        inference_wrapped_model=SimpleNamespace(inference_wrapper_config=config)
    )
    assert dynamic_engine.model_vocab_size(ours) == 5
    assert dynamic_engine.model_vocab_size(stock_0_19) == 6
    assert dynamic_engine.model_vocab_size(stock_0_16) == 7
    assert dynamic_engine.model_vocab_size(SimpleNamespace()) is None


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], ids=["cpu", "gpu"]
)
def test_an_id_outside_the_vocabulary_never_reaches_a_real_embedding(device, monkeypatch):
    """A small GPT with a real embedding: an id >= the vocabulary would raise an IndexError there
    on the CPU and, on a GPU, trip a device-side assert that ends the process's CUDA context. It
    is refused where it enters, and the same process then serves good requests on that device,
    as it serves them without the bad one."""
    from megatron_ext.testing.small_gpt import build_small_gpt, build_small_gpt_engine
    from megatron_ext.testing.synthetic import ensure_model_parallel
    from megatron_ext.testing.torch_paged_attention import (
        allow_dynamic_inference_without_flash_attn,
    )

    if device == "cpu":
        if torch.cuda.is_available():
            pytest.skip("the CPU variant runs where no GPU is visible (the model follows it)")
        # The context's fused KV append is a Triton GPU kernel; megatron-core falls back to
        # indexing when it is absent.
        from megatron.core.inference.contexts import dynamic_context as mcore_context

        monkeypatch.setattr(mcore_context, "triton_append_key_value_cache", None)
    sizes = dict(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=4)
    sizes.update(ffn_hidden_size=64, vocab_size=VOCAB, max_sequence_length=64, seed=3)
    sizes.update(max_requests=8, max_tokens=64, block_size_tokens=16, kv_blocks=16)
    args = SimpleNamespace(**sizes, paused_kv_blocks=2, device=device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ensure_model_parallel()
    model, _ = build_small_gpt(args, dtype)
    good = {0: ([5, 9, 2, 7], _params(5)), 1: ([1, 2, 3], _params(4))}

    def serve(bad: bool) -> Dict[int, List[int]]:
        with inference_flag(), allow_dynamic_inference_without_flash_attn():
            engine, _, _ = build_small_gpt_engine(model, args, dtype)
            add_to_engine(engine, {0: good[0]})
            if bad:
                add_to_engine(engine, {BAD_ID: ([3, VOCAB, 4], _params())})
            records = step_until_done(engine, {0, BAD_ID} if bad else {0})
            # A good request after the refused one, in the same process.
            add_to_engine(engine, {1: good[1]})
            records.update(step_until_done(engine, {1}))
        if bad:
            assert "prompt_tokens[1] is 64" in failure_reason(records[BAD_ID])
        if device == "cuda":
            torch.cuda.synchronize()  # a device-side assert would surface here
        assert all(completed(records[k]) for k in good)
        return {k: list(records[k].generated_tokens) for k in good}

    assert serve(bad=True) == serve(bad=False)
