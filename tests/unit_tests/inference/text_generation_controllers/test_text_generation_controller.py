# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of StaticSlicesTextGenerationController and its graph-safe sampling region.

A deterministic synthetic model (megatron_ext.testing.synthetic) stands in for the network, so
megatron-core's real DynamicInferenceEngine can run end to end on CPU: the extension must
generate exactly the tokens and log-probs of megatron-core's own controller. The region's
sampling rules are checked directly. The ``gpu`` tests capture the region in CUDA graphs and
check every replay bit for bit against eager execution, and that the region never synchronises.
"""

import contextlib
import logging
import random
from types import SimpleNamespace
from typing import Dict, List, Tuple
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from megatron.core.inference.inference_request import DynamicInferenceRequest
from megatron.core.inference.sampling_params import SamplingParams

from megatron_ext.fusions.fused_top_k_sampling import sample_top_k_candidates
from megatron_ext.inference.contexts.dynamic_context import UPSTREAM_HAS_ACTIVE_SLICES
from megatron_ext.inference.engines.dynamic_engine import FAILED_REQUESTS_KEY
from megatron_ext.inference.text_generation_controllers import (
    static_slices_controller_base as controller_base,
)
from megatron_ext.inference.text_generation_controllers.text_generation_controller import (
    SamplingPlan,
    StaticSlicesTextGenerationController,
)
from megatron_ext.testing.synthetic import (
    build_engine,
    build_synthetic_stack,
    cpu_torch_compat,
    run_engine,
)
from tests.unit_tests.inference.engine_testlib import (
    add_to_engine,
    completed,
    failure_reason,
    inference_flag,
    run_engine_records,
    step_until_done,
)

VOCAB = 64


@pytest.fixture(autouse=True)
def _cpu_compat():
    with cpu_torch_compat():
        yield


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else (torch.device("cpu"))
    )


def make_stack(extension: bool = True, **overrides):
    kwargs = dict(
        extension=extension,
        max_requests=32,
        max_tokens=128,
        max_sequence_length=192,
        block_size_tokens=8,
        num_blocks=48,
        num_paused_blocks=8,
        vocab_size=VOCAB,
    )
    kwargs.update(overrides)
    return build_synthetic_stack(**kwargs)


def random_requests(
    count: int, seed: int, materialize: bool = True, **sampling
) -> List[Tuple[List[int], SamplingParams]]:
    """Requests of mixed lengths; about half return log-probs."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        prompt = [rng.randrange(VOCAB - 1) for _ in range(rng.choice([1, 3, 8, 20, 45, 110]))]
        params = dict(
            num_tokens_to_generate=rng.randint(1, 48),
            termination_id=rng.randrange(VOCAB),
            top_k=1,
        )
        if rng.random() < 0.5:
            params.update(return_log_probs=True, skip_prompt_log_probs=materialize)
        params.update(sampling)
        requests.append((prompt, SamplingParams(**params)))
    return requests


def engine_outputs(extension: bool, requests, **overrides):
    stack = make_stack(extension=extension, **overrides)
    return run_engine(build_engine(stack), requests)


def assert_same_generations(got, expected, what: str) -> None:
    """Assert two ``run_engine`` outputs are equal; the message names the first request, field
    and position that differ, with both values (the bits that moved), and how many requests do."""
    if got == expected:
        return
    differing = sorted(r for r in set(got) | set(expected) if got.get(r) != expected.get(r))
    first = differing[0]
    a, b = got.get(first, {}), expected.get(first, {})
    detail = f"request {first} missing on one side"
    for field in sorted(set(a) | set(b)):
        x, y = a.get(field), b.get(field)
        if x != y:
            at = next(
                (i for i, (u, v) in enumerate(zip(x or [], y or [])) if u != v),
                min(len(x or []), len(y or [])),
            )
            left = x[at] if x and at < len(x) else None
            right = y[at] if y and at < len(y) else None
            tokens = (a.get("generated_tokens") or [])[: at + 1], (b.get("generated_tokens") or [])[
                : at + 1
            ]
            detail = (
                f"request {first}, {field}[{at}]: {left!r} vs {right!r} (lengths {len(x or [])} "
                f"and {len(y or [])}; tokens up to there {tokens[0]} vs {tokens[1]})"
            )
            break
    raise AssertionError(f"{what}: {len(differing)} of {len(expected)} requests differ; {detail}")


def add_requests(stack, params: List[Dict], seed: int = 0, prompt_len: int = 4) -> None:
    rng = random.Random(seed)
    for request_id, sampling in enumerate(params):
        sampling = dict(dict(num_tokens_to_generate=20, termination_id=-1, top_k=1), **sampling)
        prompt = torch.tensor(
            [rng.randrange(VOCAB - 1) for _ in range(prompt_len)], device=_device()
        )
        stack.context.add_request(
            DynamicInferenceRequest(
                request_id=request_id,
                prompt_tokens=prompt,
                sampling_params=SamplingParams(**sampling),
            )
        )


def prepare_region(stack, logits: torch.Tensor) -> int:
    """Initialise the step and place ``logits`` (one row per active request) in the buffer."""
    context, controller = stack.context, stack.controller
    context.initialize_attention_state()
    context.publish_active_slices()
    rows = controller._region_rows()
    controller.logits_buffer[: logits.shape[0]].copy_(logits)
    return rows


# ------------------------------------------------------------------------------ end to end


@pytest.mark.parametrize("materialize", [True, False], ids=["last_token_logits", "all_logits"])
def test_engine_greedy_identical_to_megatron_core(materialize):
    """Real engine, synthetic model: the extension changes nothing in the output, through
    prefill, chunked prefill, pauses, resumes and evictions."""
    requests = random_requests(60, seed=11, materialize=materialize)
    kwargs = dict(materialize_only_last_token_logits=materialize)
    stock, stock_stats = engine_outputs(False, requests, **kwargs)
    ours, our_stats = engine_outputs(True, requests, **kwargs)
    assert stock_stats == our_stats
    assert our_stats["max_paused"] > 0 and our_stats["evicted"] > 0, our_stats
    assert sorted(ours) == list(range(len(requests)))
    for request_id in range(len(requests)):
        assert ours[request_id] == stock[request_id], request_id
    assert any(out["generated_log_probs"] for out in ours.values())
    if not materialize:
        assert any(out["prompt_log_probs"] for out in ours.values())


def test_engine_stop_words_and_top_n_log_probs_identical_to_megatron_core():
    """The host-side paths: stop-word finishes and top-n log-probs (megatron-core's own code
    behind the region)."""
    rng = random.Random(17)
    requests = []
    for prompt, params in random_requests(30, seed=13):
        params.stop_words = [str(rng.randrange(VOCAB - 1))]
        if rng.random() < 0.5:
            params.return_log_probs, params.skip_prompt_log_probs = True, True
            params.top_n_logprobs = 2
        requests.append((prompt, params))
    stock, _ = engine_outputs(False, requests)
    ours, _ = engine_outputs(True, requests)
    assert ours == stock
    assert any(out["generated_top_n_logprobs"] for out in ours.values())
    # Finished early but not on the termination id: a stop word ended it.
    stopped = [
        i
        for i, (_, p) in enumerate(requests)
        if len(ours[i]["generated_tokens"]) < p.num_tokens_to_generate
        and ours[i]["generated_tokens"][-1:] != [p.termination_id]
    ]
    assert stopped, "no request finished on its stop word"


