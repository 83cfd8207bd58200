# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The inference benchmark's tables: the bookkeeping rows, the engine rows and their A/A control,
and the static MLA rows, each under a title that says how it was measured."""

import argparse
from typing import Any, Dict, List

from megatron_ext.bench.inference_bookkeeping import bookkeeping_speedups
from megatron_ext.bench.inference_engine import (
    ASYNC_STEPS_PER_TURN,
    ENGINE_MODELS,
    ENGINE_SAMPLING,
    engine_key,
    engine_model_parameters,
    engine_ratio,
)
from megatron_ext.bench.static_inference import SIZES, static_mla_table

__all__ = [
    "bookkeeping_ratio_text",
    "bookkeeping_table",
    "engine_table",
    "format_us",
    "print_tables",
    "ratio_text",
]


def format_us(stats: Dict[str, float]) -> str:
    return f"{stats['median'] * 1e3:.1f} [{stats['min'] * 1e3:.1f}-{stats['max'] * 1e3:.1f}]"


def ratio_text(value: Dict[str, float]) -> str:
    if "low" not in value:
        return f"{value['speedup']:.2f}x [one round]"
    return (
        f"{value['speedup']:.3f}x [{value['low']:.3f}-{value['high']:.3f}, "
        f"+-{100 * value['half_width']:.1f}%; {value['round_min']:.2f}-{value['round_max']:.2f}]"
    )


def bookkeeping_ratio_text(value: Dict[str, float]) -> str:
    """As the engine rows print a ratio where it has an interval; ``2.03x [rounds 1.82-2.22]``
    where it has none."""
    if "low" in value:
        return ratio_text(value)
    return f"{value['speedup']:.2f}x [rounds {value['round_min']:.2f}-{value['round_max']:.2f}]"


def bookkeeping_table(rows: List[Dict[str, Any]], cuda: bool) -> str:
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
    speedups = bookkeeping_speedups(rows)
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
        speedup = "1.00x" if value is None else bookkeeping_ratio_text(value)
        region_us = "-" if region is None else format_us(region)
        gpu_us = "-" if gpu is None else format_us(gpu)
        lines.append(
            f"| {r['max_requests']} | {r['sampling']} | {r['variant']} | "
            f"{format_us(r['bookkeeping_host_ms_spread'])} | {region_us} | "
            f"{gpu_us} | {syncs} | {r.get('cuda_graphs', '-')} | {speedup} |"
        )
    return "\n".join(lines)


def engine_table(rows: List[Dict[str, Any]]) -> str:
    lines = [
        "| model | sampling | concurrent requests | schedule | extension | median decode step ms | "
        "decode tokens/s [round min-max] | speedup [95% interval; round min-max] |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        model, sampling, requests, schedule = engine_key(r)
        value = engine_ratio(rows, engine_key(r)) if r["mode"] == "on" else None
        spread = r["decode_tokens_per_s_spread"]
        speedup = "-" if value is None else ratio_text(value)
        lines.append(
            f"| {model} | {sampling} | {requests} | {schedule} | {r['mode']} | "
            f"{r['median_decode_step_ms']:.2f} | "
            f"{r['decode_tokens_per_s']:.0f} [{spread['min']:.0f}-{spread['max']:.0f}] | "
            f"{speedup} |"
        )
    return "\n".join(lines)


def print_tables(report: Dict[str, Any], args: argparse.Namespace) -> None:
    """Print every table of a run, each under its title.

    Args:
        report (Dict[str, Any]): the benchmark report.
        args (argparse.Namespace): the run's options (rounds, steps, models, sampling).
    """
    cuda = report["cuda"]
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
    print(bookkeeping_table(report["rows"], cuda))
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
        print(engine_table(report["engine_rows"]))
    if report["engine_control_rows"]:
        print(
            "=== table: A/A control of the engine rows: both engines megatron-core's own, "
            "measured as above ('on' is the second stock engine)"
        )
        print(engine_table(report["engine_control_rows"]))
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
