# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Benchmark: per-step bookkeeping of dynamic inference, megatron-core vs static active slices,
and decode throughput through megatron-core's engine.

    python -m megatron_ext.bench inference [--out DIR] [--quick] [--max-requests 256 1024]
        [--sampling greedy top_k] [--engine-requests 256 1024]

Bookkeeping rows: each configuration fills a dynamic inference context with ``max_requests``
decoding requests and runs decode steps through the controller's real step method, with a
synthetic model in place of the network (``megatron_ext.testing.synthetic``). Per step it
measures, with the model forward and megatron-core's ``update_requests`` (the same code in every
variant) timed separately:

* ``bookkeeping``: context initialisation plus sampling bookkeeping, i.e. everything in the step
  except the forward and ``update_requests``: host (wall) time and GPU time (CUDA events);
* ``region``: host time of the sampling region (graph replay, or the eager kernels);
* the number of device-to-host synchronisations per step, counted with
  ``torch.cuda.set_sync_debug_mode`` in a separate, untimed pass.

Variants: ``stock`` (megatron-core's context and controller), ``ext-eager`` (this package's,
region not graphed: on 0.16 the region runs eagerly; on 0.19 the step samples with
megatron-core's own sampler, so it has no region time) and ``ext-graphed`` (region replayed
from a CUDA graph). The variants of a
configuration are measured interleaved in one process: after the warm-up, ``--repeats`` rounds
of ``--steps`` steps per variant, the variants stepping in turn, one step each (the order rotating
from step to step). Each row reports the median of its per-round medians and their min-max. A
speedup pairs step ``i`` of stock with step ``i`` of the variant (run back to back): a round's
ratio is the median of its paired bookkeeping-time ratios, and the speedup is the geometric mean
of the rounds' ratios with its 95% bootstrap interval (:mod:`megatron_ext.bench.stats`).

Engine rows: megatron-core's ``DynamicInferenceEngine`` with the small GPT of the inference
functional case (``megatron_ext.testing.small_gpt``; plain-torch paged-KV attention, since
flash-attn is not required), ``N`` concurrent greedy requests, extension off and on: decode
tokens per second (median decode step of a batch), off and on alternating for
``--engine-repeats`` rounds after one discarded warm-up batch each. The off/on ratio is the
geometric mean of the paired per-round ratios, with its 95% bootstrap interval
(:mod:`megatron_ext.bench.stats`); the summary says whether the interval's half-width is within
3%.

Static MLA rows (:mod:`megatron_ext.bench.static_inference`): greedy generation of a small MLA
GPT under megatron-core's static-batching inference, the MLA RoPE flag off and on: prefill and
per-token decode time.