def _mixed_sampling_requests(seed: int, mix_seed: int):
    """Requests whose sampling is greedy, top-k, top-p or plain temperature, at random."""
    requests = random_requests(24, seed=seed)
    rng = random.Random(mix_seed)
    mixed = []
    for prompt, params in requests:
        choice = rng.randrange(4)
        params.top_k = [1, 5, 0, 0][choice]
        params.top_p = [0.0, 0.0, 0.8, 0.0][choice]
        params.temperature = [1.0, 0.7, 1.0, 1.5][choice]
        mixed.append((prompt, params))
    return mixed


def test_engine_runs_every_sampling_mode():
    """Greedy, top-k, top-p and temperature requests together, through the engine."""
    mixed = _mixed_sampling_requests(5, 3)
    outputs, _ = engine_outputs(True, mixed)
    assert sorted(outputs) == list(range(len(mixed)))
    for request_id, (_, params) in enumerate(mixed):
        generated = outputs[request_id]["generated_tokens"]
        assert 1 <= len(generated) <= params.num_tokens_to_generate
        assert all(0 <= tok < VOCAB for tok in generated)


@pytest.mark.skipif(
    not UPSTREAM_HAS_ACTIVE_SLICES,
    reason="megatron-core 0.16's controller step is replaced whole (its sampler syncs per bucket)",
)
def test_eager_steps_are_megatron_cores_own_sampler(monkeypatch):
    """0.19, region not graphed: megatron-core's sampler samples every step and the region
    adds no work (no logits staging, no region run), so every sampling mode, drawn from the
    same generator, gives stock's tokens and log-probs bit for bit."""
    requests = _mixed_sampling_requests(7, 8)
    stock, _ = engine_outputs(False, requests)
    stack = make_stack(controller_kwargs=dict(cuda_graph_sampling=False))
    controller = stack.controller
    assert not controller.region_samples_this_step()

    def refuse(*args, **kwargs):
        raise AssertionError("an eager step ran the region's work")

    monkeypatch.setattr(controller, "run_graph_safe_step", refuse)
    monkeypatch.setattr(controller, "stage_logits", refuse)
    ours, _ = run_engine(build_engine(stack), requests)
    assert ours == stock
    # Nothing published the context's additions to upstream's slices (nobody read them): the
    # last step's slices are still unpublished.
    with pytest.raises(RuntimeError, match="built but not published"):
        _ = stack.context.device_active_slices
    # The comparison covers sampled (not only greedy) rows.
    assert any(
        params.top_k != 1 and len(ours[i]["generated_tokens"]) > 1
        for i, (_, params) in enumerate(requests)
    )


@pytest.mark.skipif(
    not UPSTREAM_HAS_ACTIVE_SLICES, reason="megatron-core 0.19's sampler dispatch only"
)
def test_graphed_step_samples_with_the_region():
    """0.19, region graphed: the step stages the logits and samples with the region. On CPU the
    region runs eagerly in place of its graph (the GPU tests check replay == eager bitwise);
    greedy tokens and log-probs equal megatron-core's."""
    requests = random_requests(40, seed=23)
    stock, _ = engine_outputs(False, requests)
    stack = make_stack()
    controller = stack.controller
    controller.use_cuda_graphs = True
    assert controller.region_samples_this_step()
    original = controller.run_graph_safe_step
    calls = []

    def eager_stand_in(rows, plan, use_cuda_graph=None):
        calls.append(rows)
        original(rows, plan, use_cuda_graph=False)

    controller.run_graph_safe_step = eager_stand_in
    ours, _ = run_engine(build_engine(stack), requests)
    assert ours == stock
    assert calls, "the region never sampled"


# ------------------------------------------------------------------------------ region rules


def test_region_greedy_log_probs_and_termination_rule():
    stack = make_stack(max_requests=16)
    termination = [5, 7, -1, 3]
    add_requests(
        stack,
        [
            dict(termination_id=t, return_log_probs=True, skip_prompt_log_probs=True)
            for t in termination
        ],
    )
    context, controller = stack.context, stack.controller
    # Request 3 finishes by length: prompt 4 + 1 generated token reaches its output length 5.
    context.request_output_lengths[3] = 5
    logits = torch.randn(4, VOCAB, device=_device())
    logits[0, 5] = 50.0  # request 0 samples its termination id
    rows = prepare_region(stack, logits)
    plan = controller.sampling_plan()
    assert plan == SamplingPlan(log_probs=True, greedy=True)
    controller.run_graph_safe_step(rows, plan, use_cuda_graph=False)
    host = controller.fetch_step_outputs()

    expected_tokens = logits.argmax(-1)
    assert host["tokens"][:4].tolist() == expected_tokens.tolist()
    expected_lp = F.log_softmax(logits.float(), -1).gather(1, expected_tokens[:, None])[:, 0]
    assert torch.equal(host["log_probs"][:4], expected_lp.cpu())
    assert host["active_mask"][:4].tolist() == [0, int(expected_tokens[1] != 7), 1, 0]
    assert host["request_ids"][:4].tolist() == [0, 1, 2, 3]
    # Padding rows: no request, never finished, no log-probs.
    assert host["request_ids"][4:rows].tolist() == [-1] * (rows - 4)
    assert host["active_mask"][4:rows].tolist() == [1] * (rows - 4)
    assert not host["return_log_probs"][4:rows].any()
    assert int(host["plan_violation"][0]) == 0


def test_padding_rows_do_not_change_real_rows():
    """Processing more (neutral) rows changes nothing in the real ones."""
    stack = make_stack(max_requests=32)
    add_requests(stack, [dict(top_k=1)] * 5)
    context, controller = stack.context, stack.controller
    logits = torch.randn(5, VOCAB, device=_device())
    rows = prepare_region(stack, logits)
    plan = controller.sampling_plan()
    controller.run_graph_safe_step(rows, plan, use_cuda_graph=False)
    narrow = {k: v[:5].clone() for k, v in controller.fetch_step_outputs().items() if v.numel() > 1}
    context.extend_active_padding(context.max_requests)
    controller.run_graph_safe_step(context.max_requests, plan, use_cuda_graph=False)
    wide = controller.fetch_step_outputs()
    for key, value in narrow.items():
        assert torch.equal(value, wide[key][:5]), key
    assert wide["request_ids"][rows:].tolist() == [-1] * (context.max_requests - rows)


def _sampling_rows(stack, params: List[Dict], logits: torch.Tensor, seed: int) -> torch.Tensor:
    controller = stack.controller
    rows = prepare_region(stack, logits)
    controller.sampling_rng.manual_seed(seed)
    controller.run_graph_safe_step(rows, controller.sampling_plan(), use_cuda_graph=False)
    return controller.fetch_step_outputs()["tokens"][: len(params)].clone()


def test_sampling_respects_top_k_top_p_and_greedy_rows():
    params = [
        dict(top_k=1),
        dict(top_k=3),
        dict(top_k=0, top_p=0.5),
        dict(top_k=0, top_p=0.0),
        dict(top_k=7, temperature=0.5),
    ]
    stack = make_stack(max_requests=16)
    add_requests(stack, params)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(params), VOCAB, generator=gen).to(_device()) * 3
    prepare_region(stack, logits)
    assert stack.controller.sampling_plan() == SamplingPlan(
        sample=True, top_k_cap=8, top_p=True, greedy=True, full_vocab=True
    )
    probs = logits.float().softmax(-1).cpu()
    order = probs.argsort(-1, descending=True)
    nucleus = int((probs[2][order[2]].cumsum(0) <= 0.5).sum()) + 1
    seen = {i: set() for i in range(len(params))}
    for seed in range(60):
        tokens = _sampling_rows(stack, params, logits, seed).tolist()
        for row, token in enumerate(tokens):
            seen[row].add(token)
    assert seen[0] == {int(order[0][0])}
    assert seen[1] <= set(order[1][:3].tolist()) and len(seen[1]) > 1
    assert seen[2] <= set(order[2][:nucleus].tolist())
    assert seen[4] <= set(order[4][:7].tolist())
    assert len(seen[3]) > len(seen[2])  # unfiltered sampling spreads wider than the nucleus


