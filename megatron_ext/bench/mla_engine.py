# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Benchmark: decode tokens/s of an MLA GPT through megatron-core's ``DynamicInferenceEngine``
with its CUDA graphs, against the same model through megatron-core's static batching.

    python -m megatron_ext.bench mla-engine [--quick] [--models dsv3_shard small]
        [--requests 256 1024] [--rounds N] [--prompt P] [--generate G] [--no-eager]
        [--profile-steps N] [--host-profile-steps N] [--server-loop] [--graph-scope block]
        [--out DIR]

Engines, per model and request count (bf16, random weights from one seed, random prompt tokens,
greedy):

* ``dynamic-graphed``: megatron-core's ``DynamicInferenceEngine`` with its own CUDA graphs
  (``cuda_graph_impl="local"`` in the model's config, ``num_cuda_graphs=1`` in the context: the
  engine captures its per-layer graphs on construction, for the full batch and its mixed-step
  shapes, and replays them in decode steps), served the documented way: ``mla_rope_contiguous_load``
  and ``inference_static_active_slices`` (static active slices and the graph-safe sampling region,
  replayed from megatron_ext's own CUDA graphs). ``--graph-scope block`` (megatron-core 0.19):
  one graph per decoder block (``inference_cuda_graph_scope="block"``) instead of one per layer,
  so that a decode step replays one graph instead of walking the layers' Python.
* ``dynamic-eager``: the same model and flags, a context without CUDA graphs (``--no-eager``
  leaves it out).
* ``static``: megatron-core's static batching (``StaticInferenceContext``, one prefill forward,
  then one forward per token, as :func:`megatron_ext.testing.small_mla_gpt.greedy_generate`
  drives it) with the RoPE flag, the same weights: the baseline. It decompresses keys and values
  per head into its cache, so where ``requests`` rows would not fit :data:`STATIC_CACHE_BUDGET`
  it serves them in batches of a power-of-two fraction (one such batch per round, whose decode
  tokens/s is what the batches served one after the other would give).

Models (:data:`ENGINE_MODELS`): ``dsv3_shard``, DeepSeek-V3's attention per layer (q_lora_rank
1536, kv_lora_rank 512, 128 + 64 query/key head dims, v 128, yarn RoPE, all 128 heads) at hidden
2048 and 8 layers with a dense MLP: the forward dominates the step; ``small``, two layers at
hidden 256 and 4 heads with DeepSeek-V3's head widths: host-bound.