Without a GPU the run is a correctness check, not a benchmark: extension and megatron-core must
generate the same tokens through megatron-core's engine, and the bookkeeping configurations run
(with the ``--max-requests`` and ``--sampling`` given) to check that they work; no timing or
speedup is printed.
"""

import argparse
import itertools
import json
import os
import statistics
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_ext.bench.static_inference import SIZES, run_static_mla, static_mla_table
from megatron_ext.bench.stats import ratio_interval, step_paired_ratio

VARIANTS = ("stock", "ext-eager", "ext-graphed")

# The engine rows' GPT models (megatron-core's local layer spec, plain-torch paged attention).
# "small" is host-bound: the per-step bookkeeping is a large share of a decode step. "1b" (about
# 1.0e9 parameters, 20 layers) is the case where the forward pass dominates.
ENGINE_MODELS: Dict[str, Dict[str, int]] = {
    "small": dict(
        num_layers=2,
        hidden_size=128,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=512,
        vocab_size=2048,
    ),
    "1b": dict(
        num_layers=20,
        hidden_size=2048,
        num_attention_heads=16,
        num_query_groups=8,
        ffn_hidden_size=8192,
        vocab_size=32000,
    ),
}

# Sampling parameters of the engine rows' requests: megatron-core's greedy rule, or top-k.
ENGINE_SAMPLING: Dict[str, Dict[str, Any]] = {
    "greedy": dict(top_k=1),
    "top_k": dict(top_k=20, temperature=0.8),
}


def engine_model_parameters(name: str) -> int:
    """Parameters of an engine-row model (untied embeddings, plain MLP, grouped-query attention).

    Args:
        name (str): a key of :data:`ENGINE_MODELS`.

    Returns:
        int: the parameter count, biases and norms included.
    """
    m = ENGINE_MODELS[name]
    h, f, layers, vocab = m["hidden_size"], m["ffn_hidden_size"], m["num_layers"], m["vocab_size"]
    kv = h // m["num_attention_heads"] * m["num_query_groups"]
    attention = h * (h + 2 * kv) + (h + 2 * kv) + h * h + h
    mlp = 2 * h * f + f + h
    norms = 4 * h
    return layers * (attention + mlp + norms) + 2 * vocab * h + 2 * h


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megatron_ext.bench inference")
    parser.add_argument("--out", default=None, help="directory for bench_inference.json")
    parser.add_argument("--quick", action="store_true", help="fewer steps, greedy only")
    parser.add_argument(
        "--max-requests",
        type=int,
        nargs="*",
        default=None,
        help="decoding requests per bookkeeping configuration (default: 256 1024 on a GPU, 32 on "
        "the CPU correctness check; give no value to skip the bookkeeping rows)",
    )
    parser.add_argument("--vocab-size", type=int, default=None, help="default 32000 (GPU), 1024")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed decode steps per variant per round (default 15 on a GPU, 2 on the CPU check)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="interleaved rounds per configuration (default 7 on a GPU, 2 on the CPU check)",
    )
    parser.add_argument("--warmup", type=int, default=None, help="untimed decode steps first")
    parser.add_argument(
        "--engine-repeats",
        type=int,
        default=None,
        help="interleaved off/on rounds of the engine rows (default 12; 4 with --quick); the "
        "ratio's 95%% interval narrows with more",
    )
    parser.add_argument(
        "--sampling",
        nargs="+",
        default=None,
        choices=["greedy", "top_k"],
        help="request sampling parameters (default: greedy and top_k; greedy with --quick or "
        "on the CPU correctness check)",
    )
    parser.add_argument(
        "--engine-requests",
        type=int,
        nargs="*",
        default=None,
        help="concurrent requests of the engine rows (default: 256 1024 on a GPU; none on CPU; "
        "give no value to skip them)",
    )
    parser.add_argument(
        "--engine-models",
        nargs="+",
        default=None,
        choices=sorted(ENGINE_MODELS),
        help="models of the engine rows (default: small 1b; small with --quick)",
    )
    parser.add_argument(
        "--engine-schedules",
        nargs="+",
        default=None,
        choices=["legacy", "async"],
        help="megatron-core 0.19's async_sched_mode of the engine rows (default: legacy and async "
        "on 0.19; 0.16 has legacy only)",
    )
    parser.add_argument(
        "--engine-control",
        action="store_true",
        help="also run every engine configuration with both engines megatron-core's own (an A/A "
        "control): its interval is the noise floor of the method at that configuration",
    )
    parser.add_argument(
        "--static-mla-batches",
        type=int,
        nargs="*",
        default=None,
        help="batch sizes of the static-batching MLA generation section, RoPE flag off/on "
        "(default: 1 16 on a GPU; none on CPU; give no value to skip it)",
    )
    args = parser.parse_args(argv)
    for name in ("steps", "repeats", "engine_repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup is not None and args.warmup < 0:
        parser.error("--warmup must be >= 0")
    for name in ("max_requests", "engine_requests", "static_mla_batches"):
        values = getattr(args, name) or []
        if any(v < 1 for v in values):
            parser.error(f"--{name.replace('_', '-')} values must be >= 1")
    return args


class _StepProbe:
    """Wraps the pieces of a controller step to time and count them."""

    def __init__(self, controller: Any, cuda: bool) -> None:
        self.controller = controller
        self.context = controller.inference_wrapped_model.inference_context
        self.cuda = cuda
        self.marks: Dict[str, float] = {}
        self.events: Dict[str, Any] = {}
        self.sync_log: Optional[List[Any]] = None
        self.sync_marks: Dict[str, int] = {}
        self._wrap(controller, "_dynamic_step_forward_logits", "forward")
        self._wrap(self.context, "update_requests", "update")
        if hasattr(controller, "graph_safe_step"):
            self._wrap(controller, "run_graph_safe_step", "region")
            self._wrap(controller, "_capture", "capture")

    def _mark(self, name: str) -> None:
        self.marks[name] = time.perf_counter()
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events[name] = event
        if self.sync_log is not None:
            self.sync_marks[name] = len(self.sync_log)

    def _wrap(self, owner: Any, attr: str, label: str) -> None:
        original = getattr(owner, attr)

        def wrapped(*args: Any, **kwargs: Any):
            self._mark(f"{label}_start")
            try:
                return original(*args, **kwargs)
            finally:
                self._mark(f"{label}_end")

        setattr(owner, attr, wrapped)

    def run_step(self) -> Dict[str, float]:
        """One controller step; host and GPU milliseconds of its parts."""
        self.marks, self.events, self.sync_marks = {}, {}, {}
        self._mark("start")
        result = self.controller.generate_output_tokens_dynamic_batch()
        self._mark("end")
        if result is None:
            raise RuntimeError("the benchmark context ran out of active requests")
        m = self.marks
        host = {
            "step_host_ms": (m["end"] - m["start"]) * 1e3,
            "forward_host_ms": (m["forward_end"] - m["forward_start"]) * 1e3,
            "update_host_ms": (m["update_end"] - m["update_start"]) * 1e3,
        }
        host["bookkeeping_host_ms"] = (
            host["step_host_ms"] - host["forward_host_ms"] - host["update_host_ms"]
        )
        if "region_start" in m:
            host["region_host_ms"] = (m["region_end"] - m["region_start"]) * 1e3
        if self.cuda:
            torch.cuda.synchronize()
            e = self.events

            def gap(a: str, b: str) -> float:
                return e[a].elapsed_time(e[b])

            host["bookkeeping_gpu_ms"] = gap("start", "forward_start") + gap(
                "forward_end", "update_start"
            )
            host["update_gpu_ms"] = gap("update_start", "update_end")
        return host

    def count_syncs(self) -> Dict[str, int]:
        """One step under sync debug mode; synchronisations per part of the step."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.sync_log = caught
            torch.cuda.set_sync_debug_mode("warn")
            try:
                self.run_step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
                self.sync_log = None
        syncs = [i for i, w in enumerate(caught) if "synchroniz" in str(w.message)]
        marks = self.sync_marks

        def between(a: str, b: str) -> int:
            if a not in marks or b not in marks:
                return 0
            return sum(marks[a] <= i < marks[b] for i in syncs)

        update = between("update_start", "update_end")
        forward = between("forward_start", "forward_end")
        region = between("region_start", "region_end")
        return {
            "syncs_total": len(syncs),
            "syncs_update_requests": update,
            "syncs_forward": forward,
            "syncs_region": region,
            "syncs_bookkeeping": between("start", "end") - update - forward,
        }