def test_sampling_follows_the_softmax_distribution():
    """Pure temperature sampling: empirical frequencies match softmax(logits / T)."""
    stack = make_stack(max_requests=128, max_tokens=512, num_blocks=160)
    params = [dict(top_k=0, temperature=2.0)] * 128
    add_requests(stack, params, prompt_len=1)
    logits = torch.zeros(128, VOCAB, device=_device())
    logits[:, :4] = torch.tensor([0.0, 1.0, 2.0, 3.0], device=_device())
    logits[:, 4:] = -1e4
    counts = torch.zeros(4)
    for seed in range(40):
        tokens = _sampling_rows(stack, params, logits, seed)
        counts += torch.bincount(tokens.cpu(), minlength=VOCAB)[:4].float()
    expected = torch.tensor([0.0, 1.0, 2.0, 3.0]).div(2.0).softmax(0)
    freq = counts / counts.sum()
    assert counts.sum() == 128 * 40
    assert torch.allclose(freq, expected, atol=0.03), (freq, expected)


def test_seeded_sampling_is_reproducible():
    params = [dict(top_k=0, top_p=0.9)] * 6
    stack = make_stack(max_requests=16)
    add_requests(stack, params)
    logits = torch.randn(6, VOCAB, device=_device())
    first = _sampling_rows(stack, params, logits, seed=1)
    again = _sampling_rows(stack, params, logits, seed=1)
    other = [_sampling_rows(stack, params, logits, seed=s) for s in range(2, 8)]
    assert torch.equal(first, again)
    assert any(not torch.equal(first, o) for o in other)


def test_plan_violation_is_detected_and_recomputed(caplog):
    stack = make_stack(max_requests=16)
    add_requests(stack, [dict(top_k=1)] * 3)
    context, controller = stack.context, stack.controller
    logits = torch.randn(3, VOCAB, device=_device())
    prepare_region(stack, logits)
    assert controller.sampling_plan() == SamplingPlan(greedy=True)
    # A row whose parameters the host-side plan does not know about (as if added behind the
    # context's back): top-k sampling where the plan says greedy, and log-probs.
    context.device_active_slices.metadata["top_k"][1] = 2
    context.device_active_slices.metadata["return_log_probs"][2] = True
    with caplog.at_level(logging.WARNING):
        host = controller.run_sampling_step()
    assert "missed an active request" in caplog.text
    assert int(host["plan_violation"][0]) == 0  # recomputed with everything enabled
    top2 = logits[1].topk(2).indices.tolist()
    assert int(host["tokens"][1]) in top2
    assert int(host["tokens"][0]) == int(logits[0].argmax())
    expected_lp = F.log_softmax(logits[2].float(), -1)[int(host["tokens"][2])]
    assert float(host["log_probs"][2]) == float(expected_lp)


# One request of each kind the plan check tells apart.
_ROW_KINDS = {
    "greedy": dict(top_k=1),
    "top_k_within_cap": dict(top_k=3, temperature=0.7),
    "top_k_over_cap": dict(top_k=20, temperature=0.7),
    "nucleus": dict(top_k=0, top_p=0.9, temperature=0.7),
    "whole_vocab": dict(top_k=0, top_p=0.0, temperature=0.7),
    "greedy_log_probs": dict(top_k=1, return_log_probs=True),
    "greedy_top_n": dict(top_k=1, return_log_probs=True, top_n_logprobs=2),
}


def _plan_misses(plan: SamplingPlan, kind: str) -> bool:
    """Whether ``plan`` leaves out what a request of ``kind`` needs (the rule, written out)."""
    top_k = _ROW_KINDS[kind]["top_k"]
    top_p = _ROW_KINDS[kind].get("top_p", 0.0)
    wants = _ROW_KINDS[kind].get("return_log_probs", False)
    if not plan.sample:
        missed = top_k != 1
    else:
        missed = (top_k > 1 and top_k > plan.top_k_cap) or (top_k == 1 and not plan.greedy)
        missed = missed or (top_k < 1 and top_p > 0 and not plan.top_p)
        missed = missed or (top_k < 1 and top_p <= 0 and not plan.full_vocab)
    return missed or (wants and not plan.log_probs)


@pytest.mark.parametrize(
    "plan",
    [
        SamplingPlan(greedy=True),
        SamplingPlan(greedy=True, log_probs=True),
        SamplingPlan(sample=True, top_k_cap=4),
        SamplingPlan(sample=True, top_k_cap=4, greedy=True),
        SamplingPlan(sample=True, top_k_cap=32, greedy=True, log_probs=True),
        SamplingPlan(sample=True, top_p=True),
        SamplingPlan(sample=True, top_p=True, greedy=True),
        SamplingPlan(sample=True, full_vocab=True, log_probs=True),
        SamplingPlan(sample=True, full_vocab=True, greedy=True),
        SamplingPlan(sample=True, top_k_cap=4, top_p=True),
        SamplingPlan(sample=True, top_k_cap=4, full_vocab=True, greedy=True),
        SamplingPlan(sample=True, top_p=True, greedy=True, full_vocab=True),
        SamplingPlan(sample=True, top_k_cap=4, top_p=True, full_vocab=True),
        SamplingPlan(sample=True, top_k_cap=32, top_p=True, greedy=True, full_vocab=True),
    ],
    ids=lambda plan: ",".join(k for k, v in plan.__dict__.items() if v) or "empty",
)
def test_plan_check_counts_exactly_the_rows_a_plan_leaves_out(plan):
    """The region's device-side check counts every real row whose needs the plan leaves out
    (each kind of request against each kind of plan), and no padding row."""
    kinds = list(_ROW_KINDS)
    stack = make_stack(max_requests=16)
    add_requests(stack, [_ROW_KINDS[kind] for kind in kinds])
    controller = stack.controller
    rows = prepare_region(stack, torch.randn(len(kinds), VOCAB, device=_device()))
    stack.context.extend_active_padding(rows + 3)
    controller.run_graph_safe_step(rows + 3, plan, use_cuda_graph=False)
    expected = sum(_plan_misses(plan, kind) for kind in kinds)
    assert int(controller.step_outputs["plan_violation"][0]) == expected


@pytest.mark.parametrize("top_p", [0.9, 0.0], ids=["nucleus", "whole_vocab"])
def test_greedy_requests_beside_unbounded_ones_need_no_recompute(top_p, caplog):
    """Greedy requests next to top-k-less ones (a plan with no top-k cap) are sampled by the
    plan itself: no violation, no second pass with every feature enabled."""
    stack = make_stack(max_requests=16)
    add_requests(stack, [dict(top_k=1), dict(top_k=0, top_p=top_p, temperature=0.7)] * 2)
    controller = stack.controller
    logits = torch.randn(4, VOCAB, device=_device())
    prepare_region(stack, logits)
    plan = controller.sampling_plan()
    assert plan.top_k_cap == 0 and plan.greedy
    with caplog.at_level(logging.WARNING):
        host = controller.run_sampling_step()
    assert "missed an active request" not in caplog.text
    assert int(host["plan_violation"][0]) == 0
    assert [int(host["tokens"][r]) for r in (0, 2)] == logits[[0, 2]].argmax(-1).tolist()


