# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The inference benchmark's bookkeeping rows: decode steps of a filled dynamic inference context
around a synthetic model, megatron-core's classes against the extension's (eager and graphed),
measured interleaved step by step; and their paired speedups over megatron-core's."""

import argparse
import statistics
from typing import Any, Dict, List, Tuple

import torch

from megatron_ext.bench.inference_probe import StepProbe
from megatron_ext.bench.stats import rounds_speedup, spread, step_paired_ratio

__all__ = ["VARIANTS", "bookkeeping_speedups", "build_variant", "fill_decode", "run_config"]

VARIANTS = ("stock", "ext-eager", "ext-graphed")


def fill_decode(stack: Any, max_requests: int, steps: int, sampling: str, seed: int) -> None:
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


def build_variant(
    variant: str, max_requests: int, sampling: str, args: argparse.Namespace, cuda: bool
) -> Tuple[Any, StepProbe]:
    """A filled, all-decode stack for one variant, with its step probe."""
    from megatron_ext.testing.synthetic import build_synthetic_stack

    extension = variant != "stock"
    controller_kwargs = dict(cuda_graph_sampling=variant == "ext-graphed") if extension else None
    block = 64
    steps = args.warmup + args.repeats * args.block_steps + 2
    blocks_per_request = (4 + steps + 8) // block + 2
    probe = StepProbe(cuda)
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
        instrument=probe.instrument,
    )
    fill_decode(stack, max_requests, steps, sampling, seed=0)
    probe.attach(stack.controller)
    return stack, probe


def run_config(
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
    probes = {v: build_variant(v, max_requests, sampling, args, cuda)[1] for v in variants}
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
            stats = spread(values)
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


def bookkeeping_speedups(
    rows: List[Dict[str, Any]],
) -> Dict[Tuple[int, str, str], Dict[str, float]]:
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
        result[(r["max_requests"], r["sampling"], r["variant"])] = rounds_speedup(rounds)
    return result