def _fill_decode(stack: Any, max_requests: int, steps: int, sampling: str, seed: int) -> None:
    """Add max_requests requests and run their prefill, leaving every one decoding."""
    from megatron.core.inference.inference_request import DynamicInferenceRequest
    from megatron.core.inference.sampling_params import SamplingParams

    context = stack.context
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(seed)
    params = dict(num_tokens_to_generate=steps + 64, termination_id=-1)
    params.update(dict(top_k=1) if sampling == "greedy" else dict(top_k=50, temperature=0.8))
    for request_id in range(max_requests):
        prompt = torch.randint(0, stack.logits_fn.vocab_size - 1, (4,), generator=gen).to(device)
        context.add_request(
            DynamicInferenceRequest(
                request_id=request_id,
                prompt_tokens=prompt,
                sampling_params=SamplingParams(**params),
            )
        )
    stack.controller.generate_output_tokens_dynamic_batch()  # the prefill step
    if context.get_active_request_count() != max_requests or not context.is_decode_only():
        raise RuntimeError("benchmark set-up did not reach an all-decode batch")


def _build_variant(
    variant: str, max_requests: int, sampling: str, args: argparse.Namespace, cuda: bool
) -> Tuple[Any, "_StepProbe"]:
    """A filled, all-decode stack for one variant, with its step probe."""
    from megatron_ext.testing.synthetic import build_synthetic_stack

    extension = variant != "stock"
    controller_kwargs = dict(cuda_graph_sampling=variant == "ext-graphed") if extension else None
    block = 64
    steps = args.warmup + args.repeats * args.block_steps + 2
    blocks_per_request = (4 + steps + 8) // block + 2
    stack = build_synthetic_stack(
        extension=extension,
        max_requests=max_requests,
        # Room for the all-prefill set-up step (4 prompt tokens per request).
        max_tokens=4 * max_requests // 64 * 64 + 128,
        max_sequence_length=4 + steps + 128,
        block_size_tokens=block,
        num_blocks=max_requests * blocks_per_request + 8,
        vocab_size=args.vocab_size,
        params_dtype=torch.bfloat16 if cuda else torch.float32,
        controller_kwargs=controller_kwargs,
    )
    _fill_decode(stack, max_requests, steps, sampling, seed=0)
    return stack, _StepProbe(stack.controller, cuda)