# ------------------------------------------------------------------------------ wiring


@pytest.mark.skipif(
    UPSTREAM_HAS_ACTIVE_SLICES,
    reason="megatron-core 0.19 has no per-step " "metadata copy to remove",
)
def test_no_per_step_metadata_copy_and_stock_readers_stay_current():
    stack = make_stack()
    controller, context = stack.controller, stack.context
    for label, tensor in controller._request_metadata.items():
        # Same tensor as the context's: megatron-core's per-step copy becomes a no-op.
        assert tensor is context.request_metadata[label], label
    add_requests(
        stack, [dict(top_k=1), dict(top_k=1, return_log_probs=True, skip_prompt_log_probs=True)]
    )
    context.initialize_attention_state()
    assert controller._dynamic_step_log_probs_bookkeeping() == (True, False)


def test_rejects_bad_arguments():
    stack = make_stack(max_requests=8)
    controller = stack.controller
    plan = SamplingPlan()
    with pytest.raises(ValueError):
        controller.run_graph_safe_step(0, plan, use_cuda_graph=False)
    with pytest.raises(ValueError):
        controller.run_graph_safe_step(9, plan, use_cuda_graph=False)
    with pytest.raises(TypeError):
        controller.run_graph_safe_step("4", plan, use_cuda_graph=False)
    with pytest.raises(TypeError):
        controller.run_graph_safe_step(4, None, use_cuda_graph=False)
    with pytest.raises(ValueError):
        controller.stage_logits(torch.zeros(2, 3))
    # A plan the region cannot build fails before any launch (it used to reach torch.topk).
    for bad, error, match in (
        (SamplingPlan(sample=True, top_k_cap=-3), ValueError, r"plan.top_k_cap \(-3\)"),
        (SamplingPlan(sample=True, top_k_cap=VOCAB + 1), ValueError, r"must be in \[0, 64\]"),
        (SamplingPlan(sample=True, top_k_cap=2.0), TypeError, "plan.top_k_cap must be an int"),
        (SamplingPlan(sample="yes"), TypeError, "plan.sample must be a bool"),
    ):
        with pytest.raises(error, match=match):
            controller.run_graph_safe_step(4, bad, use_cuda_graph=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError):
            controller.run_graph_safe_step(4, plan, use_cuda_graph=True)


def test_row_counts_below_the_active_requests_are_refused():
    """Fewer rows than active requests would leave the other rows' tokens stale."""
    stack = make_stack(max_requests=16)
    add_requests(stack, [dict(top_k=1)] * 5)
    controller = stack.controller
    logits = torch.randn(5, VOCAB, device=_device())
    prepare_region(stack, logits)
    with pytest.raises(ValueError, match=r"rows \(1\) must be in \[5, 16\]"):
        controller.run_sampling_step(rows=1)
    with pytest.raises(ValueError, match=r"rows \(-1\) must be in \[5, 16\]"):
        controller.stage_logits(logits.unsqueeze(0), rows=-1)
    with pytest.raises(TypeError, match="rows must be an int"):
        controller.stage_logits(logits.unsqueeze(0), rows=2.5)
    with pytest.raises(TypeError, match="logits must be a Tensor"):
        controller.stage_logits(logits.tolist())
    host = controller.run_sampling_step(rows=5)
    assert host["tokens"][:5].tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("materialize", [True, False], ids=["last_token", "all_tokens"])
