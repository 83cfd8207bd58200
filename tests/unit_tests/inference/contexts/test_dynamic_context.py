# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of StaticSlicesInferenceContext: the static active slices against plain slicing.

The context is driven directly (add_request / initialize_attention_state / update_requests, the
calls megatron-core's engine makes), with a small KV buffer so that requests pause, resume and
get evicted. After every initialize_attention_state each static slice is compared with plain
slicing of megatron-core's full tensors, and the padding rows with the neutral values.

Runs on the current CUDA device where there is one, else on the CPU (megatron-core's context
allocates on ``torch.cuda.current_device()``, redirected to the CPU by ``cpu_torch_compat`` on a
CPU-only build); the ``gpu`` variants repeat the sequences on a CUDA device.
"""

import random
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch
from megatron.core.inference.inference_request import DynamicInferenceRequest
from megatron.core.inference.sampling_params import SamplingParams

from megatron_ext.inference.contexts.dynamic_context import (
    UPSTREAM_HAS_ACTIVE_SLICES,
    SamplingRequirements,
    StaticSlicesInferenceContext,
)
from megatron_ext.inference.contexts.static_slices_context_base import REQUEST_SLICE_FIELDS
from megatron_ext.testing.synthetic import build_synthetic_stack, cpu_torch_compat

# The neutral padding values the issue specifies, spelled out here rather than read from the
# module so that a change to them fails these tests: a padded row samples from an untouched
# distribution, can never match a termination id (token ids are >= 0), never reaches its output
# length, asks for no log-probs, and gathers logits row 0.
NEUTRAL_METADATA = {
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 0.0,
    "termination_id": -1,
    "return_log_probs": False,
    "skip_prompt_log_probs": False,
    "top_n_logprobs": 0,
}
NEUTRAL_REQUEST = {
    "request_ids": -1,
    "query_lengths": 0,
    "kv_length_offsets": 0,
    "output_lengths": 2**31 - 1,
}

_REQUEST_FIELDS = {
    "request_ids": ("active_request_ids", "request_ids"),
    "query_lengths": ("active_request_query_lengths", "request_query_lengths"),
    "kv_length_offsets": ("active_request_kv_length_offsets", "request_kv_length_offsets"),
    "output_lengths": ("active_request_output_lengths", "request_output_lengths"),
}


@pytest.fixture(autouse=True)
def _cpu_compat():
    with cpu_torch_compat():
        yield


def make_context(**overrides) -> StaticSlicesInferenceContext:
    """A small extension context; overrides go to build_synthetic_stack."""
    kwargs = dict(
        extension=True,
        max_requests=16,
        max_tokens=64,
        max_sequence_length=160,
        block_size_tokens=8,
        num_blocks=40,
        num_paused_blocks=8,
        vocab_size=64,
    )
    kwargs.update(overrides)
    return build_synthetic_stack(**kwargs).context


def model_device() -> torch.device:
    """Where a model's tensors (prompts, logits) live: the current CUDA device, else the CPU.
    (On 0.19 the context's request tensors are host tensors on either.)"""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_request(request_id: int, prompt_len: int, rng: random.Random, **sampling):
    params = dict(num_tokens_to_generate=rng.randint(1, 40), termination_id=-1)
    params.update(sampling)
    prompt = torch.tensor([rng.randrange(60) for _ in range(prompt_len)], device=model_device())
    return DynamicInferenceRequest(
        request_id=request_id, prompt_tokens=prompt, sampling_params=SamplingParams(**params)
    )


def _as_list(tensor: torch.Tensor) -> List:
    return tensor.detach().cpu().tolist()


def check_active_slices(ctx: StaticSlicesInferenceContext) -> Dict[str, int]:
    """Compare every static slice with plain slicing and every padding row with its neutral
    value; also check the device mirror. Returns the counts it saw."""
    paused, total = ctx.paused_request_count, ctx.total_request_count
    active = total - paused
    padded = min(ctx.padded_active_request_count, ctx.max_requests)
    assert padded >= active
    ctx.publish_active_slices()
    device = ctx.device_active_slices

    for name, (attr, source) in _REQUEST_FIELDS.items():
        static = getattr(ctx, attr)
        assert _as_list(static[:active]) == _as_list(getattr(ctx, source)[paused:total]), name
        assert _as_list(static[active:padded]) == [NEUTRAL_REQUEST[name]] * (padded - active), name
        assert _as_list(getattr(device, name)[:padded]) == _as_list(static[:padded]), name

    for label, static in ctx.active_request_metadata.items():
        expected = ctx.request_metadata[label][paused:total]
        assert _as_list(static[:active]) == _as_list(expected), label
        neutral = NEUTRAL_METADATA[label]
        assert _as_list(static[active:padded]) == [neutral] * (padded - active), label
        assert _as_list(device.metadata[label][:padded]) == _as_list(static[:padded]), label

    lengths = ctx.request_query_lengths[paused:total].to(torch.int64)
    expected_last = _as_list(torch.cumsum(lengths, 0) - 1)
    assert _as_list(ctx.active_request_last_token_idxs[:active]) == expected_last
    assert _as_list(ctx.active_request_last_token_idxs[active:padded]) == [0] * (padded - active)
    assert _as_list(device.last_token_idxs[:padded]) == _as_list(
        ctx.active_request_last_token_idxs[:padded]
    )
    return {"active": active, "paused": paused, "padded": padded}


class RandomDriver:
    """Drives a context the way megatron-core's engine does, with random arrivals and finishes.

    Scheduling mirrors the engine's chunked-prefill scheduler: the head of the queue is added
    whole if its remaining prompt fits in the token budget, else (chunked prefill) as a chunk
    that fills the budget; new requests are admitted only while none is paused. Evicted
    requests go back to the head of the queue with their generated tokens appended to the
    prompt.
    """

    def __init__(
        self,
        ctx,
        seed: int,
        chunked_prefill: bool = True,
        sampling=None,
        check: Callable = None,
        record: Optional[Callable] = None,
    ):
        self.ctx = ctx
        self.rng = random.Random(seed)
        # Own generator for the sampled tokens, so that two drivers with one seed make the same
        # calls whatever else uses torch's global generator.
        self.gen = torch.Generator().manual_seed(seed)
        self.check = check or check_active_slices
        # Called with (ctx, phase) after initialize_attention_state and after update_requests.
        self.record = record
        self.waiting: Deque[DynamicInferenceRequest] = deque()
        self.next_id = 0
        self.chunked_prefill = chunked_prefill
        # Non-neutral values in every label, so that a wrong copy cannot pass for padding.
        self.sampling = sampling or {
            "temperature": [0.5, 1.0, 1.3],
            "top_k": [0, 1, 5],
            "top_p": [0.0, 0.9],
            "termination_id": [-1, 3, 59],
            "return_log_probs": [False, True],
            "top_n_logprobs": [0, 2],
        }
        self.seen = {"prefill_only": 0, "decode_only": 0, "mixed": 0, "chunked": 0}
        self.seen.update({"paused": 0, "padded_full": 0, "evicted": 0, "resumed": 0})

    def arrive(self, count: int) -> None:
        for _ in range(count):
            prompt_len = self.rng.choice([1, 2, 5, 9, 17, 40, 90])
            sampling = {key: self.rng.choice(values) for key, values in self.sampling.items()}
            if sampling.get("top_k", 0) > 0:
                sampling["top_p"] = 0.0  # top-k and top-p together are refused, as by stock
            self.waiting.append(make_request(self.next_id, prompt_len, self.rng, **sampling))
            self.next_id += 1

    def schedule(self) -> None:
        ctx = self.ctx
        while self.waiting:
            req = self.waiting[0]
            continuing = ctx.chunked_prefill_request_id >= 0
            can_add, _, kv_available = ctx.check_availability(req)
            if not ((continuing or can_add) and kv_available):
                return
            remaining = len(req.remaining_prompt_tokens)
            if ctx.active_token_count + remaining <= ctx.max_tokens:
                ctx.chunked_prefill_request_id = -1
                ctx.add_request(req)
                req.remaining_prompt_tokens = req.remaining_prompt_tokens.new_empty(0)
                self.waiting.popleft()
            elif self.chunked_prefill and ctx.active_token_count < ctx.max_tokens:
                chunk = ctx.max_tokens - ctx.active_token_count
                ctx.add_request(req, chunk)
                ctx.chunked_prefill_request_id = req.request_id
                req.remaining_prompt_tokens = req.remaining_prompt_tokens[chunk:]
                req.finished_chunk_token_count += chunk
                self.seen["chunked"] += 1
                return
            else:
                return

    def step(self, finish_prob: float = 0.05) -> Optional[Dict[str, int]]:
        ctx = self.ctx
        if self.rng.random() < 0.3:
            self.arrive(self.rng.randint(1, 4))
        self.schedule()
        if ctx.active_token_count == 0 and ctx.total_request_count == ctx.paused_request_count:
            return None
        prefill = ctx.num_prefill_requests
        ctx.initialize_attention_state()
        if self.record is not None:
            self.record(ctx, "initialize_attention_state")
        counts = self.check(ctx)
        active = counts["active"]
        if prefill == active:
            self.seen["prefill_only"] += 1
        elif prefill == 0:
            self.seen["decode_only"] += 1
        else:
            self.seen["mixed"] += 1
        self.seen["paused"] += counts["paused"] > 0
        self.seen["padded_full"] += counts["padded"] == ctx.max_requests

        # Random finishes on top of megatron-core's own length rule.
        mask = torch.tensor(
            [int(self.rng.random() > finish_prob) for _ in range(active)], dtype=torch.uint8
        )
        seq = ctx.request_kv_length_offsets + ctx.request_query_lengths + 1
        natural = (seq < ctx.request_output_lengths)[ctx.paused_request_count :][:active]
        mask = (mask.to(natural.device) & natural.to(torch.uint8)).to(natural.device)
        tokens = torch.randint(0, 60, (active,), generator=self.gen).to(natural.device)
        paused_before = ctx.paused_request_count
        result = ctx.update_requests(mask, tokens) or {}
        if self.record is not None:
            self.record(ctx, "update_requests")
        evicted = result.get("evict_request_ids")
        if evicted is not None and evicted.numel():
            self.seen["evicted"] += evicted.numel()
            chunked = self.waiting.popleft() if ctx.chunked_prefill_request_id >= 0 else None
            for request_id in reversed(_as_list(evicted)):
                # Re-queue with a fresh prompt of similar length, as the engine checkpoints it.
                self.waiting.appendleft(make_request(request_id, 8, self.rng))
            if chunked is not None:
                # As the engine does: the chunked-prefill request stays at the head.
                self.waiting.appendleft(chunked)
        if ctx.paused_request_count < paused_before:
            self.seen["resumed"] += 1
        if hasattr(ctx, "release_request_sampling_state"):
            ctx.release_request_sampling_state([])
        return counts


def finish_every_request(ctx, keep=()) -> None:
    """One step that finishes every active request except those in ``keep``."""
    ctx.initialize_attention_state()
    paused, total = ctx.paused_request_count, ctx.total_request_count
    ids = _as_list(ctx.request_ids[paused:total])
    device = ctx.request_ids.device
    mask = torch.tensor([int(rid in keep) for rid in ids], dtype=torch.uint8, device=device)
    ctx.update_requests(mask, torch.zeros(len(ids), dtype=torch.int64, device=device))


def run_random(ctx, steps: int, seed: int, **driver_kwargs) -> Dict[str, int]:
    driver = RandomDriver(ctx, seed, **driver_kwargs)
    driver.arrive(6)
    for _ in range(steps):
        driver.step()
    return driver.seen


# ------------------------------------------------------------------------------------- tests


def test_randomized_sequences_match_plain_slicing():
    """Thousands of steps of arrivals, pauses, resumes, evictions and finishes."""
    ctx = make_context()
    seen = run_random(ctx, steps=1500, seed=1)
    # The sequence must actually exercise every regime it is meant to check.
    for key in ("prefill_only", "decode_only", "mixed", "chunked", "paused", "resumed"):
        assert seen[key] > 0, seen
    assert seen["padded_full"] > 0, seen
    assert seen["evicted"] > 0, seen


def test_randomized_sequences_without_paused_reserve_and_full_logits():
    """No paused-block reserve (pauses resolve by resuming only) and per-token logits."""
    ctx = make_context(
        num_paused_blocks=0, max_tokens=128, materialize_only_last_token_logits=False, seed=3
    )
    seen = run_random(ctx, steps=800, seed=2, chunked_prefill=False)
    assert seen["decode_only"] > 0 and seen["mixed"] + seen["prefill_only"] > 0, seen


def test_no_active_request():
    ctx = make_context()
    ctx.initialize_attention_state()
    assert ctx.padded_active_request_count == 0
    check_active_slices(ctx)
    ctx.build_active_slices(0)
    # Nothing was ever built: every row still holds its neutral value.
    assert _as_list(ctx.active_request_ids) == [-1] * ctx.max_requests
    assert _as_list(ctx.active_request_metadata["temperature"]) == [1.0] * ctx.max_requests


def test_all_paused_reads_nothing():
    ctx = make_context()
    rng = random.Random(0)
    for i in range(3):
        ctx.add_request(make_request(i, 4, rng))
    ctx.initialize_attention_state()
    ctx.active_request_ids.fill_(7)
    # Every request paused: no active rows, and nothing may be copied.
    ctx.paused_request_count = ctx.total_request_count
    ctx.build_active_slices(0)
    assert _as_list(ctx.active_request_ids) == [7] * ctx.max_requests
    with pytest.raises(ValueError):
        ctx.build_active_slices(ctx.max_requests - ctx.paused_request_count + 1)


def test_padded_count_equal_to_max_requests_with_paused_rows_is_clamped_and_padded():
    ctx = make_context()
    rng = random.Random(0)
    for i in range(6):
        ctx.add_request(make_request(i, 3, rng))
    ctx.initialize_attention_state()
    ctx.update_requests(
        torch.ones(6, dtype=torch.uint8, device=ctx.request_ids.device),
        torch.zeros(6, dtype=torch.int64, device=ctx.request_ids.device),
    )
    # Pretend two requests are paused: the build clamps to max_requests - paused, the padding
    # still covers every row up to max_requests.
    ctx.paused_request_count = 2
    ctx.initialize_attention_state()
    assert ctx.padded_active_request_count == ctx.max_requests
    counts = check_active_slices(ctx)
    assert counts == {"active": 4, "paused": 2, "padded": ctx.max_requests}


def test_prefill_only_decode_only_and_mixed_steps():
    ctx = make_context()
    rng = random.Random(5)
    device = ctx.request_ids.device
    for i in range(3):
        ctx.add_request(make_request(i, 5 + i, rng, num_tokens_to_generate=30))
    ctx.initialize_attention_state()  # prefill only
    assert check_active_slices(ctx)["active"] == 3
    assert _as_list(ctx.active_request_last_token_idxs[:3]) == [4, 10, 17]
    ctx.update_requests(
        torch.ones(3, dtype=torch.uint8, device=device), torch.arange(3, device=device)
    )
    ctx.initialize_attention_state()  # decode only
    assert ctx.is_decode_only()
    check_active_slices(ctx)
    assert _as_list(ctx.active_request_last_token_idxs[:3]) == [0, 1, 2]
    ctx.update_requests(
        torch.ones(3, dtype=torch.uint8, device=device), torch.arange(3, device=device)
    )
    ctx.add_request(make_request(3, 7, rng))
    ctx.initialize_attention_state()  # mixed
    assert not ctx.is_decode_only()
    check_active_slices(ctx)
    assert _as_list(ctx.active_request_last_token_idxs[:4]) == [0, 1, 2, 9]


def test_chunked_prefill_request_slices():
    ctx = make_context(max_tokens=32)
    rng = random.Random(7)
    req = make_request(0, 50, rng)
    ctx.add_request(req, 32)
    ctx.chunked_prefill_request_id = 0
    ctx.initialize_attention_state()
    check_active_slices(ctx)
    assert _as_list(ctx.active_request_query_lengths[:1]) == [32]
    assert _as_list(ctx.active_request_last_token_idxs[:1]) == [31]


def test_last_token_logits_matches_megatron_core():
    ctx = make_context(materialize_only_last_token_logits=False)
    rng = random.Random(9)
    for i in range(5):
        ctx.add_request(make_request(i, rng.randint(1, 9), rng))
    ctx.initialize_attention_state()
    logits = torch.randn(1, ctx.padded_active_token_count, 11, device=model_device())
    ours = ctx.last_token_logits(logits)
    if UPSTREAM_HAS_ACTIVE_SLICES:
        assert ctx.num_last_token_logits == ours.shape[0]
    else:
        stock = super(StaticSlicesInferenceContext, ctx).last_token_logits(logits)
        assert torch.equal(ours, stock)
        assert ctx.num_last_token_logits == 5
    with pytest.raises(ValueError):
        ctx.last_token_logits(logits[:, :-1])


@pytest.mark.parametrize("bad", [-1, 10**6])
def test_build_active_slices_rejects_out_of_range(bad):
    ctx = make_context()
    with pytest.raises(ValueError):
        ctx.build_active_slices(bad)


def test_build_active_slices_refuses_fewer_rows_than_active_requests():
    """A batch below the active request count would leave active rows stale."""
    ctx = make_context()
    rng = random.Random(0)
    for request_id in range(5):
        ctx.add_request(make_request(request_id, 3, rng))
    ctx.initialize_attention_state()
    with pytest.raises(ValueError, match=r"batch_size \(4\) must be in \[5, 16\]"):
        ctx.build_active_slices(4)
    ctx.build_active_slices(5)  # the active count itself is fine


def test_duplicate_request_id_is_refused():
    ctx = make_context()
    rng = random.Random(0)
    ctx.add_request(make_request(3, 2, rng))
    with pytest.raises(ValueError, match="request id 3 is already in the context"):
        ctx.add_request(make_request(3, 2, rng))
    assert ctx.total_request_count == 1  # refused before megatron-core added a row
    finish_every_request(ctx)
    ctx.release_request_sampling_state([3])
    ctx.add_request(make_request(3, 2, rng))  # an id that left the context may come back


def test_extend_active_padding_names_rows_and_its_limit():
    ctx = make_context()
    with pytest.raises(ValueError, match=r"rows \(1000000\) must be in \[0, 16\].*max_requests"):
        ctx.extend_active_padding(10**6)
    with pytest.raises(TypeError, match="rows must be an int"):
        ctx.extend_active_padding(2.0)


@pytest.mark.parametrize("bad", [1.0, True, "2", None])
def test_build_active_slices_rejects_non_int(bad):
    ctx = make_context()
    with pytest.raises(TypeError):
        ctx.build_active_slices(bad)


def test_sampling_requirements_track_requests():
    ctx = make_context()
    rng = random.Random(0)
    assert ctx.sampling_requirements() == SamplingRequirements()
    ctx.add_request(make_request(0, 3, rng, top_k=1))
    assert ctx.sampling_requirements() == SamplingRequirements(greedy=True, max_top_k=1)
    ctx.add_request(make_request(1, 3, rng, top_k=5))
    ctx.add_request(
        make_request(
            2, 3, rng, top_k=0, top_p=0.9, return_log_probs=True, skip_prompt_log_probs=True
        )
    )
    assert ctx.sampling_requirements() == SamplingRequirements(
        sample=True, top_k_cap=8, top_p=True, log_probs=True, greedy=True, max_top_k=5
    )
    # A request still in the context keeps its features, the chunked-prefill one too.
    ctx.chunked_prefill_request_id = 1
    for held in ([2], [1], [7, 0]):
        with pytest.raises(ValueError, match=r"still in the context"):
            ctx.release_request_sampling_state(held)
    ctx._release_finished_requests([1])  # a step never finishes the chunked-prefill request
    ctx.chunked_prefill_request_id = -1
    assert ctx.sampling_requirements().top_k_cap == 8
    finish_every_request(ctx, keep=[0, 1])
    ctx.release_request_sampling_state([2, 9])  # 9: unknown ids are ignored
    assert ctx.sampling_requirements() == SamplingRequirements(
        sample=True, top_k_cap=8, greedy=True, max_top_k=5
    )
    ctx.reset()
    assert ctx.sampling_requirements() == SamplingRequirements()


def test_reset_forgets_the_kept_decompression_weights():
    from megatron_ext.fusions.mla_latent import mha_weights

    ctx = make_context()
    weight = torch.randn(2 * (8 + 8), 16)
    with torch.no_grad():
        kept = mha_weights.cached_up_projections(weight, 2, 8, 4, 12, 8)
        # A write through .data is not counted by the weight's version: the layout stays.
        weight.data.add_(1.0)
        assert mha_weights.cached_up_projections(weight, 2, 8, 4, 12, 8) is kept
        ctx.reset()
        assert mha_weights.kept_up_projections() == 0
        fresh = mha_weights.cached_up_projections(weight, 2, 8, 4, 12, 8)
    expected = mha_weights.up_projections(weight, 2, 8, 4, 12, 8)
    for built, want in zip(fresh, expected):
        torch.testing.assert_close(built, want, rtol=0, atol=0)
    assert not torch.equal(fresh[0], kept[0])


def test_reset_restores_neutral_slices():
    ctx = make_context()
    run_random(ctx, steps=30, seed=4)
    ctx.reset()
    assert _as_list(ctx.active_request_ids) == [-1] * ctx.max_requests
    assert _as_list(ctx.active_request_metadata["top_k"]) == [0] * ctx.max_requests
    assert _as_list(ctx.active_request_output_lengths) == [2**31 - 1] * ctx.max_requests


@pytest.mark.skipif(
    UPSTREAM_HAS_ACTIVE_SLICES,
    reason="megatron-core 0.19 keeps bookkeeping "
    "tensors across suspend/resume; only 0.16 reallocates them",
)
def test_suspend_and_resume_reallocate_static_slices():
    ctx = make_context()
    generation = ctx.static_slices_generation
    ctx.deallocate_all_tensors()
    with pytest.raises(RuntimeError):
        _ = ctx.device_active_slices
    for call in (lambda: ctx.build_active_slices(0), ctx.pad_active_slices):
        with pytest.raises(RuntimeError, match=r"call allocate_all_tensors\(is_init=False\)"):
            call()
    ctx.allocate_all_tensors(is_init=False)
    ctx.reset()
    assert ctx.static_slices_generation == generation + 1
    run_random(ctx, steps=50, seed=6)


@pytest.mark.skipif(
    UPSTREAM_HAS_ACTIVE_SLICES, reason="megatron-core 0.19 builds the slices on the host"
)
def test_switching_graphs_off_frees_the_captured_ones_and_runs_the_same():
    ctx = make_context()
    metadata = [t["mha_metadata"] for t in (ctx.graph_attn_metadata, ctx.non_graph_attn_metadata)]
    sentinel = object()  # stands for a graph captured at allocation (none on the CPU)
    ctx._slices_graph = sentinel
    for table in metadata:
        table._update_graph = table._reset_graph = sentinel
    ctx.cuda_graph_active_slices = True
    assert ctx._slices_graph is sentinel
    ctx.cuda_graph_active_slices = False
    assert ctx._slices_graph is None
    assert all(t._update_graph is None and t._reset_graph is None for t in metadata)
    run_random(ctx, steps=30, seed=8)


@pytest.mark.skipif(
    UPSTREAM_HAS_ACTIVE_SLICES, reason="megatron-core 0.19 builds the slices on the host"
)
@pytest.mark.parametrize("bad", [0, 1, "no", None])
def test_cuda_graph_switch_refuses_non_bool(bad):
    ctx = make_context()
    with pytest.raises(TypeError, match="cuda_graph_active_slices must be a bool"):
        ctx.cuda_graph_active_slices = bad
    assert ctx.cuda_graph_active_slices is True


@pytest.mark.gpu
def test_randomized_sequences_on_gpu():
    """The same sequences with the context on the GPU."""
    ctx = make_context()
    assert ctx.device_active_slices.request_ids.is_cuda
    seen = run_random(ctx, steps=1500, seed=1)
    assert seen["paused"] > 0 and seen["evicted"] > 0, seen


@pytest.mark.gpu
def test_build_and_pad_do_not_synchronize_on_gpu():
    if UPSTREAM_HAS_ACTIVE_SLICES:
        pytest.skip("on megatron-core 0.19 the slices are built in host memory by design")
    ctx = make_context()
    run_random(ctx, steps=20, seed=8)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ctx.build_active_slices(
            min(ctx.padded_active_request_count, ctx.max_requests - ctx.paused_request_count)
        )
        ctx.pad_active_slices()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # The slices' one implementation ran from its CUDA graph (and check_active_slices compared
    # the result with plain slicing after every step of run_random).
    assert ctx._slices_graph is not None


@pytest.mark.gpu
def test_decode_steps_set_up_attention_without_synchronizing_on_gpu():
    """0.16: once its graphs exist, a decode-only step's initialize_attention_state (megatron-core's
    set-up with the extension's attention metadata, then the slices) never waits for the GPU."""
    if UPSTREAM_HAS_ACTIVE_SLICES:
        pytest.skip("megatron-core 0.19 sets up attention on the host by design")
    ctx = make_context()
    original = ctx.initialize_attention_state
    metadata = ctx.non_graph_attn_metadata["mha_metadata"]
    strict_steps = [0]

    def guarded(*args, **kwargs):
        strict = ctx.num_prefill_requests == 0 and metadata._update_graph is not None
        strict = strict and ctx._slices_graph is not None
        if strict:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            original(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        strict_steps[0] += strict

    ctx.initialize_attention_state = guarded
    run_random(ctx, steps=300, seed=21)
    assert strict_steps[0] > 20, strict_steps


# ------------------------------------------------- extension against stock megatron-core


def _state_snapshot(ctx, phase: str) -> Dict[str, Any]:
    """megatron-core's own state of a context: counts, per-request tensors, the padded token
    tensors and the attention metadata. Tensors as raw bits (a float compared bitwise)."""

    def bits(tensor: torch.Tensor) -> List:
        tensor = tensor.detach().cpu().contiguous()
        widths = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        return tensor.view(widths[tensor.dtype.itemsize]).tolist()

    snap: Dict[str, Any] = {"phase": phase}
    # Rows past the requests a context holds are uninitialised memory in megatron-core.
    held = slice(0, ctx.total_request_count)
    for name in (
        "paused_request_count",
        "total_request_count",
        "active_token_count",
        "padded_active_token_count",
        "padded_active_request_count",
        "chunked_prefill_request_id",
    ):
        snap[name] = getattr(ctx, name, None)
    for name in (
        "request_ids",
        "request_query_lengths",
        "request_kv_length_offsets",
        "request_output_lengths",
        "request_kv_block_counts",
        "request_last_kv_block_id",
        "request_last_kv_block_offset",
        "request_to_kv_block_ids",
    ):
        if hasattr(ctx, name):
            snap[name] = bits(getattr(ctx, name)[held])
    for label, tensor in ctx.request_metadata.items():
        snap[f"metadata:{label}"] = bits(tensor[held])
    if phase == "initialize_attention_state":
        # megatron-core pads three token tensors up to the padded token count; the others hold
        # leftovers past the active tokens.
        padded_tokens = (
            "token_to_block_idx",
            "token_to_position_in_request",
            "token_to_local_position_within_kv_block",
        )
        for name in padded_tokens + (
            "token_to_input_ids",
            "token_to_pos_ids",
            "token_to_request_idx",
        ):
            if hasattr(ctx, name):
                stop = ctx.padded_active_token_count if name in padded_tokens else None
                stop = ctx.active_token_count if stop is None else stop
                snap[name] = bits(getattr(ctx, name)[:stop])
        for key, value in ctx.active_attn_metadata["mha_metadata"].state_data.items():
            snap[f"mha:{key}"] = bits(value) if isinstance(value, torch.Tensor) else value
        snap["decode_only"] = ctx.is_decode_only()
    return snap


def _bound_of_decode_max_seqlen_k(mine: Dict[str, Any], theirs: Dict[str, Any], ctx) -> None:
    """0.16: in a decode-only step the extension's metadata reports megatron-core's graphed
    metadata's bound, ``max_sequence_length``, where the non-graphed one reads the exact maximum
    back; drop that one integer from both records after checking it."""
    if UPSTREAM_HAS_ACTIVE_SLICES or mine["phase"] != "initialize_attention_state":
        return
    if not mine["decode_only"]:
        return
    assert mine["mha:max_seqlen_k"] == ctx.max_sequence_length
    assert theirs["mha:max_seqlen_k"] <= ctx.max_sequence_length
    assert mine["mha:max_seqlen_q"] == theirs["mha:max_seqlen_q"] == 1
    del mine["mha:max_seqlen_k"], theirs["mha:max_seqlen_k"]


def _counts_only(ctx) -> Dict[str, int]:
    paused, total = ctx.paused_request_count, ctx.total_request_count
    return {
        "active": total - paused,
        "paused": paused,
        "padded": min(ctx.padded_active_request_count, ctx.max_requests),
    }


def _run_stock(
    seed: int, steps: int, overrides: Dict[str, Any], driver_kwargs: Dict[str, Any]
) -> Tuple[Any, "RandomDriver", List[Dict[str, Any]]]:
    """Stock megatron-core's context driven by the randomized sequence; its state snapshots."""
    snaps: List[Dict[str, Any]] = []
    stock = make_context(extension=False, **overrides)
    driver = RandomDriver(
        stock,
        seed,
        check=_counts_only,
        record=lambda ctx, phase: snaps.append(_state_snapshot(ctx, phase)),
        **driver_kwargs,
    )
    driver.arrive(6)
    for _ in range(steps):
        driver.step()
    return stock, driver, snaps


def _check_slices_against(stock_snapshots: List[Dict[str, Any]]) -> Callable:
    """A check for the extension's driver: its static slices equal the active rows of stock
    megatron-core's tensors at the same step, neutral values after them."""
    step = [0]

    def check(ctx) -> Dict[str, int]:
        stock = [s for s in stock_snapshots if s["phase"] == "initialize_attention_state"]
        snap = stock[step[0]]
        step[0] += 1
        counts = check_active_slices(ctx)
        paused, total = snap["paused_request_count"], snap["total_request_count"]
        active, padded = total - paused, counts["padded"]
        # Rows that the per-step refresh leaves neutral past the padded count too (0.16).
        neutral_to = ctx.max_requests if not UPSTREAM_HAS_ACTIVE_SLICES else padded
        for name, (attr, source) in _REQUEST_FIELDS.items():
            static = _as_list(getattr(ctx, attr).view(torch.int32))
            assert static[:active] == snap[source][paused:total], name
            assert static[active:neutral_to] == [NEUTRAL_REQUEST[name]] * (neutral_to - active)
        for label, static in ctx.active_request_metadata.items():
            widths = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
            raw = _as_list(static.view(widths[static.dtype.itemsize]))
            assert raw[:active] == snap[f"metadata:{label}"][paused:total], label
            assert _as_list(static[active:neutral_to]) == [NEUTRAL_METADATA[label]] * (
                neutral_to - active
            ), label
        if not UPSTREAM_HAS_ACTIVE_SLICES:
            last = _as_list(ctx.device_active_slices.last_token_idxs)
            assert last[active:] == [0] * (ctx.max_requests - active)
        return counts

    return check


@pytest.mark.parametrize(
    "overrides, driver_kwargs, regimes",
    [
        (dict(), dict(), ("paused", "resumed", "evicted", "chunked", "decode_only", "mixed")),
        (
            dict(num_paused_blocks=0, max_tokens=128, materialize_only_last_token_logits=False),
            dict(chunked_prefill=False),
            ("decode_only", "mixed"),
        ),
    ],
    ids=["chunked-prefill", "no-paused-reserve"],
)
@pytest.mark.parametrize("seed", [11, 12])
def test_extension_state_matches_stock_megatron_core(overrides, driver_kwargs, regimes, seed):
    """Stock megatron-core's context and the extension's, driven by the same randomized
    add / pause / resume / evict / finish sequence: megatron-core's own state and attention
    metadata are bitwise the same after every initialize_attention_state and update_requests,
    and the extension's static slices equal the active rows of stock's tensors, padded
    neutrally."""
    steps = 400
    stock, stock_driver, stock_snaps = _run_stock(seed, steps, overrides, driver_kwargs)

    ext_snaps: List[Dict[str, Any]] = []
    ext = make_context(**overrides)
    assert isinstance(ext, StaticSlicesInferenceContext)
    assert not isinstance(stock, StaticSlicesInferenceContext)
    ext_driver = RandomDriver(
        ext,
        seed,
        check=_check_slices_against(stock_snaps),
        record=lambda ctx, phase: ext_snaps.append(_state_snapshot(ctx, phase)),
        **driver_kwargs,
    )
    ext_driver.arrive(6)
    for _ in range(steps):
        ext_driver.step()

    assert len(ext_snaps) == len(stock_snaps) > steps
    for index, (mine, theirs) in enumerate(zip(ext_snaps, stock_snaps)):
        _bound_of_decode_max_seqlen_k(mine, theirs, ext)
        assert mine == theirs, f"state differs from megatron-core's at record {index}"
    seen = ext_driver.seen
    assert seen == stock_driver.seen
    # The sequence must exercise what it is meant to compare.
    assert all(seen[regime] > 0 for regime in regimes), seen


@pytest.mark.skipif(
    not UPSTREAM_HAS_ACTIVE_SLICES, reason="megatron-core 0.19's host-side slices only"
)
@pytest.mark.parametrize("seed", [13, 14])
def test_unpublished_step_does_only_upstreams_work_and_publishing_gives_the_slices(seed):
    """0.19: initialize_attention_state does upstream's work only (the extension's host slices
    and device buffer stay untouched, reading device_active_slices raises), megatron-core's
    state stays bitwise stock's, and publish_active_slices then gives the slices of stock's
    active rows."""
    _, _, stock_snaps = _run_stock(seed, 200, {}, {})

    ext = make_context()
    check_against_stock = _check_slices_against(stock_snaps)
    untouched = {"steps": 0}

    def check(ctx) -> Dict[str, int]:
        device = ctx._ext_device.buffer
        # Upstream's own metadata slices share the host buffer and are written by upstream;
        # the extension's request slices and the device copy must be as the last publish left
        # them.
        for name, attr, _ in REQUEST_SLICE_FIELDS:
            assert torch.equal(getattr(ctx, attr), last[name]), name
        assert torch.equal(device, last["device"])
        with pytest.raises(RuntimeError, match="built but not published"):
            _ = ctx.device_active_slices
        with pytest.raises(RuntimeError, match="built but not published"):
            ctx.extend_active_padding(ctx.max_requests)
        untouched["steps"] += 1
        counts = check_against_stock(ctx)  # publishes, then compares
        for name, attr, _ in REQUEST_SLICE_FIELDS:
            last[name] = getattr(ctx, attr).clone()
        last["device"] = device.clone()
        return counts

    last = {name: getattr(ext, attr).clone() for name, attr, _ in REQUEST_SLICE_FIELDS}
    last["device"] = ext._ext_device.buffer.clone()
    ext_snaps: List[Dict[str, Any]] = []
    driver = RandomDriver(
        ext,
        seed,
        check=check,
        record=lambda ctx, phase: ext_snaps.append(_state_snapshot(ctx, phase)),
    )
    driver.arrive(6)
    for _ in range(200):
        driver.step()
    assert ext_snaps == stock_snaps
    assert untouched["steps"] > 100


@pytest.mark.skipif(
    not UPSTREAM_HAS_ACTIVE_SLICES, reason="megatron-core 0.19's host-side slices only"
)
def test_publish_after_update_requests_is_refused():
    """0.19: once update_requests has changed the request tensors, the step built before it
    cannot be published (its rows are gone); the next step's build and publish work again."""
    ctx = make_context()
    rng = random.Random(5)
    device = ctx.request_ids.device
    for i in range(3):
        ctx.add_request(make_request(i, 5 + i, rng, num_tokens_to_generate=30))
    ctx.initialize_attention_state()
    ctx.publish_active_slices()
    ctx.publish_active_slices()  # a second call in the same step does nothing
    ctx.update_requests(
        torch.ones(3, dtype=torch.uint8, device=device), torch.arange(3, device=device)
    )
    ctx.initialize_attention_state()
    ctx.update_requests(
        torch.ones(3, dtype=torch.uint8, device=device), torch.arange(3, device=device)
    )
    with pytest.raises(RuntimeError, match="update_requests"):
        ctx.publish_active_slices()
    ctx.initialize_attention_state()
    assert check_active_slices(ctx)["active"] == 3


@pytest.mark.skipif(
    UPSTREAM_HAS_ACTIVE_SLICES,
    reason="megatron-core 0.19 builds the slices host-side with upstream's own methods",
)
def test_step_slices_equal_build_then_pad():
    """Each step's slices leave rows [0, padded) exactly as the explicit
    build_active_slices(padded) + pad_active_slices() do; build leaves the rows past its batch as
    they were, and pad touches only [active, padded)."""
    if UPSTREAM_HAS_ACTIVE_SLICES:
        pytest.skip("on megatron-core 0.19 the step uses upstream's build/pad themselves")
    ctx = make_context()
    driver = RandomDriver(ctx, 21)
    driver.arrive(8)

    def snapshot():
        rows = {n: _as_list(getattr(ctx, a)) for n, (a, _) in _REQUEST_FIELDS.items()}
        rows.update({k: _as_list(v) for k, v in ctx.active_request_metadata.items()})
        rows["last"] = _as_list(ctx.active_request_last_token_idxs)
        return rows

    compared = 0
    for _ in range(300):
        driver.step()
        if ctx.total_request_count == 0:
            continue
        ctx.initialize_attention_state()  # the next step's slices, from the updated requests
        active = ctx.total_request_count - ctx.paused_request_count
        padded = min(ctx.padded_active_request_count, ctx.max_requests - ctx.paused_request_count)
        # Marks past the batch, which build must keep (a neutral fill would erase them).
        ctx.active_request_ids[padded:] = 12345
        ctx.active_request_last_token_idxs[padded:] = 54321
        stepped = snapshot()
        ctx.build_active_slices(padded)
        after_build = snapshot()
        assert set(after_build["request_ids"][padded:]) <= {12345}
        ctx.pad_active_slices()
        built = snapshot()
        pad_stop = min(ctx.padded_active_request_count, ctx.max_requests)
        for key in built:
            assert stepped[key][:active] == built[key][:active], key
            assert stepped[key][active:padded] == built[key][active:padded], key  # both neutral
            assert after_build[key][padded:] == stepped[key][padded:], key
            assert built[key][:active] == after_build[key][:active], key
            assert built[key][pad_stop:] == after_build[key][pad_stop:], key
        assert set(built["request_ids"][active:pad_stop]) <= {-1}
        compared += 1
    assert compared > 100


def test_the_context_class_of_the_installed_megatron_core_line():
    """One class per megatron-core line, picked here; the other line's module is not imported."""
    import sys

    from megatron_ext.inference.contexts import dynamic_context
    from megatron_ext.utils import is_megatron_core_min_version

    line, other = ("0_19", "0_16") if is_megatron_core_min_version("0.19.0") else ("0_16", "0_19")
    assert dynamic_context.UPSTREAM_HAS_ACTIVE_SLICES == (line == "0_19")
    cls = dynamic_context.StaticSlicesInferenceContext
    assert cls.__module__ == f"megatron_ext.inference.contexts.dynamic_context_{line}"
    assert f"megatron_ext.inference.contexts.dynamic_context_{other}" not in sys.modules


def _state(ctx) -> Tuple:
    """What add_request changes: counts, KV blocks, the request ids and the sampling record."""
    allocator = getattr(ctx, "kv_block_allocator", None) or ctx.block_allocator
    return (
        ctx.total_request_count,
        ctx.active_token_count,
        allocator.total_avail,
        _as_list(ctx.request_ids),
        len(ctx._sampling_registry),
        ctx.sampling_requirements(),
    )


# (what to change in a good request, exception, what the message must say). Each used to reach
# megatron-core's add_request, which converts the values only after it has allocated the
# request's KV blocks and written its id (an int32 overflow then left a half-added request),
# or to be recorded and sampled as token 0 (a temperature whose reciprocal overflows).
BAD_REQUESTS = {
    "temperature_1e-40": (dict(temperature=1e-40, top_k=0), ValueError, "too small to sample"),
    "temperature_1e-50_top_p": (
        dict(temperature=1e-50, top_k=0, top_p=0.5),
        ValueError,
        "too small to sample",
    ),
    "temperature_str": (dict(temperature="1.0"), TypeError, r"temperature .*got str \('1.0'\)"),
    "temperature_none": (dict(temperature=None), TypeError, "temperature .*got NoneType"),
    "top_k_none": (dict(top_k=None), TypeError, "top_k must be an int, got NoneType"),
    "top_k_2**31": (dict(top_k=2**31), ValueError, r"top_k \(2147483648\)"),
    "top_k_and_top_p": (dict(top_k=5, top_p=0.9), ValueError, "cannot both be greater"),
    "top_k_above_vocab": (dict(top_k=65), ValueError, r"top_k \(65\) is larger"),
    "termination_id_2**63": (dict(termination_id=2**63), ValueError, r"termination_id \(9223"),
    "top_n_logprobs_2**31": (
        dict(top_n_logprobs=2**31, return_log_probs=True),
        ValueError,
        r"top_n_logprobs \(2147483648\)",
    ),
    "return_log_probs_str": (dict(return_log_probs="no"), TypeError, "return_log_probs .*bool"),
    "num_tokens_none": (dict(num_tokens_to_generate=None), TypeError, "num_tokens_to_generate"),
    "num_tokens_2**31": (dict(num_tokens_to_generate=2**31), ValueError, "num_tokens_to_generate"),
}
BAD_IDS = {
    "id_2**31": (2**31, ValueError, r"request_id \(2147483648\) must be in \[0, 2147483647\]"),
    "id_2**63": (2**63, ValueError, r"request_id \(9223372036854775808\) must be in"),
    "id_negative": (-1, ValueError, r"request_id \(-1\) must be in"),
    "id_bool": (True, TypeError, "request_id must be an int, got bool"),
    "id_str": ("3", TypeError, r"request_id must be an int, got str \('3'\)"),
    "id_float": (3.0, TypeError, "request_id must be an int, got float"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS) + list(BAD_IDS))
def test_bad_requests_are_refused_before_anything_changes(case):
    ctx = make_context()
    rng = random.Random(0)
    ctx.add_request(make_request(0, 3, rng))
    before = _state(ctx)
    if case in BAD_IDS:
        request_id, error, match = BAD_IDS[case]
        request = make_request(1, 3, rng)
        request.request_id = request_id
    else:
        sampling, error, match = BAD_REQUESTS[case]
        request = make_request(1, 3, rng)
        for field, value in sampling.items():
            setattr(request.sampling_params, field, value)
    with pytest.raises(error, match=match):
        ctx.add_request(request)
    assert _state(ctx) == before
    ctx.add_request(make_request(2, 3, rng))  # the context still works


@pytest.mark.parametrize(
    "tokens,error,match",
    [
        (lambda: torch.tensor([3.0, 3.7, 1.2]), ValueError, r"\[1\] is 3\.7.* integral"),
        (lambda: torch.tensor([3.0, float("nan")]), ValueError, r"\[1\] is nan.* finite"),
        (lambda: torch.tensor([float("inf")]), ValueError, r"\[0\] is inf.* finite"),
        (lambda: torch.tensor([2, -1]), ValueError, r"\[1\] is -1: token ids must be in \[0, "),
        (lambda: torch.tensor([-2.0]), ValueError, r"\[0\] is -2\.0: token ids must be in"),
        (lambda: torch.tensor([True, False]), TypeError, "integer token ids, got a 1-D torch.bool"),
        (lambda: torch.tensor([1 + 0j]), TypeError, "integer token ids, got a 1-D torch.complex"),
        (lambda: torch.tensor([[3, 1]]), TypeError, "1-D tensor of token ids, got a 2-D"),
        (lambda: [3, 1], TypeError, "1-D tensor of token ids, got list"),
        (lambda: torch.tensor([], dtype=torch.int64), ValueError, "tokens is empty"),
    ],
    ids=["fraction", "nan", "inf", "negative", "negative_float", "bool", "complex", "2-D"]
    + ["list", "empty"],
)
def test_bad_prompt_tokens_are_refused_before_anything_changes(tokens, error, match):
    """megatron-core truncates fractional ids, stores NaN and negative ids as garbage ids, or
    asserts on an empty chunk."""
    ctx = make_context()
    before = _state(ctx)
    request = make_request(0, 3, random.Random(0))
    request.remaining_prompt_tokens = tokens()
    with pytest.raises(error, match=match):
        ctx.add_request(request)
    assert _state(ctx) == before


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.uint8]
)
def test_integral_ids_of_other_dtypes_are_stored_as_int64(dtype):
    """What megatron-core's context accepts (it copies the ids into int64 buffers; its own tests
    pass ``torch.zeros(10)``), the extension accepts and stores alike; the request then holds
    int64 ids."""
    ids = [5, 0, 63, 17]
    stored = []
    for extension in (False, True):
        ctx = make_context(extension=extension)
        request = make_request(0, 4, random.Random(0))
        request.prompt_tokens = torch.tensor(ids, dtype=dtype)
        request.remaining_prompt_tokens = request.prompt_tokens.clone()
        ctx.add_request(request)
        stored.append(_as_list(ctx.token_to_input_ids[:4]))
        if extension:
            assert request.prompt_tokens.dtype == torch.int64
            assert request.remaining_prompt_tokens.dtype == torch.int64
            assert request.prompt_tokens.tolist() == ids
    assert stored == [ids, ids]


@pytest.mark.parametrize("extension", [False, True], ids=["stock", "megatron_ext"])
def test_megatron_cores_request_overflow_scenario(extension):
    """megatron-core's own ``test_dynamic_context.py::TestDynamicContext::test_request_overflow``
    (tags core_v0.16.1 and core_v0.19.0), on a small context: float32 prompts of zeros, one
    request more than ``max_requests`` halved; the last one overflows, on both classes alike."""
    from megatron.core.inference.contexts.dynamic_context import RequestOverflowError

    # Room for every request's tokens, so that the request count is what overflows.
    ctx = make_context(extension=extension, max_tokens=256)
    ctx.max_requests //= 2
    with pytest.raises(RequestOverflowError):
        for i in range(ctx.max_requests + 1):
            ctx.add_request(
                DynamicInferenceRequest(
                    request_id=i,
                    prompt_tokens=torch.zeros(10),
                    sampling_params=SamplingParams(num_tokens_to_generate=ctx.max_tokens - 10),
                )
            )
    assert ctx.total_request_count == ctx.max_requests


@pytest.mark.parametrize(
    "chunk,error,match",
    [
        (0, ValueError, r"chunk_length \(0\) must be in \[1, 3\]"),
        (4, ValueError, r"chunk_length \(4\) must be in \[1, 3\]"),
        (True, TypeError, "chunk_length must be an int"),
        (1.5, TypeError, "chunk_length must be an int"),
    ],
)
def test_bad_chunk_lengths_are_refused_before_anything_changes(chunk, error, match):
    ctx = make_context()
    before = _state(ctx)
    request = make_request(0, 3, random.Random(0))
    with pytest.raises(error, match=match):
        ctx.add_request(request, chunk)
    assert _state(ctx) == before


def test_numpy_ids_and_parameters_are_accepted():
    ctx = make_context()
    request = make_request(0, 3, random.Random(0), top_k=np.int64(5), temperature=np.float32(0.5))
    request.request_id = np.int64(7)
    ctx.add_request(request)
    assert _as_list(ctx.request_ids[:1]) == [7] and 7 in ctx._sampling_registry


def test_release_takes_a_tensor_of_ids():
    """The engine's finished ids come as a tensor: its elements are tensors, which no id check
    takes (a tensor hashes by identity), so the tensor is read as a list."""
    ctx = make_context()
    rng = random.Random(0)
    ctx.add_request(make_request(0, 3, rng, top_k=1))
    ctx.add_request(make_request(1, 3, rng, top_k=5))
    finish_every_request(ctx, keep=[0])
    ctx.release_request_sampling_state(torch.tensor([1, 9], dtype=torch.int32))
    assert ctx.sampling_requirements() == SamplingRequirements(greedy=True, max_top_k=1)
    with pytest.raises(TypeError, match="request_ids must be an iterable of ints, got a 0-D"):
        ctx.release_request_sampling_state(torch.tensor(9))


@pytest.mark.parametrize(
    "ids,error,match",
    [
        ([True], TypeError, r"request_ids\[0\] must be an int, got bool"),
        ([4, np.bool_(True)], TypeError, r"request_ids\[1\] must be an int, got bool"),
        ([1.0], TypeError, r"request_ids\[0\] must be an int, got float \(1.0\)"),
        (1, TypeError, "request_ids must be an iterable of ints, got int"),
        ("1", TypeError, "request_ids must be an iterable of ints, got str"),
        ([1], ValueError, r"request ids \[1\] are still in the context"),
    ],
)
def test_release_refuses_bools_and_requests_still_held(ids, error, match):
    """``[True]`` used to release id 1, and a request still in the context could be released
    (its features then missing from the plan)."""
    ctx = make_context()
    rng = random.Random(0)
    for request_id in range(3):
        ctx.add_request(make_request(request_id, 3, rng, top_k=5 if request_id == 1 else 1))
    before = ctx.sampling_requirements()
    with pytest.raises(error, match=match):
        ctx.release_request_sampling_state(ids)
    assert ctx.sampling_requirements() == before and len(ctx._sampling_registry) == 3


def test_a_context_pickles_and_its_copy_keeps_its_requests():
    """As megatron-core's context does (0.16's failed on its attention metadata's weak
    reference). pickle copies views apart from the tensors they view, so the copy links its
    slices to its own buffers again; its slices then are the original's, step after step.
    (On 0.19 megatron-core's own ContextGPUView is views of one buffer, which its pickled copy
    loses: there only the extension's slices are compared. 0.19's context holds a CUDA event,
    which does not pickle: the copy gets its own.)"""
    import pickle

    ctx = make_context()
    run_random(ctx, steps=12, seed=6)
    copy = pickle.loads(pickle.dumps(ctx))
    assert copy.sampling_requirements() == ctx.sampling_requirements()
    if UPSTREAM_HAS_ACTIVE_SLICES:
        event = copy._bookkeeping_h2d_done_event
        assert isinstance(event, torch.cuda.Event)
        assert event is not ctx._bookkeeping_h2d_done_event
        if torch.cuda.is_available():
            event.record()
            event.synchronize()

    def slices(each):
        each.initialize_attention_state()
        each.publish_active_slices()
        device = each.device_active_slices
        views = {name: _as_list(getattr(device, name)) for name in NEUTRAL_REQUEST}
        views.update({label: _as_list(t) for label, t in device.metadata.items()})
        return views

    for _ in range(3):
        assert slices(copy) == slices(ctx)
        if not UPSTREAM_HAS_ACTIVE_SLICES:
            assert check_active_slices(copy) == check_active_slices(ctx)
        for each in (ctx, copy):
            active = each.total_request_count - each.paused_request_count
            device = each.request_ids.device
            each.update_requests(
                torch.ones(active, dtype=torch.uint8, device=device),
                torch.arange(active, device=device),
            )
    if UPSTREAM_HAS_ACTIVE_SLICES:
        storage = copy._ext_host.buffer.untyped_storage().data_ptr()
        assert copy.active_request_ids.untyped_storage().data_ptr() == storage