def _spread(values: List[float]) -> Dict[str, float]:
    """Median, min, max and interquartile range of per-block values."""
    ordered = sorted(values)
    if len(ordered) >= 4:
        q1, _, q3 = statistics.quantiles(ordered, n=4)
    else:
        q1, q3 = ordered[0], ordered[-1]
    return {
        "median": statistics.median(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "q1": q1,
        "q3": q3,
    }


def _run_config(
    max_requests: int,
    sampling: str,
    args: argparse.Namespace,
    cuda: bool,
    variants: Tuple[str, ...],
) -> List[Dict[str, Any]]:
    """All variants of one configuration, measured interleaved in one process.

    Every variant gets its own stack, filled before any timing. Warm-up steps are discarded;
    then ``repeats`` rounds of ``block_steps`` steps per variant, the variants stepping in turn
    one step each (the order rotating from step to step), so that a slow phase of the machine
    (clocks, other tenants) covers the steps of every variant alike. Each row keeps the median
    of every round; its figures are the median of those, with their min, max and interquartile
    range. Each non-stock row also keeps, per round, the median over the steps of stock's
    bookkeeping time over its own at the same step (``bookkeeping_paired_ratio_rounds``).
    """
    probes = {v: _build_variant(v, max_requests, sampling, args, cuda)[1] for v in variants}
    for _ in range(args.warmup):
        for variant in variants:
            probes[variant].run_step()
    blocks: Dict[str, List[Dict[str, float]]] = {v: [] for v in variants}
    paired: Dict[str, List[float]] = {v: [] for v in variants if v != "stock"}
    turn = 0
    for _ in range(args.repeats):
        samples: Dict[str, List[Dict[str, float]]] = {v: [] for v in variants}
        for _ in range(args.block_steps):
            shift = turn % len(variants)
            turn += 1
            for variant in variants[shift:] + variants[:shift]:
                samples[variant].append(probes[variant].run_step())
        for variant in variants:
            steps = samples[variant]
            blocks[variant].append(
                {key: statistics.median(s[key] for s in steps) for key in steps[0]}
            )
        if "stock" in samples:
            for variant in paired:
                paired[variant].append(
                    step_paired_ratio(
                        [(s["bookkeeping_host_ms"], i) for i, s in enumerate(samples["stock"])],
                        [(s["bookkeeping_host_ms"], i) for i, s in enumerate(samples[variant])],
                    )["ratio"]
                )
    rows = []
    for variant in variants:
        row: Dict[str, Any] = {
            "variant": variant,
            "max_requests": max_requests,
            "sampling": sampling,
            "repeats": args.repeats,
            "block_steps": args.block_steps,
        }
        for key in blocks[variant][0]:
            values = [b[key] for b in blocks[variant]]
            stats = _spread(values)
            row[key] = stats["median"]
            row[f"{key}_spread"] = stats
            row[f"{key}_blocks"] = values
        if cuda:
            row.update(probes[variant].count_syncs())
        if variant != "stock":
            row["cuda_graphs"] = len(getattr(probes[variant].controller, "_graphs", {}))
            if paired[variant]:
                row["bookkeeping_paired_ratio_rounds"] = paired[variant]
        rows.append(row)
    return rows


def _cpu_sanity(args: argparse.Namespace) -> Dict[str, Any]:
    """Extension and megatron-core generate the same tokens through the engine (CPU)."""
    import random

    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_ext.testing.synthetic import build_engine, build_synthetic_stack, run_engine

    rng = random.Random(0)
    requests = []
    for _ in range(24):
        prompt = [rng.randrange(63) for _ in range(rng.randint(1, 40))]
        params = SamplingParams(
            num_tokens_to_generate=rng.randint(1, 30), termination_id=rng.randrange(64), top_k=1
        )
        requests.append((prompt, params))
    outputs = {}
    for extension in (False, True):
        stack = build_synthetic_stack(
            extension=extension,
            max_requests=16,
            max_tokens=64,
            num_blocks=24,
            num_paused_blocks=4,
            vocab_size=64,
            block_size_tokens=8,
            max_sequence_length=128,
        )
        outputs[extension] = run_engine(build_engine(stack), requests)
    identical = outputs[False][0] == outputs[True][0]
    return {
        "identical_outputs": identical,
        "requests": len(requests),
        "engine_steps": outputs[True][1]["steps"],
        "max_paused": outputs[True][1]["max_paused"],
    }


# Steps of one engine per turn under megatron-core 0.19's async schedule: inside a turn step
# ``n + 1``'s host work still overlaps step ``n``'s GPU work; only the turn's edges synchronise.
ASYNC_STEPS_PER_TURN = 8


def step_engines(
    stacks: Dict[str, Tuple[Any, Any]], order: Sequence[str], steps_per_turn: int = 1
) -> Dict[str, List[Tuple[float, int, int]]]:
    """Step engines in turns until every one has finished its requests: each turn runs up to
    ``steps_per_turn`` steps of each engine in ``order``, synchronised before and after the turn
    and not between its steps. A step that is not a decode step (a prefill, or a step while
    requests wait) runs as a turn of its own and is not recorded, so engines given the same
    requests make the same turns, which pair one to one.

    Args:
        stacks (Dict[str, Tuple[Any, Any]]): per name, a ``DynamicInferenceEngine`` and its
            context.
        order (Sequence[str]): the names, in the order they are stepped.
        steps_per_turn (int): decode steps per engine per turn (1: every step synchronised).

    Returns:
        Dict[str, List[Tuple[float, int, int]]]: per name, ``(seconds, tokens, steps)`` of each
        turn of decode steps, where tokens is the sum of the steps' active request counts.
    """
    if steps_per_turn < 1:
        raise ValueError(f"steps_per_turn must be at least 1, got {steps_per_turn}")
    turns: Dict[str, List[Tuple[float, int, int]]] = {name: [] for name in order}
    cuda = torch.cuda.is_available()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def decode_active(name: str) -> int:
        """Active requests of the next step if it is a decode step, else 0."""
        engine, context = stacks[name]
        if engine.waiting_request_ids or not context.is_decode_only():
            return 0
        return context.total_request_count - context.paused_request_count

    def turn(name: str) -> None:
        engine = stacks[name][0]
        tokens = steps = 0
        sync()
        start = time.perf_counter()
        while steps < steps_per_turn and engine.has_unfinished_requests():
            active = decode_active(name)
            if active == 0:
                if steps == 0:
                    engine.step_modern()  # a turn of its own, not recorded
                break
            engine.step_modern()
            tokens, steps = tokens + active, steps + 1
        if steps:
            sync()
            turns[name].append((time.perf_counter() - start, tokens, steps))

    while any(stacks[name][0].has_unfinished_requests() for name in order):
        for name in order:
            if stacks[name][0].has_unfinished_requests():
                turn(name)
    return turns


def _engine_rows(
    requests: int,
    model_name: str,
    sampling: str,
    schedule: str,
    args: argparse.Namespace,
    models: Optional[Dict[str, Tuple[Any, Any]]] = None,
    control: bool = False,
) -> List[Dict[str, Any]]:
    """Decode tokens per second of megatron-core's engine around a GPT of
    :data:`ENGINE_MODELS`, extension off and on, ``requests`` concurrent requests sampled as
    :data:`ENGINE_SAMPLING` says, under megatron-core's ``schedule``, measured interleaved.

    With ``control`` the "on" engine is megatron-core's too (an A/A comparison): its ratio's
    interval is what the method reads as a difference between two identical engines.

    ``max_sequence_length`` is what the requests need, rounded up to a KV block: the test
    attention gathers every block a request may own, so a longer bound would time that gather
    rather than the step.

    Both engines are built first (the same weights: one seed; ``models`` keeps the two models
    per model name for the next rows); then each round gives both the same batch of ``requests``
    requests and steps them in turns (:func:`step_engines`; which goes first alternates between
    rounds), after one discarded warm-up round: one synchronised step per engine per turn in the
    legacy schedule, :data:`ASYNC_STEPS_PER_TURN` unsynchronised ones in the async schedule, so
    that its overlap across steps is kept inside a turn. The two engines produce the same tokens,
    so their turns pair one to one with equal token counts; a round's ratio is the median of its
    paired turn-time ratios (:func:`megatron_ext.bench.stats.step_paired_ratio`), which a slow
    phase of the machine lasting a whole batch cannot bias. Tokens/s of a round is its decode
    tokens over its decode time; a row's is the median over rounds, with min and max; the off/on
    ratio is the geometric mean of the rounds' ratios with a 95% bootstrap interval.
    """
    from types import SimpleNamespace

    from megatron.core.inference.sampling_params import SamplingParams

    import megatron_ext.inference as ext_inference
    from megatron_ext.testing.small_gpt import build_small_gpt, build_small_gpt_engine
    from megatron_ext.testing.synthetic import ensure_model_parallel
    from megatron_ext.testing.torch_paged_attention import (
        allow_dynamic_inference_without_flash_attn,
    )

    # The bookkeeping rows, which set it up too, may have been skipped.
    ensure_model_parallel()

    cuda = torch.cuda.is_available()
    prompt, generate, block = 8, 24 if args.quick else 48, 16
    blocks_per_request = (prompt + generate + block) // block + 1
    sizes = SimpleNamespace(
        **ENGINE_MODELS[model_name],
        max_sequence_length=blocks_per_request * block,
        async_sched_mode=schedule,
        seed=1234,
        # The CPU run is the tests' check of these rows (main() refuses it: no timing there).
        device="cuda" if cuda else "cpu",
        max_requests=requests,
        max_tokens=max(512, min(requests * prompt, 8192)),
        block_size_tokens=block,
        kv_blocks=requests * blocks_per_request + 16,
        paused_kv_blocks=16,
    )
    dtype = torch.bfloat16 if cuda else torch.float32
    if models is None:
        models = {}
    if model_name not in models:
        # Built on the CPU (megatron-core's deterministic initialisation): seconds per 1e9
        # parameters, so once per model, not per row.
        built = []
        for _ in ("off", "on"):
            torch.manual_seed(0)
            built.append(build_small_gpt(sizes, dtype)[0])
        models[model_name] = tuple(built)
    engines = {}
    for mode, model in zip(("off", "on"), models[model_name]):
        if mode == "on" and not control:
            ext_inference.enable_static_active_slices()
        try:
            engines[mode] = build_small_gpt_engine(model, sizes, dtype)
        finally:
            ext_inference.disable_static_active_slices()
    next_id = [0]

    steps_per_turn = 1 if schedule == "legacy" else ASYNC_STEPS_PER_TURN

    def run_round(order: Tuple[str, str]) -> Dict[str, List[Tuple[float, int, int]]]:
        """One batch of ``requests`` on each engine, the two stepped in turns in ``order``;
        each engine's ``(seconds, tokens, steps)`` per turn of decode steps."""
        gen = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(0, sizes.vocab_size - 1, (prompt,), generator=gen).tolist()
            for _ in range(requests)
        ]
        for mode in order:
            engine = engines[mode][0]
            for tokens in prompts:
                params = SamplingParams(
                    num_tokens_to_generate=generate, termination_id=-1, **ENGINE_SAMPLING[sampling]
                )
                engine.add_request(next_id[0], tokens, params)
                next_id[0] += 1
        with allow_dynamic_inference_without_flash_attn():
            return step_engines({mode: engines[mode][:2] for mode in order}, order, steps_per_turn)

    run_round(("off", "on"))  # warm-up, discarded (captures the extension's graphs)
    runs: Dict[str, List[Tuple[float, float, int]]] = {"off": [], "on": []}
    paired: List[Dict[str, float]] = []
    for round_index in range(args.engine_repeats):
        order = ("off", "on") if round_index % 2 == 0 else ("on", "off")
        turns = run_round(order)
        for mode in ("off", "on"):
            seconds = sum(t for t, _, _ in turns[mode])
            tokens = sum(n for _, n, _ in turns[mode])
            steps = sum(k for _, _, k in turns[mode])
            runs[mode].append((seconds / steps, tokens / seconds, steps))
        paired.append(
            step_paired_ratio(*([(t, n) for t, n, _ in turns[mode]] for mode in ("off", "on")))
        )
    rows = []
    for mode in ("off", "on"):
        _, context, controller = engines[mode]
        tokens_per_s = [rate for _, rate, _ in runs[mode]]
        rows.append(
            {
                "mode": mode,
                "control": control,
                "model": model_name,
                "parameters": engine_model_parameters(model_name),
                "sampling": sampling,
                "requests": requests,
                "schedule": schedule,
                "max_sequence_length": sizes.max_sequence_length,
                "rounds": args.engine_repeats,
                "steps_per_turn": steps_per_turn,
                "decode_steps_per_round": statistics.median(n for _, _, n in runs[mode]),
                "median_decode_step_ms": statistics.median(s for s, _, _ in runs[mode]) * 1e3,
                "decode_tokens_per_s": statistics.median(tokens_per_s),
                "decode_tokens_per_s_spread": _spread(tokens_per_s),
                "decode_tokens_per_s_rounds": tokens_per_s,
                **(
                    {
                        "step_paired_ratio_rounds": [p["ratio"] for p in paired],
                        "unpaired_turns": sum(p["unpaired"] for p in paired),
                    }
                    if mode == "on"
                    else {}
                ),
                "context_class": type(context).__name__,
                "controller_class": type(controller).__name__,
                "attention": "TorchPagedSelfAttention (plain-torch paged KV, megatron_ext.testing)",
            }
        )
    return rows