def test_logits_with_fewer_rows_than_the_step_needs_are_refused(materialize):
    """Stock megatron-core raises on such logits; sampling the missing rows from the previous
    step's buffer (or gathering past the rows) would be silently wrong."""
    stack = make_stack(max_requests=16, materialize_only_last_token_logits=materialize)
    add_requests(stack, [dict(top_k=1)] * 5)
    context, controller = stack.context, stack.controller
    context.initialize_attention_state()
    context.publish_active_slices()
    needed = 5 if materialize else context.active_token_count
    logits = torch.randn(1, needed - 1, VOCAB, device=_device())
    what = "active requests" if materialize else "active tokens"
    with pytest.raises(ValueError, match=f"fewer than this step's {needed} {what}"):
        controller.stage_logits(logits)
    controller.stage_logits(torch.randn(1, needed, VOCAB, device=_device()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_scaled_scores_are_bitwise_the_float32_division(dtype):
    """One promoting division equals casting to float32 and dividing, bit for bit (on the GPU
    where there is one: the region's device)."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(37, 301, generator=gen) * 30).to(dtype).to(_device())
    temperature = (torch.rand(37, generator=gen) * 2 + 1e-3).to(_device())
    scores = controller_base._scaled_scores(logits, temperature)
    expected = logits.float() / temperature.unsqueeze(1)
    assert scores.dtype == torch.float32
    assert torch.equal(scores.view(torch.int32), expected.view(torch.int32))


def test_top_k_candidate_sampler_keeps_ties_and_respects_k():
    """The candidate path (every sampling row top-k) draws only among the k largest logits,
    ties with the k-th included, and uses the temperature."""
    params = [dict(top_k=2), dict(top_k=4, temperature=0.25), dict(top_k=3)]
    stack = make_stack(max_requests=16)
    add_requests(stack, params)
    logits = torch.full((3, VOCAB), -5.0, device=_device())
    logits[0, [10, 11, 12]] = torch.tensor([3.0, 2.0, 2.0], device=_device())  # tie at k = 2
    logits[1, [1, 2, 3, 4, 5]] = torch.tensor([4.0, 3.9, 3.8, 3.7, 9.0], device=_device())
    logits[2, [7, 8, 9, 20]] = torch.tensor([1.0, 1.0, 1.0, 0.5], device=_device())
    prepare_region(stack, logits)
    plan = stack.controller.sampling_plan()
    assert plan == SamplingPlan(sample=True, top_k_cap=4)
    seen = {i: set() for i in range(3)}
    for seed in range(80):
        for row, token in enumerate(_sampling_rows(stack, params, logits, seed).tolist()):
            seen[row].add(token)
    assert seen[0] == {10, 11, 12}
    assert seen[1] == {5}  # temperature 0.25 makes the 9.0 logit all but certain
    assert seen[2] == {7, 8, 9}


def test_the_fused_candidate_draw_uses_the_torch_paths_draws():
    """On a GPU the candidate path races in one kernel (megatron_ext.fusions.fused_top_k_sampling);
    it consumes the sampling generator as the torch path does, so the two pick the same token
    wherever two candidates' races are not within rounding of each other. The torch path runs
    on the CPU here, the kernel on the GPU (or in the Triton interpreter without one)."""
    gen = torch.Generator().manual_seed(9)
    rows, cap = 48, 16
    logits = torch.randn(rows, VOCAB, generator=gen) * 2
    temperature = torch.rand(rows, generator=gen) + 0.3
    top_k = torch.randint(2, cap + 1, (rows,), generator=gen, dtype=torch.int32)
    rng = torch.Generator().manual_seed(123)
    owner = SimpleNamespace(sampling_rng=rng)
    owner._exponential_race = (
        lambda probs: controller_base.StaticSlicesControllerBase._exponential_race(owner, probs)
    )
    torch_tokens, row_max = controller_base.StaticSlicesControllerBase._sample_top_k_candidates(
        owner, logits, temperature, top_k, cap
    )
    assert torch.equal(row_max, logits.amax(-1))
    values, indices = torch.topk(logits, cap, dim=-1)
    noise = torch.empty(rows, cap).exponential_(1.0, generator=torch.Generator().manual_seed(123))
    device = _device()
    fused = sample_top_k_candidates(
        *(t.to(device) for t in (values, indices, temperature, top_k, noise))
    ).cpu()
    race = (values.double() / temperature.double().unsqueeze(1)).masked_fill(
        values < values.gather(1, (top_k.long() - 1).unsqueeze(1)), float("-inf")
    ).softmax(-1) / noise.double()
    best = race.topk(2, dim=-1).values
    clear = (best[:, 0] - best[:, 1]) / best[:, 0] > 1e-4
    assert clear.float().mean() > 0.9
    assert torch.equal(fused[clear], torch_tokens[clear])


def test_requires_the_extension_context():
    stock = make_stack(extension=False)
    with pytest.raises(TypeError):
        StaticSlicesTextGenerationController(
            stock.controller.inference_wrapped_model, stock.controller.tokenizer
        )
    with pytest.raises(TypeError):
        make_stack(controller_kwargs=dict(cuda_graph_sampling="yes"))


# ------------------------------------------------------------------------------ GPU


def _plans() -> Dict[str, Dict]:
    return {
        "greedy": dict(top_k=1, return_log_probs=False),
        "top_k": dict(top_k=4, temperature=0.8, return_log_probs=False),
        "top_p_log_probs": dict(
            top_k=0, top_p=0.9, return_log_probs=True, skip_prompt_log_probs=True
        ),
    }


def _install_replay_checker(controller, record: Dict) -> None:
    """Wrap run_graph_safe_step: run eagerly, rewind the generator, replay the graph, and
    require bit-identical outputs."""
    original = controller.run_graph_safe_step

    def checked(rows, plan, use_cuda_graph=None):
        state = controller.sampling_rng.get_state()
        original(rows, plan, use_cuda_graph=False)
        eager = {k: v[:rows].clone() for k, v in controller.step_outputs.items() if v.numel() > 1}
        controller.sampling_rng.set_state(state)
        original(rows, plan, use_cuda_graph=True)
        for key, value in eager.items():
            if key == "log_probs" and not plan.log_probs:
                continue
            assert torch.equal(value, controller.step_outputs[key][:rows]), key
        record["replays"] += 1
        record["active_counts"].add(
            controller.inference_wrapped_model.inference_context.get_active_request_count()
        )

    controller.run_graph_safe_step = checked


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(_plans()))
def test_graph_captured_once_replays_bitwise_equal_to_eager(mode):
    """One graph per plan (fixed row count), replayed across steps whose batch changes."""
    requests = random_requests(40, seed=21, **_plans()[mode])
    stack = make_stack(controller_kwargs=dict(sampling_rows=32))
    controller = stack.controller
    record = {"replays": 0, "active_counts": set()}
    _install_replay_checker(controller, record)
    _, stats = run_engine(build_engine(stack), requests)
    assert stats["max_paused"] > 0, stats
    # Every step with active requests samples once (a step may only schedule paused requests).
    assert stats["steps"] - 5 <= record["replays"] <= stats["steps"]
    assert len(record["active_counts"]) > 5, record
    assert len(controller._graphs) == 1, list(controller._graphs)


@pytest.mark.gpu
def test_engine_graphed_equals_eager_and_megatron_core():
    greedy = random_requests(60, seed=31)
    stock, _ = engine_outputs(False, greedy)
    graphed, _ = engine_outputs(True, greedy)
    assert_same_generations(graphed, stock, "graphed vs megatron-core")
    for mode in ("top_k", "top_p_log_probs"):
        requests = random_requests(40, seed=32, **_plans()[mode])
        eager, _ = engine_outputs(True, requests, controller_kwargs=dict(cuda_graph_sampling=False))
        if UPSTREAM_HAS_ACTIVE_SLICES:
            # 0.19: an eager step is megatron-core's own sampler (replay == eager region is
            # checked inside the engine by test_graph_captured_once_replays_bitwise_equal_to_eager).
            assert_same_generations(eager, engine_outputs(False, requests)[0], mode)
            continue
        graphed, _ = engine_outputs(
            True, requests, controller_kwargs=dict(cuda_graph_sampling=True)
        )
        assert_same_generations(graphed, eager, f"{mode}: graphed vs eager sampling")


@pytest.mark.gpu
def test_engine_with_the_context_bookkeeping_run_eagerly_equals_graphed():
    """0.16: ``cuda_graph_active_slices = False`` (the slices and the attention metadata written
    by launches, not replays) gives the same tokens and log-probs with graphed sampling."""
    if UPSTREAM_HAS_ACTIVE_SLICES:
        pytest.skip("megatron-core 0.19 builds the slices and the metadata on the host")
    for mode in ("greedy", "top_p_log_probs"):
        requests = random_requests(40, seed=33, **_plans()[mode])
        graphed, _ = engine_outputs(True, requests)
        stack = make_stack(extension=True)
        stack.context.cuda_graph_active_slices = False
        eager, _ = run_engine(build_engine(stack), requests)
        assert_same_generations(eager, graphed, f"{mode}: eager vs graphed bookkeeping")
        assert stack.context._slices_graph is None
        assert stack.context.non_graph_attn_metadata["mha_metadata"]._update_graph is None


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(_plans()))
def test_region_does_not_synchronize(mode):
    stack = make_stack(max_requests=16)
    add_requests(stack, [_plans()[mode]] * 5)
    controller = stack.controller
    rows = prepare_region(stack, torch.randn(5, VOCAB, device=_device()))
    plan = controller.sampling_plan()
    controller.run_graph_safe_step(rows, plan, use_cuda_graph=False)  # warm-up (lazy init)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        controller.graph_safe_step(rows, plan)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_the_controller_class_of_the_installed_megatron_core_line():
    """Picked by the same test as the context; sampling_plan is defined by the line's class."""
    import sys

    from megatron_ext.inference.contexts.dynamic_context import UPSTREAM_HAS_ACTIVE_SLICES
    from megatron_ext.inference.text_generation_controllers import text_generation_controller

    line, other = ("0_19", "0_16") if UPSTREAM_HAS_ACTIVE_SLICES else ("0_16", "0_19")
    cls = text_generation_controller.StaticSlicesTextGenerationController
    prefix = "megatron_ext.inference.text_generation_controllers.text_generation_controller"
    assert cls.__module__ == f"{prefix}_{line}"
    assert f"{prefix}_{other}" not in sys.modules
    assert "sampling_plan" in vars(cls)


# ------------------------------------------------------------------------------ refusals

# Sampling parameters at and past the edges of what megatron-core's sampler accepts. Each runs
# through stock's engine and the extension's (whose graph-safe region samples every step): where
# stock raises, the extension must raise a ValueError/TypeError that says what is wrong; where
# stock generates, the extension must generate too.
SAMPLING_EDGES = {
    "top_k_above_vocab": dict(top_k=VOCAB + 1),
    "top_k_at_vocab": dict(top_k=VOCAB),
    "top_k_negative": dict(top_k=-3),
    "top_p_above_one": dict(top_k=0, top_p=1.5),
    "top_p_one": dict(top_k=0, top_p=1.0),
    "top_p_negative": dict(top_k=0, top_p=-0.5),
    "top_p_nan": dict(top_k=0, top_p=float("nan")),
    "top_p_nan_beside_top_k": dict(top_k=5, top_p=float("nan")),
    "top_k_and_top_p": dict(top_k=5, top_p=0.5),
    "greedy_and_top_p": dict(top_k=1, top_p=0.5),
    "temperature_zero_sampling": dict(top_k=5, temperature=0.0),
    "temperature_zero_greedy": dict(top_k=1, temperature=0.0),
    "temperature_tiny": dict(top_k=5, temperature=1e-3),
    # Subnormal or 0 in the float32 metadata: stock's softmax is NaN and multinomial raises;
    # the extension used to sample token 0 every time.
    "temperature_1e-40": dict(top_k=0, temperature=1e-40),
    "temperature_1e-50_top_p": dict(top_k=0, top_p=0.5, temperature=1e-50),
}
# Values stock generates with although they mean nothing (a negative top-k or top-p is taken as
# 0): the extension refuses them, naming the field.
OUT_OF_RANGE_STOCK_GENERATES = {"top_k_negative", "top_p_negative"}


def sample_with_the_region_every_step(controller) -> None:
    """Make the region sample every step, run eagerly on CPU in place of its graph (on 0.19 a
    step samples with the region only when it is graphed)."""
    controller.use_cuda_graphs = True
    original = controller.run_graph_safe_step
    controller.run_graph_safe_step = lambda rows, plan, use_cuda_graph=None: original(
        rows, plan, use_cuda_graph=False
    )


def _multinomial_checked_on_the_host(real):
    """``torch.multinomial`` that checks its probabilities on the host first and raises the
    errors the CPU's raises. On CUDA its own checks are device-side asserts, after which every
    CUDA call of the process fails (the tests after it included)."""

    def multinomial(probabilities: torch.Tensor, *args, **kwargs):
        if not bool(torch.isfinite(probabilities).all()) or bool((probabilities < 0).any()):
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        if bool((probabilities.sum(-1) <= 0).any()):
            raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
        return real(probabilities, *args, **kwargs)

    return multinomial


def _outcome(extension: bool, sampling: Dict):
    """Stock: the exception its engine raised, or None. The extension (flag applied): request
    1's failure reason, or None when it completed; the others must complete either way."""
    requests = dict(enumerate(random_requests(3, seed=41)))
    prompt, _ = requests[1]
    requests[1] = (prompt, SamplingParams(num_tokens_to_generate=4, termination_id=-1, **sampling))
    if not extension:
        # Stock refuses some of these in multinomial's checks: on CUDA they are checked on the
        # host instead, so that the refusal is an exception here too.
        checked = (
            mock.patch("torch.multinomial", _multinomial_checked_on_the_host(torch.multinomial))
            if torch.cuda.is_available()
            else contextlib.nullcontext()
        )
        try:
            with checked:
                run_engine_records(build_engine(make_stack(extension=False)), requests)
        except Exception as error:  # noqa: BLE001 (the comparison is about whether and how)
            return error
        return None
    with inference_flag():
        stack = make_stack()
        sample_with_the_region_every_step(stack.controller)
        records = run_engine_records(build_engine(stack), requests)
    assert completed(records[0]) and completed(records[2])
    return None if completed(records[1]) else failure_reason(records[1])


@pytest.mark.parametrize(
    "row",
    [[0.5, float("nan")], [0.5, float("inf")], [0.5, -0.1], [0.0, 0.0], [0.2, 0.8]],
    ids=["nan", "inf", "negative", "zero_sum", "valid"],
)
def test_host_checked_multinomial_refuses_what_the_cpus_refuses(row):
    """The stand-in the sampling-edge tests give stock on CUDA, against the CPU's own checks."""
    probabilities = torch.tensor([row])
    outcomes = []
    for multinomial in (torch.multinomial, _multinomial_checked_on_the_host(torch.multinomial)):
        try:
            multinomial(probabilities, 1, generator=torch.Generator().manual_seed(0))
            outcomes.append(None)
        except RuntimeError as error:
            outcomes.append(str(error))
    real, checked = outcomes
    assert (real is None) == (checked is None), outcomes
    assert checked is None or checked in real, outcomes


@pytest.mark.parametrize("case", list(SAMPLING_EDGES))
def test_sampling_inputs_refused_exactly_where_megatron_core_refuses_them(case):
    """Where stock raises (every later step of its engine raising too), the extension's engine
    fails that request alone when it is added, with the reason; where stock generates, the
    extension generates, except for values out of their range."""
    stock = _outcome(False, SAMPLING_EDGES[case])
    ours = _outcome(True, SAMPLING_EDGES[case])
    if case in OUT_OF_RANGE_STOCK_GENERATES:
        assert stock is None, f"stock now refuses it: {stock!r}"
        assert ours is not None and ours.startswith("ValueError: top_"), ours
        return
    if stock is None:
        assert ours is None, f"stock generates, megatron_ext failed the request: {ours}"
        return
    assert ours is not None, f"stock raised {stock!r}, megatron_ext generated"
    assert ours.startswith(("ValueError", "TypeError")), ours
    assert "top_k" in ours or "top_p" in ours or "temperature" in ours, ours


# ------------------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: torch.randn(1, 3, 0), ValueError, "logits have 0 columns, the model's vocab"),
        (lambda: torch.randn(1, 3, VOCAB + 1), ValueError, f"{VOCAB + 1} columns"),
        (lambda: torch.randn(1, 3, VOCAB - 1), ValueError, f"{VOCAB - 1} columns"),
        (lambda: torch.ones(1, 3, VOCAB, dtype=torch.bool), TypeError, "floating point"),
        (lambda: torch.ones(1, 3, VOCAB, dtype=torch.complex64), TypeError, "floating point"),
        (lambda: torch.ones(1, 3, VOCAB, dtype=torch.int64), TypeError, "floating point"),
        (lambda: torch.empty(1, 3, VOCAB, device="meta"), ValueError, "logits are on meta"),
        (None, ValueError, "alias the controller's logits_buffer"),
    ],
    ids=["width_0", "width_plus_1", "width_minus_1", "bool", "complex", "int64", "meta", "alias"],
)
def test_stage_logits_refuses_bad_logits_before_writing(make, error, match):
    """A [1, 3, 0] tensor used to reallocate the buffer to width 0 (then "top_k (1) is larger
    than the vocabulary (0)"); one column more or fewer and int64 logits were accepted, bool and
    complex ones reached torch's argmax error."""
    stack = make_stack(max_requests=8)
    add_requests(stack, [dict(top_k=1)] * 3)
    controller = stack.controller
    prepare_region(stack, torch.randn(3, VOCAB, device=_device()))
    buffer = controller.logits_buffer
    before = buffer.clone()
    logits = controller.logits_buffer[:3].unsqueeze(0) if make is None else make()
    if make is not None and logits.device.type != "meta":
        logits = logits.to(_device())
    with pytest.raises(error, match=match):
        controller.stage_logits(logits)
    assert controller.logits_buffer is buffer and torch.equal(buffer, before)
    good = torch.randn(1, 3, VOCAB, device=_device())
    controller.stage_logits(good)
    assert torch.equal(controller.logits_buffer[:3], good[0])