Method: every round gives each engine the same ``requests`` prompts of ``--prompt`` tokens,
``--generate`` tokens each. The prefill (steps of up to :data:`MAX_PREFILL_TOKENS` prompt
tokens) is timed per engine and reported apart (``prefill ms``: the batch's time to first token;
its attention runs in the form ``MEGATRON_EXT_MLA_MHA_FORM`` selects, printed with the table;
``--prefill-forms off auto`` also times each dynamic engine's prefill per mode in the same
process, after the timed rounds); then the engines' decode steps
run in alternating turns (step ``i`` of each, back to back, synchronised before and after; the
order rotates between rounds), after one discarded warm-up round (Triton compiles, megatron_ext's
sampling graphs). Decode figures count the decode-only steps (a step after the prefill that is
not one is timed apart, for the end-to-end figure). An engine's decode tokens/s is its decode
tokens over its decode time, both summed over the timed rounds; its step time the decode time
over the steps and its tokens per step the tokens over the steps, so that tokens/s = tokens per
step / step time in every row. A comparison of two engines is the ratio of their decode tokens/s
(the table's figures divided), with a 95% bootstrap interval over the rounds
(:func:`~megatron_ext.bench.stats.totals_ratio`); the verdicts quote the same ratio. The median
over a round's step pairs of their per-token time ratio, once the comparison, is kept as a
diagnostic only: it leaves out the slow steps and the steps with fewer tokens (the dynamic
engine's requests whose prefill chunk came first finish first) that a throughput includes.
Host share: after the timed rounds, one more round per engine runs its decode steps under
``torch.profiler`` (CUDA activity only); the sum of the kernels' and copies' durations per step
against the timed rounds' step time is how far the step is from its kernels
(``1 - kernels / wall``).

Roofline (dynamic rows): the bytes and FLOPs of the rows' mean decode step
(:mod:`megatron_ext.bench.mla_roofline`: weights once, latent cache rows once per attention
head-tile pass, GEMM inputs and outputs; GEMM and attention FLOPs) against the copy bandwidth and
bf16 matmul rate measured at the start of the run; ``bound ms`` is the larger of bytes / bandwidth
and FLOPs / rate, ``of bound`` the bound over the step time.

``--profile-steps N``: N decode steps of the graphed engine under ``torch.profiler``, its top
kernels by time per step and share of the GPU time, and GPU time against wall time
(:mod:`megatron_ext.bench.mla_engine_profile`). ``--host-profile-steps N``: N decode steps of the
graphed engine under ``cProfile``, where the host time goes: self time per owner (megatron_ext,
megatron.core, torch, triton, other), the waits on the GPU apart, the top functions by self time and
megatron_ext's by cumulative time (:mod:`megatron_ext.bench.mla_engine_host_profile`).
``--server-loop``: each dynamic engine also serves the batch through megatron-core's own loop
(``run_engine``, else ``generate()``) to completion, ``--rounds`` times; generated tokens/s end to
end and the host share of one more loop under the profiler
(:mod:`megatron_ext.bench.mla_engine_server`), beside the stepped rounds' end-to-end figure.

Printed last: the verdicts (``>= 2x static at 256 requests: met/missed by X`` per model, the
graphed rows' host share, the device rates and rooflines, the server loops), the table, the
kernel breakdowns and the host profiles; ``mla_engine.json`` goes to ``--out``
(``mla_engine_block.json`` with ``--graph-scope block``, so that the two runs' reports stand side
by side). A configuration
that raises is reported with its traceback and the others still run (exit status 1).

Without a GPU it says so and times nothing: on a tiny MLA model (fp32, Triton interpreter) the
dynamic engine (flags on, no CUDA graphs) and the static path must generate the same greedy tokens.
"""

import argparse
import gc
import json
import os
import statistics
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_ext.bench import mla_engine_report as report_lib
from megatron_ext.bench.mla_engine_host_profile import (
    host_profile_lines,
    profile_host_decode_steps,
)
from megatron_ext.bench.mla_engine_profile import breakdown_lines
from megatron_ext.bench.mla_roofline import decode_step_cost, device_ceilings, roofline
from megatron_ext.testing.mla_dynamic_engine import TINY_MLA_SIZES
from megatron_ext.transformer.mla_prefill import MODES as MHA_FORM_MODES
from megatron_ext.utils import is_megatron_core_min_version

__all__ = [
    "ENGINE_MODELS",
    "GRAPH_SCOPES",
    "MAX_PREFILL_TOKENS",
    "STATIC_CACHE_BUDGET",
    "DynamicUnit",
    "StaticUnit",
    "build_models",
    "check_cpu",
    "engine_row",
    "graph_config",
    "main",
    "measure_config",
    "parse_args",
    "report_path",
    "server_loop_row",
    "static_batch",
    "static_cache_bytes",
    "timed_round",
]

# DeepSeek-V3's MLA widths. "dsv3_shard" keeps all 128 heads: its static cache at 256 requests of
# 192 tokens is 30 GiB (static_cache_bytes), which fits an H200 beside everything else, so no TP
# shard of the heads is needed; its depth and width are a shard of DeepSeek-V3's (61 layers,
# hidden 7168, MoE), with a dense 4 x hidden MLP.
_DSV3_HEADS = dict(kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128)
ENGINE_MODELS: Dict[str, Dict[str, Any]] = {
    "dsv3_shard": dict(
        num_layers=8,
        hidden_size=2048,
        num_attention_heads=128,
        q_lora_rank=1536,
        vocab_size=32000,
        max_sequence_length=256,
        init_method_std=0.02,
        **_DSV3_HEADS,
    ),
    "small": dict(
        num_layers=2,
        hidden_size=256,
        num_attention_heads=4,
        vocab_size=1024,
        max_sequence_length=256,
        init_method_std=0.02,
        **_DSV3_HEADS,
    ),
    # The CPU check's and the tests' model (widths the interpreter runs quickly).
    "tiny": dict(TINY_MLA_SIZES),
}
DEFAULT_MODELS = ("dsv3_shard", "small")
DEFAULT_REQUESTS = (256, 1024)
PROMPT = 128
GENERATE, QUICK_GENERATE = 64, 32
ROUNDS, QUICK_ROUNDS = 8, 3
BLOCK_SIZE_TOKENS = 64
# The static engine's decompressed cache per batch at most: 1024 dsv3_shard requests (120 GiB)
# would not fit beside the models, the dynamic engines and a prefill's activations.
STATIC_CACHE_BUDGET = 40 << 30
# A prefill step's token budget. The absorbed attention holds a query (576 wide) and an output
# (512 wide) per token and head: 272 KiB per token at dsv3_shard's 128 heads in bf16, 8.5 GiB at
# 32768 tokens. One step for all 1024 x 128 prompt tokens (34 GiB) ran out of memory on
# megatron-core 0.19.2 beside its CUDA graph pools (52 GiB at 1024 requests); serving chunks too.
MAX_PREFILL_TOKENS = 32768
# What one of megatron-core's inference CUDA graphs holds: a transformer layer (both lines), or
# the whole decoder block (0.19's inference_cuda_graph_scope="block"), which a decode step
# replays without running the layers' Python.
GRAPH_SCOPES = ("layer", "block")


def static_cache_bytes(sizes: Dict[str, Any], batch: int, tokens: int, itemsize: int = 2) -> int:
    """Bytes of megatron-core's static-batching cache for an MLA model: per layer, token and row,
    a key of ``heads x (qk + rope)`` and a value of ``heads x v`` (decompressed, per head).

    Args:
        sizes: an :data:`ENGINE_MODELS` entry.
        batch: rows.
        tokens: prompt + generated tokens per row.
        itemsize: bytes per element.

    Returns:
        int: the cache's size.
    """
    head = sizes["qk_head_dim"] + sizes["qk_pos_emb_head_dim"] + sizes["v_head_dim"]
    per_token = sizes["num_layers"] * sizes["num_attention_heads"] * head * itemsize
    return batch * tokens * per_token


def static_batch(
    sizes: Dict[str, Any], requests: int, tokens: int, budget: int = STATIC_CACHE_BUDGET
) -> int:
    """The static engine's batch: ``requests``, halved until its cache fits ``budget``.

    Args:
        sizes: an :data:`ENGINE_MODELS` entry.
        requests: concurrent requests.
        tokens: prompt + generated tokens per row.
        budget: bytes the cache may take.

    Returns:
        int: rows per static batch (at least 1).
    """
    batch = requests
    while batch > 1 and static_cache_bytes(sizes, batch, tokens) > budget:
        batch //= 2
    return batch


def build_models(
    name: str, dtype: torch.dtype, device: str, graph_scope: str = "layer"
) -> Tuple[Any, Any]:
    """The model of :data:`ENGINE_MODELS` for each path, with the same weights.

    The dynamic path's model has a latent cache (``cache_mla_latents``), both flags applied for
    its config, and on a GPU megatron-core's local CUDA graphs in its config; the static path's
    has megatron-core's static cache and the RoPE flag. Undo with ``undo_megatron_ext()``.

    Args:
        name: a key of :data:`ENGINE_MODELS`.
        dtype: parameter dtype.
        device: where the models live.
        graph_scope: what one of megatron-core's inference CUDA graphs holds on a GPU, one of
            :data:`GRAPH_SCOPES` (``block`` needs megatron-core 0.19).

    Returns:
        Tuple[GPTModel, GPTModel]: the dynamic and the static path's model, in eval mode.

    Raises:
        RuntimeError: if a parameter of one model has no counterpart in the other.
    """
    from megatron_ext import apply_megatron_ext
    from megatron_ext.testing.small_mla_gpt import build_small_mla_gpt

    sizes = ENGINE_MODELS[name]
    overrides = graph_config(graph_scope) if device == "cuda" else None
    # Static first, so that both flags are applied last, for the dynamic model's config. Its
    # weights come from the dynamic model's: skipping the initialisation halves the build
    # (seconds per 1e9 parameters on the CPU).
    static = build_small_mla_gpt(
        "on",
        dtype=dtype,
        device=device,
        config_overrides=dict(perform_initialization=False),
        **sizes,
    )
    dynamic = build_small_mla_gpt(
        "on",
        dtype=dtype,
        device=device,
        cache_mla_latents=True,
        config_overrides=overrides,
        **sizes,
    )
    apply_megatron_ext(
        mla_rope_contiguous_load=True, inference_static_active_slices=True, config=dynamic.config
    )
    missing, unexpected = static.load_state_dict(dynamic.state_dict(), strict=False)
    stray = [key for key in (*missing, *unexpected) if not key.endswith("_extra_state")]
    if stray:
        raise RuntimeError(f"the two paths' models differ in parameters {stray}")
    return dynamic, static


def graph_config(graph_scope: str) -> Dict[str, Any]:
    """The model config's fields for megatron-core's inference CUDA graphs of ``graph_scope``.

    Args:
        graph_scope: one of :data:`GRAPH_SCOPES`.

    Returns:
        Dict[str, Any]: ``cuda_graph_impl="local"``, and for ``block``
        ``inference_cuda_graph_scope="block"`` (a field megatron-core 0.16 does not have: its
        graphs are per layer).

    Raises:
        ValueError: for a scope not in :data:`GRAPH_SCOPES`, or ``block`` on megatron-core 0.16.
    """
    if graph_scope not in GRAPH_SCOPES:
        raise ValueError(f"graph_scope={graph_scope!r}: expected one of {GRAPH_SCOPES}")
    if graph_scope == "layer":
        return dict(cuda_graph_impl="local")
    if not is_megatron_core_min_version("0.19.0"):
        raise ValueError(
            "graph_scope='block' needs megatron-core 0.19 (its inference_cuda_graph_scope); "
            "0.16 captures one graph per layer"
        )
    return dict(cuda_graph_impl="local", inference_cuda_graph_scope="block")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class DynamicUnit:
    """megatron-core's dynamic engine as the benchmark steps it: a batch of greedy requests
    added at once, prefilled, then decoded one step at a time.

    Args:
        engine: a ``DynamicInferenceEngine``.
        context: its context.
        generate: tokens to generate per request.
        batch: the requests it serves at once.
    """

    def __init__(self, engine: Any, context: Any, generate: int, batch: int) -> None:
        self.engine, self.context, self.generate, self.batch = engine, context, generate, batch
        self.outputs: Dict[int, List[int]] = {}
        self._first_id = self._next_id = 0

    def start(self, prompts: Sequence[List[int]]) -> None:
        """Add one request per prompt."""
        self.outputs, self._first_id = {}, self._next_id
        for prompt in prompts:
            self.engine.add_request(self._next_id, list(prompt), self.sampling_params())
            self._next_id += 1

    def sampling_params(self) -> Any:
        """Greedy, ``generate`` tokens, no termination id."""
        from megatron.core.inference.sampling_params import SamplingParams

        return SamplingParams(num_tokens_to_generate=self.generate, termination_id=-1, top_k=1)

    def take_ids(self, count: int) -> int:
        """Reserve ``count`` request ids (for a loop the engine runs itself); the first."""
        first, self._next_id = self._next_id, self._next_id + count
        return first

    def _decode_active(self) -> int:
        """Active requests of the next step if it is a decode-only step, else 0."""
        if self.engine.waiting_request_ids or not self.context.is_decode_only():
            return 0
        return self.context.total_request_count - self.context.paused_request_count

    def _step(self) -> None:
        result = self.engine.step_modern()
        for record in result["finished_request_records"]:
            request = record.merge() if hasattr(record, "merge") else record
            tokens = [int(t) for t in request.generated_tokens]
            self.outputs[int(request.request_id) - self._first_id] = tokens

    def prefill(self) -> None:
        """Step until every request decodes (one step when the prompts fit the token budget)."""
        while self.engine.has_unfinished_requests() and self._decode_active() == 0:
            self._step()

    def decode_step(self) -> int:
        """One engine step; the tokens it decoded (0 if it was not a decode-only step)."""
        active = self._decode_active()
        self._step()
        return active

    @property
    def done(self) -> bool:
        """Whether every request has finished."""
        return not self.engine.has_unfinished_requests()

    def drain(self) -> None:
        """Step until every request has finished (after a failed round)."""
        while not self.done:
            self._step()


class StaticUnit:
    """megatron-core's static batching with the RoPE flag, stepped one forward at a time: the
    loop of :func:`megatron_ext.testing.small_mla_gpt.greedy_generate` over the first
    ``batch`` prompts.

    Args:
        model: the static path's model.
        batch: rows per generation.
        generate: tokens to generate per row.
    """

    def __init__(self, model: Any, batch: int, generate: int) -> None:
        self.model, self.batch, self.generate = model, batch, generate
        self.context: Any = None
        self.outputs: Dict[int, List[int]] = {}
        self._next = self._total = 0

    def start(self, prompts: Sequence[List[int]]) -> None:
        """Set up a generation of the first ``batch`` prompts (equal lengths)."""
        from megatron.core.inference.contexts import StaticInferenceContext

        device = next(self.model.parameters()).device
        rows = torch.tensor([list(p) for p in prompts[: self.batch]], device=device)
        batch, self._prompt = rows.shape
        self._total = self._prompt + self.generate
        # The previous generation's cache goes before this one's is allocated.
        self.context = None
        self.context = StaticInferenceContext(batch, self._total)
        self._tokens = torch.empty(batch, self._total, dtype=rows.dtype, device=device)
        self._tokens[:, : self._prompt] = rows
        self._positions = torch.arange(self._total, device=device).expand(batch, self._total)
        self._next, self.outputs = self._prompt, {}

    def _choose(self, logits: torch.Tensor) -> None:
        self._tokens[:, self._next] = logits[:, -1].float().argmax(-1)
        self.context.sequence_len_offset = self._next  # not megatron-core state: our context
        self._next += 1
        if self.done:
            generated = self._tokens[:, self._prompt :].tolist()
            self.outputs = dict(enumerate(generated))

    @torch.no_grad()
    def prefill(self) -> None:
        """The prompts' forward and the first token."""
        batch, prompt = self._tokens.shape[0], self._prompt
        causal = torch.ones(prompt, prompt, dtype=torch.bool, device=self._tokens.device).triu(1)
        logits = self.model(
            self._tokens[:, :prompt],
            self._positions[:, :prompt],
            causal.expand(batch, 1, prompt, prompt),
            inference_context=self.context,
            runtime_gather_output=True,
        )
        self._choose(logits)

    @torch.no_grad()
    def decode_step(self) -> int:
        """One token per row; the tokens decoded."""
        self.context.enable_decode_mode()
        at = self._next - 1
        logits = self.model(
            self._tokens[:, at : at + 1],
            self._positions[:, at : at + 1],
            None,
            inference_context=self.context,
            runtime_gather_output=True,
        )
        self._choose(logits)
        return self._tokens.shape[0]

    @property
    def done(self) -> bool:
        """Whether every token has been generated."""
        return self._next >= self._total

    def drain(self) -> None:
        """Decode to the end (after a failed round)."""
        while not self.done:
            self.decode_step()


def timed_round(
    units: Dict[str, Any], prompts: Sequence[List[int]], order: Sequence[str]
) -> Dict[str, Dict[str, Any]]:
    """One batch on each engine: the prefills one after the other, then the decode steps in
    alternating turns (step ``i`` of each engine in ``order``), each synchronised before and
    after.

    Args:
        units: per engine name, a :class:`DynamicUnit` or :class:`StaticUnit`.
        prompts: the round's prompts.
        order: the engines' order within a turn.

    Returns:
        Dict[str, Dict[str, Any]]: per engine, ``prefill_s``, ``steps`` (``(seconds, tokens)``
        per decode-only step) and ``other_s`` (the steps after the prefill that were not
        decode-only, which the decode figures leave out and the end-to-end figure keeps).
    """
    for name in order:
        units[name].start(prompts)
    result: Dict[str, Dict[str, Any]] = {}
    for name in order:
        _sync()
        began = time.perf_counter()
        units[name].prefill()
        _sync()
        result[name] = {"prefill_s": time.perf_counter() - began, "steps": [], "other_s": 0.0}
    while any(not units[name].done for name in order):
        for name in order:
            if units[name].done:
                continue
            _sync()
            began = time.perf_counter()
            tokens = units[name].decode_step()
            _sync()
            seconds = time.perf_counter() - began
            if tokens:
                result[name]["steps"].append((seconds, tokens))
            else:
                result[name]["other_s"] += seconds
    return result


def prefill_ms_by_form(
    unit: Any, prompts: Sequence[List[int]], modes: Sequence[str], rounds: int
) -> Dict[str, float]:
    """The batch's time to first token (its prefill, synchronised) with the MHA form's mode set
    to each of ``modes`` in turn: one discarded warm-up per mode (cuDNN plans its shapes), then
    ``rounds`` rounds alternating the modes; each batch is generated to the end before the next.

    Args:
        unit: a :class:`DynamicUnit`.
        prompts: the batch.
        modes: :data:`~megatron_ext.transformer.mla_prefill.MODES` to compare.
        rounds: timed rounds.

    Returns:
        Dict[str, float]: per mode, the median prefill in ms.
    """
    from megatron_ext.transformer.mla_prefill import mha_form_mode

    times: Dict[str, List[float]] = {mode: [] for mode in modes}
    for index in range(rounds + 1):
        for mode in modes:
            with mha_form_mode(mode):
                unit.start(prompts)
                _sync()
                began = time.perf_counter()
                unit.prefill()
                _sync()
                if index:  # the first round warms up
                    times[mode].append(time.perf_counter() - began)
                unit.drain()
    return {mode: statistics.median(seconds) * 1e3 for mode, seconds in times.items()}


def kernel_time_per_step(unit: Any, prompts: Sequence[List[int]]) -> Dict[str, Optional[float]]:
    """GPU work per decode step of one engine: its decode steps under ``torch.profiler`` (CUDA
    activity only), the durations of every kernel and copy summed.

    Args:
        unit: the engine.
        prompts: the batch's prompts.

    Returns:
        Dict[str, Optional[float]]: ``kernel_ms_per_step`` and ``kernels_per_step`` (None where
        the profiler saw no GPU work, e.g. without CUPTI).
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    unit.start(prompts)
    unit.prefill()
    _sync()
    steps = 0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        while not unit.done:
            steps += 1 if unit.decode_step() else 0
        _sync()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not events or not steps:
        return {"kernel_ms_per_step": None, "kernels_per_step": None}
    busy_us = sum(e.time_range.elapsed_us() for e in events)
    return {"kernel_ms_per_step": busy_us / steps / 1e3, "kernels_per_step": len(events) / steps}


def _dynamic_unit(model: Any, requests: int, prompt: int, generate: int, graphed: bool) -> Any:
    """A :class:`DynamicUnit` around ``model`` sized for ``requests`` of ``prompt + generate``."""
    from megatron_ext.testing.mla_dynamic_engine import build_mla_dynamic_engine

    blocks_per_request = -(-(prompt + generate) // BLOCK_SIZE_TOKENS) + 1
    cuda = torch.cuda.is_available()
    engine, context, _ = build_mla_dynamic_engine(
        model,
        max_requests=requests,
        # megatron-core pads a step's tokens to a multiple of 64; the budget must hold the padding.
        max_tokens=min(-(-requests * prompt // 64) * 64, MAX_PREFILL_TOKENS),
        max_sequence_length=model.max_sequence_length,
        block_size_tokens=BLOCK_SIZE_TOKENS,
        kv_blocks=requests * blocks_per_request + 16,
        paused_kv_blocks=16,
        # megatron-core's GPT wrapper is what a serving script uses; it needs CUDA.
        megatron_wrapper=cuda,
        num_cuda_graphs=1 if graphed else None,
    )
    return DynamicUnit(engine, context, generate, requests)


def _release_graphs() -> None:
    """megatron-core's captured graphs and their memory, before the next engines are built."""
    gc.collect()
    if torch.cuda.is_available():
        from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

        delete_cuda_graphs()
        gc.collect()
        torch.cuda.empty_cache()


def measure_config(
    model_name: str,
    requests: int,
    args: argparse.Namespace,
    models: Tuple[Any, Any],
) -> Dict[str, Any]:
    """Rows and per-round comparisons of one model and request count (see the module docstring).

    Args:
        model_name: a key of :data:`ENGINE_MODELS`.
        requests: concurrent requests.
        args: ``prompt``, ``generate``, ``rounds`` and ``engines`` (names of
            :data:`~megatron_ext.bench.mla_engine_report.ENGINES`).
        models: :func:`build_models`' pair.

    Returns:
        Dict[str, Any]: ``rows`` (one per engine; with ``args.host_profile_steps``, the
        profiled engine's row carries ``host_profile``), ``comparisons`` (per-round ratios of each
        dynamic engine over the static one, and graphed over eager) and ``dropped`` (an engine
        left out after failing its warm-up, with the error).
    """
    from megatron_ext.testing.synthetic import ensure_model_parallel

    ensure_model_parallel()
    dynamic_model, static_model = models
    sizes = ENGINE_MODELS[model_name]
    prompt, generate = args.prompt, args.generate
    if prompt + generate > sizes["max_sequence_length"]:
        raise ValueError(
            f"prompt + generate ({prompt + generate}) exceeds the model's "
            f"{sizes['max_sequence_length']} positions"
        )
    units: Dict[str, Any] = {}
    setup: Dict[str, Dict[str, Any]] = {}
    # Eager first: the graphed engine's construction captures megatron-core's graphs, last.
    for name in sorted(e for e in args.engines if e != "static"):
        began = time.perf_counter()
        units[name] = _dynamic_unit(
            dynamic_model, requests, prompt, generate, graphed=name == "dynamic-graphed"
        )
        capture = getattr(units[name].engine, "capture_stats", None)
        setup[name] = {
            "build_s": time.perf_counter() - began,
            "graph_capture_s": capture["time"] if capture else None,
            "cuda_graph_shapes": len(units[name].context.cuda_graph_batch_dimensions_list or []),
        }
    if "static" in args.engines:
        units["static"] = StaticUnit(
            static_model, static_batch(sizes, requests, prompt + generate), generate
        )
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, sizes["vocab_size"], (requests, prompt), generator=gen).tolist()
    names = list(units)
    dropped = {}
    try:
        timed_round(units, prompts, names)  # warm-up, discarded
    except Exception:  # noqa: BLE001 - the eager engine is optional; the others go on without it
        if "dynamic-eager" not in units:
            raise
        dropped["dynamic-eager"] = traceback.format_exc()
        print(f"dynamic-eager failed its warm-up and is left out:\n{dropped['dynamic-eager']}")
        for unit in units.values():
            unit.drain()
        del units["dynamic-eager"]
        names = list(units)
        timed_round(units, prompts, names)
    turns: List[Dict[str, Dict[str, Any]]] = []
    for index in range(args.rounds):
        shift = index % len(names)
        turns.append(timed_round(units, prompts, names[shift:] + names[:shift]))
    kernels = {}
    if torch.cuda.is_available():
        kernels = {name: kernel_time_per_step(unit, prompts) for name, unit in units.items()}
    forms = {}
    if getattr(args, "prefill_forms", None):
        forms = {
            name: prefill_ms_by_form(unit, prompts, args.prefill_forms, min(args.rounds, 3))
            for name, unit in units.items()
            if name != "static"
        }
    rows = [
        engine_row(model_name, requests, name, unit.batch, turns, args, kernels.get(name, {}))
        for name, unit in units.items()
    ]
    for row in rows:
        row.update(setup.get(row["engine"], {}))
        unit = units[row["engine"]]
        row["context_class"] = type(getattr(unit, "context", None)).__name__
        row["controller_class"] = (
            type(unit.engine.controller).__name__ if row["engine"] != "static" else None
        )
        if row["engine"] == "dynamic-graphed":
            row["graph_scope"] = getattr(args, "graph_scope", "layer")
        if row["engine"] in forms:
            row["prefill_ms_by_form"] = forms[row["engine"]]
    pairs = [(name, "static") for name in units if name != "static"] if "static" in units else []
    if {"dynamic-graphed", "dynamic-eager"} <= set(units):
        pairs.append(("dynamic-graphed", "dynamic-eager"))
    comparisons = [
        {
            "model": model_name,
            "requests": requests,
            **report_lib.engine_comparison(turns, candidate, baseline),
        }
        for candidate, baseline in pairs
    ]
    profiles, server = [], []
    profiled = "dynamic-graphed" if "dynamic-graphed" in units else None
    if getattr(args, "profile_steps", 0) and profiled and torch.cuda.is_available():
        from megatron_ext.bench.mla_engine_profile import profile_decode_steps

        breakdown = profile_decode_steps(units[profiled], prompts, args.profile_steps)
        profiles.append({"model": model_name, "requests": requests, "engine": profiled})
        profiles[-1]["breakdown"] = breakdown
    if getattr(args, "profile_prefill", False) and profiled and torch.cuda.is_available():
        from megatron_ext.bench.mla_engine_profile import profile_prefill
        from megatron_ext.transformer.mla_prefill import MODE, mha_form_mode

        for mode in getattr(args, "prefill_forms", None) or [MODE]:
            with mha_form_mode(mode):
                breakdown = profile_prefill(units[profiled], prompts)
            profiles.append({"model": model_name, "requests": requests, "engine": profiled})
            profiles[-1].update(step=f"prefill (MHA form {mode})", breakdown=breakdown)
    # The graphed engine's; the eager one's where there is none (a run without a GPU: the tests).
    hosted = profiled or ("dynamic-eager" if "dynamic-eager" in units else None)
    if getattr(args, "host_profile_steps", 0) and hosted:
        host = profile_host_decode_steps(units[hosted], prompts, args.host_profile_steps, _sync)
        next(row for row in rows if row["engine"] == hosted)["host_profile"] = host
    if getattr(args, "server_loop", False):
        server = [
            server_loop_row(model_name, name, units[name], prompts, args, turns)
            for name in units
            if name != "static"
        ]
    return {
        "rows": rows,
        "comparisons": comparisons,
        "dropped": dropped,
        "profiles": profiles,
        "server_loop": server,
    }


def engine_row(
    model_name: str,
    requests: int,
    name: str,
    batch: int,
    turns: Sequence[Dict[str, Dict[str, Any]]],
    args: argparse.Namespace,
    kernels: Dict[str, Optional[float]],
) -> Dict[str, Any]:
    """One engine's row: its decode figures (:func:`~megatron_ext.bench.mla_engine_report.
    engine_summary`), host share and, where ``args.ceilings`` holds the device's measured rates
    and the engine serves from the latent cache, its roofline.

    Args:
        model_name: a key of :data:`ENGINE_MODELS`.
        requests: concurrent requests.
        name: the engine.
        batch: rows it serves at once.
        turns: the timed rounds.
        args: ``prompt``, ``generate``, ``rounds`` and optionally ``ceilings``.
        kernels: :func:`kernel_time_per_step`'s result, or empty.

    Returns:
        Dict[str, Any]: the row.
    """
    sizes = ENGINE_MODELS[model_name]
    prompt, generate = args.prompt, args.generate
    summary = report_lib.engine_summary(turns, name)
    step_s = summary["decode_step_ms"] / 1e3
    kernel = kernels.get("kernel_ms_per_step")
    row = {
        "model": model_name,
        "requests": requests,
        "engine": name,
        "batch": batch,
        "prompt": prompt,
        "generate": generate,
        "rounds": args.rounds,
        **summary,
        "prefill_ms": statistics.median(t[name]["prefill_s"] for t in turns) * 1e3,
        # Generated tokens over everything the round took: prefill, decode-only steps and the
        # steps between that were neither (the server-loop rows' stepped counterpart).
        "end_to_end_tokens_per_s": len(turns)
        * batch
        * generate
        / sum(
            t[name]["prefill_s"] + t[name].get("other_s", 0.0) + sum(s for s, _ in t[name]["steps"])
            for t in turns
        ),
        "kernel_ms_per_step": kernel,
        "kernels_per_step": kernels.get("kernels_per_step"),
        "host_share": report_lib.host_share(step_s, None if kernel is None else kernel / 1e3),
        "static_cache_gib": (
            static_cache_bytes(sizes, batch, prompt + generate) / 2**30
            if name == "static"
            else None
        ),
        "roofline": None,
    }
    ceilings = getattr(args, "ceilings", None)
    if ceilings and name != "static":
        # The mean decode step: its mean tokens, each attending to the mean context of the
        # round's decode steps (step i attends to prompt + i rows; cost is linear in them).
        tokens = max(1, round(summary["tokens_per_step"]))
        cost = decode_step_cost(sizes, [prompt + generate // 2] * tokens)
        row["roofline"] = roofline(
            cost,
            step_s,
            ceilings["copy"]["tb_per_s"] * 1e12,
            ceilings["matmul"]["tflops"] * 1e12,
        )
    return row


def server_loop_row(
    model_name: str,
    name: str,
    unit: Any,
    prompts: Sequence[List[int]],
    args: argparse.Namespace,
    turns: Sequence[Dict[str, Dict[str, Any]]],
) -> Dict[str, Any]:
    """One dynamic engine in the server-loop mode (:mod:`megatron_ext.bench.mla_engine_server`):
    ``args.rounds`` loops to completion, pooled, and one more under the profiler on a GPU.

    Args:
        model_name: a key of :data:`ENGINE_MODELS`.
        name: the engine.
        unit: its :class:`DynamicUnit` (idle).
        prompts: the batch's prompts.
        args: ``rounds``.
        turns: the timed rounds (for the stepped end-to-end figure beside it).

    Returns:
        Dict[str, Any]: ``model``, ``requests``, ``engine``, ``entry``, ``tokens_per_s``
        (generated tokens over wall time, summed over the loops), ``loops_tokens_per_s``,
        ``host_share``, ``gpu_ms`` and ``stepped_tokens_per_s`` (the timed rounds' end to end).
    """
    from megatron_ext.bench.mla_engine_server import time_server_loop

    params = unit.sampling_params()
    loops = []
    for index in range(args.rounds):
        profile = _gpu_seconds if index == args.rounds - 1 and torch.cuda.is_available() else None
        first = unit.take_ids(2 * len(prompts))
        loops.append(time_server_loop(unit.engine, prompts, params, first, _sync, profile))
    tokens, seconds = sum(r["tokens"] for r in loops), sum(r["seconds"] for r in loops)
    stepped = engine_row(model_name, len(prompts), name, unit.batch, turns, args, {})
    return {
        "model": model_name,
        "requests": len(prompts),
        "engine": name,
        "entry": loops[0]["entry"],
        "tokens_per_s": tokens / seconds,
        "loops_tokens_per_s": [r["tokens_per_s"] for r in loops],
        "host_share": loops[-1]["host_share"],
        "gpu_ms": None if loops[-1]["gpu_s"] is None else loops[-1]["gpu_s"] * 1e3,
        "stepped_tokens_per_s": stepped["end_to_end_tokens_per_s"],
    }


def _gpu_seconds(run: Any) -> float:
    """GPU time (every kernel's and copy's duration summed) of ``run()`` under the profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        _sync()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in events) / 1e6


def check_cpu() -> Dict[str, Any]:
    """The no-GPU check: on the tiny model (fp32), the dynamic engine with both flags and the
    static path generate the same greedy tokens.

    Returns:
        Dict[str, Any]: ``identical_tokens``, ``requests``, ``generate`` and both engines'
        tokens per request.
    """
    from megatron_ext import undo_megatron_ext
    from megatron_ext.testing.synthetic import cpu_torch_compat, ensure_model_parallel

    requests, prompt, generate = 4, 6, 5
    with cpu_torch_compat():
        ensure_model_parallel()
        try:
            dynamic_model, static_model = build_models("tiny", torch.float32, "cpu")
            units = {
                "dynamic-eager": _dynamic_unit(dynamic_model, requests, prompt, generate, False),
                "static": StaticUnit(static_model, requests, generate),
            }
            gen = torch.Generator().manual_seed(0)
            vocab = ENGINE_MODELS["tiny"]["vocab_size"]
            prompts = torch.randint(0, vocab, (requests, prompt), generator=gen).tolist()
            timed_round(units, prompts, list(units))
        finally:
            undo_megatron_ext()
    tokens = {name: [unit.outputs.get(i) for i in range(requests)] for name, unit in units.items()}
    return {
        "identical_tokens": tokens["dynamic-eager"] == tokens["static"],
        "requests": requests,
        "generate": generate,
        "tokens": tokens,
    }


_EPILOG = """\
table columns: decode tok/s is an engine's decode tokens over its decode time, both summed over
the timed rounds (min-max: the rounds' own figures); step ms is the decode time over the decode
steps and tok/step the tokens over the steps, so tok/s = tok/step / step; vs static and vs eager
are the ratio of two rows' decode tok/s, with a 95% bootstrap interval over the rounds (the
verdicts quote the same ratio). kernels ms: the profiled GPU time per step; host share:
1 - kernels / step. bound ms: the step's roofline, max(bytes / copy bandwidth, FLOPs / matmul
rate) with both rates measured in this run (a large device copy, a large bf16 torch.mm) and the
bytes and FLOPs of megatron_ext.bench.mla_roofline's model (weights read once, each request's
latent cache rows once per attention head-tile pass, GEMM inputs and outputs); of bound: bound /
step ms. Dynamic (latent-cache) rows only.
"""


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_ext.bench mla-engine",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default=None, help="directory for mla_engine.json")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_ROUNDS} rounds of {QUICK_GENERATE} generated tokens (default {ROUNDS} of "
        f"{GENERATE})",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        default=list(DEFAULT_MODELS),
        choices=sorted(ENGINE_MODELS),
        help=f"models (default: {' '.join(DEFAULT_MODELS)})",
    )
    parser.add_argument(
        "--requests",
        type=int,
        nargs="+",
        default=list(DEFAULT_REQUESTS),
        help=f"concurrent requests (default: {' '.join(map(str, DEFAULT_REQUESTS))})",
    )
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per configuration")
    parser.add_argument(
        "--prompt", type=int, default=PROMPT, help=f"prompt tokens (default {PROMPT})"
    )
    parser.add_argument("--generate", type=int, default=None, help="generated tokens per request")
    parser.add_argument(
        "--no-eager", action="store_true", help="leave out the dynamic engine without CUDA graphs"
    )
    parser.add_argument(
        "--no-static",
        action="store_true",
        help="leave out megatron-core's static engine (the decode comparisons' baseline): its "
        "decompressed cache and full-batch prefill need memory that, beside 1024 dynamic "
        "requests of dsv3_shard, an 80 GB GPU does not have",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        metavar="N",
        help="after the timed rounds, run N decode steps of the graphed engine (at most one "
        "batch's) under torch.profiler and print the top kernels: time per step, calls per step, "
        "share of the GPU time, and the step's GPU time against its wall time (host share)",
    )
    parser.add_argument(
        "--profile-prefill",
        action="store_true",
        help="after the timed rounds, run one prefill of the graphed engine's batch (its time to "
        "first token) under torch.profiler per --prefill-forms mode (else in the environment's "
        "mode) and print the top kernels, the prefill's GPU time against its wall time",
    )
    parser.add_argument(
        "--host-profile-steps",
        type=int,
        default=0,
        metavar="N",
        help="after the timed rounds, run N decode steps of the graphed engine (at most one "
        "batch's) under cProfile and print where the host time goes: self time per step per "
        "owner (megatron_ext, megatron.core, torch, triton, python/other), the waits on the GPU "
        "(.item(), synchronize) apart, the top functions by self time and megatron_ext's by "
        "cumulative time",
    )
    parser.add_argument(
        "--server-loop",
        action="store_true",
        help="also run each dynamic engine as a server does: every request added, then "
        "megatron-core's own loop (DynamicInferenceEngine.run_engine, else generate()) to "
        "completion, not stepped; generated tokens/s end to end (prefill included) per --rounds "
        "loops, the host share from one loop under torch.profiler, beside the stepped rounds' "
        "end-to-end figure",
    )
    parser.add_argument(
        "--prefill-forms",
        nargs="+",
        choices=MHA_FORM_MODES,
        default=None,
        metavar="MODE",
        help="after the timed rounds, time each dynamic engine's prefill of the batch (its time "
        "to first token) with the MHA form's mode set to each MODE in turn (off, auto, force), "
        "in the same process; without it the prefill runs in the mode the environment sets "
        "(MEGATRON_EXT_MLA_MHA_FORM)",
    )
    parser.add_argument(
        "--graph-scope",
        choices=GRAPH_SCOPES,
        default="layer",
        help="what one of megatron-core's CUDA graphs holds in the graphed engine: a layer "
        "(default; both megatron-core lines) or the whole decoder block (megatron-core 0.19's "
        "inference_cuda_graph_scope='block': a decode step replays one graph instead of one per "
        "layer)",
    )
    args = parser.parse_args(argv)
    try:
        graph_config(args.graph_scope)  # a scope the installed megatron-core has
    except ValueError as error:
        parser.error(f"--graph-scope {args.graph_scope}: {error}")
    if args.rounds is None:
        args.rounds = QUICK_ROUNDS if args.quick else ROUNDS
    if args.generate is None:
        args.generate = QUICK_GENERATE if args.quick else GENERATE
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (an interval needs two rounds)")
    if args.prompt < 1 or args.generate < 2:
        parser.error("--prompt must be >= 1 and --generate >= 2 (one decode step at least)")
    if any(r < 1 for r in args.requests):
        parser.error("--requests values must be >= 1")
    if args.profile_steps < 0:
        parser.error("--profile-steps must be >= 0")
    if args.host_profile_steps < 0:
        parser.error("--host-profile-steps must be >= 0")
    left_out = {"dynamic-eager"} if args.no_eager else set()
    left_out |= {"static"} if args.no_static else set()
    args.engines = [e for e in report_lib.ENGINES if e not in left_out]
    return args


def report_path(args: argparse.Namespace) -> str:
    """Where the run's JSON goes (``--out`` made if missing): ``mla_engine.json``, with the graph
    scope in the name when it is not the default, so that a run per scope keeps both reports.

    Args:
        args: :func:`parse_args`' namespace, with ``out`` set.

    Returns:
        str: the file's path.
    """
    os.makedirs(args.out, exist_ok=True)
    suffix = "" if args.graph_scope == "layer" else f"_{args.graph_scope}"
    return os.path.join(args.out, f"mla_engine{suffix}.json")


def bench_gpu(args: argparse.Namespace) -> int:
    """Every configuration, then the verdicts and the table; the JSON to ``args.out``.

    Args:
        args: :func:`parse_args`' namespace.

    Returns:
        int: 0, or 1 if a configuration failed.
    """
    from megatron.core import package_info

    from megatron_ext import undo_megatron_ext
    from megatron_ext.testing.synthetic import ensure_model_parallel
    from megatron_ext.transformer import mla_prefill

    ensure_model_parallel()
    report: Dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "megatron_core": package_info.__version__,
        "torch": torch.__version__,
        "graph_scope": args.graph_scope,
        # Which form the prefill steps (prefill ms: the batch's time to first token) ran in.
        "mha_form": {
            "mode": mla_prefill.MODE,
            "backend": mla_prefill.backend_for(
                torch.device("cuda"), torch.bfloat16, mla_prefill.MODE
            ),
        },
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": [],
        "comparisons": [],
        "failed": [],
        "dropped": [],
        "profiles": [],
        "server_loop": [],
    }
    # The roofline's rates, measured once in this run, before the models take the memory.
    args = argparse.Namespace(**vars(args), ceilings=device_ceilings(args.quick))
    report["ceilings"] = args.ceilings
    # megatron-core's CUDA graphs accept only its inference RNG tracker; this process keeps it (as
    # an inference script does).
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    for model_name in args.models:
        try:
            began = time.perf_counter()
            models = build_models(model_name, torch.bfloat16, "cuda", args.graph_scope)
            print(f"{model_name}: models built in {time.perf_counter() - began:.0f} s")
        except Exception:  # noqa: BLE001 - reported; the other models still run
            report["failed"].append({"model": model_name, "error": traceback.format_exc()})
            print(f"FAILED building {model_name}:\n{report['failed'][-1]['error']}")
            continue
        for requests in args.requests:
            began = time.perf_counter()
            try:
                result = measure_config(model_name, requests, args, models)
            except Exception:  # noqa: BLE001 - reported; the other configurations still run
                error = traceback.format_exc()
                report["failed"].append({"model": model_name, "requests": requests})
                report["failed"][-1]["error"] = error
                print(f"FAILED {model_name} at {requests} requests:\n{error}", flush=True)
                _release_graphs()
                continue
            for key in ("rows", "comparisons", "profiles", "server_loop"):
                report[key] += result[key]
            report["dropped"] += [
                {"model": model_name, "requests": requests, "engine": name, "error": error}
                for name, error in result["dropped"].items()
            ]
            rates = ", ".join(
                f"{row['engine']} {row['decode_tokens_per_s']:.0f}" for row in result["rows"]
            )
            print(
                f"{model_name} at {requests} requests done in "
                f"{time.perf_counter() - began:.0f} s: decode tokens/s {rates}",
                flush=True,
            )
            _release_graphs()
        del models
        undo_megatron_ext()
        _release_graphs()
    if args.out:
        with open(report_path(args), "w") as f:
            json.dump(report, f, indent=2)
    # The suite's summary (scripts/run_gpu_suite.sh) prints what follows this header.
    print("=== table: MLA decode through the engines (bf16)")
    print(f"graphed engine: megatron-core's CUDA graphs, one per {args.graph_scope}")
    form = report["mha_form"]
    print(
        f"prefill attention: MHA form {form['mode']} (backend {form['backend']}; environment "
        "MEGATRON_EXT_MLA_MHA_FORM=off|auto|force: run once per mode to compare prefill ms)"
    )
    for failure in report["failed"]:
        print(f"FAILED: {failure['model']} {failure.get('requests', '(build)')}")
    for line in report_lib.verdicts(report):
        print(line)
    print(report_lib.table(report))
    for row in report["rows"]:
        if row.get("prefill_ms_by_form"):
            forms = ", ".join(f"{m} {ms:.1f} ms" for m, ms in row["prefill_ms_by_form"].items())
            print(
                f"time to first token ({row['model']}, {row['requests']} prompts of "
                f"{row['prompt']} tokens, {row['engine']}), per MHA-form mode: {forms}"
            )
    for entry in report["profiles"]:
        title = f"{entry['model']}, {entry['requests']} requests, {entry['engine']}"
        step = entry.get("step", "decode step")
        if entry["breakdown"].get("steps"):
            print("\n".join(breakdown_lines(title, entry["breakdown"], step=step)))
        else:
            print(f"kernels per {step} ({title}): the profiler saw no GPU work")
    for row in report["rows"]:
        if "host_profile" in row:
            title = f"{row['model']}, {row['requests']} requests, {row['engine']}"
            lines = host_profile_lines(title, row["host_profile"], row["decode_step_ms"])
            print("\n".join(lines))
    return 1 if report["failed"] else 0


def main(argv: Optional[List[str]] = None) -> int:
    """Run the benchmark (on a GPU) or the correctness check (without one).

    Args:
        argv: command-line arguments (see ``--help``).

    Returns:
        int: 0 on success; 1 if a configuration failed or the CPU check found different tokens.
    """
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "mla-engine benchmark: no CUDA GPU. This is a correctness check, not a benchmark: no "
            "timing or speedup is reported. The dynamic engine (both flags) and the static path "
            "generate greedily on a tiny MLA model (fp32, Triton interpreter)."
        )
        result = check_cpu()
        if args.out:
            with open(report_path(args), "w") as f:
                json.dump({"cuda": False, "cpu_check": result}, f, indent=2)
        verdict = "the same" if result["identical_tokens"] else "DIFFERENT"
        print(
            f"dynamic vs static engine, {result['requests']} requests x {result['generate']} "
            f"greedy tokens: {verdict} tokens"
        )
        return 0 if result["identical_tokens"] else 1
    return bench_gpu(args)


if __name__ == "__main__":
    raise SystemExit(main())