def _speedups(rows: List[Dict[str, Any]]) -> Dict[Tuple[int, str, str], Dict[str, float]]:
    """Bookkeeping host-time speedup of each extension row over stock in the same configuration.

    The geometric mean of the rounds' paired ratios (``bookkeeping_paired_ratio_rounds``) with
    its 95% bootstrap interval (``low``, ``high``, ``half_width``) and the extreme rounds; one
    round has no interval.
    """
    result = {}
    for r in rows:
        # Only a configuration measured with stock has paired rounds.
        rounds = r.get("bookkeeping_paired_ratio_rounds")
        if not rounds:
            continue
        result[(r["max_requests"], r["sampling"], r["variant"])] = _rounds_speedup(rounds)
    return result


def _bookkeeping_ratio_text(value: Dict[str, float]) -> str:
    """As the engine rows print a ratio where it has an interval; ``2.03x [rounds 1.82-2.22]``
    where it has none."""
    if "low" in value:
        return _ratio_text(value)
    return f"{value['speedup']:.2f}x [rounds {value['round_min']:.2f}-{value['round_max']:.2f}]"


def _verdict(value: Dict[str, float]) -> str:
    """Whether a speedup differs from parity: by its confidence interval where it has one, else
    by its per-round spread."""
    if "low" in value:
        if value["low"] > 1.0:
            return "faster: the interval is above 1.00"
        if value["high"] < 1.0:
            return "slower: the interval is below 1.00"
        return "the interval contains 1.00"
    if value["round_min"] > 1.0:
        return "faster in every round"
    if value["round_max"] < 1.0:
        return "slower in every round"
    return "within the measured spread of parity"