# Rows whose scores are not finite, and the code the region gives each. Row 4's request has a
# temperature at the float32 edge (allowed: 1 / t is finite) that overflows logits near 10.
_POISONED_ROWS = {1: "nan", 2: "inf", 3: "all_neg_inf", 4: "overflow"}


def _poisoned_logits(rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(rows, VOCAB, generator=gen) * 2 + 8
    logits[1, 7] = float("nan")
    logits[2, 9] = float("inf")
    logits[3] = float("-inf")
    logits[5, :10] = float("-inf")  # a masked vocabulary is finite
    return logits.to(_device())


_NON_FINITE_PLANS = {
    "greedy": dict(top_k=1),
    "top_k": dict(top_k=4, temperature=0.8),
    "top_p": dict(top_k=0, top_p=0.9),
    "whole_vocab": dict(top_k=0, temperature=1.3),
    "mixed": None,
}


def _non_finite_requests(mode: str) -> List[Dict]:
    if mode == "mixed":
        params = [dict(top_k=1), dict(top_k=4), dict(top_k=0, top_p=0.5), dict(top_k=0)] * 2
        params = params[:6]
    else:
        params = [dict(_NON_FINITE_PLANS[mode]) for _ in range(6)]
    params[4]["temperature"] = 1e-38
    return params


def _expected_codes(params: List[Dict]) -> List[int]:
    codes = [0] * len(params)
    for row, kind in _POISONED_ROWS.items():
        if kind == "overflow":
            codes[row] = 0 if params[row]["top_k"] == 1 else 1  # greedy rows are not scaled
        else:
            codes[row] = 2
    return codes


@pytest.mark.parametrize("mode", list(_NON_FINITE_PLANS))
def test_the_region_reports_rows_whose_scores_are_not_finite(mode):
    """A NaN, a +inf or an all -inf row, or logits / temperature overflowing, used to be sampled
    as a plausible token (usually 0). The region gives each row a code, read with the outputs'
    one copy; the finite rows sample as before."""
    params = _non_finite_requests(mode)
    stack = make_stack(max_requests=16)
    add_requests(stack, params)
    controller = stack.controller
    logits = _poisoned_logits(len(params))
    prepare_region(stack, logits)
    host = controller.run_sampling_step()
    expected = _expected_codes(params)
    assert host["non_finite"][: len(params)].tolist() == expected
    failed = controller.non_finite_requests(host, len(params))
    reasons = controller_base.NON_FINITE_REASONS
    assert failed == {row: reasons[code] for row, code in enumerate(expected) if code}
    for row in (0, 5):
        token = int(host["tokens"][row])
        assert bool(torch.isfinite(logits[row, token])), (row, token)
        if params[row]["top_k"] == 1:
            assert token == int(logits[row].argmax())


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(_NON_FINITE_PLANS))
def test_gpu_graph_replay_reports_rows_whose_scores_are_not_finite(mode):
    """The graphed region cannot raise: its replays give the rows the same codes as an eager
    run, with every output bitwise equal, and the host reads them from its one copy."""
    params = _non_finite_requests(mode)
    stack = make_stack(max_requests=16)
    add_requests(stack, params)
    controller = stack.controller
    logits = _poisoned_logits(len(params))
    rows = prepare_region(stack, logits)
    plan = controller.sampling_plan()
    state = controller.sampling_rng.get_state()
    controller.run_graph_safe_step(rows, plan, use_cuda_graph=False)
    eager = {k: v[:rows].clone() for k, v in controller.step_outputs.items() if v.numel() > 1}
    expected = _expected_codes(params)
    reasons = controller_base.NON_FINITE_REASONS
    for _ in range(3):  # the capture, then replays
        controller.sampling_rng.set_state(state)
        controller.run_graph_safe_step(rows, plan, use_cuda_graph=True)
        host = controller.fetch_step_outputs()
        for key, value in eager.items():
            if key == "log_probs" and not plan.log_probs:
                continue
            assert torch.equal(value.cpu(), host[key][:rows]), key
        assert host["non_finite"][: len(params)].tolist() == expected
        failed = controller.non_finite_requests(host, len(params))
        assert failed == {row: reasons[code] for row, code in enumerate(expected) if code}
    assert list(controller._graphs) == [(rows, plan)]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["greedy", "top_k"])
