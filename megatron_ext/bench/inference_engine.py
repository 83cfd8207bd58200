# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The inference benchmark's engine rows: decode tokens per second through megatron-core's
``DynamicInferenceEngine`` around small GPT models, extension off and on, the two engines stepped
in alternating turns; and the CPU check that both generate the same tokens."""

import argparse
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_ext.bench.stats import rounds_speedup, spread, step_paired_ratio

__all__ = [
    "ASYNC_STEPS_PER_TURN",
    "ENGINE_MODELS",
    "ENGINE_SAMPLING",
    "engine_key",
    "engine_model_parameters",
    "engine_outputs_match",
    "engine_ratio",
    "engine_rows",
    "step_engines",
]

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


def engine_outputs_match(args: argparse.Namespace) -> Dict[str, Any]:
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


def engine_rows(
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
                "decode_tokens_per_s_spread": spread(tokens_per_s),
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


def engine_key(row: Dict[str, Any]) -> Tuple[str, str, int, str]:
    return row["model"], row["sampling"], row["requests"], row["schedule"]


def engine_ratio(
    rows: List[Dict[str, Any]], key: Tuple[str, str, int, str]
) -> Optional[Dict[str, float]]:
    """Decode tokens/s on over off in one (model, sampling, requests, schedule) configuration,
    from the per-round ratios (step-paired where the rows have them): see
    :func:`rounds_speedup`."""
    pair = {r["mode"]: r for r in rows if engine_key(r) == key}
    if "off" not in pair or "on" not in pair:
        return None
    per_round = pair["on"].get("step_paired_ratio_rounds")
    if per_round is None:
        # Rows of batches run one after the other: pair the rounds' throughputs.
        off = pair["off"]["decode_tokens_per_s_rounds"]
        per_round = [b / a for a, b in zip(off, pair["on"]["decode_tokens_per_s_rounds"])]
    return rounds_speedup(per_round)