def _us(stats: Dict[str, float]) -> str:
    return f"{stats['median'] * 1e3:.1f} [{stats['min'] * 1e3:.1f}-{stats['max'] * 1e3:.1f}]"


def _table(rows: List[Dict[str, Any]], cuda: bool) -> str:
    """Markdown table of the bookkeeping rows; timings and speedups only with a GPU."""
    if not cuda:
        lines = [
            "| max requests | sampling | variant | rounds x steps run |",
            "| --- | --- | --- | --- |",
        ]
        for r in rows:
            lines.append(
                f"| {r['max_requests']} | {r['sampling']} | {r['variant']} | "
                f"{r['repeats']} x {r['block_steps']} |"
            )
        return "\n".join(lines)
    speedups = _speedups(rows)
    lines = [
        "| max requests | sampling | variant | bk host us | region host us | bk GPU us | "
        "syncs bk/region/upd | graphs | speedup [95% interval, +-; round min-max] |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        value = speedups.get((r["max_requests"], r["sampling"], r["variant"]))
        region = r.get("region_host_ms_spread")
        gpu = r.get("bookkeeping_gpu_ms_spread")
        syncs = (
            f"{r.get('syncs_bookkeeping', '-')}/{r.get('syncs_region', '-')}/"
            f"{r.get('syncs_update_requests', '-')}"
        )
        speedup = "1.00x" if value is None else _bookkeeping_ratio_text(value)
        lines.append(
            f"| {r['max_requests']} | {r['sampling']} | {r['variant']} | "
            f"{_us(r['bookkeeping_host_ms_spread'])} | {'-' if region is None else _us(region)} | "
            f"{'-' if gpu is None else _us(gpu)} | {syncs} | {r.get('cuda_graphs', '-')} | "
            f"{speedup} |"
        )
    return "\n".join(lines)


def _engine_key(row: Dict[str, Any]) -> Tuple[str, str, int, str]:
    return row["model"], row["sampling"], row["requests"], row["schedule"]


def _engine_ratio(
    rows: List[Dict[str, Any]], key: Tuple[str, str, int, str]
) -> Optional[Dict[str, float]]:
    """Decode tokens/s on over off in one (model, sampling, requests, schedule) configuration,
    from the per-round ratios (step-paired where the rows have them): see
    :func:`_rounds_speedup`."""
    pair = {r["mode"]: r for r in rows if _engine_key(r) == key}
    if "off" not in pair or "on" not in pair:
        return None
    per_round = pair["on"].get("step_paired_ratio_rounds")
    if per_round is None:
        # Rows of batches run one after the other: pair the rounds' throughputs.
        off = pair["off"]["decode_tokens_per_s_rounds"]
        per_round = [b / a for a, b in zip(off, pair["on"]["decode_tokens_per_s_rounds"])]
    return _rounds_speedup(per_round)


def _rounds_speedup(per_round: List[float]) -> Dict[str, float]:
    """``speedup``: the rounds' geometric mean, with its 95% bootstrap interval
    (:func:`megatron_ext.bench.stats.ratio_interval`) from two rounds on; the extreme rounds."""
    if len(per_round) < 2:
        return {"speedup": per_round[0], "round_min": per_round[0], "round_max": per_round[0]}
    interval = ratio_interval(per_round)
    return {"speedup": interval.pop("ratio"), **interval}


def _ratio_text(value: Dict[str, float]) -> str:
    if "low" not in value:
        return f"{value['speedup']:.2f}x [one round]"
    return (
        f"{value['speedup']:.3f}x [{value['low']:.3f}-{value['high']:.3f}, "
        f"+-{100 * value['half_width']:.1f}%; {value['round_min']:.2f}-{value['round_max']:.2f}]"
    )


def _engine_table(rows: List[Dict[str, Any]]) -> str:
    lines = [
        "| model | sampling | concurrent requests | schedule | extension | median decode step ms | "
        "decode tokens/s [round min-max] | speedup [95% interval; round min-max] |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        model, sampling, requests, schedule = _engine_key(r)
        value = _engine_ratio(rows, _engine_key(r)) if r["mode"] == "on" else None
        spread = r["decode_tokens_per_s_spread"]
        speedup = "-" if value is None else _ratio_text(value)
        lines.append(
            f"| {model} | {sampling} | {requests} | {schedule} | {r['mode']} | "
            f"{r['median_decode_step_ms']:.2f} | "
            f"{r['decode_tokens_per_s']:.0f} [{spread['min']:.0f}-{spread['max']:.0f}] | "
            f"{speedup} |"
        )
    return "\n".join(lines)


def _engine_summary(report: Dict[str, Any]) -> List[str]:
    """Summary lines of the engine rows and their A/A control; sets ``report["worst_engine_row"]``
    (the row whose interval's lower end is lowest).

    Args:
        report (Dict[str, Any]): the benchmark report, with ``engine_rows`` and
            ``engine_control_rows``.

    Returns:
        List[str]: one line per configuration, the control's after the extension's.
    """
    summary: List[str] = []
    worst_engine = None
    engine = report["engine_rows"]
    ratios = {key: _engine_ratio(engine, key) for key in sorted({_engine_key(r) for r in engine})}
    ratios = {k: v for k, v in ratios.items() if v is not None}
    if ratios:
        # The worst row by the interval's lower end: what the data cannot rule out.
        worst_engine = min(ratios, key=lambda k: ratios[k].get("low", ratios[k]["speedup"]))
        model, sampling, requests, schedule = worst_engine
        report["worst_engine_row"] = {
            "model": model,
            "sampling": sampling,
            "requests": requests,
            "schedule": schedule,
            **ratios[worst_engine],
        }
    for key, value in ratios.items():
        model, sampling, requests, schedule = key
        settled = (
            "one round: no interval"
            if "half_width" not in value
            else f"interval half-width {100 * value['half_width']:.1f}% "
            + ("(settled: <= 3%)" if value["half_width"] <= 0.03 else "(> 3%: more rounds)")
        )
        summary.append(
            f"engine, {model} model, {sampling}, {requests} concurrent requests, {schedule} "
            "schedule: decode "
            f"{_ratio_text(value)} tokens/s with the extension ({_verdict(value)}; {settled})"
            + (" <- worst engine row" if key == worst_engine else "")
        )
    control = report["engine_control_rows"]
    for key in sorted({_engine_key(r) for r in control}):
        value = _engine_ratio(control, key)
        if value is None:
            continue
        model, sampling, requests, schedule = key
        summary.append(
            f"A/A control, {model} model, {sampling}, {requests} concurrent requests, "
            f"{schedule} schedule: megatron-core against itself {_ratio_text(value)} (what "
            "the method reads between identical engines here)"
        )
    return summary


def main(argv: Optional[List[str]] = None) -> int:
    """Run the benchmark (on a GPU) or the correctness check (without one).

    Args:
        argv: command-line arguments (see ``--help``).

    Returns:
        int: 0 on success, 1 if a check failed.
    """
    args = _parse(argv)
    cuda = torch.cuda.is_available()
    if args.steps is None:
        args.steps = 15 if cuda else 2
    args.block_steps = args.steps
    if args.repeats is None:
        args.repeats = (3 if args.quick else 7) if cuda else 2
    if args.engine_repeats is None:
        args.engine_repeats = 4 if args.quick else 12
    if args.warmup is None:
        args.warmup = (5 if args.quick else 20) if cuda else 1
    if args.sampling is None:
        args.sampling = ["greedy"] if args.quick or not cuda else ["greedy", "top_k"]
    if args.engine_models is None:
        args.engine_models = ["small"] if args.quick else ["small", "1b"]
    if args.max_requests is None:
        args.max_requests = [256, 1024] if cuda else [32]
    if args.vocab_size is None:
        args.vocab_size = 32000 if cuda else 1024
    if args.engine_requests is None:
        args.engine_requests = [256, 1024] if cuda else []
    if args.static_mla_batches is None:
        args.static_mla_batches = [1, 16] if cuda else []
    from megatron_ext.inference.contexts.static_slices_context_base import (
        UPSTREAM_HAS_ACTIVE_SLICES,
    )

    if args.engine_schedules is None:
        args.engine_schedules = ["legacy", "async"] if UPSTREAM_HAS_ACTIVE_SLICES else ["legacy"]
    if not UPSTREAM_HAS_ACTIVE_SLICES and args.engine_schedules != ["legacy"]:
        print(
            "inference benchmark: megatron-core 0.16 has one schedule; --engine-schedules "
            f"{' '.join(args.engine_schedules)} refused",
            file=sys.stderr,
        )
        return 2
    if (args.engine_requests or args.static_mla_batches) and not cuda:
        print(
            "inference benchmark: --engine-requests and --static-mla-batches need a CUDA GPU "
            "(their models' runs are GPU benchmarks); refused",
            file=sys.stderr,
        )
        return 2

    from megatron.core import package_info

    from megatron_ext.testing.synthetic import cpu_torch_compat

    report: Dict[str, Any] = {
        "cuda": cuda,
        "device": torch.cuda.get_device_name() if cuda else None,
        "megatron_core": package_info.__version__,
        "torch": torch.__version__,
        "rows": [],
        "engine_rows": [],
        "engine_control_rows": [],
    }
    controls = (False, True) if args.engine_control else (False,)
    variants = VARIANTS if cuda else ("stock", "ext-eager")
    with cpu_torch_compat():
        if not cuda:
            print(
                "inference benchmark: no CUDA GPU. This is a correctness check, not a benchmark: "
                "no timing or speedup is reported."
            )
            report["cpu_sanity"] = _cpu_sanity(args)
        for max_requests in args.max_requests:
            for sampling in args.sampling:
                report["rows"] += _run_config(max_requests, sampling, args, cuda, variants)
        for model_name in args.engine_models:
            models: Dict[str, Tuple[Any, Any]] = {}
            configurations = itertools.product(
                args.sampling, args.engine_requests, args.engine_schedules, controls
            )
            for sampling, requests, schedule, control in configurations:
                rows = _engine_rows(requests, model_name, sampling, schedule, args, models, control)
                report["engine_control_rows" if control else "engine_rows"] += rows
                # A run cut short by a time limit keeps what it finished.
                key = _engine_key(rows[-1])
                off, on = rows
                print(
                    f"engine {'control ' if control else ''}row done: {' '.join(map(str, key))}: "
                    f"{_ratio_text(_engine_ratio(rows, key))}; decode tokens/s off/on "
                    f"{off['decode_tokens_per_s']:.0f} / {on['decode_tokens_per_s']:.0f}, "
                    f"step ms {off['median_decode_step_ms']:.2f} / "
                    f"{on['median_decode_step_ms']:.2f}",
                    flush=True,
                )
    if args.static_mla_batches:
        report["static_mla_rows"] = run_static_mla(
            args.static_mla_batches, prompt=256, new_tokens=32, rounds=2 if args.quick else 5
        )

    failed = False
    summary: List[str] = []
    if not cuda:
        sanity = report["cpu_sanity"]
        failed = not sanity["identical_outputs"]
        summary.append(
            f"CPU correctness check: {sanity['requests']} requests through megatron-core's "
            f"engine, extension and megatron-core outputs "
            f"{'identical' if sanity['identical_outputs'] else 'DIFFER'} "
            f"({sanity['engine_steps']} steps, up to {sanity['max_paused']} paused); "
            f"{len(report['rows'])} bookkeeping configurations ran"
        )
    else:
        for row in report["rows"]:
            if row["variant"] != "stock" and row.get("syncs_region", 0) != 0:
                summary.append(f"FAIL: {row['variant']} synchronised inside the graph-safe region")
                failed = True
        speedups = _speedups(report["rows"])
        report["speedups"] = [
            {"max_requests": k[0], "sampling": k[1], "variant": k[2], **v}
            for k, v in speedups.items()
        ]
        if speedups:
            worst = min(speedups, key=lambda k: speedups[k]["speedup"])
            value = speedups[worst]
            report["worst_row"] = {"row": list(worst), **value}
            summary.append(
                f"worst bookkeeping row: {worst[0]} requests {worst[1]} {worst[2]}: "
                f"{_bookkeeping_ratio_text(value)} stock ({_verdict(value)}; floor 1.00x)"
            )
            for (requests, sampling, variant), value in sorted(speedups.items()):
                if variant == "ext-graphed":
                    target = " (goal 2x)" if requests >= 1024 else ""
                    summary.append(
                        f"ext-graphed at {requests} {sampling}: {_bookkeeping_ratio_text(value)} "
                        f"({_verdict(value)}){target}"
                    )
        summary += _engine_summary(report)
    static_rows = report.get("static_mla_rows") or []
    if static_rows:
        by_key = {(r["batch"], r["mode"]): r for r in static_rows}
        ratios = {
            batch: by_key[(batch, "off")]["decode_ms_per_token"]
            / by_key[(batch, "on")]["decode_ms_per_token"]
            for batch in sorted({r["batch"] for r in static_rows})
        }
        worst_batch = min(ratios, key=ratios.get)
        summary.append(
            f"static MLA generation: decode per token {ratios[worst_batch]:.2f}x with the flag at "
            f"batch {worst_batch} (worst of batches {sorted(ratios)})"
        )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_inference.json"), "w") as f:
            json.dump(report, f, indent=2)
    for line in summary:
        print(line)
    print(
        f"=== table: dynamic-inference bookkeeping per decode step, megatron-core "
        f"{report['megatron_core']}"
        + (
            f" (interleaved step by step: {args.repeats} rounds x {args.block_steps} steps per "
            f"variant after {args.warmup} warm-up steps; median of the per-round medians "
            "[min-max over rounds]; bk = context initialisation + sampling bookkeeping, i.e. the "
            "step minus the forward and update_requests; region = the sampling region's host "
            "time; syncs = device-to-host synchronisations per step; speedup = geometric mean "
            "over rounds of the median ratio of stock's step to the variant's step run next to "
            "it, 95% bootstrap interval [min-max of the rounds' ratios])"
            if cuda
            else " (CPU correctness check: configurations run; the CPU times kept in the JSON "
            "are not benchmark figures)"
        )
    )
    print(_table(report["rows"], cuda))
    if report["engine_rows"]:
        print(
            "=== table: decode throughput through megatron-core's DynamicInferenceEngine, GPT "
            "models "
            + "; ".join(
                f"{name}: {m['num_layers']} layers, hidden {m['hidden_size']}, vocab "
                f"{m['vocab_size']}, {engine_model_parameters(name):.3g} parameters"
                for name, m in ENGINE_MODELS.items()
                if name in args.engine_models
            )
            + "; bf16, attention TorchPagedSelfAttention (plain torch, paged KV); sampling "
            + "; ".join(f"{k} {v}" for k, v in ENGINE_SAMPLING.items() if k in args.sampling)
            + f"; {args.engine_repeats} rounds after one discarded warm-up round, each the same "
            "batch on both engines, stepped in alternating turns synchronised at their edges: "
            f"one step per turn (legacy schedule), {ASYNC_STEPS_PER_TURN} unsynchronised steps "
            "per turn (async); a round's ratio: median of its paired turn-time ratios; speedup: "
            "geometric mean of the rounds' ratios, 95% bootstrap interval (its half-width "
            "against the 3% target)"
        )
        print(_engine_table(report["engine_rows"]))
    if report["engine_control_rows"]:
        print(
            "=== table: A/A control of the engine rows: both engines megatron-core's own, "
            "measured as above ('on' is the second stock engine)"
        )
        print(_engine_table(report["engine_control_rows"]))
    if report.get("static_mla_rows"):
        print(
            "=== table: static-batching MLA generation (StaticInferenceContext), "
            f"{SIZES['num_layers']} MLA layers, hidden {SIZES['hidden_size']}, "
            f"{SIZES['num_attention_heads']} heads, bf16, SDPA core attention, greedy; off = "
            "megatron-core's unfused RoPE (it refuses fused RoPE in inference), on = "
            "--mla-rope-contiguous-load; synchronised wall time per forward, eager, medians "
            "over interleaved rounds"
        )
        print(static_mla_table(report["static_mla_rows"]))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