def test_gpu_engine_with_graphed_sampling_fails_a_non_finite_request_alone(mode):
    """As test_engine_fails_a_request_whose_logits_are_not_finite_alone, with the region
    replayed from its CUDA graphs (the fused candidate draw in the top-k plan)."""
    mark = VOCAB - 1
    sampling = {"greedy": dict(top_k=1), "top_k": dict(top_k=4)}[mode]
    requests = dict(enumerate(random_requests(8, seed=45, **sampling)))
    prompt, params = requests[5]
    requests[5] = ([*prompt, mark], params)
    with inference_flag():
        stack = make_stack()
        _poison(stack, "nan", mark)
        assert stack.controller.use_cuda_graphs
        records = run_engine_records(build_engine(stack), requests)
    assert stack.controller._graphs, "the region was not replayed from a graph"
    assert "logits row is not finite" in failure_reason(records[5])
    assert records[5].generated_tokens == []
    assert all(completed(records[k]) for k in requests if k != 5)


def _poison(stack, kind: str, mark: int) -> None:
    """Logits of rows whose input token is ``mark`` become ``kind``; no row ever samples
    ``mark`` (its column is -inf)."""
    wrapper = stack.controller.inference_wrapped_model
    real = wrapper.logits_fn

    def poisoned(input_ids, position_ids):
        logits = real(input_ids, position_ids).clone()
        logits[:, mark] = float("-inf")
        rows = input_ids.reshape(-1) == mark
        if kind == "nan":
            logits[rows, 3] = float("nan")
        elif kind == "inf":
            logits[rows, 3] = float("inf")
        elif kind == "zeros":  # what the eager 0.19 step samples in place of a flagged row
            logits[rows] = 0
        else:
            logits[rows] = float("-inf")
        return logits

    wrapper.logits_fn = poisoned


@pytest.mark.parametrize("kind", ["nan", "inf", "all_neg_inf"])
@pytest.mark.parametrize("mode", ["greedy", "top_k", "top_p"])
def test_engine_fails_a_request_whose_logits_are_not_finite_alone(mode, kind):
    """Through megatron-core's engine: the request fails alone, with the reason and no token,
    and the requests beside it finish as they do without it."""
    mark = VOCAB - 1  # random_requests' prompts never hold it
    sampling = {"greedy": dict(top_k=1), "top_k": dict(top_k=4), "top_p": dict(top_k=0, top_p=0.9)}
    requests = dict(enumerate(random_requests(8, seed=43, **sampling[mode])))
    prompt, params = requests[3]
    requests[3] = ([*prompt, mark], params)

    def run(with_bad: bool):
        stack = make_stack()
        _poison(stack, kind, mark)
        sample_with_the_region_every_step(stack.controller)
        wanted = requests if with_bad else {k: v for k, v in requests.items() if k != 3}
        return run_engine_records(build_engine(stack), wanted)

    with inference_flag():
        records = run(with_bad=True)
        clean = run(with_bad=False)
    assert "logits row is not finite" in failure_reason(records[3])
    assert records[3].generated_tokens == []
    for request_id, request in clean.items():
        assert completed(records[request_id]), request_id
        if mode == "greedy":  # sampled rows draw other noise beside another row
            assert records[request_id].generated_tokens == request.generated_tokens
    # Without the engine's patch no request can fail alone: the step refuses, naming it, before
    # its bookkeeping changed anything.
    stack = make_stack()
    _poison(stack, kind, mark)
    sample_with_the_region_every_step(stack.controller)
    with pytest.raises(ValueError, match=r"no token can be sampled for requests 3: its logits"):
        run_engine_records(build_engine(stack), requests)


_EAGER_SAMPLING = {"greedy": dict(top_k=1), "top_k": dict(top_k=4)}
# The extension's controller with its region not graphed, so that megatron-core's sampler samples
# every step on CUDA too (the region is graphed there by default; off CUDA it never is).
_EAGER = dict(controller_kwargs=dict(cuda_graph_sampling=False))


@pytest.mark.skipif(
    not UPSTREAM_HAS_ACTIVE_SLICES,
    reason="megatron-core 0.16's eager step is the region (tested above)",
)
@pytest.mark.parametrize("kind", ["nan", "inf", "all_neg_inf"])
@pytest.mark.parametrize("mode", list(_EAGER_SAMPLING))
def test_eager_0_19_step_fails_a_request_whose_logits_are_not_finite_alone(mode, kind):
    """0.19, region not graphed (megatron-core's own sampler samples every step): greedy took
    the NaN's or inf's index as the token and top-k's multinomial raised for the whole step. Now
    the request fails alone with the reason and no token, the others finish (greedy: with the
    tokens they have without it), and without the engine's patch the step refuses, naming it."""
    mark = VOCAB - 1  # random_requests' prompts never hold it
    requests = dict(enumerate(random_requests(8, seed=43, **_EAGER_SAMPLING[mode])))
    prompt, params = requests[3]
    requests[3] = ([*prompt, mark], params)

    def stack():
        built = make_stack(**_EAGER)
        assert not built.controller.region_samples_this_step()
        _poison(built, kind, mark)
        return built

    with inference_flag():
        records = run_engine_records(build_engine(stack()), requests)
        clean = run_engine_records(
            build_engine(stack()), {k: v for k, v in requests.items() if k != 3}
        )
    assert "logits row is not finite" in failure_reason(records[3])
    assert records[3].generated_tokens == []
    for request_id, request in clean.items():
        assert completed(records[request_id]), request_id
        assert all(0 <= token < VOCAB - 1 for token in records[request_id].generated_tokens)
        if mode == "greedy":  # sampled rows draw other noise beside another row
            assert records[request_id].generated_tokens == request.generated_tokens
    with pytest.raises(ValueError, match=r"no token can be sampled for requests 3: its logits"):
        run_engine_records(build_engine(stack()), requests)


@pytest.mark.skipif(not UPSTREAM_HAS_ACTIVE_SLICES, reason="megatron-core 0.19's eager step")
@pytest.mark.parametrize("materialize", [True, False], ids=["last_token_logits", "all_logits"])
@pytest.mark.parametrize("kind", ["nan", "inf", "all_neg_inf"])
def test_eager_0_19_step_samples_the_other_rows_as_megatron_core(kind, materialize):
    """One eager step with greedy and top-k rows (several sampling buckets): every other row's
    token is bit for bit megatron-core's own sampler's on the same logits with the flagged row
    zeroed (the row megatron-core's sampler reads in its place), drawn from the same generator;
    only the flagged request is reported."""
    mark = VOCAB - 1
    rng = random.Random(3)
    sampling = [dict(top_k=1), dict(top_k=4), dict(top_k=8, temperature=0.7), dict(top_k=4)] * 2
    requests = {
        k: (
            [rng.randrange(VOCAB - 1) for _ in range(4)] + ([mark] if k == 3 else []),
            SamplingParams(num_tokens_to_generate=8, termination_id=-1, **params),
        )
        for k, params in enumerate(sampling)
    }

    def first_step(extension: bool, poison: str):
        eager = _EAGER if extension else {}
        stack = make_stack(extension, materialize_only_last_token_logits=materialize, **eager)
        if extension:
            assert not stack.controller.region_samples_this_step()
        _poison(stack, poison, mark)
        controller, seen = stack.controller, []
        bookkeeping = controller._dynamic_step_context_bookkeeping

        def record():
            result = bookkeeping()
            seen.append(result)
            return result

        controller._dynamic_step_context_bookkeeping = record
        engine = build_engine(stack)
        add_to_engine(engine, requests)
        engine.step_modern()
        return seen[0]

    with inference_flag():
        ours = first_step(True, kind)
    stock = first_step(False, "zeros")
    ids = ours["active_request_ids"].tolist()
    assert ids == stock["active_request_ids"].tolist() and sorted(ids) == list(requests)
    assert FAILED_REQUESTS_KEY not in stock
    assert ours[FAILED_REQUESTS_KEY] == {3: controller_base.NON_FINITE_REASONS[2]}
    good = [row for row, request_id in enumerate(ids) if request_id != 3]
    assert torch.equal(ours["sample"][good], stock["sample"][good])


# Requests refused where they enter (each used to stall megatron-core's queue: every later step
# raised on the head of it, and the requests behind it never finished).
REFUSED_AT_ADD = {
    "top_k_and_top_p": (dict(top_k=5, top_p=0.9), "top_k (5) and top_p (0.9)"),
    "temperature_1e-40": (dict(top_k=0, temperature=1e-40), "temperature (1e-40) is too small"),
    "temperature_str": (dict(top_k=0, temperature="1.0"), "temperature must be a real number"),
    "top_k_2**31": (dict(top_k=2**31), "top_k (2147483648)"),
    "top_k_above_vocab": (dict(top_k=VOCAB + 1), f"top_k ({VOCAB + 1}) is larger"),
    "request_id_2**31": (None, "request_id (2147483648) must be in"),
}


@pytest.mark.parametrize("case", list(REFUSED_AT_ADD))
def test_engine_fails_a_refused_request_when_it_enters_and_finishes_the_rest(case):
    sampling, reason = REFUSED_AT_ADD[case]
    requests = dict(enumerate(random_requests(6, seed=47)))
    bad_id = 2
    if sampling is None:
        bad_id = 2**31
        requests[bad_id] = requests.pop(2)
    else:
        prompt, _ = requests[2]
        requests[2] = (prompt, SamplingParams(num_tokens_to_generate=4, **sampling))
    with inference_flag():
        engine = build_engine(make_stack())
        add_to_engine(engine, requests)
        assert bad_id not in engine.waiting_request_ids  # it never reaches the scheduler
        records = step_until_done(engine, set(requests))
    assert reason in failure_reason(records[bad_id])
    assert records[bad_id].generated_tokens == []
    good = sorted(k for k in requests if k != bad_id)
    clean, _ = engine_outputs(True, [requests[k] for k in good])
    for index, request_id in enumerate(good):
        assert completed(records[request_id]), request_id
        assert records[request_id].generated_tokens == clean[index]["generated_tokens"]


def test_generation_comparison_names_the_first_difference():
    base = {0: {"generated_tokens": [5, 6, 7], "generated_log_probs": [-0.5, -1.0, -2.0]}}
    moved = {0: {"generated_tokens": [5, 6, 7], "generated_log_probs": [-0.5, -1.25, -2.0]}}
    assert_same_generations(base, {0: dict(base[0])}, "equal")
    with pytest.raises(
        AssertionError,
        match=r"1 of 1 requests differ; request 0, "
        r"generated_log_probs\[1\]: -1.0 vs -1.25 .*tokens up to there \[5, 6\]",
    ):
        assert_same_generations(base, moved, "moved")
    with pytest.raises(AssertionError, match="request 3 missing"):
        assert_same_generations(base, {**base, 3: {}}, "extra")
